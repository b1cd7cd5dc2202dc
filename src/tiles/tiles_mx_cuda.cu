// MXFP8's casts in one pass: quantize_mx and cast_transpose_mx, bit for bit tiles_cpu.cpp. One block
// of 128 threads per 32 x 128 region of x; 32 is kMxBlock, so a region's rows are one block of the
// transpose's (a 32 x 1 column of x). The block reads the region once and writes each code and
// scale once:
//
// - Each thread loads a 4-row x 8-column piece into registers: row group rg = thread / 16 holds
//   rows 4 rg .. 4 rg + 3, column group cg = thread % 16 columns 8 cg .. 8 cg + 7 (one 16-byte load
//   a row for 16-bit inputs, two for float32), so the 16 threads of a row group read 256
//   consecutive bytes a row.
// - A 1 x 32 block's amax (the copy along the rows) comes from the 4 threads of its column groups,
//   lanes differing in bits 0 and 1, by shuffles that reduce and scatter at once: afterwards lane
//   q (= lane % 4) holds row q's amax, whose E8M0 scale it computes and stores.
// - A 32 x 1 block's amax (a column of the region) comes from the warp's 2 row groups (lane bit 4)
//   the same way, then from the 4 warps through shared memory.
// - The codes along the rows go to `out` from registers; those of a column, 4 rows to a 32-bit
//   word, into a shared [128 columns][8 words] tile, from which each column's 32 codes go to its
//   out_t row as two 16-byte stores. Column c of column group g = c / 8 sits in row c ^ (g % 4)
//   of the tile, its word w at w ^ (2 * (g / 4)): a warp's 32 word stores (16 column groups x 2
//   row groups) then hit 32 different banks, and the 16-byte reads stay whole and conflict-free.
//
// Amaxes are float bits with the sign cleared, which order like |x| with every NaN above inf.
// The codecs are word_pack.cuh's and the scales E8M0ScaleRule's, as on the CPU.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"
#include "tiles/tiles_cuda.cuh"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kMxRows = static_cast<int>(kMxBlock);  // a region's rows: one block of the transpose
constexpr int kMxCols = 128;                         // a region's columns: four blocks of the rows
constexpr int kMxThreads = 128;
constexpr int kMxWarps = kMxThreads / 32;
constexpr int kPieceRows = 4;
constexpr int kPieceCols = 8;
constexpr int kColumnGroups = kMxCols / kPieceCols;   // 16: the threads of a row group
constexpr int kColumnWords = kMxRows / 4;             // 32-bit words of codes in a column of the region
constexpr int kChunk = 16;                            // codes in a 16-byte store of an out_t row
constexpr int kBlockLanes = kMxRows / kPieceCols;     // 4: the threads that share a 1 x 32 block
constexpr unsigned kAllLanes = 0xFFFFFFFFu;
static_assert(kMxThreads / kColumnGroups * kPieceRows == kMxRows, "the pieces cover the region's rows");
static_assert(kBlockLanes == kPieceRows, "each thread of a block's 4 computes one of its 4 rows' scales");
static_assert(32 / kColumnGroups == 2, "a warp holds two row groups, told apart by lane bit 4");

template <class In, class Out, bool kTranspose, bool kWhole>
__global__ void __launch_bounds__(kMxThreads)
    mx_kernel(const In* __restrict__ x, Out* __restrict__ out, uint8_t* __restrict__ scales, Out* __restrict__ out_t,
              uint8_t* __restrict__ scales_t, int64_t rows, int64_t cols, bool x_vector_ok, bool out_vector_ok,
              bool out_t_vector_ok) {
  constexpr int NI = 16 / static_cast<int>(sizeof(In));  // elements of one 16-byte load
  constexpr int kLoads = kPieceCols / NI;
  constexpr float kFmax = numerics::format_max<Out>();
  const E8M0ScaleRule rule;
  const int64_t region_cols = ceil_div(cols, kMxCols);
  const int64_t rb = static_cast<int64_t>(blockIdx.x) / region_cols, cb = static_cast<int64_t>(blockIdx.x) % region_cols;
  const int64_t r0 = rb * kMxRows, c0 = cb * kMxCols;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int cg = static_cast<int>(threadIdx.x) % kColumnGroups, rg = static_cast<int>(threadIdx.x) / kColumnGroups;
  const int tr = rg * kPieceRows, tc = cg * kPieceCols;  // the piece's first row and column in the region

  uint32_t piece[kPieceRows][kLoads][kWords<In, NI>];
#pragma unroll
  for (int i = 0; i < kPieceRows; ++i) {
    const int64_t r = r0 + tr + i;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t c = c0 + tc + l * NI;
      load_matrix_pack<kWhole, NI>(x + r * cols + c, r < rows ? valid_count<NI>(c, cols) : 0, x_vector_ok, piece[i][l]);
    }
  }

  // Amax keys of the piece's rows and columns (zeros outside the matrix change none).
  uint32_t row_key[kPieceRows] = {}, col_key[kPieceCols] = {};
#pragma unroll
  for (int i = 0; i < kPieceRows; ++i) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      float v[NI];
      decode_pack<In>(piece[i][l], v);
#pragma unroll
      for (int e = 0; e < NI; ++e) {
        const uint32_t key = numerics::float_bits(v[e]) & 0x7FFFFFFFu;
        row_key[i] = max(row_key[i], key);
        col_key[l * NI + e] = max(col_key[l * NI + e], key);
      }
    }
  }

  // The 1 x 32 blocks: each step sends the partner lane the half of the rows it keeps.
  const bool b1 = lane & 2, b0 = lane & 1;
  const uint32_t pair0 = max(b1 ? row_key[2] : row_key[0], __shfl_xor_sync(kAllLanes, b1 ? row_key[0] : row_key[2], 2));
  const uint32_t pair1 = max(b1 ? row_key[3] : row_key[1], __shfl_xor_sync(kAllLanes, b1 ? row_key[1] : row_key[3], 2));
  const uint32_t key = max(b0 ? pair1 : pair0, __shfl_xor_sync(kAllLanes, b0 ? pair0 : pair1, 1));
  const BlockScale<uint8_t> block = rule(numerics::amax_from_key(key), kFmax);
  {
    const int64_t r = r0 + tr + lane % kBlockLanes, b = (c0 + tc) / kMxBlock;  // the row and block this lane scales
    if (r < rows && b * kMxBlock < cols) scales[r * ceil_div(cols, kMxBlock) + b] = block.stored;
  }
  float row_scale[kPieceRows];
#pragma unroll
  for (int i = 0; i < kPieceRows; ++i) row_scale[i] = __shfl_sync(kAllLanes, block.scale, (lane & ~3) + i);

  // The 32 x 1 blocks (the region's columns).
  __shared__ float col_scales[kTranspose ? kMxCols : 1];
  if constexpr (kTranspose) {
    __shared__ uint32_t warp_col_keys[kMxWarps][kMxCols];
    const bool b4 = lane & 16;  // this thread keeps its columns 4 * b4 .. 4 * b4 + 3
#pragma unroll
    for (int m = 0; m < kPieceCols / 2; ++m) {
      const uint32_t half =
          max(b4 ? col_key[4 + m] : col_key[m], __shfl_xor_sync(kAllLanes, b4 ? col_key[m] : col_key[4 + m], 16));
      warp_col_keys[warp][tc + (b4 ? 4 : 0) + m] = half;
    }
    __syncthreads();
    const int c = static_cast<int>(threadIdx.x);
    static_assert(kMxThreads == kMxCols, "one thread per column of the region");
    uint32_t col_amax_key = 0;
#pragma unroll
    for (int w = 0; w < kMxWarps; ++w) col_amax_key = max(col_amax_key, warp_col_keys[w][c]);
    const BlockScale<uint8_t> col_block = rule(numerics::amax_from_key(col_amax_key), kFmax);
    col_scales[c] = col_block.scale;
    if (c0 + c < cols) scales_t[(c0 + c) * ceil_div(rows, kMxBlock) + rb] = col_block.stored;
    __syncthreads();
  }

  __shared__ alignas(16) uint32_t codes_t[kTranspose ? kMxCols : 1][kColumnWords];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    float v[kPieceRows][NI];
#pragma unroll
    for (int i = 0; i < kPieceRows; ++i) decode_pack<In>(piece[i][l], v[i]);
    const int64_t c = c0 + tc + l * NI;
#pragma unroll
    for (int i = 0; i < kPieceRows; ++i) {
      uint32_t codes[kWords<Out, NI>];
      encode_scaled_pack<Out>(v[i], row_scale[i], codes);
      const int64_t r = r0 + tr + i;
      store_matrix_pack<kWhole, NI>(out + r * cols + c, codes, r < rows ? valid_count<NI>(c, cols) : 0, out_vector_ok);
    }
    if constexpr (kTranspose) {
#pragma unroll
      for (int e = 0; e < NI; ++e) {
        const int col = tc + l * NI + e;
        const float scale = col_scales[col];
        float column[kPieceRows];
#pragma unroll
        for (int i = 0; i < kPieceRows; ++i) column[i] = v[i][e];
        uint32_t word[1];
        encode_scaled_pack<Out>(column, scale, word);
        codes_t[col ^ (cg % 4)][rg ^ (2 * (cg / 4))] = word[0];
      }
    }
  }

  if constexpr (kTranspose) {
    __syncthreads();
    constexpr int kChunksPerColumn = kMxRows / kChunk;
#pragma unroll
    for (int u = 0; u < kMxCols * kChunksPerColumn / kMxThreads; ++u) {
      const int p = u * kMxThreads + static_cast<int>(threadIdx.x);
      const int col = p / kChunksPerColumn, chunk = p % kChunksPerColumn;
      // Word 4 chunk + k, stored at (4 chunk + k) ^ 2y: in the 16 bytes at 4 (chunk ^ (y / 2)),
      // at k ^ 2 (y % 2).
      const int g = col / kPieceCols, y = g / 4;
      const uint4 w4 = *reinterpret_cast<const uint4*>(&codes_t[col ^ (g % 4)][(chunk ^ (y / 2)) * 4]);
      const bool swapped = y % 2;
      const uint32_t words[4] = {swapped ? w4.z : w4.x, swapped ? w4.w : w4.y, swapped ? w4.x : w4.z,
                                 swapped ? w4.y : w4.w};
      const int64_t r = r0 + chunk * kChunk, cc = c0 + col;
      store_matrix_pack<kWhole, kChunk>(out_t + cc * rows + r, words, cc < cols ? valid_count<kChunk>(r, rows) : 0,
                                        out_t_vector_ok);
    }
  }
}

template <class In, class Out, bool kTranspose>
void launch_mx(const CastTransposeMx& p, cudaStream_t stream) {
  constexpr int NI = 16 / static_cast<int>(sizeof(In));
  const int64_t rows = p.t.rows, cols = p.t.cols;
  const In* x = static_cast<const In*>(p.x);
  Out* out = static_cast<Out*>(p.out);
  Out* out_t = static_cast<Out*>(p.out_t);
  const bool x_vector_ok = cols % NI == 0 && is_aligned(x, 16);
  const bool out_vector_ok = cols % NI == 0 && is_aligned(out, NI);
  const bool out_t_vector_ok = !kTranspose || (rows % kChunk == 0 && is_aligned(out_t, 16));
  const int64_t blocks = ceil_div(rows, kMxRows) * ceil_div(cols, kMxCols);
  const char* op = kTranspose ? "cast_transpose_mx" : "quantize_mx";
  const auto kernel = x_vector_ok && out_vector_ok && out_t_vector_ok ? mx_kernel<In, Out, kTranspose, true>
                                                                      : mx_kernel<In, Out, kTranspose, false>;
  kernel<<<grid_size(blocks, op), kMxThreads, 0, stream>>>(x, out, p.scale_inv, out_t, p.scale_inv_t, rows, cols,
                                                           x_vector_ok, out_vector_ok, out_t_vector_ok);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_mx_regions(DType in_dtype, DType out_dtype, const CastTransposeMx& p, cudaStream_t stream) {
  if (p.t.rows * p.t.cols == 0) return;  // no block, no scale
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      p.out_t != nullptr ? launch_mx<In, Out, true>(p, stream) : launch_mx<In, Out, false>(p, stream);
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
