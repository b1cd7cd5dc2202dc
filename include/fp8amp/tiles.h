// Fine-grained scaling (docs/tiles.md): a matrix cut into tiles, each with a scale of its own, so
// one outlier sets the scale of its tile only. x is viewed as [rows, cols] (its last dim is cols)
// and cut into tiles of tile_rows x tile_cols, the last ones in each direction possibly partial:
// (1, cols) is rowwise scaling, (1, 128) DeepSeek-V3's activation tiles, (128, 128) its weight
// blocks. Scales are float32 [ceil(rows / tile_rows), ceil(cols / tile_cols)], row-major.
// Current scaling only: each tile's scale comes from its own amax in the same op. Like every
// fp8amp op these run on the device of their tensors and never sync with the host; outputs never
// share memory with inputs (ValueError naming both).
#pragma once

#include <cstdint>
#include <vector>

#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// out [rows, cols] (E4M3 or E5M2) = encode(x * scale[tile]); scale_inv[tile] = 1 / scale[tile].
// scale[tile] = the recipe's rule (scaling.h) from the tile's amax; a tile of zeros gets scale 1.
// A tile whose amax is inf or NaN gets scale 1 and scale_inv NaN: the whole tile reads NaN (an
// FP8 code cannot hold the overflow), every other tile is untouched. x fp32/bf16/fp16, contiguous.
void quantize_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv, int64_t tile_rows,
                    int64_t tile_cols, const ScalingRecipe& recipe, Stream stream);

// out [rows, cols] (fp32/bf16/fp16, IEEE rounding) = decode(x) * scale_inv[tile]; x E4M3/E5M2.
void dequantize_tiles(const TensorView& x, const TensorView& scale_inv, const TensorView& out, int64_t tile_rows,
                      int64_t tile_cols, Stream stream);

// One pass over x [rows, cols] (fp32/bf16/fp16, contiguous) writing two quantized copies, each
// bit for bit what quantize_tiles writes: out [rows, cols] with scale_inv by tile_rows x tile_cols
// tiles of x, and out_t [cols, rows] (x's transpose, contiguous) with scale_inv_t
// [ceil(cols / tile_rows_t), ceil(rows / tile_cols_t)] by tile_rows_t x tile_cols_t tiles of that
// transpose. With the same tile for both, each copy's tiles run along its own rows, as the GEMMs
// of the forward and backward passes contract them; rowwise is tile (1, cols) with tile_t (1, rows).
void cast_transpose_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv,
                          const TensorView& out_t, const TensorView& scale_inv_t, int64_t tile_rows, int64_t tile_cols,
                          int64_t tile_rows_t, int64_t tile_cols_t, const ScalingRecipe& recipe, Stream stream);

// The fused dequantize-add-requantize of a tiled accumulator (blockwise weight gradients): out
// (acc's format) with scale_inv = quantize_tiles of s = fl(fl(decode(acc) * acc_scale_inv[tile]) +
// update), each tile with a fresh scale from the amax of its sums. acc E4M3/E5M2 with
// acc_scale_inv by the same tiles; update fp32/bf16/fp16 of acc's shape. A NaN acc_scale_inv (a
// poisoned tile) or a non-finite sum poisons that tile of out again, and only that tile.
void scaled_accumulate_tiles(const TensorView& acc, const TensorView& acc_scale_inv, const TensorView& update,
                             const TensorView& out, const TensorView& scale_inv, int64_t tile_rows, int64_t tile_cols,
                             const ScalingRecipe& recipe, Stream stream);

// The 2-norms of n tile-scaled tensors: out[i] (float32 [n]) = sqrt(sum over xs[i]'s elements of
// (decode(x) * scale_invs[i][tile])^2), each xs[i] (one dtype for all: E4M3, E5M2 or FP16 codes,
// contiguous, at least 1 dimension) viewed as [rows, cols] and cut into tile_rows x tile_cols
// tiles; scale_invs[i] float32, contiguous, one element per tile in row-major order (its shape
// does not matter). Tiles larger than the matrix make one scale for all of it. The squares of
// each 16-byte pack of a row's codes (its run in one tile) are summed in float32, then scaled and
// summed in float64, so no sum overflows where the norm itself fits in float32 and the result is
// within about an ulp of the float64 norm rounded; a NaN or inf in a tensor, or a non-finite scale
// it uses, gives that tensor's norm only NaN or inf.
// workspace: uint8 of at least multi_norm_tiles_workspace(xs) bytes, 8-byte aligned (the CUDA
// kernel's per-block partial sums; the CPU does not use it).
void multi_norm_tiles(const std::vector<TensorView>& xs, const std::vector<TensorView>& scale_invs, int64_t tile_rows,
                      int64_t tile_cols, const TensorView& out, const TensorView& workspace, Stream stream);
int64_t multi_norm_tiles_workspace(const std::vector<TensorView>& xs);

// ---- MXFP8 (OCP Microscaling, docs/tiles.md#mxfp8) ----
constexpr int64_t kMxBlock = 32;  // the elements of an MX block

// Blocks of 1 x 32 consecutive elements of a row (the last one of a row may be partial), each with
// one E8M0 scale: a uint8 exponent code, X = 2^(code - 127), 0xFF = NaN. scales is uint8
// [rows, ceil(cols / 32)], row-major. Each block's X is the smallest 2^e, e >= -127, with
// amax / X <= fmax (OCP MX's floor(log2(amax)) - emax, or one more; exact from the bits), so the
// elements encode(v / X) never saturate. A block of zeros gets X = 1 (code 127); a block holding
// an inf or NaN gets code 0xFF (it reads NaN) and no other block changes. x fp32/bf16/fp16,
// contiguous; out E4M3 or E5M2.
void quantize_mx(const TensorView& x, const TensorView& out, const TensorView& scales, Stream stream);

// out (fp32/bf16/fp16, IEEE rounding) = decode(x) * X[block]; x E4M3/E5M2 with scales as above.
void dequantize_mx(const TensorView& x, const TensorView& scales, const TensorView& out, Stream stream);

// x and its transpose, each cut into 1 x 32 blocks along its own rows, bit for bit quantize_mx of
// x and of x's transpose: out [rows, cols] with scales [rows, ceil(cols / 32)], out_t [cols, rows]
// with scales_t [cols, ceil(rows / 32)] (blocks of 32 rows of x for each column): the operands of
// the forward GEMM (along x's columns) and of the weight-gradient GEMM (along its rows).
void cast_transpose_mx(const TensorView& x, const TensorView& out, const TensorView& scales, const TensorView& out_t,
                       const TensorView& scales_t, Stream stream);

// ValueError unless both tile sizes are positive (what a caller allocating scale_inv checks first);
// `owner` names the tile argument they belong to when it is not plain `tile` (e.g. "tile_t's ").
void check_tile_sizes(int64_t tile_rows, int64_t tile_cols, const char* op, const char* owner = "");

}  // namespace fp8amp
