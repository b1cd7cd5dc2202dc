// One-row tiles outside the region kernel's (1, 128): rowwise scaling's (1, cols) tiles of x, and
// the transpose's (1, L) tiles, which are segments of x's columns (rowwise: one scale a column).
// All read x with 16-byte loads along its rows and convert whole packs (word_pack.cuh: the
// hardware conversions on sm_89+). x's own tiles alone take one block per tile, which holds the
// tile in registers; the transpose's take two passes, one for the amax keys (over 128-row strips
// of 32 packs of columns, or over the codes pass's regions where x's row tiles split a strip), one
// for the codes over 128 x 64 regions of x, staged in shared memory so that its rows, too, are
// stored 16 bytes at a time; where x's tiles are whole regions wide, the same two passes also find
// their keys and store their codes (two reads of x for both copies). Bit for bit tiles_cpu.cpp, as the region
// kernel: the same amax keys, scale rule and element codec.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"
#include "tiles/tiles_cuda.cuh"
#include "tiles/tiles_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kTileThreads = 128;            // row_tiles_kernel's block ...
constexpr int kHeld = 8;                     // ... and the packs a thread of it holds
constexpr int kRowThreads = 256;             // the other kernels' blocks
constexpr int kRegionCols = 64;              // the columns of x one region block covers ...
constexpr int kRegionRows = 128;             // ... and its rows
constexpr int kChunk = 16;                   // codes in a 16-byte chunk of an out_t row

template <class In>
constexpr int kVec = 16 / static_cast<int>(sizeof(In));  // elements of one 16-byte load

template <class In>
bool loads_whole(const void* x, int64_t cols) {
  return cols % kVec<In> == 0 && is_aligned(x, 16);
}

// A 16-byte pack of In as words, and its elements' amax keys: the raw magnitude bits, which
// order like the values, NaNs above infinity (a NaN key reads NaN, as numerics::amax_key's).
template <class In>
using Words = uint32_t[kWords<In, kVec<In>>];

template <class In>
__device__ __forceinline__ uint32_t max_key(const Words<In>& w, uint32_t key) {
  float v[kVec<In>];
  decode_pack<In>(w, v);
#pragma unroll
  for (int e = 0; e < kVec<In>; ++e) key = max(key, numerics::float_bits(v[e]) & 0x7FFFFFFFu);
  return key;
}

// The pack's codes by `scale`, into the kVec<In> bytes at `out`.
template <class In, class Out>
__device__ __forceinline__ void store_codes(const Words<In>& w, float scale, Out* out) {
  float v[kVec<In>];
  decode_pack<In>(w, v);
  uint32_t codes[kWords<Out, kVec<In>>];
  encode_scaled_pack<Out>(v, scale, codes);
  store_words(out, codes);
}

// One block per tile (1, tile_cols): its amax, its scale, its codes. A thread keeps its first
// kHeld packs in registers, loaded together, so a tile of up to kTileThreads * kHeld packs (8,192
// bf16 elements) is read once; the packs beyond are read again for the codes (an L1/L2 hit).
template <class In, class Out>
__global__ void __launch_bounds__(kTileThreads)
    row_tiles_kernel(const In* __restrict__ x, Out* __restrict__ y, float* __restrict__ scale_inv, TileShape t,
                     RecipeScaleRule rule) {
  constexpr int V = kVec<In>;
  const int64_t tile = blockIdx.x;
  const int64_t r = tile / t.grid_cols();
  const int64_t c0 = tile % t.grid_cols() * t.tile_cols;
  const int64_t packs = (min(t.cols, c0 + t.tile_cols) - c0) / V;
  const In* in = x + r * t.cols + c0;
  Out* out = y + r * t.cols + c0;
  constexpr int64_t kHeldPacks = int64_t{kTileThreads} * kHeld;
  Words<In> held[kHeld];
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    const int64_t k = h * kTileThreads + threadIdx.x;
    if (k < packs) {
      load_words(in + k * V, held[h]);
    } else {
#pragma unroll
      for (auto& w : held[h]) w = 0;  // zeros change no amax
    }
  }
  uint32_t key = 0;
#pragma unroll
  for (int h = 0; h < kHeld; ++h) key = max_key<In>(held[h], key);
  for (int64_t k = kHeldPacks + threadIdx.x; k < packs; k += kTileThreads) {
    Words<In> w;
    load_words(in + k * V, w);
    key = max_key<In>(w, key);
  }
  const float scale = block_tile_scale<kTileThreads, Out>(key, rule, scale_inv + tile);
#pragma unroll
  for (int h = 0; h < kHeld; ++h) {
    const int64_t k = h * kTileThreads + threadIdx.x;
    if (k < packs) store_codes<In>(held[h], scale, out + k * V);
  }
  for (int64_t k = kHeldPacks + threadIdx.x; k < packs; k += kTileThreads) {
    Words<In> w;
    load_words(in + k * V, w);
    store_codes<In>(w, scale, out + k * V);
  }
}

// The tiles of one region pass: the transpose's (1, len) tiles, segments of x's columns (len a
// multiple of kRegionRows, or the whole column), and, when the pass also covers x's own tiles,
// x's (1, tile_cols) tiles (tile_cols a multiple of kRegionCols, or the whole row). So a region
// lies in one segment of each of its columns and in one tile of each of its rows.
struct RegionTiles {
  int64_t rows, cols;
  int64_t len, segments;             // the transpose's tiles: segment s of column c is key c * segments + s
  int64_t tile_cols, tiles_per_row;  // x's: tile j of row r is key r * tiles_per_row + j
};

// A region's threads: kLanes of them share a row of the region (consecutive lanes of one warp),
// each reading V = kVec<In> columns of kPasses rows, kRowsPerPass rows apart.
template <class In>
struct RegionLayout {
  static constexpr int V = kVec<In>;
  static constexpr int kLanes = kRegionCols / V;
  static constexpr int kRowsPerPass = kRowThreads / kLanes;
  static constexpr int kPasses = kRegionRows / kRowsPerPass;
  int64_t r0, c0;  // the region's first row and column
  int lane;
  __device__ RegionLayout(int64_t cols) {
    const int64_t region_cols = ceil_div(cols, kRegionCols);
    r0 = blockIdx.x / region_cols * kRegionRows;
    c0 = blockIdx.x % region_cols * kRegionCols;
    lane = threadIdx.x % kLanes;
  }
  __device__ int row(int pass) const { return pass * kRowsPerPass + threadIdx.x / kLanes; }  // in the region
  __device__ int64_t col() const { return c0 + lane * V; }
  // The thread's packs, loaded together; zeros outside x (they change no amax).
  __device__ void load(const In* x, const RegionTiles& t, Words<In> (&w)[kPasses]) const {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int64_t r = r0 + row(pass);
      if (r < t.rows && col() < t.cols) {
        load_words(x + r * t.cols + col(), w[pass]);
      } else {
#pragma unroll
        for (auto& word : w[pass]) word = 0;
      }
    }
  }
};

// The amax keys of one region: of each column's segment into col_keys (one atomicMax a column)
// and, unless row_keys is null, of each row's tile into row_keys (one atomicMax a row).
template <class In>
__global__ void __launch_bounds__(kRowThreads)
    region_amax_kernel(const In* __restrict__ x, uint32_t* __restrict__ col_keys, uint32_t* __restrict__ row_keys,
                       RegionTiles t) {
  using L = RegionLayout<In>;
  constexpr int V = L::V;
  __shared__ uint32_t warp_cols[kRowThreads / 32][kRegionCols];
  const L at(t.cols);
  Words<In> w[L::kPasses];
  at.load(x, t, w);
  uint32_t ck[V] = {};
#pragma unroll
  for (int pass = 0; pass < L::kPasses; ++pass) {
    float v[V];
    decode_pack<In>(w[pass], v);
    uint32_t rk = 0;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const uint32_t key = numerics::float_bits(v[e]) & 0x7FFFFFFFu;
      rk = max(rk, key);
      ck[e] = max(ck[e], key);
    }
    if (row_keys != nullptr) {
#pragma unroll
      for (int o = L::kLanes / 2; o > 0; o /= 2) rk = max(rk, __shfl_xor_sync(0xFFFFFFFFu, rk, o));
      const int64_t r = at.r0 + at.row(pass);
      if (at.lane == 0 && r < t.rows && rk != 0) atomicMax(&row_keys[r * t.tiles_per_row + at.c0 / t.tile_cols], rk);
    }
  }
  // The columns: first the warp's rows (its lanes kLanes apart share columns), then the warps'.
#pragma unroll
  for (int e = 0; e < V; ++e) {
#pragma unroll
    for (int o = L::kLanes; o < 32; o *= 2) ck[e] = max(ck[e], __shfl_xor_sync(0xFFFFFFFFu, ck[e], o));
  }
  if (threadIdx.x % 32 < L::kLanes) {
#pragma unroll
    for (int e = 0; e < V; ++e) warp_cols[threadIdx.x / 32][at.lane * V + e] = ck[e];
  }
  __syncthreads();
  const int64_t c = at.c0 + threadIdx.x;
  if (threadIdx.x < kRegionCols && c < t.cols) {
    uint32_t key = 0;
#pragma unroll
    for (int k = 0; k < kRowThreads / 32; ++k) key = max(key, warp_cols[k][threadIdx.x]);
    atomicMax(&col_keys[c * t.segments + at.r0 / t.len], key);
  }
}

// The same keys from strips of kRegionRows rows x 32 packs of columns, one block a strip: a warp
// reads whole 32-pack pieces of its rows (512 coalesced bytes), takes a row's key with a warp
// reduction (one atomicMax a row a strip: a quarter of region_amax_kernel's for bf16) and keeps
// its lane's column maxima in registers over all its rows, then the warps' column keys meet in
// shared memory (one atomicMax a column). It maxes raw bits, two 16-bit values a packed max, and
// decodes only the maxima (the region kernel decodes every element: the pass was bound by issuing
// instructions). Needs x's row tiles, if any, to hold whole strips (strips_fit); otherwise
// region_amax_kernel.
constexpr int kStripBatch = 4;  // rows a warp loads before it folds any

template <class In>
constexpr int64_t kStripCols = 32 * kVec<In>;

bool strips_fit(DType in_dtype, const TileShape& t, bool row_keys) {
  bool fit = false;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    fit = !row_keys || t.tile_cols % kStripCols<decltype(in)> == 0 || t.tile_cols >= t.cols;
  });
  return fit;
}

// The key (the region kernels': a decoded value's bits, sign cleared) from raw magnitude bits: decoding is
// monotonic in them, so the largest raw bits give the largest key.
template <class In>
__device__ __forceinline__ uint32_t key_of_raw(uint32_t raw) {
  if constexpr (sizeof(In) == 4) return raw;
  return numerics::float_bits(numerics::to_float(from_bits<In>(raw))) & 0x7FFFFFFFu;
}

template <class In>
__global__ void __launch_bounds__(kRowThreads, 4)  // 4 blocks an SM: at most 64 registers a thread
    strip_amax_kernel(const In* __restrict__ x, uint32_t* __restrict__ col_keys, uint32_t* __restrict__ row_keys,
                      RegionTiles t) {
  constexpr int V = kVec<In>;
  constexpr int W = kWords<In, V>;  // 4 words: 8 16-bit values two to a word, or 4 float32
  constexpr int kWarps = kRowThreads / 32;
  constexpr int kRowsPerWarp = kRegionRows / kWarps;
  static_assert(kRowsPerWarp % kStripBatch == 0, "a warp's rows come in whole batches");
  __shared__ uint32_t warp_cols[kWarps][kStripCols<In>];
  const int64_t strips = ceil_div(t.cols, kStripCols<In>);
  const int64_t r0 = blockIdx.x / strips * kRegionRows, c0 = blockIdx.x % strips * kStripCols<In>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col = c0 + lane * V;
  // The raw magnitude bits, maxed without decoding (abs_max_pack's order): 16-bit ones two to a
  // word through the packed max, each column in its own half.
  uint32_t cmax[W] = {};
  for (int b = 0; b < kRowsPerWarp; b += kStripBatch) {
    Words<In> w[kStripBatch];  // loaded together; zeros outside x change no amax
#pragma unroll
    for (int k = 0; k < kStripBatch; ++k) {
      const int64_t r = r0 + (b + k) * kWarps + warp;
      if (r < t.rows && col < t.cols) {
        load_words(x + r * t.cols + col, w[k]);
      } else {
#pragma unroll
        for (auto& word : w[k]) word = 0;
      }
    }
#pragma unroll
    for (int k = 0; k < kStripBatch; ++k) {
      uint32_t rmax = 0;
#pragma unroll
      for (int i = 0; i < W; ++i) {
        if constexpr (sizeof(In) == 2) {
          const uint32_t m = w[k][i] & 0x7FFF7FFFu;
          cmax[i] = __vmaxu2(cmax[i], m);
          rmax = __vmaxu2(rmax, m);
        } else {
          const uint32_t m = w[k][i] & 0x7FFFFFFFu;
          cmax[i] = max(cmax[i], m);
          rmax = max(rmax, m);
        }
      }
      if (row_keys != nullptr) {
        if constexpr (sizeof(In) == 2) rmax = max(rmax & 0xFFFFu, rmax >> 16);
#pragma unroll
        for (int o = 16; o > 0; o /= 2) rmax = max(rmax, __shfl_xor_sync(0xFFFFFFFFu, rmax, o));
        const int64_t r = r0 + (b + k) * kWarps + warp;
        if (lane == 0 && r < t.rows && rmax != 0) {
          atomicMax(&row_keys[r * t.tiles_per_row + c0 / t.tile_cols], key_of_raw<In>(rmax));
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const uint32_t raw = sizeof(In) == 2 ? (cmax[e / 2] >> (16 * (e % 2))) & 0xFFFFu : cmax[e];
    warp_cols[warp][lane * V + e] = key_of_raw<In>(raw);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kStripCols<In>; c += kRowThreads) {
    uint32_t key = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) key = max(key, warp_cols[k][c]);
    if (c0 + c < t.cols && key != 0) atomicMax(&col_keys[(c0 + c) * t.segments + r0 / t.len], key);
  }
}

// One block per region of x: its codes by the segments' scales (from col_keys), stored
// transposed, and, unless out is null, by the row tiles' scales (from row_keys), stored in place.
template <class In, class Out>
__global__ void __launch_bounds__(kRowThreads)
    transpose_cast_kernel(const In* __restrict__ x, const uint32_t* __restrict__ col_keys, Out* __restrict__ out_t,
                          const uint32_t* __restrict__ row_keys, Out* __restrict__ out, RegionTiles t,
                          RecipeScaleRule rule, bool out_t_whole) {
  using L = RegionLayout<In>;
  constexpr int V = L::V;
  constexpr int kRowBytes = kRegionRows + 4;  // a column's codes; + 4: columns start in distinct banks
  __shared__ float col_scale[kRegionCols];
  __shared__ float row_scale[kRegionRows];
  __shared__ uint32_t codes_t[kRegionCols * kRowBytes / 4];
  const L at(t.cols);
  const int64_t rows = t.rows, cols = t.cols, r0 = at.r0, c0 = at.c0;
  Words<In> w[L::kPasses];  // loaded together, before the wait for the scales
  at.load(x, t, w);
  const float fmax = numerics::format_max<Out>();
  if (threadIdx.x < kRegionCols) {
    const int64_t col = c0 + threadIdx.x;
    col_scale[threadIdx.x] =
        col < cols ? rule(numerics::amax_from_key(col_keys[col * t.segments + r0 / t.len]), fmax).scale : 0.0f;
  } else if (out != nullptr && threadIdx.x < kRegionCols + kRegionRows) {
    const int i = threadIdx.x - kRegionCols;
    const int64_t r = r0 + i;
    row_scale[i] =
        r < rows ? rule(numerics::amax_from_key(row_keys[r * t.tiles_per_row + c0 / t.tile_cols]), fmax).scale : 0.0f;
  }
  __syncthreads();
  auto* bytes_t = reinterpret_cast<uint8_t*>(codes_t);
  const int lane = at.lane;
#pragma unroll
  for (int pass = 0; pass < L::kPasses; ++pass) {
    const int i = at.row(pass);
    float v[V];
    decode_pack<In>(w[pass], v);
    if (out != nullptr && r0 + i < rows && at.col() < cols) {
      uint32_t row_codes[kWords<Out, V>];
      encode_scaled_pack<Out>(v, row_scale[i], row_codes);
      store_words(out + (r0 + i) * cols + at.col(), row_codes);
    }
#pragma unroll
    for (int e = 0; e < V; e += 4) {  // four columns' codes at a time, then a byte each
      float scaled[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) scaled[j] = rn::mul(v[e + j], col_scale[lane * V + e + j]);
      uint32_t four[1];
      encode_pack<Out>(scaled, four);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        bytes_t[(lane * V + e + j) * kRowBytes + i] = static_cast<uint8_t>(four[0] >> (8 * j));
      }
    }
  }
  __syncthreads();
  constexpr int kChunksPerColumn = kRegionRows / kChunk;
  for (int u = threadIdx.x; u < kRegionCols * kChunksPerColumn; u += kRowThreads) {
    const int col = u / kChunksPerColumn, chunk = u % kChunksPerColumn;
    const int64_t cc = c0 + col, r = r0 + chunk * kChunk;
    if (cc >= cols || r >= rows) continue;
    const uint8_t* src = bytes_t + col * kRowBytes + chunk * kChunk;
    uint8_t* dst = reinterpret_cast<uint8_t*>(out_t + cc * rows + r);
    if (out_t_whole) {
      const uint32_t* s4 = reinterpret_cast<const uint32_t*>(src);
      const uint32_t words[4] = {s4[0], s4[1], s4[2], s4[3]};
      store_words(dst, words);
    } else {
      for (int e = 0; e < kChunk && r + e < rows; ++e) dst[e] = src[e];
    }
  }
}

// The stored scale_inv of every tile, in place of its key: keys[0, n) and then more_keys[0, more).
__global__ void keys_to_scale_inv_kernel(uint32_t* keys, int64_t n, uint32_t* more_keys, int64_t more,
                                         RecipeScaleRule rule, float fmax) {
  int64_t i = blockIdx.x * int64_t{kRowThreads} + threadIdx.x;
  uint32_t* k = keys;
  if (i >= n) {
    i -= n;
    k = more_keys;
    if (i >= more) return;
  }
  reinterpret_cast<float*>(k)[i] = rule(numerics::amax_from_key(k[i]), fmax).stored;
}

}  // namespace

bool row_tiles_fit(DType in_dtype, const void* x, const void* out, const TileShape& t) {
  bool fit = false;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
    fit = t.tile_rows == 1 && t.tile_cols % kVec<In> == 0 && loads_whole<In>(x, t.cols) && is_aligned(out, kVec<In>);
  });
  return fit;
}

bool column_tiles_fit(DType in_dtype, const void* x, const TileShape& t, const TileShape& t_t) {
  bool fit = false;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
    fit = t_t.tile_rows == 1 && (t_t.tile_cols % kRegionRows == 0 || t_t.tile_cols >= t.rows) &&
          loads_whole<In>(x, t.cols);
  });
  return fit;
}

bool row_regions_fit(const TileShape& t) { return t.tile_cols % kRegionCols == 0 || t.tile_cols >= t.cols; }

void quantize_row_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv,
                        const TileShape& t, const ScalingRecipe& recipe, cudaStream_t stream) {
  const int64_t tiles = t.grid_rows() * t.grid_cols();  // 0 iff x is empty
  if (tiles == 0) return;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      row_tiles_kernel<In, Out><<<grid_size(tiles, "quantize_tiles"), kTileThreads, 0, stream>>>(
          static_cast<const In*>(x), static_cast<Out*>(out), scale_inv, t, RecipeScaleRule{recipe});
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

void quantize_column_tiles(DType in_dtype, DType out_dtype, const void* x, void* out, float* scale_inv, void* out_t,
                           float* scale_inv_t, const TileShape& t, const TileShape& t_t, const ScalingRecipe& recipe,
                           cudaStream_t stream) {
  const int64_t rows = t.rows, cols = t.cols;
  if (rows * cols == 0) return;
  const RegionTiles tiles{rows, cols, t_t.tile_cols, t_t.grid_cols(), t.tile_cols, t.grid_cols()};
  // The keys live where their scales go, and become the scales in the last launch.
  auto* col_keys = reinterpret_cast<uint32_t*>(scale_inv_t);
  auto* row_keys = out != nullptr ? reinterpret_cast<uint32_t*>(scale_inv) : nullptr;
  const int64_t n_col = cols * tiles.segments, n_row = out != nullptr ? rows * tiles.tiles_per_row : 0;
  FP8AMP_CUDA_CHECK(cudaMemsetAsync(col_keys, 0, n_col * sizeof(uint32_t), stream));
  if (row_keys != nullptr) FP8AMP_CUDA_CHECK(cudaMemsetAsync(row_keys, 0, n_row * sizeof(uint32_t), stream));
  const RecipeScaleRule rule{recipe};
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const auto* xs = static_cast<const In*>(x);
      const unsigned regions =
          grid_size(ceil_div(rows, kRegionRows) * ceil_div(cols, kRegionCols), "cast_transpose_tiles");
      if (strips_fit(in_dtype, t, row_keys != nullptr)) {
        const unsigned strips =
            grid_size(ceil_div(rows, kRegionRows) * ceil_div(cols, kStripCols<In>), "cast_transpose_tiles");
        strip_amax_kernel<In><<<strips, kRowThreads, 0, stream>>>(xs, col_keys, row_keys, tiles);
      } else {
        region_amax_kernel<In><<<regions, kRowThreads, 0, stream>>>(xs, col_keys, row_keys, tiles);
      }
      FP8AMP_CUDA_CHECK_LAUNCH();
      const bool out_t_whole = rows % kChunk == 0 && is_aligned(out_t, 16);
      transpose_cast_kernel<In, Out><<<regions, kRowThreads, 0, stream>>>(
          xs, col_keys, static_cast<Out*>(out_t), row_keys, static_cast<Out*>(out), tiles, rule, out_t_whole);
      FP8AMP_CUDA_CHECK_LAUNCH();
      keys_to_scale_inv_kernel<<<grid_size(ceil_div(n_col + n_row, kRowThreads), "cast_transpose_tiles"),
                                 kRowThreads, 0, stream>>>(col_keys, n_col, row_keys, n_row, rule,
                                                           numerics::format_max<Out>());
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
