// CUDA twin of tiles_cpu.cpp, bit for bit. The (1, 128) and (128, 128) tilings of quantize_tiles,
// cast_transpose_tiles and scaled_accumulate_tiles run the one-pass region kernel
// (tiles_region_cuda.cu); other one-row tiles (rowwise scaling) run tiles_rows_cuda.cu's row and
// two-pass region kernels where x's rows take 16-byte loads. Every other tiling runs tile_kernel: one block
// per tile, which finds the tile's amax, then quantizes it (the second read hits L1/L2: a tile is
// at most a few tens of KB).
// Threads run along a tile's rows, so a warp reads consecutive elements of a row-major matrix.
// MXFP8's casts run their own one-pass kernel (tiles_mx_cuda.cu); dequantize_mx runs
// dequantize_tiles' kernel by E8M0ScaleRule.
// The element codecs are numerics.h's, shared with the CPU reference.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "tiles/tiles_cuda.cuh"
#include "tiles/tiles_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kTileThreads = 128;
constexpr int kDequantizeThreads = 256;

// The element values tile_kernel quantizes, as in tiles_cpu.cpp: x's own, its transpose's, or the
// accumulated sums.
template <class In>
struct RowMajor {
  const In* x;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return numerics::to_float(x[r * cols + c]); }
};

template <class In>
struct Transposed {  // element (r, c) is x[c, r]; x has x_cols columns
  const In* x;
  int64_t x_cols;
  __device__ float operator()(int64_t r, int64_t c) const { return numerics::to_float(x[c * x_cols + r]); }
};

template <class Acc, class Update>
struct Accumulated {
  const Acc* acc;
  const float* acc_scale_inv;
  const Update* update;
  TileShape t;
  __device__ float operator()(int64_t r, int64_t c) const {
    const float si = acc_scale_inv[(r / t.tile_rows) * t.grid_cols() + c / t.tile_cols];
    return accumulated(acc[r * t.cols + c], si, update[r * t.cols + c]);
  }
};

// One block of kThreads per tile: the tile's amax, its scale by `rule` (the stored value into
// scales), then its codes.
template <int kThreads, class Out, class Value, class Rule>
__global__ void __launch_bounds__(kThreads)
    tile_kernel(Value value, Out* __restrict__ y, typename Rule::Stored* __restrict__ scales, TileShape t, Rule rule) {
  const int64_t tile = blockIdx.x;
  const int64_t tr = tile / t.grid_cols();
  const int64_t tc = tile % t.grid_cols();
  const int64_t r0 = tr * t.tile_rows;
  const int64_t c0 = tc * t.tile_cols;
  const int64_t r_end = min(t.rows, r0 + t.tile_rows);
  const int64_t c_end = min(t.cols, c0 + t.tile_cols);
  uint32_t key = 0;
  for (int64_t r = r0; r < r_end; ++r) {
    for (int64_t c = c0 + threadIdx.x; c < c_end; c += kThreads) key = max(key, numerics::amax_key(value(r, c)));
  }
  const float scale = block_tile_scale<kThreads, Out>(key, rule, scales + tile);
  for (int64_t r = r0; r < r_end; ++r) {
    for (int64_t c = c0 + threadIdx.x; c < c_end; c += kThreads) {
      y[r * t.cols + c] = numerics::quantize_to<Out>(rn::mul(value(r, c), scale));
    }
  }
}

template <class Out, class Value, class Rule>
void launch_tiles(const Value& value, void* out, typename Rule::Stored* scales, const TileShape& t, const Rule& rule,
                  cudaStream_t stream, const char* op) {
  const int64_t tiles = t.grid_rows() * t.grid_cols();
  if (tiles == 0 || t.rows * t.cols == 0) return;
  tile_kernel<kTileThreads, Out><<<grid_size(tiles, op), kTileThreads, 0, stream>>>(value, static_cast<Out*>(out),
                                                                                    scales, t, rule);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

// N elements of T, loaded and stored as one access.
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Vec consecutive elements of one row a thread (cols % Vec == 0, aligned pointers): one wide load
// and one wide store each instead of Vec narrow ones.
template <int Vec, class In, class Out, class Rule>
__global__ void __launch_bounds__(kDequantizeThreads)
    dequantize_tiles_kernel(const In* __restrict__ x, const typename Rule::Stored* __restrict__ scales,
                            Out* __restrict__ y, TileShape t) {
  const int64_t groups = t.rows * t.cols / Vec;
  for (int64_t g = blockIdx.x * int64_t{kDequantizeThreads} + threadIdx.x; g < groups;
       g += int64_t{gridDim.x} * kDequantizeThreads) {
    const int64_t r = g * Vec / t.cols;
    const int64_t c = g * Vec - r * t.cols;
    const typename Rule::Stored* row_scales = scales + (r / t.tile_rows) * t.grid_cols();
    const Pack<In, Vec> in = reinterpret_cast<const Pack<In, Vec>*>(x)[g];
    Pack<Out, Vec> out;
#pragma unroll
    for (int k = 0; k < Vec; ++k) {
      const float s = Rule::scale_inv(row_scales[(c + k) / t.tile_cols]);
      out.v[k] = numerics::round_to<Out>(rn::mul(numerics::to_float(in.v[k]), s));
    }
    reinterpret_cast<Pack<Out, Vec>*>(y)[g] = out;
  }
}

// x and, unless p.out_t is null, its transpose, each by its own tiles: one-row tiles by the
// row/column kernels where they fit (both copies from two reads of x where both fit the region
// pass), any other by tile_kernel (two reads of x, at least).
void cast_transpose_by_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p,
                             const ScalingRecipe& recipe, cudaStream_t stream, const char* op) {
  const RecipeScaleRule rule{recipe};
  const bool rows_fit = row_tiles_fit(in_dtype, p.x, p.out, p.t);
  const bool columns_fit = p.out_t != nullptr && column_tiles_fit(in_dtype, p.x, p.t, p.t_t);
  const bool both_from_regions = rows_fit && columns_fit && row_regions_fit(p.t);
  if (rows_fit && !both_from_regions) {
    quantize_row_tiles(in_dtype, out_dtype, p.x, p.out, p.scale_inv, p.t, recipe, stream);
  }
  if (columns_fit) {
    void* out = both_from_regions ? p.out : nullptr;
    float* scale_inv = both_from_regions ? p.scale_inv : nullptr;
    quantize_column_tiles(in_dtype, out_dtype, p.x, out, scale_inv, p.out_t, p.scale_inv_t, p.t, p.t_t, recipe,
                          stream);
  }
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const In* x = static_cast<const In*>(p.x);
      if (!rows_fit) launch_tiles<Out>(RowMajor<In>{x, p.t.cols}, p.out, p.scale_inv, p.t, rule, stream, op);
      if (p.out_t != nullptr && !columns_fit) {
        launch_tiles<Out>(Transposed<In>{x, p.t.cols}, p.out_t, p.scale_inv_t, p.t_t, rule, stream, op);
      }
    });
  });
}

template <class Rule>
void dequantize_by_tiles(DType in_dtype, DType out_dtype, const void* x, const typename Rule::Stored* scales,
                         void* out, const TileShape& t, cudaStream_t stream, const char* op) {
  const int64_t numel = t.rows * t.cols;
  if (numel == 0) return;
  visit(Fp8Types{}, in_dtype, [&](auto in) {
    visit(HighPrecisionTypes{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      constexpr int kVec = 4;
      const bool wide = t.cols % kVec == 0 && reinterpret_cast<uintptr_t>(x) % sizeof(Pack<In, kVec>) == 0 &&
                        reinterpret_cast<uintptr_t>(out) % sizeof(Pack<Out, kVec>) == 0;
      const int64_t blocks =
          std::min<int64_t>(ceil_div(numel / (wide ? kVec : 1), kDequantizeThreads), int64_t{1} << 20);
      auto* kernel = wide ? dequantize_tiles_kernel<kVec, In, Out, Rule> : dequantize_tiles_kernel<1, In, Out, Rule>;
      kernel<<<grid_size(blocks, op), kDequantizeThreads, 0, stream>>>(static_cast<const In*>(x), scales,
                                                                       static_cast<Out*>(out), t);
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace

void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe, Stream stream) {
  const CastTransposeTiles p{x, out, scale_inv, nullptr, nullptr, t, t};
  if (region_tiling(t)) {
    quantize_regions(in_dtype, out_dtype, p, recipe, cuda_stream(stream));
    return;
  }
  cast_transpose_by_tiles(in_dtype, out_dtype, p, recipe, cuda_stream(stream), "quantize_tiles");
}

void cast_transpose_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe,
                          Stream stream) {
  if (region_tiling(p.t) && p.t_t.is(p.t.tile_rows, p.t.tile_cols)) {
    quantize_regions(in_dtype, out_dtype, p, recipe, cuda_stream(stream));
    return;
  }
  cast_transpose_by_tiles(in_dtype, out_dtype, p, recipe, cuda_stream(stream), "cast_transpose_tiles");
}

void quantize_mx(DType in_dtype, DType out_dtype, const CastTransposeMx& p, Stream stream) {
  quantize_mx_regions(in_dtype, out_dtype, p, cuda_stream(stream));
}

void scaled_accumulate_tiles(DType acc_dtype, DType update_dtype, const AccumulateTiles& p,
                             const ScalingRecipe& recipe, Stream stream) {
  if (region_tiling(p.t)) {
    accumulate_regions(acc_dtype, update_dtype, p, recipe, cuda_stream(stream));
    return;
  }
  visit(Fp8Types{}, acc_dtype, [&](auto a) {
    visit(HighPrecisionTypes{}, update_dtype, [&](auto u) {
      using Acc = decltype(a);
      using Update = decltype(u);
      const Accumulated<Acc, Update> value{static_cast<const Acc*>(p.acc), p.acc_scale_inv,
                                           static_cast<const Update*>(p.update), p.t};
      launch_tiles<Acc>(value, p.out, p.scale_inv, p.t, RecipeScaleRule{recipe}, cuda_stream(stream),
                        "scaled_accumulate_tiles");
    });
  });
}

void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t, Stream stream) {
  dequantize_by_tiles<RecipeScaleRule>(in_dtype, out_dtype, x, scale_inv, out, t, cuda_stream(stream),
                                       "dequantize_tiles");
}

void dequantize_mx(DType in_dtype, DType out_dtype, const void* x, const uint8_t* scales, void* out,
                   const TileShape& t, Stream stream) {
  dequantize_by_tiles<E8M0ScaleRule>(in_dtype, out_dtype, x, scales, out, t, cuda_stream(stream), "dequantize_mx");
}

}  // namespace cuda
}  // namespace fp8amp
