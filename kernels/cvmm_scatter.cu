// The scatter kernel of cvmm_rows (kernels/cvmm_scatter.cuh: what it computes and how) as
// training runs it: instantiated with NoClock, which marks nothing.
#include "kernels/cvmm_scatter.cuh"

namespace moeut::cuda {

template <bool kTransW>
void launch_scatter(const CvmmPlan& plan, const CvmmRowsArgs& a, cudaStream_t stream) {
  scatter::launch<kTransW>(plan, a, scatter::NoClock{}, stream);
}
template void launch_scatter<true>(const CvmmPlan&, const CvmmRowsArgs&, cudaStream_t);
template void launch_scatter<false>(const CvmmPlan&, const CvmmRowsArgs&, cudaStream_t);

// Scatters whose product is at most two slabs deep and whose rows take 16-byte additions (with N
// as the band width too: every band but the last is 128 wide, and the last is N mod 128, a
// multiple of 4 when N is).
bool cvmm_on_scatter_kernel(const CvmmRowsArgs& a) {
  return a.accumulate && a.K <= 2 * BK && rows_addable(a.out_f32, a.N, a.N);
}

}  // namespace moeut::cuda
