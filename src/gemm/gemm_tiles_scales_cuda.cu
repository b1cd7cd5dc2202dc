// The copies of a GEMM's tile scales from quantize_tiles' row-major layout into the one cuBLASLt
// reads (CublasScaleLayout, gemm_tiles_kernels.h): a transpose for (1, 128) tiles, a re-pitch to a
// multiple of 4 floats for (128, 128) blocks. Both operands' in one launch: the copies are small
// and a GEMM step's launches add up. Bit-exact: it moves floats.
#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a grid-stride loop covers the rest

struct ScaleCopies {
  ScaleCopy copies[kMaxScaleCopies];
  int count;
};

// Element e of the copies' elements laid end to end.
__global__ void __launch_bounds__(kThreads) copy_scales_kernel(const __grid_constant__ ScaleCopies c, int64_t total) {
  for (int64_t e = blockIdx.x * int64_t{kThreads} + threadIdx.x; e < total; e += int64_t{gridDim.x} * kThreads) {
    int64_t local = e;
    int k = 0;
    while (k + 1 < c.count && local >= c.copies[k].layout.elements()) local -= c.copies[k++].layout.elements();
    const ScaleCopy& copy = c.copies[k];
    const CublasScaleLayout& layout = copy.layout;
    const int64_t o = local / layout.ld, i = local % layout.ld;
    copy.dst[local] = i < layout.inner
                          ? (layout.transposed ? copy.src[i * copy.src_cols + o] : copy.src[o * copy.src_cols + i])
                          : 0.0f;
  }
}

}  // namespace

void copy_tile_scales(const ScaleCopy* copies, int count, Stream stream) {
  ScaleCopies c{};
  int64_t total = 0;
  for (int k = 0; k < count; ++k) {
    c.copies[k] = copies[k];
    total += copies[k].layout.elements();
  }
  c.count = count;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, (total + kThreads - 1) / kThreads);
  copy_scales_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(c, total);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace fp8amp
