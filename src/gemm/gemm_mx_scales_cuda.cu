// The copy of an operand's E8M0 scales from quantize_mx's row-major [rows, K / 32] into the 128 x 4
// tiled layout cuBLASLt reads (MxScaleLayout, gemm_tiles_kernels.h). Bit-exact: it moves bytes;
// the padding gets code 127 (a scale of 1) for rows and K-blocks that hold no codes.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a grid-stride loop covers the rest
constexpr uint8_t kUnitScale = 127;

__global__ void __launch_bounds__(kThreads) copy_mx_scales_kernel(const uint8_t* src, MxScaleLayout layout, uint8_t* dst) {
  const int64_t cols = layout.padded_k_blocks();
  const int64_t total = layout.padded_rows() * cols;
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < total; e += int64_t{gridDim.x} * kThreads) {
    const int64_t r = e / cols, j = e % cols;
    dst[layout.offset(r, j)] = r < layout.rows && j < layout.k_blocks ? src[r * layout.k_blocks + j] : kUnitScale;
  }
}

}  // namespace

void copy_mx_scales(const uint8_t* src, const MxScaleLayout& layout, uint8_t* dst, Stream stream) {
  const int64_t total = layout.bytes();
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, (total + kThreads - 1) / kThreads);
  copy_mx_scales_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, layout, dst);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace fp8amp
