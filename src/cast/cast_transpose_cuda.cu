// CUDA twin of cast_cpu.cpp's cast_transpose (cast_transpose_dbias and cast_transpose_rescaled
// too): the same ops, bit for bit, as kernels that never sync with the host. cast_transpose_kernel
// quantizes a [rows, cols] matrix into out and out_t through a shared tile, after the amax pre-pass
// of current scaling (cast_cuda.cu's warmup_amax); sum_bands_kernel finishes the column sums.
#include <cuda_runtime.h>

#include <cstdint>

#include "cast/cast_cuda.cuh"
#include "cast/cast_kernels.h"
#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"

namespace fp8amp {
namespace cuda {
namespace {

// ----------------------------------------------------------------------------------------------
// Cast + transpose.
//
// A tile is kTileRows rows x 128 bytes of x (64 columns of bf16/fp16, 32 of fp32). A block
// quantizes kTilesPerBlock tiles stacked down one column of tiles, and consecutive blocks take
// consecutive columns of tiles, so the blocks resident at one time read whole rows of x. Each
// thread owns the same 4-row x 16-byte block of every tile and per tile:
// - loads its 4 rows at once (16 bytes each; a warp reads 4 x 128 bytes per load instruction),
//   quantizes them and stores them into out, then transposes the codes in registers (byte
//   permutes) into one 4-row piece per column and writes each piece to a shared code tile with
//   one 4- or 8-byte store;
// - after one barrier, copies 16-byte chunks of the code tile's columns to out_t, 8 (FP8) or 16
//   (FP16) threads per column: a warp writes whole 128-byte lines of out_t rows.
// The code tile is double-buffered: tile k + 1 writes the buffer whose last reads (the out_t stores
// of tile k - 1) every thread finished before the barrier of tile k, so one barrier a tile suffices.
// Bank conflicts: the chunks of column c are stored in the order chunk ^ (c / NI), NI the columns of
// a thread's block. A warp's piece stores hit 8 columns with different c / NI at one chunk index,
// which the swizzle spreads over all 32 banks; a quarter-warp reads 8 consecutive chunks of one
// column, a permutation of one 128-byte row of banks. Both are conflict-free.

constexpr int kTileRows = 128;
constexpr int kTileBytes = 128;  // of an x row
constexpr int kTilesPerBlock = 2;
// Blocks of cast_transpose_kernel resident per SM, which sets its register budget: with FP8 codes,
// 64 registers (4 blocks) let a thread issue its 4 loads of a tile at once (at 48, for 5 blocks,
// the compiler split them into two round trips); FP16 codes need 3 blocks' worth to avoid spills.
template <class Out>
constexpr int kTransposeBlocksPerSm = sizeof(Out) == 1 ? 4 : 3;
constexpr int kThreadsPerTileRow = kTileBytes / 16;  // one 16-byte load each
constexpr int kThreadRows = kTileRows * kThreadsPerTileRow / kThreads;
static_assert(kThreadRows == 4, "the register transpose takes 4 rows (FP8) or 2 x 2 rows (FP16)");

// The shared code tile of cast_transpose_kernel<In, Out, ...>: kCols columns (rows of out_t) of
// kTileRows codes each, as words, swizzled as described above.
template <class In, class Out>
struct CodeTile {
  static constexpr int kCols = kTileBytes / sizeof(In);
  static constexpr int kChunks = kTileRows * sizeof(Out) / 16;  // 16-byte chunks in a column
  static_assert(kChunks >= kThreadsPerTileRow, "the swizzle permutes chunks within a column");
  uint32_t words[2][kCols][kChunks * 4];

  // Word w of column c in buffer b.
  __device__ uint32_t* at(int b, int c, int w) {
    const int swizzle = c / (16 / static_cast<int>(sizeof(In)));
    return &words[b][c][((w / 4) ^ swizzle) * 4 + w % 4];
  }
};

// Transposes a square block of codes held in words: w[i] holds row i, its code j at bit
// 8 * sizeof(Out) * j; afterwards w[j] holds column j, its code i at the same place.
// __byte_perm(a, b, s): result byte n is byte (s >> 4n) & 7 of the 8 bytes of (b:a).
template <class Out>
__device__ void transpose_words(uint32_t (&w)[4 / sizeof(Out)]) {
  if constexpr (sizeof(Out) == 1) {
    const uint32_t r01_c01 = __byte_perm(w[0], w[1], 0x5140);  // bytes: r0c0 r1c0 r0c1 r1c1
    const uint32_t r01_c23 = __byte_perm(w[0], w[1], 0x7362);  //        r0c2 r1c2 r0c3 r1c3
    const uint32_t r23_c01 = __byte_perm(w[2], w[3], 0x5140);
    const uint32_t r23_c23 = __byte_perm(w[2], w[3], 0x7362);
    w[0] = __byte_perm(r01_c01, r23_c01, 0x5410);
    w[1] = __byte_perm(r01_c01, r23_c01, 0x7632);
    w[2] = __byte_perm(r01_c23, r23_c23, 0x5410);
    w[3] = __byte_perm(r01_c23, r23_c23, 0x7632);
  } else {
    static_assert(sizeof(Out) == 2, "codes are 1 or 2 bytes");
    const uint32_t c0 = __byte_perm(w[0], w[1], 0x5410);  // the low halves: column 0
    w[1] = __byte_perm(w[0], w[1], 0x7632);
    w[0] = c0;
  }
}

static_assert(kSumTileRows == kTileRows && kSumTiles == kTilesPerBlock && kSumGroupRows == kThreadRows,
              "cast_kernels.h's column-sum order is this kernel's thread layout");

// What cast_transpose_kernel writes. kCodes (cast_transpose): out and out_t with the scale of s,
// folding x's amax and writing scale_inv; kCodesAndSums (cast_transpose_dbias): also this block's
// column sums of x (its band, its columns) into band_sums [bands, cols]; kTransposed
// (cast_transpose_rescaled): out_t alone, with the scale of rescale (s unused: no amax, no scale_inv).
enum class Outputs { kCodes, kCodesAndSums, kTransposed };

// kWholePacks: the launcher found x, out and out_t aligned to their packs and both dimensions whole
// numbers of packs, so no element-wise code is compiled (the vector_ok flags are then all true).
template <class In, class Out, bool kWholePacks, Outputs kOutputs>
__global__ void __launch_bounds__(kThreads, kTransposeBlocksPerSm<Out>)
    cast_transpose_kernel(const In* __restrict__ x, Out* __restrict__ out, Out* __restrict__ out_t, int64_t rows,
                          int64_t cols, bool x_vector_ok, bool out_vector_ok, bool out_t_vector_ok,
                          float* __restrict__ band_sums, const ScalingPtrs s, const RescalePtrs rescale) {
  constexpr bool kColumnSums = kOutputs == Outputs::kCodesAndSums;
  constexpr bool kRowCodes = kOutputs != Outputs::kTransposed;  // out, the amax and scale_inv
  using Tile = CodeTile<In, Out>;
  constexpr int NI = 16 / sizeof(In);   // columns of a thread's block: one 16-byte load per row
  constexpr int NT = 16 / sizeof(Out);  // codes in a 16-byte chunk of an out_t row
  constexpr int kPerWord = 4 / sizeof(Out);
  constexpr int kPieceWords = kThreadRows / kPerWord;  // a thread's piece of a code-tile column
  __shared__ alignas(16) Tile codes;

  // This block's tiles: up to kTilesPerBlock tile rows from `band`, at column tile blockIdx.x % col_tiles.
  const int64_t col_tiles = ceil_div(cols, Tile::kCols);
  const int64_t band = static_cast<int64_t>(blockIdx.x) / col_tiles * kTilesPerBlock;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) % col_tiles * Tile::kCols;
  const int n = static_cast<int>(min(int64_t{kTilesPerBlock}, ceil_div(rows, kTileRows) - band));

  // This thread's block of each tile: rows tr + [0, kThreadRows), columns tc + [0, NI).
  const int tc = static_cast<int>(threadIdx.x) % kThreadsPerTileRow * NI;
  const int tr = static_cast<int>(threadIdx.x) / kThreadsPerTileRow * kThreadRows;
  const int64_t c = c0 + tc;
  const int row_valid = valid_count<NI>(c, cols);  // of each of its rows inside the matrix

  // The rows of this thread's block of tile k, 16 bytes each, zeros outside the matrix (which change
  // no amax). Held as words, not elements, so that a 16-bit row takes 4 registers rather than 8.
  uint32_t xs[kThreadRows][4];
  const auto load = [&](int k) {
    const int64_t r = (band + k) * kTileRows + tr;
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      const int valid = r + i < rows ? row_valid : 0;
      load_matrix_pack<kWholePacks, NI>(x + (r + i) * cols + c, valid, x_vector_ok, xs[i]);
    }
  };
  load(0);  // first, so that these loads are in flight while the scale is read
  float scale;
  if constexpr (kRowCodes) {
    scale = quantize_scale<Out>(s, 0, blockIdx.x == 0);
  } else {
    scale = rescaled_scale(rescale);
  }

  uint32_t abs_max = 0;
  float group_sum[kColumnSums ? NI : 1] = {};  // this thread's row group, its NI columns
#pragma unroll 1
  for (int k = 0; k < n; ++k) {
    if (k > 0) load(k);
    const int64_t r0 = (band + k) * kTileRows;
    uint32_t row_words[kThreadRows][NI / kPerWord];  // the codes of each row
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      if constexpr (kRowCodes) abs_max = abs_max_pack<In, NI>(xs[i], abs_max);
      float v[NI];
      decode_pack<In>(xs[i], v);
      if constexpr (kColumnSums) {
#pragma unroll
        for (int e = 0; e < NI; ++e) group_sum[e] = rn::add(group_sum[e], v[e]);
      }
#pragma unroll
      for (int e = 0; e < NI; ++e) v[e] *= scale;
      encode_pack<Out>(v, row_words[i]);
      if constexpr (kRowCodes) {
        const int64_t r = r0 + tr + i;
        store_matrix_pack<kWholePacks, NI>(out + r * cols + c, row_words[i], r < rows ? row_valid : 0,
                                           out_vector_ok);
      }
    }

    uint32_t col_words[NI][kPieceWords];  // the codes of each column, rows tr + [0, kThreadRows)
#pragma unroll
    for (int i0 = 0; i0 < kThreadRows; i0 += kPerWord) {
#pragma unroll
      for (int jw = 0; jw < NI / kPerWord; ++jw) {
        uint32_t block[kPerWord];
#pragma unroll
        for (int t = 0; t < kPerWord; ++t) block[t] = row_words[i0 + t][jw];
        transpose_words<Out>(block);
#pragma unroll
        for (int t = 0; t < kPerWord; ++t) col_words[jw * kPerWord + t][i0 / kPerWord] = block[t];
      }
    }
#pragma unroll
    for (int j = 0; j < NI; ++j) {
      uint32_t* piece = codes.at(k % 2, tc + j, tr / kPerWord);
      if constexpr (kPieceWords == 2) {
        *reinterpret_cast<uint2*>(piece) = make_uint2(col_words[j][0], col_words[j][1]);
      } else {
        *piece = col_words[j][0];
      }
    }
    __syncthreads();

    // Chunk p: column p / kChunks of the code tile, rows (p % kChunks) * NT + [0, NT) of the tile.
#pragma unroll
    for (int u = 0; u < Tile::kCols * Tile::kChunks / kThreads; ++u) {
      const int p = u * kThreads + static_cast<int>(threadIdx.x);
      const int col = p / Tile::kChunks, chunk = p % Tile::kChunks;
      const uint4 w4 = *reinterpret_cast<const uint4*>(codes.at(k % 2, col, chunk * 4));
      const uint32_t w[4] = {w4.x, w4.y, w4.z, w4.w};
      const int64_t r = r0 + chunk * NT, cc = c0 + col;
      store_matrix_pack<kWholePacks, NT>(out_t + cc * rows + r, w, cc < cols ? valid_count<NT>(r, rows) : 0,
                                         out_t_vector_ok);
    }
  }
  if constexpr (kRowCodes) fold_block_amax(s.amax, amax_key_from<In>(abs_max));
  if constexpr (kColumnSums) {
    // The band's sum of each column: its row groups' sums, added in group order by one thread.
    __shared__ float group_sums[kTileRows / kThreadRows][Tile::kCols];
#pragma unroll
    for (int e = 0; e < NI; ++e) group_sums[tr / kThreadRows][tc + e] = group_sum[e];
    __syncthreads();
    const int col = static_cast<int>(threadIdx.x);
    if (col < Tile::kCols && c0 + col < cols) {
      float band_sum = 0.0f;
#pragma unroll 8
      for (int g = 0; g < kTileRows / kThreadRows; ++g) band_sum = rn::add(band_sum, group_sums[g][col]);
      band_sums[band / kTilesPerBlock * cols + c0 + col] = band_sum;
    }
  }
}

// dbias[c] = the sum of band_sums[b, c] over bands b, in band order (cast_kernels.h). A few
// thousand threads each add tens of values: latency-bound, so each thread has kSumLoads loads in
// flight before it adds them in order, and the blocks are small so that more SMs take part.
constexpr int kSumThreads = 128;
constexpr int kSumLoads = 8;

__global__ void sum_bands_kernel(const float* __restrict__ band_sums, int64_t bands, int64_t cols,
                                 float* __restrict__ dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float sum = 0.0f;
  int64_t b = 0;
  for (; b + kSumLoads <= bands; b += kSumLoads) {
    float v[kSumLoads];
#pragma unroll
    for (int j = 0; j < kSumLoads; ++j) v[j] = band_sums[(b + j) * cols + c];
#pragma unroll
    for (int j = 0; j < kSumLoads; ++j) sum = rn::add(sum, v[j]);
  }
  for (; b < bands; ++b) sum = rn::add(sum, band_sums[b * cols + c]);
  dbias[c] = sum;
}

void sum_bands(const float* band_sums, int64_t rows, int64_t cols, float* dbias, cudaStream_t stream) {
  if (cols == 0) return;
  sum_bands_kernel<<<grid_size(ceil_div(cols, kSumThreads), "cast"), kSumThreads, 0, stream>>>(
      band_sums, column_sum_bands(rows), cols, dbias);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

// One launch of cast_transpose_kernel. out is nullptr for kTransposed (nothing of it then limits
// the kernel); band_sums is read only for kCodesAndSums.
template <Outputs kOutputs, class In, class Out>
void launch_cast_transpose(const In* x, Out* out, Out* out_t, int64_t rows, int64_t cols, float* band_sums,
                           const ScalingPtrs& s, const RescalePtrs& rescale, cudaStream_t stream) {
  // Packs are used only where every pack of the matrix is whole and aligned; when all three are,
  // the kernel without element-wise code (and its registers) runs.
  constexpr int NI = 16 / sizeof(In), NT = 16 / sizeof(Out);
  const bool x_vector_ok = cols % NI == 0 && is_aligned(x, 16);
  const bool out_vector_ok = kOutputs == Outputs::kTransposed || (cols % NI == 0 && is_aligned(out, NI * sizeof(Out)));
  const bool out_t_vector_ok = rows % NT == 0 && is_aligned(out_t, 16);
  const int64_t blocks =
      ceil_div(ceil_div(rows, kTileRows), kTilesPerBlock) * ceil_div(cols, CodeTile<In, Out>::kCols);
  const auto kernel = x_vector_ok && out_vector_ok && out_t_vector_ok ? cast_transpose_kernel<In, Out, true, kOutputs>
                                                                      : cast_transpose_kernel<In, Out, false, kOutputs>;
  kernel<<<grid_size(blocks, "cast"), kThreads, 0, stream>>>(x, out, out_t, rows, cols, x_vector_ok, out_vector_ok,
                                                             out_t_vector_ok, band_sums, s, rescale);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void cast_transpose(DType in_dtype, DType out_dtype, const void* x, void* out, void* out_t, int64_t rows,
                    int64_t cols, const ScalingPtrs& s, float* dbias, float* workspace, Stream stream) {
  if (rows * cols == 0) {
    // No tile to launch, but scale_inv is still written and the amax slot folded (with nothing):
    // exactly what quantizing an empty tensor does; the column sums of no rows are zeros.
    quantize(in_dtype, out_dtype, {TensorSlice{x, out, 0}}, s, stream);
    if (dbias != nullptr) sum_bands(workspace, rows, cols, dbias, cuda_stream(stream));
    return;
  }
  warmup_amax(in_dtype, {TensorSlice{x, nullptr, rows * cols}}, s, cuda_stream(stream));
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
    visit(ScaledFormatTypes{}, out_dtype, [&](auto o) {
      using Out = decltype(o);
      const In* xi = static_cast<const In*>(x);
      Out* y = static_cast<Out*>(out);
      Out* yt = static_cast<Out*>(out_t);
      if (dbias != nullptr) {
        launch_cast_transpose<Outputs::kCodesAndSums>(xi, y, yt, rows, cols, workspace, s, RescalePtrs{},
                                                      cuda_stream(stream));
        sum_bands(workspace, rows, cols, dbias, cuda_stream(stream));
      } else {
        launch_cast_transpose<Outputs::kCodes>(xi, y, yt, rows, cols, nullptr, s, RescalePtrs{}, cuda_stream(stream));
      }
    });
  });
}

void cast_transpose_rescaled(DType out_dtype, const numerics::fp16* x, void* out_t, int64_t rows, int64_t cols,
                             const RescalePtrs& rescale, Stream stream) {
  if (rows * cols == 0) return;  // no tile, and nothing else to write
  visit(ScaledFormatTypes{}, out_dtype, [&](auto o) {
    using Out = decltype(o);
    launch_cast_transpose<Outputs::kTransposed>(x, static_cast<Out*>(nullptr), static_cast<Out*>(out_t), rows, cols,
                                                nullptr, ScalingPtrs{}, rescale, cuda_stream(stream));
  });
}

}  // namespace cuda
}  // namespace fp8amp
