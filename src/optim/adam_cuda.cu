// CUDA twin of adam_cpu.cpp: the same step, bit for bit, in kernels that never sync with the host.
//
// A step is (optim.h, "How, without a host sync"):
//   memset(amax) -> pass 1 (adam_amax_kernel) for every tensor -> pass 2 (adam_store_kernel) for
//   every tensor -> commit_kernel for every tensor.
// Passes are multi-tensor launches, like cast_cuda.cu's: a launch covers up to kMaxTensors
// tensors of one dtype combination, whose pointers travel in the kernel parameters; tensor t owns
// blocks [block_begin[t], block_begin[t + 1]), a block one chunk of kChunk elements. Every
// thread handles packs of N consecutive elements, each array moved as one access of N * its
// element size bytes (4, 8 or 16) where the tensor's arrays are aligned for it.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"
#include "optim/adam_bound.h"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kElementsPerThread = 32;  // per block: a chunk of kThreads * 32 elements of one tensor
constexpr int64_t kChunk = int64_t{kThreads} * kElementsPerThread;

// Tensors per launch: the batch must fit the 4 KB of kernel parameters with AdamArgs.
constexpr int kMaxTensors = 30;

// Blocks the passes keep resident an SM: 4 (half occupancy) caps them at 64 registers a thread,
// what they used before holding a second pack; 3 would leave them their 70-73.
constexpr int kBlocksPerSm = 4;

struct AdamBatch {
  AdamTensorPtrs tensors[kMaxTensors];
  int32_t index[kMaxTensors];  // the tensor's position in the call: its row of amax
  int32_t block_begin[kMaxTensors + 1];
  int32_t count;
};
static_assert(sizeof(AdamBatch) + sizeof(AdamArgs) <= 4096, "kernel parameters must stay under 4 KB");

// ------------------------------------------------------------------------------------------------
// The passes.

template <class G, class P, class M, class V>
constexpr int kPackSize =
    static_cast<int>(16 / std::max({sizeof(G), sizeof(P), sizeof(M), sizeof(V)}));

// The scale_inv of a scaled input, 1 (unused) otherwise.
__device__ float scale_inv_or_1(const float* p) { return p != nullptr ? *p : 1.0f; }

// The pointers, input scales and chunk of the tensor that owns this block, as both passes read them.
template <class G, class P, class M, class V>
struct Chunk {
  static constexpr int N = kPackSize<G, P, M, V>;
  const AdamTensorPtrs& tp;
  float* amax_row;
  const G* grad;
  P* param;
  M* exp_avg;
  V* exp_avg_sq;
  numerics::fp8_e4m3* weight;
  float g_si, p_si, m_si, v_si;
  bool vector_ok;  // every array aligned for one access per pack
  int64_t begin, end;

  __device__ Chunk(const AdamBatch& batch, const AdamArgs& args, int t)
      : tp(batch.tensors[t]),
        amax_row(args.amax + static_cast<int64_t>(batch.index[t]) * kAdamAmaxColumns),
        grad(static_cast<const G*>(tp.grad)),
        param(static_cast<P*>(tp.param)),
        exp_avg(static_cast<M*>(tp.exp_avg)),
        exp_avg_sq(static_cast<V*>(tp.exp_avg_sq)),
        weight(static_cast<numerics::fp8_e4m3*>(tp.weight_fp8)),
        g_si(scale_inv_or_1(tp.grad_scale_inv)),
        p_si(scale_inv_or_1(tp.param_scale_inv)),
        m_si(scale_inv_or_1(tp.exp_avg_scale_inv)),
        v_si(scale_inv_or_1(tp.exp_avg_sq_scale_inv)),
        vector_ok(is_aligned(grad, N * sizeof(G)) && is_aligned(param, N * sizeof(P)) &&
                  is_aligned(exp_avg, N * sizeof(M)) && is_aligned(exp_avg_sq, N * sizeof(V)) &&
                  is_aligned(weight, N)),
        begin(static_cast<int64_t>(static_cast<int>(blockIdx.x) - batch.block_begin[t]) * kChunk),
        end(min(tp.numel, begin + kChunk)) {}

  // One pack of every input as loaded. The passes fetch the next pack before they compute on this
  // one: Nsight Compute found them at half occupancy (register-bound) with ~40 % of warp cycles
  // waiting for their loads, so a thread keeps a second round trip in flight.
  struct Pack {
    uint32_t g[kWords<G, N>], p[kWords<P, N>], m[kWords<M, N>], v[kWords<V, N>];
    int valid;  // elements of the pack before the chunk's end
  };

  __device__ void fetch(int64_t j, Pack& w) const {
    w.valid = valid_count<N>(j, end);
    load_pack<N>(grad + j, w.valid, vector_ok, w.g);
    load_pack<N>(param + j, w.valid, vector_ok, w.p);
    load_pack<N>(exp_avg + j, w.valid, vector_ok, w.m);
    load_pack<N>(exp_avg_sq + j, w.valid, vector_ok, w.v);
  }

  // The dequantized inputs of the pack's valid elements, and 0.0f after them (whatever the
  // scales), so that the amax pass can fold a whole pack into the g, m', v' maxima: zero inputs
  // give g = m' = v' = 0.
  __device__ void decode(const Pack& w, float (&g)[N], float (&p)[N], float (&m)[N], float (&v)[N]) const {
    decode_array<G>(w.g, w.valid, kIsFp8<G>, g_si, g);
    decode_array<P>(w.p, w.valid, !std::is_same_v<P, float>, p_si, p);
    decode_array<M>(w.m, w.valid, !std::is_same_v<M, float>, m_si, m);
    decode_array<V>(w.v, w.valid, !std::is_same_v<V, float>, v_si, v);
  }

  template <class T>
  __device__ void decode_array(const uint32_t (&w)[kWords<T, N>], int valid, bool scaled, float scale_inv,
                               float (&x)[N]) const {
    decode_pack<T>(w, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = scaled ? rn::mul(x[k], scale_inv) : x[k];
    if (valid < N) {
#pragma unroll
      for (int k = 0; k < N; ++k) x[k] = k < valid ? x[k] : 0.0f;
    }
  }
};

// The approximate instructions param_bracket assumes (adam_bound.h): about 1 ulp, subnormal
// inputs and results flushed to zero.
struct HardwareApprox {
  __device__ float sqrt(float x) const {
    float r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
  }
  __device__ float rcp(float x) const {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
  }
};

// |x| as bits. A max over these orders like the magnitudes; NaNs (any payload) are above
// infinity and become the canonical NaN key once, at the end (canonical_key).
__device__ uint32_t magnitude_bits(float x) { return numerics::float_bits(x) & 0x7FFFFFFFu; }
__device__ uint32_t canonical_key(uint32_t bits) {
  return bits > 0x7F800000u ? numerics::kCanonicalNanBits : bits;
}

// Pass 1: fold the amaxes of g, m', v', p' into amax[index] and flag non-finite values in
// found_inf, bit for bit as the CPU reference's amax pass. m' and v' are exact and cheap; p' needs
// the IEEE sqrt and two divisions, so it is bracketed with approximate instructions and evaluated
// exactly only where the bracket cannot prove it below the maximum (adam_bound.h, "The skip rule").
// The threshold T: nextup of the row's value when the block starts (the exact maxima of the
// tensor's finished blocks), and, per pack, the warp's largest bracket lower bound and nextup of
// each lane's exact maximum so far. A warp usually evaluates p' exactly for one element of its
// first pack and then only when a pack holds a new maximum; blocks that start after others of
// their tensor finished evaluate almost none.
template <class G, class P, class M, class V>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    adam_amax_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  using C = Chunk<G, P, M, V>;
  constexpr int N = C::N;
  __shared__ AdamConstants shared_constants;
  __shared__ AdamBoundConstants shared_bound;
  __shared__ int32_t shared_known;

  const C chunk(batch, args, owning_tensor(batch));
  if (threadIdx.x == 0) {
    shared_constants = adam_constants(args.hyper, call_step(args));
    shared_bound = adam_bound_constants(shared_constants);
    // Any value the row held during this call will do; other blocks raise it concurrently.
    const uint32_t row = *reinterpret_cast<volatile const uint32_t*>(chunk.amax_row + kAdamAmaxParam);
    shared_known = static_cast<int32_t>(row + 1u);  // INT_MIN for the NaN key: no information
  }
  __syncthreads();
  const AdamConstants c = shared_constants;
  const AdamBoundConstants bound = shared_bound;
  const int32_t known = shared_known;

  const int lane = static_cast<int>(threadIdx.x) % 32;
  uint32_t keys[kAdamAmaxColumns] = {};  // magnitude bits
  float lower = 0.0f;                    // the largest lower_magnitude this lane has seen
  constexpr int kPacks = kElementsPerThread / N;
  typename C::Pack pack{}, next{};
  if (chunk.begin + (static_cast<int64_t>(threadIdx.x) - lane) * N < chunk.end) {
    chunk.fetch(chunk.begin + static_cast<int64_t>(threadIdx.x) * N, pack);
  }
  for (int u = 0; u < kPacks; ++u, pack = next) {
    // The warp goes through its packs together: the warp-wide votes below need every lane.
    const int64_t warp_j = chunk.begin + (static_cast<int64_t>(u) * kThreads + threadIdx.x - lane) * N;
    if (warp_j >= chunk.end) break;
    const int64_t j = warp_j + lane * N;
    if (u + 1 < kPacks && warp_j + kThreads * N < chunk.end) chunk.fetch(j + kThreads * N, next);
    const int valid = pack.valid;
    float g[N], p[N], m[N], v[N];
    chunk.decode(pack, g, p, m, v);

    AdamMoments mo[N];
    float upper = 0.0f;  // the largest upper_magnitude of the pack, NaN if any is NaN
#pragma unroll
    for (int k = 0; k < N; ++k) {
      mo[k] = adam_moments(p[k], g[k], m[k], v[k], c);
      // Lanes past the end (zeros) add 0 to these three and a lower bound of 0 or NaN (ignored);
      // their p' may be 0/0 when eps is 0, so they can make a pack look like it needs exact
      // values, but are never evaluated below.
      keys[kAdamAmaxGrad] = max(keys[kAdamAmaxGrad], magnitude_bits(g[k]));
      keys[kAdamAmaxExpAvg] = max(keys[kAdamAmaxExpAvg], magnitude_bits(mo[k].exp_avg));
      keys[kAdamAmaxExpAvgSq] = max(keys[kAdamAmaxExpAvgSq], magnitude_bits(mo[k].exp_avg_sq));
      const ParamBracket br = param_bracket(mo[k], c, bound, HardwareApprox{});
      lower = fmaxf(lower, lower_magnitude(br));
      upper = max_nan(upper, upper_magnitude(br));
    }
    // T as bits: non-negative floats order like signed ints; a NaN's key + 1 is INT_MIN.
    const int32_t mine = max(static_cast<int32_t>(numerics::float_bits(lower)),
                             static_cast<int32_t>(keys[kAdamAmaxParam] + 1u));
    const float threshold =
        numerics::bits_float(static_cast<uint32_t>(max(known, __reduce_max_sync(0xFFFFFFFFu, mine))));
    if (__any_sync(0xFFFFFFFFu, !(upper < threshold))) {  // rare: see adam_bound.h, "The skip rule"
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k < valid && !(upper_magnitude(param_bracket(mo[k], c, bound, HardwareApprox{})) < threshold)) {
          keys[kAdamAmaxParam] = max(keys[kAdamAmaxParam], magnitude_bits(adam_param(mo[k], c)));
        }
      }
    }
  }

  // Block max of the four keys, then one atomic max per column (the row was zeroed by this call
  // and holds only keys, which order like their values).
  __shared__ uint32_t warp_keys[kAdamAmaxColumns][kWarps];
#pragma unroll
  for (int col = 0; col < kAdamAmaxColumns; ++col) {
    const uint32_t key = __reduce_max_sync(0xFFFFFFFFu, canonical_key(keys[col]));
    if (lane == 0) warp_keys[col][threadIdx.x / 32] = key;
  }
  __syncthreads();
  if (threadIdx.x < kAdamAmaxColumns) {
    const int col = static_cast<int>(threadIdx.x);
    uint32_t key = 0;
    for (int w = 0; w < kWarps; ++w) key = max(key, warp_keys[col][w]);
    if (key != 0) atomicMax(reinterpret_cast<unsigned int*>(chunk.amax_row + col), key);
    if (is_nonfinite_key(key)) *args.found_inf = 1.0f;  // every writer writes the same value
  }
}

// Pass 2: unless found_inf is set, recompute m', v', p' as the reference does and store them and
// the weight copy with the new scales.
template <class G, class P, class M, class V>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    adam_store_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  using C = Chunk<G, P, M, V>;
  constexpr int N = C::N;
  constexpr bool kScaledParam = !std::is_same_v<P, float>;
  constexpr bool kScaledExpAvg = !std::is_same_v<M, float>;
  constexpr bool kScaledExpAvgSq = !std::is_same_v<V, float>;
  __shared__ AdamConstants shared_constants;
  __shared__ AdamScales shared_scales;
  __shared__ bool shared_skip;

  const C chunk(batch, args, owning_tensor(batch));
  if (threadIdx.x == 0) {
    shared_constants = adam_constants(args.hyper, call_step(args));
    shared_skip = *args.found_inf != 0.0f;
    if (!shared_skip) shared_scales = adam_new_scales(chunk.tp, chunk.amax_row, args.hyper.margin);
  }
  __syncthreads();
  if (shared_skip) return;  // the same answer for the whole block
  const AdamConstants c = shared_constants;
  const AdamScales& s = shared_scales;

  constexpr int kPacks = kElementsPerThread / N;
  typename C::Pack pack{}, next{};
  if (chunk.begin + static_cast<int64_t>(threadIdx.x) * N < chunk.end) {
    chunk.fetch(chunk.begin + static_cast<int64_t>(threadIdx.x) * N, pack);
  }
  for (int u = 0; u < kPacks; ++u, pack = next) {
    const int64_t j = chunk.begin + (static_cast<int64_t>(u) * kThreads + threadIdx.x) * N;
    if (j >= chunk.end) break;
    if (u + 1 < kPacks && j + kThreads * N < chunk.end) chunk.fetch(j + kThreads * N, next);
    const int valid = pack.valid;
    float g[N], p[N], m[N], v[N];
    chunk.decode(pack, g, p, m, v);
    AdamUpdate r[N];
#pragma unroll
    for (int k = 0; k < N; ++k) r[k] = adam_update(p[k], g[k], m[k], v[k], c);

    float x[N];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = kScaledExpAvg ? rn::mul(r[k].exp_avg, s.exp_avg.scale) : r[k].exp_avg;
    uint32_t wm[kWords<M, N>];
    encode_pack<M>(x, wm);
    store_pack<N>(chunk.exp_avg + j, wm, valid, chunk.vector_ok);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      x[k] = kScaledExpAvgSq ? rn::mul(r[k].exp_avg_sq, s.exp_avg_sq.scale) : r[k].exp_avg_sq;
    }
    uint32_t wv[kWords<V, N>];
    encode_pack<V>(x, wv);
    store_pack<N>(chunk.exp_avg_sq + j, wv, valid, chunk.vector_ok);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = kScaledParam ? rn::mul(r[k].param, s.param.scale) : r[k].param;
    uint32_t wp[kWords<P, N>];
    encode_pack<P>(x, wp);
    store_pack<N>(chunk.param + j, wp, valid, chunk.vector_ok);
    if (chunk.weight != nullptr) {
      // The copy of the master as stored: the codes just written, dequantized with the new scale.
      if constexpr (kScaledParam) decode_pack<P>(wp, x);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float stored = kScaledParam ? rn::mul(x[k], s.param.scale_inv) : r[k].param;
        x[k] = rn::mul(stored, s.weight.scale);
      }
      uint32_t ww[kWords<numerics::fp8_e4m3, N>];
      encode_pack<numerics::fp8_e4m3>(x, ww);
      store_pack<N>(chunk.weight + j, ww, valid, chunk.vector_ok);
    }
  }
}

// The commit: thread t writes tensor t's new scale pairs (recomputed as pass 2 did), and the
// thread of tensor 0 advances the step counter.
__global__ void __launch_bounds__(kMaxTensors)
    commit_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  const int t = static_cast<int>(threadIdx.x);
  if (t >= batch.count || *args.found_inf != 0.0f) return;
  const AdamTensorPtrs& tp = batch.tensors[t];
  const int64_t index = batch.index[t];
  store_scales(tp, adam_new_scales(tp, args.amax + index * kAdamAmaxColumns, args.hyper.margin));
  if (index == 0 && args.step_tensor != nullptr) *args.step_tensor = rn::add(*args.step_tensor, 1.0f);
}

// Runs pass 1 or 2 over the tensors `indices` (one dtype combination), in as few launches as the
// batch size allows. Empty tensors have no elements to visit; the commit still sees them.
template <class G, class P, class M, class V>
void launch_pass(const std::vector<AdamTensorPtrs>& tensors, const std::vector<int32_t>& indices,
                 const AdamArgs& args, bool store, cudaStream_t stream) {
  AdamBatch batch{};
  int64_t blocks = 0;
  const auto launch = [&] {
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    if (store) {
      adam_store_kernel<G, P, M, V><<<grid_size(blocks, "adam_step"), kThreads, 0, stream>>>(batch, args);
    } else {
      adam_amax_kernel<G, P, M, V><<<grid_size(blocks, "adam_step"), kThreads, 0, stream>>>(batch, args);
    }
    FP8AMP_CUDA_CHECK_LAUNCH();
    batch.count = 0;
    blocks = 0;
  };
  for (const int32_t i : indices) {
    const int64_t need = ceil_div(tensors[i].numel, kChunk);
    if (need == 0) continue;
    if (batch.count == kMaxTensors || (batch.count > 0 && blocks + need > INT_MAX)) launch();
    batch.tensors[batch.count] = tensors[i];
    batch.index[batch.count] = i;
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    ++batch.count;
    blocks += need;
  }
  if (batch.count > 0) launch();
}

}  // namespace

void adam_step(const std::vector<AdamTensorPtrs>& tensors, const std::vector<AdamFormats>& formats,
               const AdamArgs& args, Stream stream) {
  const cudaStream_t s = cuda_stream(stream);
  const size_t n = tensors.size();
  FP8AMP_CUDA_CHECK(cudaMemsetAsync(args.amax, 0, n * kAdamAmaxColumns * sizeof(float), s));

  // The tensors of each dtype combination, in order of first appearance.
  std::vector<std::pair<AdamFormats, std::vector<int32_t>>> groups;
  for (size_t i = 0; i < n; ++i) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == formats[i]; });
    if (it == groups.end()) it = groups.insert(groups.end(), {formats[i], {}});
    it->second.push_back(static_cast<int32_t>(i));
  }
  // Every tensor's pass 1 runs before any pass 2: the skip decision covers the whole call.
  for (const bool store : {false, true}) {
    for (const auto& group : groups) {
      visit_formats(group.first, [&](auto g, auto p, auto m, auto v) {
        launch_pass<decltype(g), decltype(p), decltype(m), decltype(v)>(tensors, group.second, args, store, s);
      });
    }
  }

  AdamBatch batch{};
  for (size_t i = 0; i < n; ++i) {
    batch.tensors[batch.count] = tensors[i];
    batch.index[batch.count] = static_cast<int32_t>(i);
    if (++batch.count == kMaxTensors || i + 1 == n) {
      commit_kernel<<<1, kMaxTensors, 0, s>>>(batch, args);
      FP8AMP_CUDA_CHECK_LAUNCH();
      batch.count = 0;
    }
  }
}

}  // namespace cuda
}  // namespace fp8amp
