// CUDA twin of comm_cpu.cpp: the comm ops (comm.h) bit for bit, without host syncs.
//
// comm_quantize: one launch per batch of up to kMaxTensors tensors (as the multi-tensor casts:
// tensor t owns blocks [block_begin[t], block_begin[t + 1]), one chunk of kChunk elements each).
// Every block derives its tensor's scale from the shared amax on the device; block 0 of the first
// launch also writes every scale_inv (the bucket's non-finite flag is one __syncthreads_or over the
// amaxes) and zeroes the send buffer's tail.
//
// comm_sum_shards: the pieces take the place of the tensors (piece p owns blocks of kChunk
// columns); a thread sums kPack columns of every row. A requantized output takes two launches of
// one kernel template: the amax pass (sums reduced to a max amax_key per block, atomicMax'ed into
// out_amax, zeroed first: the keys are canonical, so an integer max is exact), then the store pass,
// which recomputes the sums (N code bytes a column, fewer than a float32 round trip) and encodes them
// with the scale its block derives from out_amax.
//
// word_pack.cuh's codecs give numerics.h's bits, so the sums and codes are the CPU reference's.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "comm/comm_kernels.h"
#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPacksPerThread = 4;
constexpr int kMaxTensors = 128;  // a batch stays under the 4 KB of kernel parameters

// The tensors (comm_quantize) or pieces (comm_sum_shards) of one launch.
struct Batch {
  const void* in[kMaxTensors];
  int64_t begin[kMaxTensors];  // the codes' offset (quantize) or the piece's first column (sum)
  int64_t numel[kMaxTensors];
  int32_t block_begin[kMaxTensors + 1];
  int count;
  int first;
};
static_assert(sizeof(Batch) + sizeof(ShardPtrs) + 64 <= 4096, "kernel parameters must stay under 4 KB");

// Runs `launch(batch, blocks)` over every item, in as few launches as the batch size allows;
// item k has numel(k) elements, in chunks of `chunk`.
template <class Fill, class Launch>
void for_batches(int64_t items, int64_t chunk, Fill&& fill, Launch&& launch) {
  Batch batch{};
  int64_t blocks = 0;
  const auto flush = [&] {
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    launch(batch, grid_size(blocks, "comm"));
    batch.first += batch.count;
    batch.count = 0;
    blocks = 0;
  };
  for (int64_t k = 0; k < items; ++k) {
    const int64_t numel = fill(k, batch, batch.count);
    const int64_t need = std::max<int64_t>(1, ceil_div(numel, chunk));
    if (batch.count > 0 && blocks + need > INT_MAX) {  // k moves to a launch of its own
      flush();
      fill(k, batch, 0);
    }
    batch.numel[batch.count] = numel;
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    ++batch.count;
    blocks += need;
    if (batch.count == kMaxTensors) flush();
  }
  if (batch.count > 0) flush();
}

template <class In, class Out>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const __grid_constant__ Batch batch, const BucketPtrs p,
                                                            int64_t tensors, int64_t tail) {
  if (batch.first == 0 && blockIdx.x == 0) {
    bool non_finite = false;
    for (int64_t i = threadIdx.x; i < tensors; i += kThreads) non_finite = non_finite || !numerics::is_finite(p.amax[i]);
    non_finite = __syncthreads_or(non_finite);
    for (int64_t i = threadIdx.x; i < tensors; i += kThreads) {
      p.scale_inv[i] = comm::bucket_scale_inv(p.amax[i], p.fmax, non_finite);
    }
    uint8_t* out = static_cast<uint8_t*>(p.out);
    for (int64_t j = tail + threadIdx.x; j < p.out_numel; j += kThreads) out[j] = 0;
  }
  constexpr int N = 16 / sizeof(In);
  constexpr int64_t kChunk = int64_t{kThreads} * kPacksPerThread * N;
  const int t = owning_tensor(batch);
  const float scale = comm::bucket_scale(p.amax[batch.first + t], p.fmax).scale;
  const In* in = static_cast<const In*>(batch.in[t]);
  Out* out = static_cast<Out*>(p.out) + batch.begin[t];
  const bool vector_ok = is_aligned(in, 16) && is_aligned(out, N * sizeof(Out));
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - batch.block_begin[t]) * kChunk;
  const int64_t end = min(batch.numel[t], begin + kChunk);
  // Every pack's load before the first store (which the compiler may not move a load above, the
  // buffers possibly aliasing): kPacksPerThread round trips in flight, not one.
  uint32_t w[kPacksPerThread][kWords<In, N>];
  int valid[kPacksPerThread];
#pragma unroll
  for (int u = 0; u < kPacksPerThread; ++u) {
    const int64_t j = begin + (int64_t{u} * kThreads + threadIdx.x) * N;
    valid[u] = valid_count<N>(j, end);
    if (valid[u] > 0) load_pack<N, Access::kStreaming>(in + j, valid[u], vector_ok, w[u]);
  }
#pragma unroll
  for (int u = 0; u < kPacksPerThread; ++u) {
    if (valid[u] == 0) break;
    const int64_t j = begin + (int64_t{u} * kThreads + threadIdx.x) * N;
    float v[N];
    decode_pack<In>(w[u], v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = rn::mul(v[k], scale);
    uint32_t codes[kWords<Out, N>];
    encode_pack<Out>(v, codes);
    store_pack<N>(out + j, codes, valid[u], vector_ok);
  }
}

// Columns a thread sums: 4 codes (one word) of each row.
constexpr int kPack = 4;
constexpr int64_t kSumChunk = int64_t{kThreads} * kPacksPerThread * kPack;

enum class Pass { kAmax, kStore };

template <class Code, class Out, Pass kPass>
__global__ void __launch_bounds__(kThreads) sum_kernel(const __grid_constant__ Batch batch, const ShardPtrs p,
                                                        int64_t first_column, bool rows_aligned) {
  constexpr bool kRequantize = kIsFp8<Out>;
  const int t = owning_tensor(batch);
  const int64_t piece = batch.first + t;
  const int block_in_piece = static_cast<int>(blockIdx.x) - batch.block_begin[t];
  float scale = 1.0f;
  if constexpr (kRequantize && kPass == Pass::kStore) {
    const numerics::ScalePair pair = accumulate::new_scale(p.out_amax[piece], numerics::format_max<Out>(), 0, true);
    scale = pair.scale;
    if (block_in_piece == 0 && threadIdx.x == 0) p.out_scale_inv[piece] = pair.scale_inv;
  }
  const Code* codes = static_cast<const Code*>(p.codes);
  Out* out = static_cast<Out*>(p.out);
  const int64_t piece_begin = batch.begin[t];
  const int64_t begin = piece_begin + block_in_piece * kSumChunk;
  const int64_t end = min(piece_begin + batch.numel[t], begin + kSumChunk);
  // Row by row, every pack of the thread at once, the next row's codes loaded before this row's are
  // added: 2 * kPacksPerThread loads in flight. The sum of each column stays in rank order.
  int64_t column[kPacksPerThread];
  int valid[kPacksPerThread];
  bool codes_ok[kPacksPerThread];
  uint32_t w[kPacksPerThread][kWords<Code, kPack>] = {}, next[kPacksPerThread][kWords<Code, kPack>] = {};
  float v[kPacksPerThread][kPack] = {};
#pragma unroll
  for (int u = 0; u < kPacksPerThread; ++u) {
    column[u] = begin + (int64_t{u} * kThreads + threadIdx.x) * kPack;
    valid[u] = valid_count<kPack>(column[u], end);
    codes_ok[u] = rows_aligned && is_aligned(codes + column[u], kPack);
    if (valid[u] > 0) load_pack<kPack>(codes + column[u], valid[u], codes_ok[u], w[u]);
  }
  for (int64_t j = 0; j < p.rows; ++j) {
    if (j + 1 < p.rows) {
#pragma unroll
      for (int u = 0; u < kPacksPerThread; ++u) {
        if (valid[u] > 0) load_pack<kPack>(codes + (j + 1) * p.cols + column[u], valid[u], codes_ok[u], next[u]);
      }
    }
    const float s = p.scale_inv[j * p.scale_inv_row_stride + piece];
#pragma unroll
    for (int u = 0; u < kPacksPerThread; ++u) {
      float x[kPack];
      decode_pack<Code>(w[u], x);
#pragma unroll
      for (int k = 0; k < kPack; ++k) v[u][k] = comm::add_copy(v[u][k], x[k], s, j == 0);
#pragma unroll
      for (int i = 0; i < kWords<Code, kPack>; ++i) w[u][i] = next[u][i];
    }
  }
  uint32_t key = 0;
#pragma unroll
  for (int u = 0; u < kPacksPerThread; ++u) {
    if (valid[u] == 0) break;
#pragma unroll
    for (int k = 0; k < kPack; ++k) v[u][k] = comm::mean_of_sum(v[u][k], p.divisor);
    if constexpr (kRequantize && kPass == Pass::kAmax) {
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        if (k < valid[u]) key = max(key, numerics::amax_key(v[u][k]));
      }
    } else {
      Out* dst = out + (column[u] - first_column);
      const bool out_ok = is_aligned(dst, kPack * sizeof(Out));
      uint32_t o[kWords<Out, kPack>];
      if constexpr (kRequantize) {
#pragma unroll
        for (int k = 0; k < kPack; ++k) v[u][k] = rn::mul(v[u][k], scale);
        encode_pack<Out>(v[u], o);
      } else {
        round_pack<Out>(v[u], o);
      }
      store_pack<kPack>(dst, o, valid[u], out_ok);
    }
  }
  if constexpr (kRequantize && kPass == Pass::kAmax) {
    key = block_max_key<kThreads>(key);
    if (threadIdx.x == 0 && key != 0) atomicMax(reinterpret_cast<unsigned int*>(p.out_amax + piece), key);
  }
}

template <class Code, class Out>
void sum_shards(const std::vector<int64_t>& bounds, const ShardPtrs& p, cudaStream_t stream) {
  const int64_t pieces = static_cast<int64_t>(bounds.size()) - 1;
  const bool rows_aligned = p.cols % kPack == 0 && is_aligned(p.codes, kPack);
  const auto fill = [&](int64_t k, Batch& batch, int slot) {
    batch.begin[slot] = bounds[k];
    return bounds[k + 1] - bounds[k];
  };
  const auto pass = [&](auto kernel) {
    for_batches(pieces, kSumChunk, fill, [&](const Batch& batch, unsigned blocks) {
      kernel<<<blocks, kThreads, 0, stream>>>(batch, p, bounds[0], rows_aligned);
      FP8AMP_CUDA_CHECK_LAUNCH();
    });
  };
  if constexpr (kIsFp8<Out>) {
    FP8AMP_CUDA_CHECK(cudaMemsetAsync(p.out_amax, 0, sizeof(float) * pieces, stream));
    pass(sum_kernel<Code, Out, Pass::kAmax>);
  }
  pass(sum_kernel<Code, Out, Pass::kStore>);
}

}  // namespace

void comm_quantize(DType in_dtype, DType out_dtype, const std::vector<BucketSlice>& tensors, const BucketPtrs& p,
                   Stream stream) {
  int64_t tail = 0;
  for (const BucketSlice& s : tensors) tail = std::max(tail, s.offset + s.numel);
  const int64_t count = static_cast<int64_t>(tensors.size());
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      constexpr int64_t kChunk = int64_t{kThreads} * kPacksPerThread * (16 / sizeof(In));
      const auto fill = [&](int64_t k, Batch& batch, int slot) {
        batch.in[slot] = tensors[k].in;
        batch.begin[slot] = tensors[k].offset;
        return tensors[k].numel;
      };
      for_batches(count, kChunk, fill, [&](const Batch& batch, unsigned blocks) {
        quantize_kernel<In, Out><<<blocks, kThreads, 0, cuda_stream(stream)>>>(batch, p, count, tail);
        FP8AMP_CUDA_CHECK_LAUNCH();
      });
    });
  });
}

void comm_sum_shards(DType code_dtype, DType out_dtype, const std::vector<int64_t>& bounds, const ShardPtrs& p,
                     Stream stream) {
  visit(Fp8Types{}, code_dtype, [&](auto c) {
    using Code = decltype(c);
    if (is_high_precision(out_dtype)) {
      visit(HighPrecisionTypes{}, out_dtype, [&](auto o) { sum_shards<Code, decltype(o)>(bounds, p, cuda_stream(stream)); });
    } else {
      visit(Fp8Types{}, out_dtype, [&](auto o) { sum_shards<Code, decltype(o)>(bounds, p, cuda_stream(stream)); });
    }
  });
}

}  // namespace cuda
}  // namespace fp8amp
