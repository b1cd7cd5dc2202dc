// The one case of the GEMM that cuBLASLt does not cover: K == 0, the empty sum. Then
// out = bias (or 0), plus the old out when accumulating, exactly as the CPU reference computes it.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/dispatch.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a grid-stride loop covers the rest

template <class Out, class Bias>
__global__ void __launch_bounds__(kThreads)
    empty_sum_kernel(Out* out, int64_t ldo, int64_t m, int64_t n, const Bias* bias, bool accumulate) {
  const int64_t total = m * n;
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < total; e += int64_t{gridDim.x} * kThreads) {
    const int64_t i = e / n, j = e % n;
    Out* o = out + i * ldo + j;
    // The reference's arithmetic, step for step, so the two agree bit for bit.
    double v = 0.0;
    if (bias != nullptr) v += numerics::to_float(bias[j]);
    *o = epilogue<Out>(v, accumulate ? o : nullptr);
  }
}

}  // namespace

void gemm_empty_sum(const GemmProblem& g, bool accumulate, Stream stream) {
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, (g.m * g.n + kThreads - 1) / kThreads);
  visit(HighPrecisionTypes{}, g.out_dtype, [&](auto out_type) {
    visit(BiasTypes{}, g.bias_dtype, [&](auto bias_type) {
      using Out = decltype(out_type);
      using Bias = decltype(bias_type);
      empty_sum_kernel<Out, Bias><<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<Out*>(g.out), g.ldo, g.m, g.n, static_cast<const Bias*>(g.bias), accumulate);
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
