// Shared by the MPI test executables. Their main() (mpi_test_main.cpp) runs every test on every
// rank, prints rank 0's results, and fails when any rank fails.
#pragma once
#include <mpi.h>

#include "small_config.h"

namespace moeut {

extern int g_ep;  // from --ep=E

int world_rank();
int world_size();

// 10 FFN experts, uneven over 4 ranks: 3, 3, 2, 2.
inline Config mpi_small_run(int64_t steps, const std::string& train_data, const std::string& val_data,
                            const std::string& metrics) {
  return test::small_run({.d_model = 24, .n_layers = 4, .group_size = 2, .ff_n_experts = 10, .ff_k = 3,
                          .ff_expert_size = 8},
                         {.steps = steps, .batch_size = 8, .micro_batch_size = 2, .warmup_steps = 2,
                          .train_data = train_data, .val_data = val_data, .metrics = metrics});
}

}  // namespace moeut
