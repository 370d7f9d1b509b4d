// Named ranges on an Nsight Systems timeline (NVTX): the trainer's step parts, and each layer's
// passes in the GPU model (on passes that run eagerly: a replayed CUDA graph shows as one launch;
// MOEUT_NO_GRAPHS=1 runs every pass eagerly). Built without CUDA, a range is nothing.
#pragma once
#ifdef MOEUT_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace moeut {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#ifdef MOEUT_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#ifdef MOEUT_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace moeut
