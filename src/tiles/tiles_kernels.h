// What the tile kernels see: raw pointers and sizes, validated by tiles.cpp, and the per-tile
// math both implementations share. Each function has a CPU reference (tiles_cpu.cpp) and a CUDA
// twin (tiles_cuda.cu, tiles_transpose_cuda.cu) with the same signature; the CPU one defines
// correct.
#pragma once

#include <cstdint>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// A [rows, cols] matrix cut into tile_rows x tile_cols tiles (tiles.h).
struct TileShape {
  int64_t rows;
  int64_t cols;
  int64_t tile_rows;
  int64_t tile_cols;

  FP8AMP_HD int64_t grid_rows() const { return (rows + tile_rows - 1) / tile_rows; }
  FP8AMP_HD int64_t grid_cols() const { return (cols + tile_cols - 1) / tile_cols; }
  FP8AMP_HD bool is(int64_t tr, int64_t tc) const { return tile_rows == tr && tile_cols == tc; }
};

// The scale a tile is quantized with, and the scale_inv stored for it, from the tile's amax
// (tiles.h: 1 for zeros; 1 with a NaN scale_inv for a non-finite amax).
FP8AMP_HD numerics::ScalePair tile_scale(float amax, float fmax, const ScalingRecipe& recipe) {
  const numerics::ScalePair one{1.0f, 1.0f};
  if (!numerics::is_finite(amax)) return {1.0f, numerics::bits_float(numerics::kCanonicalNanBits)};
  return numerics::scale_from_amax(amax, fmax, recipe.margin, recipe.pow2_scale, one);
}

// scaled_accumulate_tiles' value of one element: fl(fl(decode(acc) * acc_scale_inv) + update),
// each operation rounded once (what dequantize_tiles to float32, then a float32 add, computes).
template <class Acc, class Update>
FP8AMP_HD float accumulated(Acc acc, float acc_scale_inv, Update update) {
  return rn::add(rn::mul(numerics::to_float(acc), acc_scale_inv), numerics::to_float(update));
}

// cast_transpose_tiles' buffers: x [t.rows, t.cols] quantized into out by t's tiles and into
// out_t [t.cols, t.rows] (x's transpose) by t_t's tiles, t_t being the tiling of that transpose.
struct CastTransposeTiles {
  const void* x;
  void* out;
  float* scale_inv;
  void* out_t;
  float* scale_inv_t;
  TileShape t;
  TileShape t_t;
};

// scaled_accumulate_tiles' buffers: acc (FP8 codes) with acc_scale_inv by t's tiles, plus update,
// requantized into out (acc's format) with scale_inv by the same tiles.
struct AccumulateTiles {
  const void* acc;
  const float* acc_scale_inv;
  const void* update;
  void* out;
  float* scale_inv;
  TileShape t;
};

namespace cpu {
void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe);
void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t);
void cast_transpose_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe);
void scaled_accumulate_tiles(DType acc_dtype, DType update_dtype, const AccumulateTiles& p,
                             const ScalingRecipe& recipe);
}  // namespace cpu

namespace cuda {
void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe, Stream stream);
void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t, Stream stream);
void cast_transpose_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe,
                          Stream stream);
void scaled_accumulate_tiles(DType acc_dtype, DType update_dtype, const AccumulateTiles& p,
                             const ScalingRecipe& recipe, Stream stream);
}  // namespace cuda

}  // namespace fp8amp
