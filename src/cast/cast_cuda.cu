// CUDA twin of cast_cpu.cpp's quantize, dequantize and amax: the same ops, bit for bit, as kernels
// that never sync with the host (cast+transpose: cast_transpose_cuda.cu; the scale updates:
// scaling_cuda.cu).
//
// multi_tensor_kernel<Op> does element-wise work over a list of tensors in one launch (quantize,
// dequantize, amax); a block owns one chunk of one tensor (an amax block possibly several) and
// folds its amax once. Current scaling (warm-up) needs a tensor's whole amax before its first
// element is quantized, so quantize and cast_transpose then run an amax pre-pass first
// (warmup_amax); its blocks read the warm-up counter on the device and skip tensors that are past
// warm-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

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
// for dequantize, whose input is narrower than its output: one pack at a time leaves too few bytes
// of codes in flight, and a single 16-byte pack of codes would make each warp store half-sectors.
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
    // one (16 bytes), as holding 2 or 4 (to have more loads in flight) costs more in occupancy than
    // it gains.
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
int64_t amax_blocks_cap() { return current_sm_count() * (2048 / kThreads); }

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
// same packs of each, loading them all before it folds any, so that short runs (SDPA's strided q,
// k and v) still keep several loads in flight.
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

}  // namespace

// ----------------------------------------------------------------------------------------------
// Launchers, in the order of cast_kernels.h.

void warmup_amax(DType in_dtype, const std::vector<TensorSlice>& tensors, const ScalingPtrs& s, cudaStream_t stream) {
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
    if (s.current) {
      launch_multi_tensor(tensors, AmaxOp<In>{s.amax, s.amax_stride, nullptr, 0}, stream);
    } else if (s.warmup_counter != nullptr) {
      launch_multi_tensor(tensors, AmaxOp<In>{s.amax, s.amax_stride, s.warmup_counter, s.warmup_steps}, stream);
    }
  });
}

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
  warmup_amax(in_dtype, tensors, s, cuda_stream(stream));
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    using In = decltype(in);
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

void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride,
                Stream stream) {
  visit(AmaxTypes{}, dtype, [&](auto in) {
    using In = decltype(in);
    launch_multi_tensor(tensors, AmaxOp<In>{amax, amax_stride, nullptr, 0}, cuda_stream(stream));
  });
}

}  // namespace cuda
}  // namespace fp8amp
