// One-row tiles outside the region kernel's (1, 128): rowwise scaling's (1, cols) tiles of x, and
// the transpose's (1, L) tiles, which are segments of x's columns (rowwise: one scale a column).
// Both read x with 16-byte loads along its rows and convert whole packs (word_pack.cuh: the
// hardware conversions on sm_89+); the transpose's tiles are written through shared memory so
// that its rows, too, are stored 16 bytes at a time. Bit for bit tiles_cpu.cpp, as the region
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
constexpr int kRegionCols = 64;              // the columns of x one transpose block covers ...
constexpr int kRegionRows = 64;              // ... and its rows
constexpr int kAmaxChunkRows = kRegionRows;  // the rows one column-amax thread reads
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

// The transpose's tiles of length `len` along x's columns: the amax key of column c's segment s
// goes to keys[c * segments + s]. A thread reads kVec columns over kAmaxChunkRows rows, which lie
// in one segment (len is a multiple of kAmaxChunkRows, or the whole column).
template <class In>
__global__ void __launch_bounds__(kRowThreads)
    column_amax_kernel(const In* __restrict__ x, uint32_t* __restrict__ keys, int64_t rows, int64_t cols,
                       int64_t len, int64_t segments) {
  constexpr int V = kVec<In>;
  const int64_t col_groups = cols / V;
  const int64_t g = blockIdx.x * int64_t{kRowThreads} + threadIdx.x;
  const int64_t r0 = g / col_groups * kAmaxChunkRows, c = g % col_groups * V;
  if (r0 >= rows) return;
  const int64_t r_end = min(rows, r0 + kAmaxChunkRows);
  uint32_t k[V] = {};
#pragma unroll 8
  for (int64_t r = r0; r < r_end; ++r) {
    Words<In> w;
    load_words(x + r * cols + c, w);
    float v[V];
    decode_pack<In>(w, v);
#pragma unroll
    for (int e = 0; e < V; ++e) k[e] = max(k[e], numerics::float_bits(v[e]) & 0x7FFFFFFFu);
  }
  const int64_t segment = r0 / len;
#pragma unroll
  for (int e = 0; e < V; ++e) atomicMax(&keys[(c + e) * segments + segment], k[e]);
}

// One block per kRegionRows x kRegionCols region of x: its codes by the segments' scales (from
// the keys), stored transposed. A region lies in one segment of each column (len is a multiple
// of kRegionRows, or the whole column).
template <class In, class Out>
__global__ void __launch_bounds__(kRowThreads)
    transpose_cast_kernel(const In* __restrict__ x, const uint32_t* __restrict__ keys, Out* __restrict__ out_t,
                          int64_t rows, int64_t cols, int64_t len, int64_t segments, RecipeScaleRule rule,
                          bool out_t_whole) {
  constexpr int V = kVec<In>;
  constexpr int kLanes = kRegionCols / V;  // threads that share a row of the region
  constexpr int kRowsPerPass = kRowThreads / kLanes;
  constexpr int kPasses = kRegionRows / kRowsPerPass;
  constexpr int kRowBytes = kRegionRows + 4;  // a column's codes; + 4: columns start in distinct banks
  __shared__ float scale[kRegionCols];
  __shared__ uint32_t codes_t[kRegionCols * kRowBytes / 4];
  const int64_t region_cols = ceil_div(cols, kRegionCols);
  const int64_t r0 = blockIdx.x / region_cols * kRegionRows, c0 = blockIdx.x % region_cols * kRegionCols;
  const int lane = threadIdx.x % kLanes;
  const int64_t c = c0 + lane * V;
  Words<In> w[kPasses];  // loaded together, before the wait for the scales
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t r = r0 + pass * kRowsPerPass + threadIdx.x / kLanes;
    if (r < rows && c < cols) {
      load_words(x + r * cols + c, w[pass]);
    } else {
#pragma unroll
      for (auto& word : w[pass]) word = 0;
    }
  }
  if (threadIdx.x < kRegionCols) {
    const int64_t col = c0 + threadIdx.x;
    scale[threadIdx.x] =
        col < cols ? rule(numerics::amax_from_key(keys[col * segments + r0 / len]), numerics::format_max<Out>()).scale
                   : 0.0f;
  }
  __syncthreads();
  auto* bytes_t = reinterpret_cast<uint8_t*>(codes_t);
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int i = pass * kRowsPerPass + threadIdx.x / kLanes;
    float v[V];
    decode_pack<In>(w[pass], v);
#pragma unroll
    for (int e = 0; e < V; e += 4) {  // four columns' codes at a time, then a byte each
      float scaled[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) scaled[j] = rn::mul(v[e + j], scale[lane * V + e + j]);
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

// The stored scale_inv of every segment, in place of its key.
__global__ void keys_to_scale_inv_kernel(uint32_t* keys, int64_t n, RecipeScaleRule rule, float fmax) {
  const int64_t i = blockIdx.x * int64_t{kRowThreads} + threadIdx.x;
  if (i < n) reinterpret_cast<float*>(keys)[i] = rule(numerics::amax_from_key(keys[i]), fmax).stored;
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
    fit = t_t.tile_rows == 1 && (t_t.tile_cols % kAmaxChunkRows == 0 || t_t.tile_cols >= t.rows) &&
          loads_whole<In>(x, t.cols);
  });
  return fit;
}

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

void quantize_column_tiles(DType in_dtype, DType out_dtype, const void* x, void* out_t, float* scale_inv_t,
                           const TileShape& t, const TileShape& t_t, const ScalingRecipe& recipe,
                           cudaStream_t stream) {
  const int64_t rows = t.rows, cols = t.cols;
  if (rows * cols == 0) return;
  const int64_t len = t_t.tile_cols, segments = t_t.grid_cols();
  auto* keys = reinterpret_cast<uint32_t*>(scale_inv_t);  // the keys live where their scales go
  FP8AMP_CUDA_CHECK(cudaMemsetAsync(keys, 0, cols * segments * sizeof(uint32_t), stream));
  const RecipeScaleRule rule{recipe};
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      const auto* xs = static_cast<const In*>(x);
      const int64_t amax_threads = ceil_div(rows, kAmaxChunkRows) * (cols / kVec<In>);
      column_amax_kernel<In><<<grid_size(ceil_div(amax_threads, kRowThreads), "cast_transpose_tiles"), kRowThreads,
                               0, stream>>>(xs, keys, rows, cols, len, segments);
      FP8AMP_CUDA_CHECK_LAUNCH();
      const int64_t regions = ceil_div(rows, kRegionRows) * ceil_div(cols, kRegionCols);
      const bool out_t_whole = rows % kChunk == 0 && is_aligned(out_t, 16);
      transpose_cast_kernel<In, Out><<<grid_size(regions, "cast_transpose_tiles"), kRowThreads, 0, stream>>>(
          xs, keys, static_cast<Out*>(out_t), rows, cols, len, segments, rule, out_t_whole);
      FP8AMP_CUDA_CHECK_LAUNCH();
      const int64_t n = cols * segments;
      keys_to_scale_inv_kernel<<<grid_size(ceil_div(n, kRowThreads), "cast_transpose_tiles"), kRowThreads, 0,
                                 stream>>>(keys, n, rule, numerics::format_max<Out>());
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace cuda
}  // namespace fp8amp
