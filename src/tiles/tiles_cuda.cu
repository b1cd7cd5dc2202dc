// CUDA twin of tiles_cpu.cpp, bit for bit. quantize_tiles: one block per tile, which finds the
// tile's amax, then quantizes it (the second read hits L1/L2: a tile is at most a few tens of KB).
// Threads run along a tile's rows, so a warp reads consecutive elements. The element codecs are
// numerics.h's, shared with the CPU reference.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "tiles/tiles_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kTileThreads = 128;
constexpr int kDequantizeThreads = 256;

template <class In, class Out>
__global__ void __launch_bounds__(kTileThreads)
    quantize_tiles_kernel(const In* __restrict__ x, Out* __restrict__ y, float* __restrict__ scale_inv, TileShape t,
                          ScalingRecipe recipe) {
  const int64_t tile = blockIdx.x;
  const int64_t tr = tile / t.grid_cols();
  const int64_t tc = tile % t.grid_cols();
  const int64_t r0 = tr * t.tile_rows;
  const int64_t c0 = tc * t.tile_cols;
  const int64_t r_end = min(t.rows, r0 + t.tile_rows);
  const int64_t c_end = min(t.cols, c0 + t.tile_cols);
  uint32_t key = 0;
  for (int64_t r = r0; r < r_end; ++r) {
    for (int64_t c = c0 + threadIdx.x; c < c_end; c += kTileThreads) {
      key = max(key, numerics::amax_key(numerics::to_float(x[r * t.cols + c])));
    }
  }
  key = block_max_key<kTileThreads>(key);
  __shared__ float tile_scale_value;
  if (threadIdx.x == 0) {
    const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), numerics::format_max<Out>(), recipe);
    scale_inv[tile] = pair.scale_inv;
    tile_scale_value = pair.scale;
  }
  __syncthreads();
  const float scale = tile_scale_value;
  for (int64_t r = r0; r < r_end; ++r) {
    for (int64_t c = c0 + threadIdx.x; c < c_end; c += kTileThreads) {
      y[r * t.cols + c] = numerics::quantize_to<Out>(rn::mul(numerics::to_float(x[r * t.cols + c]), scale));
    }
  }
}

template <class In, class Out>
__global__ void __launch_bounds__(kDequantizeThreads)
    dequantize_tiles_kernel(const In* __restrict__ x, const float* __restrict__ scale_inv, Out* __restrict__ y,
                            TileShape t) {
  const int64_t numel = t.rows * t.cols;
  for (int64_t i = blockIdx.x * int64_t{kDequantizeThreads} + threadIdx.x; i < numel;
       i += int64_t{gridDim.x} * kDequantizeThreads) {
    const int64_t r = i / t.cols;
    const int64_t c = i % t.cols;
    const float s = scale_inv[(r / t.tile_rows) * t.grid_cols() + c / t.tile_cols];
    y[i] = numerics::round_to<Out>(rn::mul(numerics::to_float(x[i]), s));
  }
}

}  // namespace

void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe, Stream stream) {
  const int64_t tiles = t.grid_rows() * t.grid_cols();
  if (tiles == 0 || t.rows * t.cols == 0) return;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      quantize_tiles_kernel<In, Out><<<grid_size(tiles, "quantize_tiles"), kTileThreads, 0, cuda_stream(stream)>>>(
          static_cast<const In*>(x), static_cast<Out*>(out), scale_inv, t, recipe);
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t, Stream stream) {
  const int64_t numel = t.rows * t.cols;
  if (numel == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(numel, kDequantizeThreads), int64_t{1} << 20);
  visit(Fp8Types{}, in_dtype, [&](auto in) {
    visit(HighPrecisionTypes{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      dequantize_tiles_kernel<In, Out><<<grid_size(blocks, "dequantize_tiles"), kDequantizeThreads, 0,
                                         cuda_stream(stream)>>>(static_cast<const In*>(x), scale_inv,
                                                                static_cast<Out*>(out), t);
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
