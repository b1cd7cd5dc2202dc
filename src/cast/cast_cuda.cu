// CUDA twin of cast_cpu.cpp: the same ops, bit for bit, as kernels that never sync with the host.
//
// Three kernel families:
// - multi_tensor_kernel<Op>: element-wise work over a list of tensors in one launch (quantize,
//   dequantize, amax); a block owns one chunk of one tensor and folds its amax once.
// - cast_transpose_kernel: quantize a [rows, cols] matrix into out and out_t through a shared tile.
// - compute_scale_kernel / update_delayed_scaling_kernel: one thread per tensor.
// Current scaling (warm-up) needs a tensor's whole amax before its first element is quantized, so
// quantize and cast_transpose then run an amax pre-pass first; its blocks read the warm-up counter
// on the device and skip tensors that are past warm-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cast/cast_kernels.h"
#include "common/cuda_check.h"
#include "common/dispatch.h"

namespace fp8amp {
namespace cuda {
namespace {

using numerics::amax_key;
using numerics::to_float;

constexpr int kThreads = 256;  // every kernel here is launched with this block size
constexpr int kWarps = kThreads / 32;

cudaStream_t cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

// A grid of `blocks` blocks in x (its limit is 2^31 - 1; y and z would stop at 65535).
unsigned grid_size(int64_t blocks) {
  FP8AMP_CHECK(blocks <= INT_MAX, kNotImplemented, "cast", "too large for one launch: ", blocks,
               " blocks of ", kThreads, " threads");
  return static_cast<unsigned>(blocks);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ----------------------------------------------------------------------------------------------
// Element access: packs of N consecutive elements moved as one load or store of up to 16 bytes.

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <class T>
__host__ __device__ bool is_aligned(const T* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// How many of the N elements starting at index j lie before `end`.
template <int N>
__device__ int valid_count(int64_t j, int64_t end) {
  return static_cast<int>(max(int64_t{0}, min(int64_t{N}, end - j)));
}

// Reads the first `valid` (0..N) elements at p and zeros the rest (a zero changes no amax).
// One vector access when the whole pack is valid and the caller has checked the alignment,
// else one element at a time: the tails and misaligned tensors.
template <int N, class T>
__device__ Pack<T, N> load_pack(const T* p, int valid, bool vector_ok) {
  if (vector_ok && valid == N) return *reinterpret_cast<const Pack<T, N>*>(p);
  Pack<T, N> r;
#pragma unroll
  for (int k = 0; k < N; ++k) r.v[k] = k < valid ? p[k] : T{};
  return r;
}

template <int N, class T>
__device__ void store_pack(T* p, const Pack<T, N>& x, int valid, bool vector_ok) {
  if (vector_ok && valid == N) {
    *reinterpret_cast<Pack<T, N>*>(p) = x;
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < valid) p[k] = x.v[k];
  }
}

// ----------------------------------------------------------------------------------------------
// Numerics on packs.

template <class T>
constexpr bool kIsFp8 = std::is_same_v<T, numerics::fp8_e4m3> || std::is_same_v<T, numerics::fp8_e5m2>;

// quantize_to<Out> of N already scaled values. FP8 on sm_89+ uses the hardware converter, two
// values an instruction: round to nearest even, saturate to +-max (infinities too), NaN -> 0x7F,
// which is numerics::encode(x, saturate=true) bit for bit (test_cast_cuda proves it over every
// fp32 input). Everything else is the software codec the CPU reference runs.
template <class Out, int N>
__device__ Pack<Out, N> quantize_pack(const float (&v)[N]) {
  Pack<Out, N> q;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kIsFp8<Out>) {
    static_assert(N % 2 == 0, "FP8 packs convert in pairs");
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      uint16_t pair;  // v[k] in the low byte, v[k + 1] in the high byte
      if constexpr (std::is_same_v<Out, numerics::fp8_e4m3>) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(v[k + 1]), "f"(v[k]));
      } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(v[k + 1]), "f"(v[k]));
      }
      q.v[k].bits = static_cast<uint8_t>(pair & 0xFFu);
      q.v[k + 1].bits = static_cast<uint8_t>(pair >> 8);
    }
    return q;
  }
#endif
#pragma unroll
  for (int k = 0; k < N; ++k) q.v[k] = numerics::quantize_to<Out>(v[k]);
  return q;
}

// ----------------------------------------------------------------------------------------------
// Amax and scale.

// cpu::fold_amax on the device: slot = amax_from_key(max(amax_key(slot), key)). A compare-and-swap
// loop instead of an integer atomicMax on the bits, because the slot may hold what amax_key
// normalizes (-0, a NaN of another payload, a negative value) and the CPU rewrites it canonical.
// It writes only when the value changes, so once the slot has settled a block just reads it.
__device__ void fold_amax(float* slot, uint32_t key) {
  unsigned int* bits = reinterpret_cast<unsigned int*>(slot);
  unsigned int seen = *reinterpret_cast<volatile unsigned int*>(bits);
  while (true) {
    const unsigned int want = max(amax_key(numerics::bits_float(seen)), key);
    if (want == seen) return;
    const unsigned int before = atomicCAS(bits, seen, want);
    if (before == seen) return;
    seen = before;
  }
}

// Every thread brings its key; one fold per block. Called by all threads of the block.
__device__ void fold_block_amax(float* slot, uint32_t key) {
  __shared__ uint32_t warp_keys[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, offset));
  if (threadIdx.x % 32 == 0) warp_keys[threadIdx.x / 32] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) key = max(key, warp_keys[w]);
    fold_amax(slot, key);
  }
}

// The scale tensor i is quantized with. While it warms up, its amax slot already holds this
// step's amax (the pre-pass folded it), and the quantize kernel's own folds leave it unchanged,
// so every block reads the same value. The tensor's first block writes scale_inv[i].
template <class Out>
__device__ float quantize_scale(const ScalingPtrs& s, int64_t i, bool first_block) {
  const float* slot = s.amax + i * s.amax_stride;
  const float amax_now =
      warming_up(s.warmup_counter, i, s.warmup_steps) ? *static_cast<const volatile float*>(slot) : 0.0f;
  const numerics::ScalePair pair = select_scale(s, i, amax_now, numerics::format_max<Out>());
  if (first_block && threadIdx.x == 0) s.scale_inv[i] = pair.scale_inv;
  return pair.scale;
}

// ----------------------------------------------------------------------------------------------
// Multi-tensor element-wise kernel.
//
// A launch covers up to kMaxTensorsPerLaunch tensors, passed by value (TensorBatch stays well
// under the 4 KB of kernel parameters). Tensor t owns blocks [block_begin[t], block_begin[t + 1]),
// at least one even when empty, so every tensor gets its scale_inv and amax fold.

constexpr int kMaxTensorsPerLaunch = 64;
constexpr int kUnroll = 4;  // packs per thread, all loaded before any is converted

struct TensorBatch {
  const void* in[kMaxTensorsPerLaunch];
  void* out[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int32_t block_begin[kMaxTensorsPerLaunch + 1];
  int64_t first;  // index of in[0] among all tensors: its row of the scaling buffers
  int32_t count;
};
static_assert(sizeof(TensorBatch) + sizeof(ScalingPtrs) <= 4096, "kernel parameters must stay under 4 KB");

// The ops. Each names its element types, says per tensor whether its blocks work and the factor
// values are multiplied by (start), converts packs (convert), and says where its amax goes.

// out = quantize_to<Out>(x * scale), amax of x folded (cast.h: quantize).
template <class InT, class OutT>
struct QuantizeOp {
  using In = InT;
  using Out = OutT;
  static constexpr bool kFoldsAmax = true;
  ScalingPtrs s;

  __device__ bool start(int64_t i, bool first_block, float* factor) const {
    *factor = quantize_scale<Out>(s, i, first_block);
    return true;
  }
  template <int N>
  __device__ Pack<Out, N> convert(const float (&v)[N]) const {
    return quantize_pack<Out>(v);
  }
  __device__ float* amax_slot(int64_t i) const { return s.amax + i * s.amax_stride; }
};

// out = round_to<Out>(x * scale_inv[i]) (cast.h: dequantize).
template <class InT, class OutT>
struct DequantizeOp {
  using In = InT;
  using Out = OutT;
  static constexpr bool kFoldsAmax = false;
  const float* scale_inv;

  __device__ bool start(int64_t i, bool, float* factor) const {
    *factor = scale_inv[i];
    return true;
  }
  template <int N>
  __device__ Pack<Out, N> convert(const float (&v)[N]) const {
    Pack<Out, N> r;
#pragma unroll
    for (int k = 0; k < N; ++k) r.v[k] = numerics::round_to<Out>(v[k]);
    return r;
  }
  __device__ float* amax_slot(int64_t) const { return nullptr; }
};

// Folds the amax of x into amax[i * stride]; with a warm-up counter, only for tensors warming up
// (cast.h: amax, multi_amax, and the pre-pass of current scaling).
template <class InT>
struct AmaxOp {
  using In = InT;
  using Out = void;
  static constexpr bool kFoldsAmax = true;
  float* amax;
  int64_t stride;
  const int32_t* warmup_counter;
  int warmup_steps;

  __device__ bool start(int64_t i, bool, float*) const {
    return warmup_counter == nullptr || warming_up(warmup_counter, i, warmup_steps);
  }
  __device__ float* amax_slot(int64_t i) const { return amax + i * stride; }
};

// Elements per pack: 16 bytes of the wider of input and output.
template <class Op>
constexpr int pack_size() {
  using In = typename Op::In;
  using Out = typename Op::Out;
  if constexpr (std::is_void_v<Out>) {
    return 16 / sizeof(In);
  } else {
    return 16 / (sizeof(In) > sizeof(Out) ? sizeof(In) : sizeof(Out));
  }
}

template <class Op>
constexpr int64_t chunk_size() {
  return int64_t{kThreads} * kUnroll * pack_size<Op>();
}

// The tensor that owns this block: the last t with block_begin[t] <= blockIdx.x.
__device__ int owning_tensor(const TensorBatch& batch) {
  const int block = static_cast<int>(blockIdx.x);
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.block_begin[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <class Op>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(const __grid_constant__ TensorBatch batch,
                                                                 const __grid_constant__ Op op) {
  using In = typename Op::In;
  using Out = typename Op::Out;
  constexpr bool kWrites = !std::is_void_v<Out>;
  constexpr int N = pack_size<Op>();

  const int t = owning_tensor(batch);
  const int64_t i = batch.first + t;
  const int block_in_tensor = static_cast<int>(blockIdx.x) - batch.block_begin[t];
  float factor = 1.0f;
  if (!op.start(i, block_in_tensor == 0, &factor)) return;  // the same answer for the whole block

  const In* in = static_cast<const In*>(batch.in[t]);
  const int64_t begin = block_in_tensor * chunk_size<Op>();
  const int64_t end = min(batch.numel[t], begin + chunk_size<Op>());
  bool vector_ok = is_aligned(in, sizeof(Pack<In, N>));
  if constexpr (kWrites) vector_ok = vector_ok && is_aligned(batch.out[t], sizeof(Pack<Out, N>));

  // Pack u of this thread starts at element begin + (u * kThreads + threadIdx.x) * N: a warp
  // reads 32 consecutive packs, and all kUnroll loads are in flight together.
  Pack<In, N> x[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t j = begin + (u * kThreads + static_cast<int>(threadIdx.x)) * N;
    x[u] = load_pack<N>(in + j, valid_count<N>(j, end), vector_ok);
  }
  uint32_t key = 0;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = to_float(x[u].v[k]);
      key = max(key, amax_key(v[k]));
    }
    if constexpr (kWrites) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] *= factor;
      const int64_t j = begin + (u * kThreads + static_cast<int>(threadIdx.x)) * N;
      store_pack(static_cast<Out*>(batch.out[t]) + j, op.template convert<N>(v), valid_count<N>(j, end), vector_ok);
    }
  }
  if constexpr (Op::kFoldsAmax) fold_block_amax(op.amax_slot(i), key);
}

// Runs op over all tensors, in as few launches as the batch size allows.
template <class Op>
void launch_multi_tensor(const std::vector<TensorSlice>& tensors, const Op& op, cudaStream_t stream) {
  TensorBatch batch{};
  int64_t blocks = 0;
  const auto launch = [&] {
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    multi_tensor_kernel<Op><<<grid_size(blocks), kThreads, 0, stream>>>(batch, op);
    FP8AMP_CUDA_CHECK_LAUNCH();
    batch.first += batch.count;
    batch.count = 0;
    blocks = 0;
  };
  for (const TensorSlice& tensor : tensors) {
    const int64_t need = std::max<int64_t>(1, ceil_div(tensor.numel, chunk_size<Op>()));
    if (batch.count == kMaxTensorsPerLaunch || blocks + need > INT_MAX) launch();
    batch.in[batch.count] = tensor.in;
    batch.out[batch.count] = tensor.out;
    batch.numel[batch.count] = tensor.numel;
    batch.block_begin[batch.count] = static_cast<int32_t>(grid_size(blocks));
    ++batch.count;
    blocks += need;
  }
  if (batch.count > 0) launch();
}

// The pre-pass of current scaling: folds the amax of every tensor that is warming up.
template <class In>
void warmup_amax(const std::vector<TensorSlice>& tensors, const ScalingPtrs& s, cudaStream_t stream) {
  if (s.warmup_counter == nullptr) return;
  launch_multi_tensor(tensors, AmaxOp<In>{s.amax, s.amax_stride, s.warmup_counter, s.warmup_steps}, stream);
}

// ----------------------------------------------------------------------------------------------
// Cast + transpose.
//
// A block quantizes one kTile x kTile tile of x. Phase 1 reads its rows in 16-byte packs, writes
// them to out in the same layout and keeps the codes in shared memory; phase 2 reads the tile's
// columns back and writes them as 16-byte packs of out_t rows. With a warp on 32 consecutive
// columns of one tile row, phase 2's shared reads hit 32 different bytes of one row, so no bank
// conflicts without padding; phase 1 stores are contiguous within each (quarter-)warp.

constexpr int kTile = 64;

template <class In, class Out>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(const In* __restrict__ x, Out* __restrict__ out,
                                                                  Out* __restrict__ out_t, int64_t rows, int64_t cols,
                                                                  int64_t col_tiles, bool rows_vector_ok,
                                                                  bool cols_vector_ok, const ScalingPtrs s) {
  constexpr int NI = 16 / sizeof(In);   // elements of a pack along a row of x and out
  constexpr int NT = 16 / sizeof(Out);  // elements of a pack along a row of out_t
  constexpr int kRowPacks = kTile * kTile / NI / kThreads;
  constexpr int kColPacks = kTile * kTile / NT / kThreads;
  static_assert(kRowPacks >= 1 && kColPacks >= 1, "a tile must give every thread work");
  __shared__ Pack<Out, NI> tile[kTile][kTile / NI];

  const int64_t r0 = static_cast<int64_t>(blockIdx.x / col_tiles) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x % col_tiles) * kTile;
  const float scale = quantize_scale<Out>(s, 0, blockIdx.x == 0);

  // Phase 1: pack p covers tile row p / (kTile / NI), columns (p % (kTile / NI)) * NI + [0, NI).
  Pack<In, NI> xs[kRowPacks];
#pragma unroll
  for (int u = 0; u < kRowPacks; ++u) {
    const int p = u * kThreads + static_cast<int>(threadIdx.x);
    const int64_t r = r0 + p / (kTile / NI), c = c0 + (p % (kTile / NI)) * NI;
    const int valid = r < rows ? valid_count<NI>(c, cols) : 0;
    xs[u] = load_pack<NI>(x + r * cols + c, valid, cols_vector_ok);
  }
  uint32_t key = 0;
#pragma unroll
  for (int u = 0; u < kRowPacks; ++u) {
    const int p = u * kThreads + static_cast<int>(threadIdx.x);
    const int64_t r = r0 + p / (kTile / NI), c = c0 + (p % (kTile / NI)) * NI;
    float v[NI];
#pragma unroll
    for (int k = 0; k < NI; ++k) {
      v[k] = to_float(xs[u].v[k]);
      key = max(key, amax_key(v[k]));
      v[k] *= scale;
    }
    const Pack<Out, NI> q = quantize_pack<Out>(v);
    store_pack(out + r * cols + c, q, r < rows ? valid_count<NI>(c, cols) : 0, cols_vector_ok);
    tile[p / (kTile / NI)][p % (kTile / NI)] = q;
  }
  __syncthreads();

  // Phase 2: pack p covers tile column p % kTile, rows (p / kTile) * NT + [0, NT).
  const Out* codes = &tile[0][0].v[0];  // the tile as kTile x kTile codes
#pragma unroll
  for (int u = 0; u < kColPacks; ++u) {
    const int p = u * kThreads + static_cast<int>(threadIdx.x);
    const int tc = p % kTile, tr = (p / kTile) * NT;
    Pack<Out, NT> q;
#pragma unroll
    for (int k = 0; k < NT; ++k) q.v[k] = codes[(tr + k) * kTile + tc];
    const int64_t r = r0 + tr, c = c0 + tc;
    store_pack(out_t + c * rows + r, q, c < cols ? valid_count<NT>(r, rows) : 0, rows_vector_ok);
  }
  fold_block_amax(s.amax, key);
}

// ----------------------------------------------------------------------------------------------
// Scale updates: one thread per tensor, the CPU loop body as is.

constexpr int kScaleThreads = 128;

__global__ void compute_scale_kernel(const float* amax, int64_t amax_stride, float* scale, float* scale_inv,
                                     int64_t n, float fmax, int margin, bool pow2) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const numerics::ScalePair pair =
      numerics::scale_from_amax(amax[i * amax_stride], fmax, margin, pow2, {scale[i], scale_inv[i]});
  scale[i] = pair.scale;
  scale_inv[i] = pair.scale_inv;
}

__global__ void update_delayed_scaling_kernel(float* amax_history, int64_t n, int64_t history_len, float* scale,
                                              float* scale_inv, int32_t* counter, float fmax, int margin,
                                              bool pow2) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float* h = amax_history + i * history_len;
  const bool bad = !numerics::is_finite(h[0]);
  if (bad) h[0] = 0.0f;
  float window_max = 0.0f;
  // std::max's rule, as on the CPU: an older NaN entry never wins.
  for (int64_t j = 0; j < history_len; ++j) window_max = window_max < h[j] ? h[j] : window_max;
  const numerics::ScalePair pair =
      numerics::scale_from_amax(window_max, fmax, margin, pow2, {scale[i], scale_inv[i]});
  scale[i] = pair.scale;
  scale_inv[i] = pair.scale_inv;
  for (int64_t j = history_len - 1; j > 0; --j) h[j] = h[j - 1];
  h[0] = 0.0f;
  counter[i] = bad ? 0 : static_cast<int32_t>(min(static_cast<int64_t>(counter[i]) + 1, history_len));
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Launchers, in the order of cast_kernels.h.

void amax(DType dtype, const void* x, int64_t numel, float* amax, const int32_t* warmup_counter, int warmup_steps,
          Stream stream) {
  visit(HighPrecisionTypes{}, dtype, [&](auto in) {
    using In = decltype(in);
    launch_multi_tensor({TensorSlice{x, nullptr, numel}}, AmaxOp<In>{amax, 0, warmup_counter, warmup_steps},
                        cuda_stream(stream));
  });
}

void quantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const ScalingPtrs& s,
              Stream stream) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
    warmup_amax<In>(tensors, s, cuda_stream(stream));
    visit(ScaledFormatTypes{}, out_dtype, [&](auto out) {
      using Out = decltype(out);
      launch_multi_tensor(tensors, QuantizeOp<In, Out>{s}, cuda_stream(stream));
    });
  });
}

void dequantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const float* scale_inv,
                Stream stream) {
  visit(ScaledFormatTypes{}, in_dtype, [&](auto in) {
    visit(HighPrecisionTypes{}, out_dtype, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      launch_multi_tensor(tensors, DequantizeOp<In, Out>{scale_inv}, cuda_stream(stream));
    });
  });
}

void cast_transpose(DType in_dtype, DType out_dtype, const void* x, void* out, void* out_t, int64_t rows,
                    int64_t cols, const ScalingPtrs& s, Stream stream) {
  if (rows * cols == 0) {
    // No tile to launch, but scale_inv is still written and the amax slot folded (with nothing):
    // exactly what quantizing an empty tensor does.
    quantize(in_dtype, out_dtype, {TensorSlice{x, out, 0}}, s, stream);
    return;
  }
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
    warmup_amax<In>({TensorSlice{x, nullptr, rows * cols}}, s, cuda_stream(stream));
    visit(ScaledFormatTypes{}, out_dtype, [&](auto o) {
      using Out = decltype(o);
      const In* xi = static_cast<const In*>(x);
      Out* y = static_cast<Out*>(out);
      Out* yt = static_cast<Out*>(out_t);
      // Packs are used only where every pack of the matrix is whole and aligned.
      constexpr int NI = 16 / sizeof(In), NT = 16 / sizeof(Out);
      const bool cols_vector_ok = cols % NI == 0 && is_aligned(xi, 16) && is_aligned(y, NI * sizeof(Out));
      const bool rows_vector_ok = rows % NT == 0 && is_aligned(yt, 16);
      const int64_t col_tiles = ceil_div(cols, kTile);
      cast_transpose_kernel<In, Out><<<grid_size(ceil_div(rows, kTile) * col_tiles), kThreads, 0,
                                       cuda_stream(stream)>>>(xi, y, yt, rows, cols, col_tiles, rows_vector_ok,
                                                              cols_vector_ok, s);
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  });
}

void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride,
                Stream stream) {
  visit(HighPrecisionTypes{}, dtype, [&](auto in) {
    using In = decltype(in);
    launch_multi_tensor(tensors, AmaxOp<In>{amax, amax_stride, nullptr, 0}, cuda_stream(stream));
  });
}

void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2, Stream stream) {
  if (n == 0) return;
  compute_scale_kernel<<<grid_size(ceil_div(n, kScaleThreads)), kScaleThreads, 0, cuda_stream(stream)>>>(
      amax, amax_stride, scale, scale_inv, n, fmax, margin, pow2);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

void update_delayed_scaling(float* amax_history, int64_t n, int64_t history_len, float* scale, float* scale_inv,
                            int32_t* counter, float fmax, int margin, bool pow2, Stream stream) {
  if (n == 0) return;
  update_delayed_scaling_kernel<<<grid_size(ceil_div(n, kScaleThreads)), kScaleThreads, 0, cuda_stream(stream)>>>(
      amax_history, n, history_len, scale, scale_inv, counter, fmax, margin, pow2);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace fp8amp
