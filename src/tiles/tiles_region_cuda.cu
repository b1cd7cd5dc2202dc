// The one-pass tile kernel: quantize_tiles, cast_transpose_tiles and scaled_accumulate_tiles with
// (1, 128) tiles or (128, 128) blocks, bit for bit tiles_cpu.cpp. One block of 256 threads per 128 x 128 region of
// x, which it reads from memory once, and whose copies (and scales) it writes once:
//
// - Each thread loads a 4-row x 16-column piece of the region into registers: per row, 16-byte
//   loads at columns l * 8 * NI + lane_in_row * NI (NI elements of 16 bytes), so the 8 threads of
//   a row read 128 consecutive bytes per load.
// - Amaxes, as the float bits with the sign cleared (which order like |x|, every NaN above inf):
//   a row tile's from the 8 threads of its row (warp shuffles that reduce and scatter at once,
//   so that each thread ends with one row's amax and computes one scale); a column tile's (a
//   tile of the transpose) from the 4 row groups of each warp (the same), then the 8 warps
//   (shared memory); a block's from every thread (block_max_key).
// - out: each row piece times its tile's scale, encoded and stored straight from registers.
// - out_t: each column of a thread's piece (4 rows) times its tile's scale encodes into one
//   32-bit word of 4 codes, stored into a shared [128 columns][128 codes] tile; after a barrier,
//   8 threads copy each column's 128 codes to its out_t row with 16-byte stores. Word w of column
//   c sits at w ^ (4 * s), s = (c / NI) % 8 (the thread of its row that holds c), so that a warp's
//   word stores (8 threads x 4 row groups) hit 32 banks and 8 threads reading one column's
//   16-byte chunks read one 128-byte row of banks: conflict-free both ways.
//
// The codecs are word_pack.cuh's, which give numerics.h's bits (test_cast_cuda proves them), and
// the scales come from tile_scale, as on the CPU.
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

constexpr int kRegion = 128;  // a region is kRegion x kRegion elements; tiles are 1 x kRegion or kRegion x kRegion
constexpr int kRegionThreads = 256;
constexpr int kWarps = kRegionThreads / 32;
constexpr int kThreadRows = 4;    // a thread's piece of the region: kThreadRows rows ...
constexpr int kThreadCols = 16;   // ... of kThreadCols columns
constexpr int kRowLanes = kRegion / kThreadCols;  // the threads that share a row
constexpr int kColumnWords = kRegion / 4;         // 32-bit words of FP8 codes in one column of the region
constexpr int kChunk = 16;                        // codes in a 16-byte chunk of an out_t row
static_assert(kRegionThreads / kRowLanes * kThreadRows == kRegion, "the threads' pieces cover the region");
static_assert(kRowLanes == 8 && 32 % kRowLanes == 0, "a row's threads are lanes differing in their low 3 bits");
static_assert(kRegion * (kRegion / kChunk) % kRegionThreads == 0, "the out_t chunks split evenly over the threads");

enum class Tiling { kRowTiles, kBlocks };  // (1, 128) tiles, or (128, 128) blocks

// What region_kernel quantizes: x's own values (CastSource) or scaled_accumulate_tiles' sums
// (AccumulateSource). A source loads the packs of a thread's piece into a Piece of registers (pack
// l of the piece's row i: kPack elements from element `offset` of the matrix, `valid` of them
// inside it, zeros after) and gives a pack's values on demand, as often as asked: it keeps the
// packs, which take fewer registers than their floats. Zeros outside the matrix give values that
// change no tile's amax.
template <class In>
struct CastSource {
  static constexpr int kPack = 16 / static_cast<int>(sizeof(In));  // elements of one 16-byte load
  static constexpr int kLoads = kThreadCols / kPack;                // loads per row of a piece
  // Resident blocks per SM, which sets the register budget: 16-bit inputs hold a piece in 32
  // registers, float32 in 64.
  static constexpr int kBlocksPerSm = sizeof(In) == 4 ? 2 : 3;
  struct Piece {
    uint32_t x[kThreadRows][kLoads][kWords<In, kPack>];
  };

  const In* x;
  bool vector_ok;  // x is aligned to 16 bytes and its rows are whole packs

  // Before the loads: the piece's first row in the matrix and its region (nothing to read here).
  __device__ void begin(Piece&, int64_t, int64_t, int64_t, int64_t, int64_t) const {}
  template <bool kWhole>
  __device__ void load(Piece& piece, int i, int l, int64_t offset, int valid) const {
    load_matrix_pack<kWhole, kPack>(x + offset, valid, vector_ok, piece.x[i][l]);
  }
  __device__ void values(const Piece& piece, int i, int l, float (&v)[kPack]) const { decode_pack<In>(piece.x[i][l], v); }
};

// accumulated() of tiles_kernels.h: acc's codes times their tile's acc_scale_inv, plus update. A
// zero outside the matrix stays zero unless acc_scale_inv is inf or NaN, whose tile is poisoned
// by its own elements anyway (any value times inf or NaN is not finite).
template <class Acc, class Update, Tiling kTiling>
struct AccumulateSource {
  static constexpr int kPack = 16 / static_cast<int>(sizeof(Update));
  static constexpr int kLoads = kThreadCols / kPack;
  static constexpr int kBlocksPerSm = 2;
  struct Piece {
    uint32_t acc[kThreadRows][kLoads][kWords<Acc, kPack>];
    uint32_t update[kThreadRows][kLoads][kWords<Update, kPack>];
    float acc_scale_inv[kThreadRows];
  };

  const Acc* acc;
  const float* acc_scale_inv;
  const Update* update;
  bool acc_vector_ok, update_vector_ok;

  __device__ void begin(Piece& piece, int64_t first_row, int64_t rows, int64_t rb, int64_t cb,
                        int64_t region_cols) const {
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      const int64_t r = first_row + i;
      if constexpr (kTiling == Tiling::kBlocks) {
        piece.acc_scale_inv[i] = acc_scale_inv[rb * region_cols + cb];
      } else {
        piece.acc_scale_inv[i] = r < rows ? acc_scale_inv[r * region_cols + cb] : 0.0f;
      }
    }
  }
  template <bool kWhole>
  __device__ void load(Piece& piece, int i, int l, int64_t offset, int valid) const {
    load_matrix_pack<kWhole, kPack>(acc + offset, valid, acc_vector_ok, piece.acc[i][l]);
    load_matrix_pack<kWhole, kPack>(update + offset, valid, update_vector_ok, piece.update[i][l]);
  }
  __device__ void values(const Piece& piece, int i, int l, float (&v)[kPack]) const {
    float a[kPack], u[kPack];
    decode_pack<Acc>(piece.acc[i][l], a);
    decode_pack<Update>(piece.update[i][l], u);
#pragma unroll
    for (int e = 0; e < kPack; ++e) v[e] = rn::add(rn::mul(a[e], piece.acc_scale_inv[i]), u[e]);
  }
};

constexpr unsigned kAllLanes = 0xFFFFFFFFu;

// kWhole: the launcher found every pointer aligned and both dimensions whole numbers of packs.
template <class Source, class Out, Tiling kTiling, bool kTranspose, bool kWhole>
__global__ void __launch_bounds__(kRegionThreads, Source::kBlocksPerSm)
    region_kernel(const Source src, Out* __restrict__ out, float* __restrict__ scale_inv, Out* __restrict__ out_t,
                  float* __restrict__ scale_inv_t, int64_t rows, int64_t cols, ScalingRecipe recipe,
                  bool out_vector_ok, bool out_t_vector_ok) {
  constexpr int NI = Source::kPack;
  constexpr int kLoads = Source::kLoads;
  constexpr float kFmax = numerics::format_max<Out>();
  const int64_t region_rows = ceil_div(rows, kRegion), region_cols = ceil_div(cols, kRegion);
  const int64_t rb = static_cast<int64_t>(blockIdx.x) / region_cols, cb = static_cast<int64_t>(blockIdx.x) % region_cols;
  const int64_t r0 = rb * kRegion, c0 = cb * kRegion;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int lane_in_row = lane % kRowLanes;
  const int tr = static_cast<int>(threadIdx.x) / kRowLanes * kThreadRows;  // the piece's first row in the region
  const auto col_of = [&](int l) { return l * kRowLanes * NI + lane_in_row * NI; };  // load l's first column

  typename Source::Piece piece;
  src.begin(piece, r0 + tr, rows, rb, cb, region_cols);
#pragma unroll
  for (int i = 0; i < kThreadRows; ++i) {
    const int64_t r = r0 + tr + i;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t c = c0 + col_of(l);
      src.template load<kWhole>(piece, i, l, r * cols + c, r < rows ? valid_count<NI>(c, cols) : 0);
    }
  }

  // Amax keys of the piece's rows and columns (zeros outside the matrix change none).
  uint32_t row_key[kThreadRows] = {}, col_key[kThreadCols] = {};
#pragma unroll
  for (int i = 0; i < kThreadRows; ++i) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      float v[NI];
      src.values(piece, i, l, v);
#pragma unroll
      for (int e = 0; e < NI; ++e) {
        const uint32_t key = numerics::float_bits(v[e]) & 0x7FFFFFFFu;
        row_key[i] = max(row_key[i], key);
        col_key[l * NI + e] = max(col_key[l * NI + e], key);
      }
    }
  }

  float row_scale[kThreadRows];
  // The transpose's column scales stay in shared memory, read as the codes are made: held in
  // registers, they made the kernel spill.
  __shared__ float col_scales[kTranspose && kTiling == Tiling::kRowTiles ? kRegion : 1];
  if constexpr (kTiling == Tiling::kBlocks) {
    uint32_t key = 0;
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) key = max(key, row_key[i]);
    key = block_max_key<kRegionThreads>(key);
    __shared__ float block_scale;
    if (threadIdx.x == 0) {
      const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), kFmax, recipe);
      scale_inv[rb * region_cols + cb] = pair.scale_inv;
      if constexpr (kTranspose) scale_inv_t[cb * region_rows + rb] = pair.scale_inv;
      block_scale = pair.scale;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) row_scale[i] = block_scale;
  } else {
    // The amaxes of the piece's 4 rows over the row's 8 threads, reduced and scattered at once
    // (each step sends a thread's partner the half it keeps): afterwards thread lane_in_row holds
    // the amax of row lane_in_row / 2, whose scale it computes; the others' come by shuffle.
    static_assert(kThreadRows == 4 && kThreadCols == 16, "the shuffle steps below split 4 rows and 16 columns");
    const bool b2 = lane_in_row & 4, b1 = lane_in_row & 2;
    const uint32_t pair0 =
        max(b2 ? row_key[2] : row_key[0], __shfl_xor_sync(kAllLanes, b2 ? row_key[0] : row_key[2], 4));
    const uint32_t pair1 =
        max(b2 ? row_key[3] : row_key[1], __shfl_xor_sync(kAllLanes, b2 ? row_key[1] : row_key[3], 4));
    uint32_t key = max(b1 ? pair1 : pair0, __shfl_xor_sync(kAllLanes, b1 ? pair0 : pair1, 2));
    key = max(key, __shfl_xor_sync(kAllLanes, key, 1));
    const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), kFmax, recipe);
    const int64_t r = r0 + tr + lane_in_row / 2;
    if (lane_in_row % 2 == 0 && r < rows) scale_inv[r * region_cols + cb] = pair.scale_inv;
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) row_scale[i] = __shfl_sync(kAllLanes, pair.scale, (lane & ~7) + 2 * i);
    if constexpr (kTranspose) {
      __shared__ uint32_t warp_col_keys[kWarps][kRegion];
      // The amaxes of the piece's 16 columns over the warp's 4 row groups (lane bits 3 and 4),
      // reduced and scattered the same way: afterwards this thread holds those of its columns
      // 8 * b3 + 4 * b4 + [0, 4), which it stores for the reduction over the warps.
      const bool b3 = lane & 8, b4 = lane & 16;
      uint32_t half[kThreadCols / 2], quarter[kThreadCols / 4];
#pragma unroll
      for (int m = 0; m < kThreadCols / 2; ++m) {
        half[m] =
            max(b3 ? col_key[8 + m] : col_key[m], __shfl_xor_sync(kAllLanes, b3 ? col_key[m] : col_key[8 + m], 8));
      }
#pragma unroll
      for (int m = 0; m < kThreadCols / 4; ++m) {
        quarter[m] = max(b4 ? half[4 + m] : half[m], __shfl_xor_sync(kAllLanes, b4 ? half[m] : half[4 + m], 16));
      }
#pragma unroll
      for (int m = 0; m < kThreadCols / 4; ++m) {
        const int j = (b3 ? 8 : 0) + (b4 ? 4 : 0) + m;  // the piece's column j: load j / NI, element j % NI
        warp_col_keys[warp][col_of(j / NI) + j % NI] = quarter[m];
      }
      __syncthreads();
      if (threadIdx.x < kRegion) {
        const int c = static_cast<int>(threadIdx.x);
        uint32_t col_amax_key = 0;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) col_amax_key = max(col_amax_key, warp_col_keys[k][c]);
        const numerics::ScalePair col_pair = tile_scale(numerics::amax_from_key(col_amax_key), kFmax, recipe);
        col_scales[c] = col_pair.scale;
        if (c0 + c < cols) scale_inv_t[(c0 + c) * region_rows + rb] = col_pair.scale_inv;
      }
      __syncthreads();
    }
  }
  // The scale of the transpose's tile holding the piece's column l * NI + e (a block's is its rows').
  const auto col_scale = [&](int l, int e) {
    if constexpr (kTiling == Tiling::kBlocks) {
      return row_scale[0];
    } else {
      return col_scales[col_of(l) + e];
    }
  };

  __shared__ alignas(16) uint32_t codes_t[kTranspose ? kRegion : 1][kColumnWords];
  const int swizzle = lane_in_row * 4;  // (c / NI) % 8 of every column c of this piece, times 4
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    float v[kThreadRows][NI];
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) src.values(piece, i, l, v[i]);
    const int64_t c = c0 + col_of(l);
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      uint32_t codes[kWords<Out, NI>];
      encode_scaled_pack<Out>(v[i], row_scale[i], codes);
      const int64_t r = r0 + tr + i;
      store_matrix_pack<kWhole, NI>(out + r * cols + c, codes, r < rows ? valid_count<NI>(c, cols) : 0, out_vector_ok);
    }
    if constexpr (kTranspose) {
#pragma unroll
      for (int e = 0; e < NI; ++e) {
        const float scale = col_scale(l, e);
        float column[kThreadRows];
#pragma unroll
        for (int i = 0; i < kThreadRows; ++i) column[i] = v[i][e];
        uint32_t word[1];
        encode_scaled_pack<Out>(column, scale, word);
        codes_t[col_of(l) + e][(tr / 4) ^ swizzle] = word[0];
      }
    }
  }

  if constexpr (kTranspose) {
    __syncthreads();
    constexpr int kChunksPerColumn = kRegion / kChunk;
#pragma unroll
    for (int u = 0; u < kRegion * kChunksPerColumn / kRegionThreads; ++u) {
      const int p = u * kRegionThreads + static_cast<int>(threadIdx.x);
      const int col = p / kChunksPerColumn, chunk = p % kChunksPerColumn;
      const int s = col / NI % kRowLanes;
      const uint4 w4 = *reinterpret_cast<const uint4*>(&codes_t[col][(chunk ^ s) * 4]);
      const uint32_t words[4] = {w4.x, w4.y, w4.z, w4.w};
      const int64_t r = r0 + chunk * kChunk, cc = c0 + col;
      store_matrix_pack<kWhole, kChunk>(out_t + cc * rows + r, words, cc < cols ? valid_count<kChunk>(r, rows) : 0,
                                        out_t_vector_ok);
    }
  }
}

template <class Out, Tiling kTiling, bool kTranspose, class Source>
void launch(const Source& src, bool src_whole, void* out_ptr, float* scale_inv, void* out_t_ptr, float* scale_inv_t,
            const TileShape& t, const ScalingRecipe& recipe, cudaStream_t stream, const char* op) {
  const int64_t rows = t.rows, cols = t.cols;
  Out* out = static_cast<Out*>(out_ptr);
  Out* out_t = static_cast<Out*>(out_t_ptr);
  const bool out_vector_ok = cols % Source::kPack == 0 && is_aligned(out, Source::kPack);
  const bool out_t_vector_ok = !kTranspose || (rows % kChunk == 0 && is_aligned(out_t, 16));
  const int64_t blocks = ceil_div(rows, kRegion) * ceil_div(cols, kRegion);
  const auto kernel = src_whole && out_vector_ok && out_t_vector_ok ? region_kernel<Source, Out, kTiling, kTranspose, true>
                                                                    : region_kernel<Source, Out, kTiling, kTranspose, false>;
  kernel<<<grid_size(blocks, op), kRegionThreads, 0, stream>>>(src, out, scale_inv, out_t, scale_inv_t, rows, cols,
                                                               recipe, out_vector_ok, out_t_vector_ok);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

template <class In, class Out, Tiling kTiling, bool kTranspose>
void launch_cast(const CastTransposeTiles& p, const ScalingRecipe& recipe, cudaStream_t stream) {
  const In* x = static_cast<const In*>(p.x);
  const CastSource<In> src{x, p.t.cols % CastSource<In>::kPack == 0 && is_aligned(x, 16)};
  launch<Out, kTiling, kTranspose>(src, src.vector_ok, p.out, p.scale_inv, p.out_t, p.scale_inv_t, p.t, recipe, stream,
                                   kTranspose ? "cast_transpose_tiles" : "quantize_tiles");
}

template <class Acc, class Update, Tiling kTiling>
void launch_accumulate(const AccumulateTiles& p, const ScalingRecipe& recipe, cudaStream_t stream) {
  using Source = AccumulateSource<Acc, Update, kTiling>;
  const Acc* acc = static_cast<const Acc*>(p.acc);
  const Update* update = static_cast<const Update*>(p.update);
  const bool whole_rows = p.t.cols % Source::kPack == 0;
  const Source src{acc, p.acc_scale_inv, update, whole_rows && is_aligned(acc, Source::kPack),
                   whole_rows && is_aligned(update, 16)};
  launch<Acc, kTiling, false>(src, src.acc_vector_ok && src.update_vector_ok, p.out, p.scale_inv, nullptr, nullptr,
                              p.t, recipe, stream, "scaled_accumulate_tiles");
}

}  // namespace

void quantize_regions(DType in_dtype, DType out_dtype, const CastTransposeTiles& p, const ScalingRecipe& recipe,
                      cudaStream_t stream) {
  if (p.t.rows * p.t.cols == 0) return;  // no tile, no scale
  const bool blocks = p.t.is(kRegion, kRegion);
  const bool transpose = p.out_t != nullptr;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      if (blocks) {
        transpose ? launch_cast<In, Out, Tiling::kBlocks, true>(p, recipe, stream)
                  : launch_cast<In, Out, Tiling::kBlocks, false>(p, recipe, stream);
      } else {
        transpose ? launch_cast<In, Out, Tiling::kRowTiles, true>(p, recipe, stream)
                  : launch_cast<In, Out, Tiling::kRowTiles, false>(p, recipe, stream);
      }
    });
  });
}

void accumulate_regions(DType acc_dtype, DType update_dtype, const AccumulateTiles& p, const ScalingRecipe& recipe,
                        cudaStream_t stream) {
  if (p.t.rows * p.t.cols == 0) return;
  const bool blocks = p.t.is(kRegion, kRegion);
  visit(Fp8Types{}, acc_dtype, [&](auto a) {
    visit(HighPrecisionTypes{}, update_dtype, [&](auto u) {
      using Acc = decltype(a);
      using Update = decltype(u);
      blocks ? launch_accumulate<Acc, Update, Tiling::kBlocks>(p, recipe, stream)
             : launch_accumulate<Acc, Update, Tiling::kRowTiles>(p, recipe, stream);
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
