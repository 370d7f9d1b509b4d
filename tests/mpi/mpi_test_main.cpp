// main() of the MPI test executables, with the helpers mpi_test.h declares.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "mpi_test.h"

namespace moeut {

int g_ep = 1;

int world_rank() { int r; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int s; MPI_Comm_size(MPI_COMM_WORLD, &s); return s; }

}  // namespace moeut

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--ep=", 5) == 0) moeut::g_ep = std::atoi(argv[i] + 5);
  if (moeut::world_rank() != 0) delete testing::UnitTest::GetInstance()->listeners().Release(
                                    testing::UnitTest::GetInstance()->listeners().default_result_printer());
  const int failed = RUN_ALL_TESTS();
  // A failure on any rank fails the run.
  int any = failed;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
