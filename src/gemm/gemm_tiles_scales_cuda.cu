// The copy of an operand's tile scales from quantize_tiles' row-major layout into the one cuBLASLt
// reads (CublasScaleLayout, gemm_tiles_kernels.h): a transpose for (1, 128) tiles, a re-pitch to a
// multiple of 4 floats for (128, 128) blocks, a plain copy for rowwise. Bit-exact: it moves floats.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a grid-stride loop covers the rest

__global__ void __launch_bounds__(kThreads)
    copy_scales_kernel(const float* src, int64_t src_cols, CublasScaleLayout layout, float* dst) {
  const int64_t total = layout.elements();
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < total; e += int64_t{gridDim.x} * kThreads) {
    const int64_t o = e / layout.ld, i = e % layout.ld;
    dst[e] = i < layout.inner ? (layout.transposed ? src[i * src_cols + o] : src[o * src_cols + i]) : 0.0f;
  }
}

}  // namespace

void copy_tile_scales(const float* src, int64_t src_cols, const CublasScaleLayout& layout, float* dst, Stream stream) {
  const int64_t total = layout.elements();
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, (total + kThreads - 1) / kThreads);
  copy_scales_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, src_cols, layout, dst);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace fp8amp
