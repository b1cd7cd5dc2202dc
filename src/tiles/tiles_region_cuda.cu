// The one-pass tile kernel: quantize_tiles and cast_transpose_tiles with (1, 128) tiles or
// (128, 128) blocks, bit for bit tiles_cpu.cpp. One block of 256 threads per 128 x 128 region of
// x, which it reads from memory once, and whose copies (and scales) it writes once:
//
// - Each thread loads a 4-row x 16-column piece of the region into registers: per row, 16-byte
//   loads at columns l * 8 * NI + lane_in_row * NI (NI elements of 16 bytes), so the 8 threads of
//   a row read 128 consecutive bytes per load.
// - Amaxes, as the float bits with the sign cleared (which order like |x|, every NaN above inf):
//   a row tile's from the 8 threads of its row (warp shuffles); a column tile's (a tile of the
//   transpose) from the 4 row groups of each warp (shuffles), then the 8 warps (shared memory);
//   a block's from every thread (block_max_key).
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

// Resident blocks per SM, which sets the register budget: 16-bit inputs hold their piece in 32
// registers, float32 in 64.
template <class In>
constexpr int kRegionBlocksPerSm = sizeof(In) == 4 ? 2 : 3;

// A pack that is whole or wholly outside the matrix (kWhole: the launcher checked alignment and
// that both dimensions are whole numbers of packs), or any pack (element-wise at the edges).
template <bool kWhole, int N, class T>
__device__ __forceinline__ void load_piece(const T* p, int valid, bool vector_ok, uint32_t (&w)[kWords<T, N>]) {
  if constexpr (kWhole) {
    if (valid == N) {
      load_words(p, w);
    } else {
#pragma unroll
      for (int i = 0; i < kWords<T, N>; ++i) w[i] = 0;
    }
  } else {
    load_pack<N>(p, valid, vector_ok, w);
  }
}

template <bool kWhole, int N, class T>
__device__ __forceinline__ void store_piece(T* p, const uint32_t (&w)[kWords<T, N>], int valid, bool vector_ok) {
  if constexpr (kWhole) {
    if (valid == N) store_words(p, w);
  } else {
    store_pack<N>(p, w, valid, vector_ok);
  }
}

__device__ __forceinline__ uint32_t max_over_lanes(uint32_t key, int first_mask, int last_mask) {
#pragma unroll
  for (int m = first_mask; m <= last_mask; m *= 2) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, m));
  return key;
}

template <class In, class Out, Tiling kTiling, bool kTranspose, bool kWhole>
__global__ void __launch_bounds__(kRegionThreads, kRegionBlocksPerSm<In>)
    region_kernel(const In* __restrict__ x, Out* __restrict__ out, float* __restrict__ scale_inv,
                  Out* __restrict__ out_t, float* __restrict__ scale_inv_t, int64_t rows, int64_t cols,
                  ScalingRecipe recipe, bool x_vector_ok, bool out_vector_ok, bool out_t_vector_ok) {
  constexpr int NI = 16 / static_cast<int>(sizeof(In));  // elements of one 16-byte load
  constexpr int kLoads = kThreadCols / NI;               // loads per row of a piece
  constexpr float kFmax = numerics::format_max<Out>();
  const int64_t region_rows = ceil_div(rows, kRegion), region_cols = ceil_div(cols, kRegion);
  const int64_t rb = static_cast<int64_t>(blockIdx.x) / region_cols, cb = static_cast<int64_t>(blockIdx.x) % region_cols;
  const int64_t r0 = rb * kRegion, c0 = cb * kRegion;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int lane_in_row = lane % kRowLanes;
  const int tr = static_cast<int>(threadIdx.x) / kRowLanes * kThreadRows;  // the piece's first row in the region
  const auto col_of = [&](int l) { return l * kRowLanes * NI + lane_in_row * NI; };  // load l's first column

  uint32_t w[kThreadRows][kLoads][kWords<In, NI>];
#pragma unroll
  for (int i = 0; i < kThreadRows; ++i) {
    const int64_t r = r0 + tr + i;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t c = c0 + col_of(l);
      load_piece<kWhole, NI>(x + r * cols + c, r < rows ? valid_count<NI>(c, cols) : 0, x_vector_ok, w[i][l]);
    }
  }

  // Amax keys of the piece's rows and columns (zeros outside the matrix change none).
  uint32_t row_key[kThreadRows] = {}, col_key[kThreadCols] = {};
#pragma unroll
  for (int i = 0; i < kThreadRows; ++i) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      float v[NI];
      decode_pack<In>(w[i][l], v);
#pragma unroll
      for (int e = 0; e < NI; ++e) {
        const uint32_t key = numerics::float_bits(v[e]) & 0x7FFFFFFFu;
        row_key[i] = max(row_key[i], key);
        col_key[l * NI + e] = max(col_key[l * NI + e], key);
      }
    }
  }

  float row_scale[kThreadRows];
  float col_scale[kThreadCols];
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
#pragma unroll
    for (int j = 0; j < kThreadCols; ++j) col_scale[j] = block_scale;
  } else {
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      const uint32_t key = max_over_lanes(row_key[i], 1, kRowLanes / 2);
      const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), kFmax, recipe);
      row_scale[i] = pair.scale;
      const int64_t r = r0 + tr + i;
      if (lane_in_row == 0 && r < rows) scale_inv[r * region_cols + cb] = pair.scale_inv;
    }
    if constexpr (kTranspose) {
      __shared__ uint32_t warp_col_keys[kWarps][kRegion];
      __shared__ float col_scales[kRegion];
#pragma unroll
      for (int j = 0; j < kThreadCols; ++j) col_key[j] = max_over_lanes(col_key[j], kRowLanes, 16);
      if (lane < kRowLanes) {
#pragma unroll
        for (int l = 0; l < kLoads; ++l) {
#pragma unroll
          for (int e = 0; e < NI; ++e) warp_col_keys[warp][col_of(l) + e] = col_key[l * NI + e];
        }
      }
      __syncthreads();
      if (threadIdx.x < kRegion) {
        const int c = static_cast<int>(threadIdx.x);
        uint32_t key = 0;
#pragma unroll
        for (int k = 0; k < kWarps; ++k) key = max(key, warp_col_keys[k][c]);
        const numerics::ScalePair pair = tile_scale(numerics::amax_from_key(key), kFmax, recipe);
        col_scales[c] = pair.scale;
        if (c0 + c < cols) scale_inv_t[(c0 + c) * region_rows + rb] = pair.scale_inv;
      }
      __syncthreads();
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
#pragma unroll
        for (int e = 0; e < NI; ++e) col_scale[l * NI + e] = col_scales[col_of(l) + e];
      }
    }
  }

  __shared__ alignas(16) uint32_t codes_t[kTranspose ? kRegion : 1][kColumnWords];
  const int swizzle = lane_in_row * 4;  // (c / NI) % 8 of every column c of this piece, times 4
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    float v[kThreadRows][NI];
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) decode_pack<In>(w[i][l], v[i]);
    const int64_t c = c0 + col_of(l);
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      float q[NI];
#pragma unroll
      for (int e = 0; e < NI; ++e) q[e] = rn::mul(v[i][e], row_scale[i]);
      uint32_t codes[kWords<Out, NI>];
      encode_pack<Out>(q, codes);
      const int64_t r = r0 + tr + i;
      store_piece<kWhole, NI>(out + r * cols + c, codes, r < rows ? valid_count<NI>(c, cols) : 0, out_vector_ok);
    }
    if constexpr (kTranspose) {
#pragma unroll
      for (int e = 0; e < NI; ++e) {
        float q[kThreadRows];
#pragma unroll
        for (int i = 0; i < kThreadRows; ++i) q[i] = rn::mul(v[i][e], col_scale[l * NI + e]);
        uint32_t word[1];
        encode_pack<Out>(q, word);
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
      store_piece<kWhole, kChunk>(out_t + cc * rows + r, words, cc < cols ? valid_count<kChunk>(r, rows) : 0,
                                  out_t_vector_ok);
    }
  }
}

template <class In, class Out, Tiling kTiling, bool kTranspose>
void launch(const CastTransposeTiles& p, const ScalingRecipe& recipe, cudaStream_t stream) {
  const int64_t rows = p.t.rows, cols = p.t.cols;
  constexpr int NI = 16 / static_cast<int>(sizeof(In));
  const In* x = static_cast<const In*>(p.x);
  Out* out = static_cast<Out*>(p.out);
  Out* out_t = static_cast<Out*>(p.out_t);
  const bool x_vector_ok = cols % NI == 0 && is_aligned(x, 16);
  const bool out_vector_ok = cols % NI == 0 && is_aligned(out, NI);
  const bool out_t_vector_ok = !kTranspose || (rows % kChunk == 0 && is_aligned(out_t, 16));
  const int64_t blocks = ceil_div(rows, kRegion) * ceil_div(cols, kRegion);
  const auto kernel = x_vector_ok && out_vector_ok && out_t_vector_ok
                          ? region_kernel<In, Out, kTiling, kTranspose, true>
                          : region_kernel<In, Out, kTiling, kTranspose, false>;
  kernel<<<grid_size(blocks, kTranspose ? "cast_transpose_tiles" : "quantize_tiles"), kRegionThreads, 0, stream>>>(
      x, out, p.scale_inv, out_t, p.scale_inv_t, rows, cols, recipe, x_vector_ok, out_vector_ok, out_t_vector_ok);
  FP8AMP_CUDA_CHECK_LAUNCH();
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
        transpose ? launch<In, Out, Tiling::kBlocks, true>(p, recipe, stream)
                  : launch<In, Out, Tiling::kBlocks, false>(p, recipe, stream);
      } else {
        transpose ? launch<In, Out, Tiling::kRowTiles, true>(p, recipe, stream)
                  : launch<In, Out, Tiling::kRowTiles, false>(p, recipe, stream);
      }
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
