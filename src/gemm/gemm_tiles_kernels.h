// What the tile-scaled GEMM's backends see (gemm.h, gemm_tiles): raw pointers and sizes validated
// by gemm_tiles.cpp. The CPU reference (gemm_tiles_cpu.cpp) defines correct; the CUDA path
// (gemm_tiles_cuda.cpp, cuBLASLt) has the same signature plus a stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {

// The width of a K-block and the height of a weight block.
constexpr int64_t kTileBlock = 128;

// How one operand is scaled (gemm.h lists the tilings).
enum class TileScaling : int8_t { kRowwise, kTile1x128, kBlock128x128 };

// One operand's scales as the caller gives them: row-major [ceil(rows / row_tile), cols].
struct TileScales {
  const float* data;
  TileScaling scaling;
  int64_t cols;  // ceil(K / 128) for the tiled scalings, 1 for rowwise (0 when K == 0)

  int64_t row_tile() const { return scaling == TileScaling::kBlock128x128 ? kTileBlock : 1; }
  // The scale of row r (of M or N) in K-block kb.
  float at(int64_t r, int64_t kb) const { return data[(r / row_tile()) * cols + kb]; }
};

// out[M, N] (row stride ldo) = sum over K-blocks of scales * a[M, K] · b[N, K]ᵀ (+ bias[N]).
struct GemmTilesArgs : GemmProblem {
  TileScales a_scales;
  TileScales b_scales;
  // The K-blocks the sum is cut into: 128 wide for the tiled pairs, all of K for rowwise, 32 for
  // MXFP8 (whose scales the CPU path gets as float32 scale_inv, per row like (1, 128) tiles).
  int64_t block_k;
};

// The layout cuBLASLt reads an operand's scales in (the CUDA path copies them into it): `outer`
// runs of `ld` floats; run o holds, at i < inner, the scale of
//   kTile1x128:    row i, K-block o   (ld = rows rounded up to 4: the rows are contiguous)
//   kBlock128x128: row block o, K-block i   (ld = the K-blocks rounded up to 4)
//   kRowwise:      row i   (one run, ld = rows)
// and zeros in the padding. The padding to 4 floats keeps every run 16-byte aligned.
struct CublasScaleLayout {
  int64_t outer, ld, inner;
  bool transposed;  // run o, element i comes from the caller's [i][o] (else from [o][i])

  FP8AMP_HD int64_t elements() const { return outer * ld; }

  // Whether the caller's row-major scales, src_cols wide, are already this layout, element for
  // element (no padding, no transpose): 128 x 128 blocks whose K-blocks are a multiple of 4, and
  // rowwise's one column. cuBLASLt then reads them where they are.
  bool same_as(int64_t src_cols) const {
    if (inner != ld) return false;
    return transposed ? outer == 1 && src_cols == 1 : src_cols == ld;
  }
};

inline CublasScaleLayout cublas_scale_layout(TileScaling scaling, int64_t rows, int64_t k) {
  const int64_t k_blocks = (k + kTileBlock - 1) / kTileBlock;
  const auto round4 = [](int64_t v) { return (v + 3) / 4 * 4; };
  switch (scaling) {
    case TileScaling::kTile1x128: return {k_blocks, round4(rows), rows, true};
    case TileScaling::kBlock128x128: return {(rows + kTileBlock - 1) / kTileBlock, round4(k_blocks), k_blocks, false};
    case TileScaling::kRowwise: break;
  }
  return {1, rows, rows, true};
}

// Where the CUDA path puts each copy in the workspace: 256-byte aligned, a's then b's.
constexpr size_t kScaleCopyAlignment = 256;
inline size_t round_up_to_scale_copy_alignment(size_t bytes) {
  return (bytes + kScaleCopyAlignment - 1) / kScaleCopyAlignment * kScaleCopyAlignment;
}
// The first address at or after p where a scale copy may start.
inline char* align_scale_copy(void* p) {
  return reinterpret_cast<char*>(round_up_to_scale_copy_alignment(reinterpret_cast<uintptr_t>(p)));
}
inline size_t scale_copy_bytes(const CublasScaleLayout& layout) {
  return round_up_to_scale_copy_alignment(static_cast<size_t>(layout.elements()) * sizeof(float));
}

// MXFP8's copy of an operand's E8M0 scales [rows, k_blocks] in cuBLASLt's 128 x 4 tiled layout:
// rows padded to 128 and K-blocks to 4 (the padding holds code 127, a scale of 1),
// tile (rows / 128, k_blocks / 4) at ((row tile) * (padded k_blocks / 4) + k tile) * 512 bytes,
// inside it row r and K-block j at (r % 32) * 16 + (r % 128) / 32 * 4 + j % 4.
struct MxScaleLayout {
  int64_t rows, k_blocks;

  FP8AMP_HD int64_t padded_rows() const { return (rows + 127) / 128 * 128; }
  FP8AMP_HD int64_t padded_k_blocks() const { return (k_blocks + 3) / 4 * 4; }
  FP8AMP_HD int64_t bytes() const { return padded_rows() * padded_k_blocks(); }
  FP8AMP_HD int64_t offset(int64_t r, int64_t j) const {
    const int64_t tile = (r / 128) * (padded_k_blocks() / 4) + j / 4;
    return tile * 512 + (r % 32) * 16 + (r % 128) / 32 * 4 + j % 4;
  }
  // Its place in the workspace, kScaleCopyAlignment-aligned like the tile scales' copies.
  size_t copy_bytes() const { return round_up_to_scale_copy_alignment(static_cast<size_t>(bytes())); }
};

namespace cpu {
void gemm_tiles(const GemmTilesArgs& g);
}  // namespace cpu

namespace cuda {
void gemm_tiles(const GemmTilesArgs& g, Stream stream);
// cuBLASLt's scale modes (cublasLtMatmulMatrixScale_t values) and scale copies of both operands,
// and how messages name them and the op.
struct ScaleModes {
  int32_t a_mode, b_mode;
  const void* a_scales;
  const void* b_scales;
  const char* a_name;
  const char* b_name;
  const char* op;
};
// out = a · bᵀ (+ bias) through cuBLASLt with those scales, in workspace (cuBLASLt's part), on the
// current device g.device_index (gemm_tiles_cuda.cpp), with the problem's algorithm from the
// shared cache (algo_tuner.h); NotImplementedError where cuBLASLt has none.
void scaled_matmul(const GemmTilesArgs& g, const ScaleModes& modes, void* workspace, size_t workspace_bytes,
                   Stream stream);
// One operand's scale copy: dst (layout) = the caller's scales src (row-major, src_cols wide).
struct ScaleCopy {
  const float* src;
  int64_t src_cols;
  CublasScaleLayout layout;
  float* dst;
};
// The copies (count of them, at most kMaxScaleCopies) in one launch on stream (gemm_tiles_scales_cuda.cu).
constexpr int kMaxScaleCopies = 2;
void copy_tile_scales(const ScaleCopy* copies, int count, Stream stream);
// The MXFP8 GEMM through cuBLASLt (gemm_mx_cuda.cpp): g's a_scales / b_scales are unused, the E8M0
// codes [rows, K / 32] come as a_scales / b_scales.
void gemm_mx(const GemmTilesArgs& g, const uint8_t* a_scales, const uint8_t* b_scales, Stream stream);
// dst (layout) = the E8M0 codes src [layout.rows, layout.k_blocks], padding 127 (gemm_mx_scales_cuda.cu).
void copy_mx_scales(const uint8_t* src, const MxScaleLayout& layout, uint8_t* dst, Stream stream);
}  // namespace cuda

}  // namespace fp8amp
