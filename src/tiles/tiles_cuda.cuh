// The CUDA tile kernels' internal interface between tiles_cuda.cu (the launchers, the any-tile
// kernel), tiles_region_cuda.cu (the one-pass kernel of 128 x 128 regions), tiles_rows_cuda.cu
// (one-row tiles: rowwise scaling) and tiles_mx_cuda.cu (MXFP8's one-pass casts).
#pragma once

#include <cuda_runtime.h>

#include "common/cuda_utils.cuh"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "tiles/tiles_kernels.h"

namespace fp8amp {
namespace cuda {

// The scale of the tile one block of kThreads covers, from its threads' amax keys: thread 0
// applies `rule` and stores the rule's value (the tile's scale_inv, or its E8M0 code) at *stored;
// every thread gets the scale that multiplies into Out. One barrier.
template <int kThreads, class Out, class Rule>
__device__ float block_tile_scale(uint32_t key, const Rule& rule, typename Rule::Stored* stored) {
  key = block_max_key<kThreads>(key);
  __shared__ float scale;
  if (threadIdx.x == 0) {
    const auto block = rule(numerics::amax_from_key(key), numerics::format_max<Out>());
    *stored = block.stored;
    scale = block.scale;
  }
  __syncthreads();
  return scale;
}

// Whether quantize_regions takes these tilings: (1, 128) tiles or (128, 128) blocks, the
// transpose (when written) by the same tiles.
inline bool region_tiling(const TileShape& t) { return t.is(1, 128) || t.is(128, 128); }

// Quantizes p.x into p.out / p.scale_inv by p.t's tiles and, unless p.out_t is null, its transpose
// into p.out_t / p.scale_inv_t by p.t_t's (the same tiles), reading x once: one block per 128 x 128
// region of x. Needs region_tiling(p.t) (and p.t_t.is(p.t.tile_rows, p.t.tile_cols) with out_t).
void quantize_regions(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe,
                      cudaStream_t stream);

// quantize_mx (p.out_t null) or cast_transpose_mx, reading x once: one block per 32 x 128 region of x
// (tiles_mx_cuda.cu).
void quantize_mx_regions(DType in_dtype, DType out_dtype, const CastTransposeMx& p, cudaStream_t stream);

// scaled_accumulate_tiles by the same kernel, reading acc and update once. Needs region_tiling(p.t).
void accumulate_regions(DType acc_dtype, DType update_dtype, const AccumulateTiles& p, const ScalingRecipe& recipe,
                        cudaStream_t stream);

// One-row tiles outside region_tiling (tiles_rows_cuda.cu), for 16-byte loads of x along its rows.
// quantize_row_tiles quantizes x by t's (1, tile_cols) tiles; it needs row_tiles_fit.
bool row_tiles_fit(DType in_dtype, const void* x, const void* out, const TileShape& t);
void quantize_row_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv,
                        const TileShape& t, const ScalingRecipe& recipe, cudaStream_t stream);
// quantize_column_tiles quantizes x's transpose by t_t's (1, len) tiles, segments of x's columns,
// into out_t / scale_inv_t; it needs column_tiles_fit (len a multiple of 128, or at least x's rows).
// With out (not null) the same two reads of x also quantize x by t's (1, tile_cols) tiles into
// out / scale_inv, which needs row_tiles_fit and row_regions_fit (tile_cols a multiple of 64, or
// the whole row) as well.
bool column_tiles_fit(DType in_dtype, const void* x, const TileShape& t, const TileShape& t_t);
bool row_regions_fit(const TileShape& t);
void quantize_column_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, void* out_t,
                           float* scale_inv_t, const TileShape& t, const TileShape& t_t, const ScalingRecipe& recipe,
                           cudaStream_t stream);

}  // namespace cuda
}  // namespace fp8amp
