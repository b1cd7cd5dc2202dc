// What the tile kernels see: raw pointers and sizes, validated by tiles.cpp, and the per-tile
// math both implementations share. Each function has a CPU reference (tiles_cpu.cpp) and a CUDA
// twin (tiles_cuda.cu, tiles_region_cuda.cu) with the same signature; the CPU one defines
// correct.
#pragma once

#include <cstdint>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"
#include "fp8amp/tiles.h"

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

// What a quantizing tile op gets from a tile's amax: the scale its elements are multiplied by,
// and what is stored for the tile (Rule::Stored). A rule also says what a stored value means as a
// scale_inv (Rule::scale_inv). Two rules share every tile kernel:
template <class Stored>
struct BlockScale {
  float scale;
  Stored stored;
};

// The tile ops' float32 scales by a ScalingRecipe (tile_scale): scale_inv is stored.
struct RecipeScaleRule {
  using Stored = float;
  ScalingRecipe recipe;
  FP8AMP_HD BlockScale<float> operator()(float amax, float fmax) const {
    const numerics::ScalePair pair = tile_scale(amax, fmax, recipe);
    return {pair.scale, pair.scale_inv};
  }
  static FP8AMP_HD float scale_inv(float stored) { return stored; }
};

// ---- MXFP8 (tiles.h, docs/tiles.md#mxfp8): blocks of 1 x kMxBlock, one E8M0 scale each ----
constexpr int kE8M0Bias = 127;
constexpr uint8_t kE8M0Nan = 0xFF;

// The scale_inv an E8M0 code stands for: 2^(code - 127) (code 0 is 2^-127, a float subnormal,
// exact), NaN for 0xFF.
FP8AMP_HD float e8m0_scale_inv(uint8_t code) {
  if (code == kE8M0Nan) return numerics::bits_float(numerics::kCanonicalNanBits);
  if (code == 0) return numerics::bits_float(0x00400000u);
  return numerics::pow2(static_cast<int>(code) - kE8M0Bias);
}

// A block's scale X = 2^e: the smallest e >= -127 (E8M0's smallest) with amax * 2^-e <= fmax, so
// that no element saturates (docs/tiles.md#the-ops-and-the-scale-rule). OCP MX's floor rule,
// floor(log2(amax)) - floor(log2(fmax)), is e or e - 1: one more when amax's mantissa is above
// fmax's, the test below (amax * 2^-e is then in [2^emax, 2^(emax+1)): exact). The elements are
// v * 2^-e (exact), rounded to nearest. A block of zeros gets X = 1 (code 127); a block holding an
// inf or NaN gets the NaN code and scale 1 (it reads NaN; no other block changes).
FP8AMP_HD BlockScale<uint8_t> mx_block_scale(float amax, float fmax) {
  if (!numerics::is_finite(amax)) return {1.0f, kE8M0Nan};
  if (amax == 0.0f) return {1.0f, static_cast<uint8_t>(kE8M0Bias)};
  int e = numerics::floor_log2(amax) - numerics::floor_log2(fmax);
  if (e < -kE8M0Bias) {
    e = -kE8M0Bias;  // amax < 2^-119: amax * 2^127 < 2^8, below fmax
  } else if (amax * numerics::pow2(-e) > fmax) {
    ++e;  // at most 128 - 8 for a finite float amax
  }
  return {numerics::pow2(-e), static_cast<uint8_t>(e + kE8M0Bias)};
}

struct E8M0ScaleRule {
  using Stored = uint8_t;
  FP8AMP_HD BlockScale<uint8_t> operator()(float amax, float fmax) const { return mx_block_scale(amax, fmax); }
  static FP8AMP_HD float scale_inv(uint8_t stored) { return e8m0_scale_inv(stored); }
};

// A [rows, cols] matrix cut into MX blocks along its rows.
inline TileShape mx_blocks(int64_t rows, int64_t cols) { return TileShape{rows, cols, 1, kMxBlock}; }

// scaled_accumulate_tiles' value of one element: fl(fl(decode(acc) * acc_scale_inv) + update),
// each operation rounded once (what dequantize_tiles to float32, then a float32 add, computes).
template <class Acc, class Update>
FP8AMP_HD float accumulated(Acc acc, float acc_scale_inv, Update update) {
  return rn::add(rn::mul(numerics::to_float(acc), acc_scale_inv), numerics::to_float(update));
}

// cast_transpose_tiles' buffers: x [t.rows, t.cols] quantized into out by t's tiles and into
// out_t [t.cols, t.rows] (x's transpose) by t_t's tiles, t_t being the tiling of that transpose;
// each tile's scale stored as Stored (float32 scale_inv, or an E8M0 code for MXFP8).
template <class Stored>
struct CastTransposeOf {
  const void* x;
  void* out;
  Stored* scale_inv;
  void* out_t;
  Stored* scale_inv_t;
  TileShape t;
  TileShape t_t;
};
using CastTransposeTiles = CastTransposeOf<float>;
using CastTransposeMx = CastTransposeOf<uint8_t>;  // scale_inv, scale_inv_t: the E8M0 scales

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

// ---- multi_norm_tiles ----
// One tensor of multi_norm_tiles: its codes viewed as t, with one scale_inv per tile of t.
struct NormTensor {
  const void* x;
  const float* scale_inv;
  TileShape t;
};

// The CUDA kernel's work items over a [rows, cols] matrix: blocks of row_chunk rows by col_chunk
// columns (the whole row up to kNormItemCols), about kNormItemElements elements each; one partial
// sum each in the workspace.
constexpr int64_t kNormItemCols = 16384;
constexpr int64_t kNormItemElements = 65536;

struct NormItems {
  int64_t col_chunk;
  int64_t row_chunk;
  int64_t col_items;  // items across a row
  int64_t count;
};

FP8AMP_HD NormItems norm_items(int64_t rows, int64_t cols) {
  const int64_t col_chunk = cols < kNormItemCols ? (cols > 0 ? cols : 1) : kNormItemCols;
  const int64_t row_chunk = kNormItemElements / col_chunk > 1 ? kNormItemElements / col_chunk : 1;
  const int64_t col_items = (cols + col_chunk - 1) / col_chunk;
  return {col_chunk, row_chunk, col_items, ((rows + row_chunk - 1) / row_chunk) * col_items};
}

// The share of the squared norm of n consecutive values v (1 <= n <= P, and v[n..P) zeros) of one
// row, the first at column `col`, in tile `tile` of tiles tile_cols wide: the float32 sum of the
// squares of each run of them in one tile (in order), times that tile's scale_inv squared
// (scale_row: the scale_invs of the row's tiles), in float64. Both implementations group a row's
// values in the same packs, so these shares are bit for bit the same; only their float64 sum's
// order differs. (A code's square is exact in float32, so a fused multiply-add rounds as the
// separate ops do.) Every index into v is a constant once the loop is unrolled, which keeps the
// pack in registers on the GPU; kOneTile drops the boundary test where no tile begins inside it.
template <bool kOneTile, int P>
FP8AMP_HD double pack_runs_norm_squared(const float (&v)[P], int n, int next, int64_t tile, int64_t tile_cols,
                                        const float* scale_row) {
  double total = 0.0;
  float sum = 0.0f;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int e = 0; e < P; ++e) {
    if (!kOneTile && e == next) {  // a run ends: add its share, the next tile's run begins
      const double s = scale_row[tile];
      total += static_cast<double>(sum) * (s * s);
      sum = 0.0f;
      ++tile;
      next = next + tile_cols < n ? next + static_cast<int>(tile_cols) : P;
    }
    sum += v[e] * v[e];
  }
  const double s = scale_row[tile];
  return total + static_cast<double>(sum) * (s * s);
}

template <int P>
FP8AMP_HD double pack_norm_squared(const float (&v)[P], int n, int64_t col, int64_t tile, int64_t tile_cols,
                                   const float* scale_row) {
  const int64_t to_next = (tile + 1) * tile_cols - col;  // columns until the next tile begins
  const int next = to_next < n ? static_cast<int>(to_next) : P;
  return next == P ? pack_runs_norm_squared<true>(v, n, next, tile, tile_cols, scale_row)
                   : pack_runs_norm_squared<false>(v, n, next, tile, tile_cols, scale_row);
}

namespace cpu {
void quantize_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, const TileShape& t,
                    const ScalingRecipe& recipe);
void dequantize_tiles(DType in_dtype, DType out_dtype, const void* x, const float* scale_inv, void* out,
                      const TileShape& t);
void cast_transpose_tiles(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe);
void scaled_accumulate_tiles(DType acc_dtype, DType update_dtype, const AccumulateTiles& p,
                             const ScalingRecipe& recipe);
// MXFP8 (t = mx_blocks(...)): p.out_t null for the rowwise copy only.
void quantize_mx(DType in_dtype, DType out_dtype, const CastTransposeMx& p);
void dequantize_mx(DType in_dtype, DType out_dtype, const void* x, const uint8_t* scales, void* out,
                   const TileShape& t);
void multi_norm_tiles(DType dtype, const std::vector<NormTensor>& tensors, float* out);
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
void quantize_mx(DType in_dtype, DType out_dtype, const CastTransposeMx& p, Stream stream);
void dequantize_mx(DType in_dtype, DType out_dtype, const void* x, const uint8_t* scales, void* out,
                   const TileShape& t, Stream stream);
// workspace: one double per norm_items(...).count of each tensor, in order.
void multi_norm_tiles(DType dtype, const std::vector<NormTensor>& tensors, float* out, double* workspace,
                      Stream stream);
}  // namespace cuda

}  // namespace fp8amp
