// A second CUDA stream for work that may overlap the main stream's (the expert weight gradients
// beside the input gradients: independent products that each leave the GPU partly idle alone).
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda_check.h"

namespace moeut {

class SideStream {
 public:
  explicit SideStream(cudaStream_t main) : main_(main) {
    MOEUT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    MOEUT_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
    MOEUT_CUDA_CHECK(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming));
    MOEUT_CUDA_CHECK(cudaEventCreateWithFlags(&marked_, cudaEventDisableTiming));
  }
  ~SideStream() {
    cudaEventDestroy(marked_);
    cudaEventDestroy(joined_);
    cudaEventDestroy(forked_);
    cudaStreamDestroy(side_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t get() const { return side_; }
  // Work queued on the side stream from now on starts after everything queued on the main one.
  void fork() {
    MOEUT_CUDA_CHECK(cudaEventRecord(forked_, main_));
    MOEUT_CUDA_CHECK(cudaStreamWaitEvent(side_, forked_));
  }
  // Work queued on the main stream from now on starts after everything queued on the side one.
  void join() {
    MOEUT_CUDA_CHECK(cudaEventRecord(joined_, side_));
    MOEUT_CUDA_CHECK(cudaStreamWaitEvent(main_, joined_));
  }
  // A join in two halves, for a main stream that needs the side's work in stages: mark() notes
  // the work queued on the side stream so far; after join_marked(), work queued on the main
  // stream starts after that work, not after what was queued on the side since.
  void mark() { MOEUT_CUDA_CHECK(cudaEventRecord(marked_, side_)); }
  void join_marked() { MOEUT_CUDA_CHECK(cudaStreamWaitEvent(main_, marked_)); }

 private:
  cudaStream_t main_, side_ = nullptr;
  cudaEvent_t forked_ = nullptr, joined_ = nullptr, marked_ = nullptr;
};

}  // namespace moeut
