// CUDA twin of cast_cpu.cpp: the same ops, bit for bit, as kernels that never sync with the host.
//
// Two kernel families (the scale updates are scaling_cuda.cu's):
// - multi_tensor_kernel<Op>: element-wise work over a list of tensors in one launch (quantize,
//   dequantize, amax); a block owns one chunk of one tensor (an amax block possibly several) and
//   folds its amax once.
// - cast_transpose_kernel: quantize a [rows, cols] matrix into out and out_t through a shared tile.
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
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"

namespace fp8amp {
namespace cuda {
namespace {

using numerics::amax_key;
using numerics::to_float;

constexpr int kThreads = 256;  // the block size of the cast kernels

// ----------------------------------------------------------------------------------------------
// Packs (common/word_pack.cuh) of a matrix whose every pack the caller knows to be aligned and
// wholly inside or wholly outside it (kWhole): then valid is 0 or N, and no element-wise code is
// compiled.

template <bool kWhole, int N, class T>
__device__ void load_matrix_pack(const T* p, int valid, bool vector_ok, uint32_t (&w)[kWords<T, N>]) {
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
__device__ void store_matrix_pack(T* p, const uint32_t (&w)[kWords<T, N>], int valid, bool vector_ok) {
  if constexpr (kWhole) {
    if (valid == N) store_words(p, w);
  } else {
    store_pack<N>(p, w, valid, vector_ok);
  }
}

template <class T>
__device__ uint32_t amax_key_from(uint32_t acc) {
  if constexpr (sizeof(T) == 2) acc = max(acc & 0xFFFFu, acc >> 16);
  return amax_key(to_float(from_bits<T>(acc)));
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
  key = block_max_key<kThreads>(key);
  if (threadIdx.x == 0) fold_amax(slot, key);
}

// The scale tensor i is quantized with. While it warms up, its amax slot already holds this
// step's amax (the pre-pass folded it), and the quantize kernel's own folds leave it unchanged,
// so every block reads the same value. The tensor's first block writes scale_inv[i].
template <class Out>
__device__ float quantize_scale(const ScalingPtrs& s, int64_t i, bool first_block) {
  const float* slot = s.amax + i * s.amax_stride;
  const float amax_now = current_scaling(s, i) ? *static_cast<const volatile float*>(slot) : 0.0f;
  const numerics::ScalePair pair = select_scale(s, i, amax_now, numerics::format_max<Out>());
  if (first_block && threadIdx.x == 0) s.scale_inv[i] = scale_inv_to_write(s, pair, amax_now);
  return pair.scale;
}

// ----------------------------------------------------------------------------------------------
// Multi-tensor element-wise kernel.
//
// A launch covers up to kMaxTensorsPerLaunch tensors, passed by value (TensorBatch stays
// under the 4 KB of kernel parameters). Tensor t owns blocks [block_begin[t], block_begin[t + 1]),
// at least one even when empty, so every tensor gets its scale_inv and amax fold.

constexpr int kMaxTensorsPerLaunch = 128;

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
  static constexpr Access kAccess = Access::kDefault;
  ScalingPtrs s;

  __device__ bool start(int64_t i, bool first_block, float* factor) const {
    *factor = quantize_scale<Out>(s, i, first_block);
    return true;
  }
  template <int N>
  __device__ void convert(const float (&v)[N], uint32_t (&w)[kWords<Out, N>]) const {
    encode_pack<Out>(v, w);
  }
  __device__ float* amax_slot(int64_t i) const { return s.amax + i * s.amax_stride; }
};

// out = round_to<Out>(x * scale_inv[i]) (cast.h: dequantize).
template <class InT, class OutT>
struct DequantizeOp {
  using In = InT;
  using Out = OutT;
  static constexpr bool kFoldsAmax = false;
  static constexpr Access kAccess = Access::kStreaming;  // each code read once, each value written once
  const float* scale_inv;

  __device__ bool start(int64_t i, bool, float* factor) const {
    *factor = scale_inv[i];
    return true;
  }
  template <int N>
  __device__ void convert(const float (&v)[N], uint32_t (&w)[kWords<Out, N>]) const {
    round_pack<Out>(v, w);
  }
};

// Folds the amax of x into amax[i * stride]; with a warm-up counter, only for tensors warming up
// (cast.h: amax, multi_amax, and the pre-pass of current scaling).
template <class InT>
struct AmaxOp {
  using In = InT;
  using Out = void;
  static constexpr bool kFoldsAmax = true;
  static constexpr Access kAccess = Access::kDefault;
  float* amax;
  int64_t stride;
  const int32_t* warmup_counter;
  int warmup_steps;

  __device__ bool start(int64_t i, bool, float*) const {
    return warmup_counter == nullptr || warming_up(warmup_counter, i, warmup_steps);
  }
  __device__ float* amax_slot(int64_t i) const { return amax + i * stride; }
};

// Elements per pack: 16 bytes of the wider of input and output (an amax op has no output).
template <class T>
constexpr size_t kElementBytes = sizeof(T);
template <>
constexpr size_t kElementBytes<void> = 0;

template <class Op>
constexpr int kPackSize = static_cast<int>(
    16 / std::max(kElementBytes<typename Op::In>, kElementBytes<typename Op::Out>));


// Packs a thread loads before it converts any: 16 bytes of input. One for quantize and amax; 2 or 4
// for dequantize, whose input is narrower than its output. (One pack at a time, dequantize had 8
// bytes of FP8 codes in flight a thread and reached 86 % of copy bandwidth, 0.93x torch.compile's
// kernel; loading one 16-byte pack of codes instead would make each warp store half-sectors.)
template <class Op>
constexpr int kPacksInFlight = static_cast<int>(16 / (kPackSize<Op> * sizeof(typename Op::In)));

// Packs a thread converts (a block's chunk of a tensor is kThreads * kPacksPerThread packs): 8 for
// quantize and amax; dequantize takes just the packs it holds at once, so each thread makes one
// round trip and the tensor is spread over 4x more, shorter blocks (as Inductor's kernel does).
template <class Op>
constexpr int kPacksPerThread = Op::kFoldsAmax ? 8 : kPacksInFlight<Op>;

template <class Op>
constexpr int64_t kChunkSize = int64_t{kThreads} * kPacksPerThread<Op> * kPackSize<Op>;  // elements per block

template <class Op>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(const __grid_constant__ TensorBatch batch,
                                                                 const __grid_constant__ Op op) {
  using In = typename Op::In;
  using Out = typename Op::Out;
  constexpr bool kWrites = !std::is_void_v<Out>;
  constexpr int N = kPackSize<Op>;

  const int t = owning_tensor(batch);
  const int64_t i = batch.first + t;
  const int block_in_tensor = static_cast<int>(blockIdx.x) - batch.block_begin[t];
  float factor = 1.0f;
  if (!op.start(i, block_in_tensor == 0, &factor)) return;  // the same answer for the whole block

  const In* in = static_cast<const In*>(batch.in[t]);
  bool vector_ok = is_aligned(in, N * sizeof(In));
  if constexpr (kWrites) vector_ok = vector_ok && is_aligned(batch.out[t], N * sizeof(Out));

  // The block takes chunks block_in_tensor, + tensor_blocks, ...: quantize and dequantize launch one
  // block per chunk, amax passes at most about one wave of blocks (launch_multi_tensor), so that the
  // pre-pass of delayed scaling, whose blocks find the tensor warmed up and return, costs one wave.
  // Amax passes also take the chunks last first: blocks start roughly in order, so the chunks they
  // read last are the first ones that the quantize or cast_transpose launched next reads (current
  // scaling reads x twice), and up to the L2 cache's size of them (50 MB on H100/H200) is not read
  // from DRAM again. The amax does not depend on the order.
  const int64_t chunks = ceil_div(batch.numel[t], kChunkSize<Op>);
  const int tensor_blocks = batch.block_begin[t + 1] - batch.block_begin[t];
  uint32_t abs_max = 0;
  for (int64_t c = block_in_tensor; c < chunks; c += tensor_blocks) {
    const int64_t begin = (kWrites ? c : chunks - 1 - c) * kChunkSize<Op>;
    const int64_t end = min(batch.numel[t], begin + kChunkSize<Op>);
    // Pack u of this thread starts at element begin + (u * kThreads + threadIdx.x) * N, so a warp
    // reads 32 consecutive packs. kPacksInFlight packs in registers at a time: for quantize and amax
    // one (16 bytes) measured fastest on H200: holding 2 or 4 (to have more loads in flight) cost
    // more in occupancy than it gained.
    constexpr int G = kPacksInFlight<Op>;
    for (int u0 = 0; u0 < kPacksPerThread<Op>; u0 += G) {
      if (begin + (u0 * kThreads + static_cast<int>(threadIdx.x)) * N >= end) break;
      int64_t j[G];
      int valid[G];
      uint32_t x[G][kWords<In, N>];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        j[g] = begin + ((u0 + g) * kThreads + static_cast<int>(threadIdx.x)) * N;
        valid[g] = valid_count<N>(j[g], end);
        load_pack<N, Op::kAccess>(in + j[g], valid[g], vector_ok, x[g]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if constexpr (Op::kFoldsAmax) abs_max = abs_max_pack<In, N>(x[g], abs_max);
        if constexpr (kWrites) {
          float v[N];
          decode_pack<In>(x[g], v);
#pragma unroll
          for (int k = 0; k < N; ++k) v[k] *= factor;
          uint32_t w[kWords<Out, N>];
          op.template convert<N>(v, w);
          store_pack<N, Op::kAccess>(static_cast<Out*>(batch.out[t]) + j[g], w, valid[g], vector_ok);
        }
      }
    }
  }
  if constexpr (Op::kFoldsAmax) fold_block_amax(op.amax_slot(i), amax_key_from<In>(abs_max));
}

// Blocks an amax pass launches per tensor at most: about one wave (8 blocks of kThreads per SM).
int64_t amax_blocks_cap() {
  int device = 0, sms = 0;
  FP8AMP_CUDA_CHECK(cudaGetDevice(&device));
  FP8AMP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return int64_t{std::max(sms, 1)} * (2048 / kThreads);
}

// Runs op over all tensors, in as few launches as the batch size allows.
template <class Op>
void launch_multi_tensor(const std::vector<TensorSlice>& tensors, const Op& op, cudaStream_t stream) {
  TensorBatch batch{};
  int64_t blocks = 0;
  const auto launch = [&] {
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    multi_tensor_kernel<Op><<<grid_size(blocks, "cast"), kThreads, 0, stream>>>(batch, op);
    FP8AMP_CUDA_CHECK_LAUNCH();
    batch.first += batch.count;
    batch.count = 0;
    blocks = 0;
  };
  const int64_t cap = std::is_void_v<typename Op::Out> ? amax_blocks_cap() : INT_MAX;
  for (const TensorSlice& tensor : tensors) {
    const int64_t need = std::clamp<int64_t>(ceil_div(tensor.numel, kChunkSize<Op>), 1, cap);
    if (batch.count == kMaxTensorsPerLaunch || (batch.count > 0 && blocks + need > INT_MAX)) launch();
    batch.in[batch.count] = tensor.in;
    batch.out[batch.count] = tensor.out;
    batch.numel[batch.count] = tensor.numel;
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    ++batch.count;
    blocks += need;
  }
  if (batch.count > 0) launch();
}

// amax of a tensor of several row runs (tensor.h: row_runs; one run takes multi_tensor_kernel).
// A block takes kRunsInFlight consecutive runs at a time, blockIdx.x's first, and every thread the
// same packs of each, loading them all before it folds any. (Inductor's reduction over SDPA's
// strided q, k and v ran at about half of copy bandwidth on the H200.)
constexpr int kRunsInFlight = 4;

template <class In>
__global__ void __launch_bounds__(kThreads) row_runs_amax_kernel(const In* x, const RowRuns runs, float* amax,
                                                                 const int32_t* warmup_counter, int warmup_steps) {
  if (warmup_counter != nullptr && !warming_up(warmup_counter, 0, warmup_steps)) return;
  constexpr int N = 16 / sizeof(In);
  const bool vector_ok = is_aligned(x, 16) && runs.row_stride % N == 0;
  uint32_t abs_max = 0;
  for (int64_t r0 = int64_t{blockIdx.x} * kRunsInFlight; r0 < runs.rows; r0 += int64_t{gridDim.x} * kRunsInFlight) {
    for (int64_t c = int64_t{threadIdx.x} * N; c < runs.cols; c += int64_t{kThreads} * N) {
      uint32_t w[kRunsInFlight][kWords<In, N>];
#pragma unroll
      for (int k = 0; k < kRunsInFlight; ++k) {
        const int valid = r0 + k < runs.rows ? valid_count<N>(c, runs.cols) : 0;
        load_pack<N>(x + (r0 + k) * runs.row_stride + c, valid, vector_ok, w[k]);
      }
#pragma unroll
      for (int k = 0; k < kRunsInFlight; ++k) abs_max = abs_max_pack<In, N>(w[k], abs_max);
    }
  }
  fold_block_amax(amax, amax_key_from<In>(abs_max));
}

// The pre-pass of current scaling: folds the amax of every tensor that is warming up (of every
// tensor, with s.current).
template <class In>
void warmup_amax(const std::vector<TensorSlice>& tensors, const ScalingPtrs& s, cudaStream_t stream) {
  if (s.current) {
    launch_multi_tensor(tensors, AmaxOp<In>{s.amax, s.amax_stride, nullptr, 0}, stream);
  } else if (s.warmup_counter != nullptr) {
    launch_multi_tensor(tensors, AmaxOp<In>{s.amax, s.amax_stride, s.warmup_counter, s.warmup_steps}, stream);
  }
}

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
//   (FP16) threads per column: a warp writes whole 128-byte lines of out_t rows. (The previous
//   version went through shared memory byte by byte and wrote each out_t row in 16-byte pieces
//   from different warps: 64-67 % of copy bandwidth from bf16.)
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

// kWholePacks: the launcher found x, out and out_t aligned to their packs and both dimensions whole
// numbers of packs, so no element-wise code is compiled (the vector_ok flags are then all true).
// kColumnSums: also this block's column sums of x (its band, its columns) into band_sums [bands, cols].
template <class In, class Out, bool kWholePacks, bool kColumnSums>
__global__ void __launch_bounds__(kThreads, kTransposeBlocksPerSm<Out>)
    cast_transpose_kernel(const In* __restrict__ x, Out* __restrict__ out, Out* __restrict__ out_t, int64_t rows,
                          int64_t cols, bool x_vector_ok, bool out_vector_ok, bool out_t_vector_ok,
                          float* __restrict__ band_sums, const ScalingPtrs s) {
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
  const float scale = quantize_scale<Out>(s, 0, blockIdx.x == 0);

  uint32_t abs_max = 0;
  float group_sum[kColumnSums ? NI : 1] = {};  // this thread's row group, its NI columns
#pragma unroll 1
  for (int k = 0; k < n; ++k) {
    if (k > 0) load(k);
    const int64_t r0 = (band + k) * kTileRows;
    uint32_t row_words[kThreadRows][NI / kPerWord];  // the codes of each row
#pragma unroll
    for (int i = 0; i < kThreadRows; ++i) {
      abs_max = abs_max_pack<In, NI>(xs[i], abs_max);
      float v[NI];
      decode_pack<In>(xs[i], v);
      if constexpr (kColumnSums) {
#pragma unroll
        for (int e = 0; e < NI; ++e) group_sum[e] = rn::add(group_sum[e], v[e]);
      }
#pragma unroll
      for (int e = 0; e < NI; ++e) v[e] *= scale;
      encode_pack<Out>(v, row_words[i]);
      const int64_t r = r0 + tr + i;
      store_matrix_pack<kWholePacks, NI>(out + r * cols + c, row_words[i], r < rows ? row_valid : 0, out_vector_ok);
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
  fold_block_amax(s.amax, amax_key_from<In>(abs_max));
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

}  // namespace

// ----------------------------------------------------------------------------------------------
// Launchers, in the order of cast_kernels.h.

void amax(DType dtype, const void* x, const RowRuns& runs, float* amax, const int32_t* warmup_counter,
          int warmup_steps, Stream stream) {
  visit(HighPrecisionTypes{}, dtype, [&](auto in) {
    using In = decltype(in);
    if (runs.rows <= 1) {
      launch_multi_tensor({TensorSlice{x, nullptr, runs.rows * runs.cols}},
                          AmaxOp<In>{amax, 0, warmup_counter, warmup_steps}, cuda_stream(stream));
      return;
    }
    const int64_t blocks = std::min(ceil_div(runs.rows, int64_t{kRunsInFlight}), amax_blocks_cap());
    row_runs_amax_kernel<In><<<grid_size(blocks, "amax"), kThreads, 0, cuda_stream(stream)>>>(
        static_cast<const In*>(x), runs, amax, warmup_counter, warmup_steps);
    FP8AMP_CUDA_CHECK_LAUNCH();
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

void quantize_current(DType in_dtype, DType out_dtype, const TensorSlice& tensor, const ScalingPtrs& s,
                      Stream stream) {
  FP8AMP_CUDA_CHECK(cudaMemsetAsync(s.amax, 0, sizeof(float), cuda_stream(stream)));
  quantize(in_dtype, out_dtype, {tensor}, s, stream);
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
                    int64_t cols, const ScalingPtrs& s, float* dbias, float* workspace, Stream stream) {
  if (rows * cols == 0) {
    // No tile to launch, but scale_inv is still written and the amax slot folded (with nothing):
    // exactly what quantizing an empty tensor does; the column sums of no rows are zeros.
    quantize(in_dtype, out_dtype, {TensorSlice{x, out, 0}}, s, stream);
    if (dbias != nullptr) sum_bands(workspace, rows, cols, dbias, cuda_stream(stream));
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
      // Packs are used only where every pack of the matrix is whole and aligned; when all three
      // are, the kernel without element-wise code (and its registers) runs.
      constexpr int NI = 16 / sizeof(In), NT = 16 / sizeof(Out);
      const bool x_vector_ok = cols % NI == 0 && is_aligned(xi, 16);
      const bool out_vector_ok = cols % NI == 0 && is_aligned(y, NI * sizeof(Out));
      const bool out_t_vector_ok = rows % NT == 0 && is_aligned(yt, 16);
      const int64_t blocks =
          ceil_div(ceil_div(rows, kTileRows), kTilesPerBlock) * ceil_div(cols, CodeTile<In, Out>::kCols);
      const bool whole = x_vector_ok && out_vector_ok && out_t_vector_ok;
      const auto kernel = dbias != nullptr ? (whole ? cast_transpose_kernel<In, Out, true, true>
                                                    : cast_transpose_kernel<In, Out, false, true>)
                                           : (whole ? cast_transpose_kernel<In, Out, true, false>
                                                    : cast_transpose_kernel<In, Out, false, false>);
      kernel<<<grid_size(blocks, "cast"), kThreads, 0, cuda_stream(stream)>>>(
          xi, y, yt, rows, cols, x_vector_ok, out_vector_ok, out_t_vector_ok, workspace, s);
      FP8AMP_CUDA_CHECK_LAUNCH();
      if (dbias != nullptr) sum_bands(workspace, rows, cols, dbias, cuda_stream(stream));
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

}  // namespace cuda
}  // namespace fp8amp
