// CUDA twin of adam_cpu.cpp: the same step, bit for bit, in kernels that never sync with the host.
//
// A step is (optim.h, "How, without a host sync"):
//   memset(amax) -> pass 1 (adam_amax_kernel) for every tensor -> pass 2 (adam_store_kernel) for
//   every tensor -> commit_kernel for every tensor.
// Passes are multi-tensor launches, like cast_cuda.cu's: a launch covers up to kMaxTensors
// tensors of one dtype combination, whose pointers travel in the kernel parameters; tensor t owns
// blocks [block_begin[t], block_begin[t + 1]), a block one chunk of Chunk::kSize elements (the
// pass's own size). Every thread handles packs of N consecutive elements, each array moved as one
// access of N * its element size bytes (4, 8 or 16) where the tensor's arrays are aligned for it.
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
#include "optim/adam_chunk.cuh"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

// The approximate instructions param_bounds assumes (adam_bound.h): about 1 ulp, subnormal
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

// max(acc, |x|), NaN if either is NaN: one FMNMX.NAN with an |x| operand. A running maximum of
// these is the amax of the values folded, with its key (float_bits: non-negative floats order like
// their bits) the reference's amax_key; NaN payloads are made canonical at the end (canonical_key).
__device__ float fold_magnitude(float acc, float x) { return max_nan(acc, fabsf(x)); }
__device__ uint32_t canonical_key(float amax) {
  const uint32_t bits = numerics::float_bits(amax);
  return bits > 0x7F800000u ? numerics::kCanonicalNanBits : bits;
}

// Pass 1: fold the amaxes of g, m', v', p' into amax[index] and flag non-finite values in
// found_inf, bit for bit as the CPU reference's amax pass. m' and v' are exact and cheap; p' needs
// the IEEE sqrt and two divisions, so |p'| is bounded with approximate instructions and p' evaluated
// exactly only where the upper bound cannot prove it below the maximum (adam_bound.h, "The skip
// rule"). The threshold T: nextup of the row's value when the block starts (the exact maxima of the
// tensor's finished blocks), and, per pack, the warp's largest lower bound of |p'| and nextup of
// each lane's exact maximum so far. A warp usually evaluates p' exactly for one element of its
// first pack and then only when a pack holds a new maximum; blocks that start after others of
// their tensor finished evaluate almost none.
template <class G, class P, class M, class V, bool kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    adam_amax_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  using C = Chunk<G, P, M, V, kBlocks, kAmaxElementsPerThread>;
  constexpr int N = C::N;
  __shared__ AdamConstants shared_constants;
  __shared__ AdamBoundConstants shared_bound;
  __shared__ int32_t shared_known;
  __shared__ float shared_kept;

  const int t = owning_tensor(batch);
  const C chunk(batch, args, t, !uses_kept_amax(batch.tensors[t], args.hyper.adamw, args.hyper.weight_decay != 0.0));
  const int lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kPacks = C::kPacks;
  typename C::Pack pack{};
  const int warp_first = (static_cast<int>(threadIdx.x) - lane) * N;  // the warp's first element
  const bool has_first = warp_first < chunk.length;
  if (has_first) chunk.fetch_arrays(warp_first + lane * N, pack);
  if (threadIdx.x == 0) {
    chunk.make_blocks();
    shared_constants = adam_constants(args.hyper, call_step(args));
    shared_bound = adam_bound_constants(shared_constants);
    shared_kept = kept_param_bound(chunk.tp, shared_constants);
    // Any value the row held during this call will do; other blocks raise it concurrently.
    const uint32_t row = *reinterpret_cast<volatile const uint32_t*>(chunk.amax_row + kAdamAmaxParam);
    shared_known = static_cast<int32_t>(row + 1u);  // INT_MIN for the NaN key: no information
  }
  __syncthreads();
  const AdamConstants c = without_maximize(shared_constants);
  const AdamBoundConstants bound = shared_bound;
  const int32_t known = shared_known;
  const float kept = shared_kept;  // A_d (adam_kernels.h), or negative: the master is read
  if (has_first) chunk.fetch_block_scale(warp_first + lane * N, pack);

  constexpr int kColumns = kAdamAmaxNewParam;  // the columns pass 1 folds (pass 2 the last one)
  float amax[kColumns] = {};  // this lane's maxima of |g|, |m'|, |v'| and the exact |p'| (or its bound)
  float lower = 0.0f;                 // the largest lower bound of |p'| this lane has seen
  // An FP8 grad with one scale_inv: |g| is folded from the codes (their fp16 pairs, two
  // instructions a pack) and scaled once at the end, which rounds as scaling each would. The
  // pairs come from sm_89's FP8 conversions, which fp8amp's GPUs all have.
  constexpr bool kGradFromCodes = kIsFp8<G> && !kBlocks && kHardwareConvert;
  uint32_t grad_codes = 0;  // the fp16 pair of this lane's largest code magnitudes
  // The loop, compiled twice: with a kept amax (kKept) every |p_d| is A_d, so that the master is
  // neither decoded nor folded, and the exact path folds scale_grid_top of the bound moments' p'.
  const auto fold_packs = [&](auto kept_known) {
    constexpr bool kKept = decltype(kept_known)::value;
    for (int u = 0; u < kPacks; ++u) {
      // The warp goes through its packs together: the warp-wide votes below need every lane.
      const int warp_i = u * kThreads * N + warp_first;
      if (warp_i >= chunk.length) break;
      const int valid = pack.valid;
      float g[N], p[N], m[N], v[N];
      chunk.template decode<!kKept>(pack, g, p, m, v);
      if constexpr (kGradFromCodes) grad_codes = fold_code_magnitudes<G, N>(pack.g, grad_codes);
      // The next pack goes into the registers just decoded (a second buffer costs a copy a pack);
      // its load still overlaps this pack's compute.
      if (u + 1 < kPacks && warp_i + kThreads * N < chunk.length) chunk.fetch(warp_i + (kThreads + lane) * N, pack);

      AdamMoments mo[N];
      // The pack's largest |p_d| and |t| (adam_bound.h), NaN if any is NaN.
      float p_max = kKept ? kept : 0.0f, t_max = 0.0f;
      // With a kept amax the step is AdamW's or undecayed (uses_kept_amax), and p_d is A_d
      // (bound_moments): the decay's branches and product can go.
      AdamConstants moment_constants = c;
      if constexpr (kKept) moment_constants.decays = false;
      with_known_lerp(moment_constants, [&](const AdamConstants& ck) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          mo[k] = adam_moments(p[k], g[k], m[k], v[k], ck);
          // Elements past the end (zeros) add 0 to these four and a t of 0, or NaN when eps is 0
          // (0/0), which sends the pack to the exact path below; they are never evaluated there.
          if constexpr (!kGradFromCodes) amax[kAdamAmaxGrad] = fold_magnitude(amax[kAdamAmaxGrad], g[k]);
          amax[kAdamAmaxExpAvg] = fold_magnitude(amax[kAdamAmaxExpAvg], mo[k].exp_avg);
          amax[kAdamAmaxExpAvgSq] = fold_magnitude(amax[kAdamAmaxExpAvgSq], mo[k].exp_avg_sq);
          if constexpr (!kKept) p_max = fold_magnitude(p_max, mo[k].param);
          t_max = fold_magnitude(t_max, update_ratio(mo[k], c, HardwareApprox{}));
        }
      });
      const ParamBounds pack_bounds = param_bounds(p_max, ratio_bound(t_max, bound));
      lower = fmaxf(lower, pack_bounds.lower);
      // T as bits: non-negative floats order like signed ints; the NaN key + 1 is INT_MIN.
      const int32_t mine = max(static_cast<int32_t>(numerics::float_bits(lower)),
                               static_cast<int32_t>(canonical_key(amax[kAdamAmaxParam]) + 1u));
      const float threshold =
          numerics::bits_float(static_cast<uint32_t>(max(known, __reduce_max_sync(0xFFFFFFFFu, mine))));
      if (__any_sync(0xFFFFFFFFu, !(pack_bounds.upper < threshold))) {  // rare: adam_bound.h, "The skip rule"
#pragma unroll
        for (int k = 0; k < N; ++k) {
          if constexpr (kKept) mo[k] = bound_moments(mo[k], kept);
          const float w = update_bound(mo[k], c, bound, HardwareApprox{});
          if (k < valid && !(param_bounds(fabsf(mo[k].param), w).upper < threshold)) {
            const float param = adam_param(mo[k], c);
            amax[kAdamAmaxParam] = fold_magnitude(amax[kAdamAmaxParam], kKept ? scale_grid_top(param) : param);
          }
        }
      }
    }
  };
  if (kept >= 0.0f) {
    fold_packs(std::true_type{});
  } else {
    fold_packs(std::false_type{});
  }
  if constexpr (kGradFromCodes) {
    float low, high;
    fp16x2_to_float(grad_codes, low, high);
    amax[kAdamAmaxGrad] = rn::mul(max_nan(low, high), fabsf(chunk.g_si));
  }

  // Block max of the four keys, then one atomic max per column (the row was zeroed by this call
  // and holds only keys, which order like their values).
  __shared__ uint32_t warp_keys[kColumns][kWarps];
#pragma unroll
  for (int col = 0; col < kColumns; ++col) {
    const uint32_t key = __reduce_max_sync(0xFFFFFFFFu, canonical_key(amax[col]));
    if (lane == 0) warp_keys[col][threadIdx.x / 32] = key;
  }
  __syncthreads();
  if (threadIdx.x < kColumns) {
    const int col = static_cast<int>(threadIdx.x);
    uint32_t key = 0;
    for (int w = 0; w < kWarps; ++w) key = max(key, warp_keys[col][w]);
    if (key != 0) atomicMax(reinterpret_cast<unsigned int*>(chunk.amax_row + col), key);
    if (is_nonfinite_key(key)) *args.found_inf = 1.0f;  // every writer writes the same value
  }
}

// Stochastic rounding of a float16 master (optim.h): overwrites the codes w, rounded to nearest,
// of the pack x (already times the scale) whose first pair of elements is `pair`; returns the
// largest magnitude code of its first `valid` elements.
template <int N>
__device__ uint32_t round_pack_stochastic(const float (&x)[N], RoundingStream stream, uint32_t pair, int valid,
                                          uint32_t (&w)[N / 2]) {
  uint32_t largest = 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const uint32_t bits = pair_random_bits(stream, pair + i);
    const uint32_t lo = numerics::fp16_stochastic_code(x[2 * i], bits, static_cast<uint16_t>(w[i]));
    const uint32_t hi = numerics::fp16_stochastic_code(x[2 * i + 1], bits >> 16, static_cast<uint16_t>(w[i] >> 16));
    w[i] = lo | (hi << 16);
    if (2 * i < valid) largest = max(largest, lo & 0x7FFFu);
    if (2 * i + 1 < valid) largest = max(largest, hi & 0x7FFFu);
  }
  return largest;
}

// Pass 2: unless found_inf is set, recompute m', v', p' as the reference does and store them and
// the weight copy with the new scales.
template <class G, class P, class M, class V, bool kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    adam_store_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  using C = Chunk<G, P, M, V, kBlocks, kStoreElementsPerThread>;
  constexpr int N = C::N;
  constexpr bool kScaledParam = !std::is_same_v<P, float>;
  constexpr bool kScaledExpAvg = !std::is_same_v<M, float>;
  constexpr bool kScaledExpAvgSq = !std::is_same_v<V, float>;
  __shared__ AdamConstants shared_constants;
  __shared__ AdamScales shared_scales;
  __shared__ bool shared_skip;
  __shared__ uint32_t warp_keys[kWarps];
  __shared__ RoundingStream shared_stream;

  const int owner = owning_tensor(batch);
  const C chunk(batch, args, owner, true);
  constexpr int kPacks = C::kPacks;
  // (a uniform branch; pairs of elements: a chunk holds kSize / 2, which divides 2^32, so the high
  // bits of j / 2 are the chunk's)
  const bool stochastic = std::is_same_v<P, numerics::fp16> && args.hyper.stochastic_rounding;
  const auto first_pair = static_cast<uint64_t>(chunk.begin) / 2;
  typename C::Pack pack{}, next{};
  const int first = static_cast<int>(threadIdx.x) * N;
  if (first < chunk.length) chunk.fetch_arrays(first, pack);
  if (threadIdx.x == 0) {
    chunk.make_blocks();
    shared_constants = adam_constants(args.hyper, call_step(args));
    shared_skip = *args.found_inf != 0.0f;
    if (!shared_skip) shared_scales = adam_new_scales(chunk.tp, chunk.amax_row, args.hyper.margin);
    if (stochastic) {
      shared_stream = rounding_stream(args.hyper.rounding_seed, call_step(args),
                                      static_cast<uint32_t>(batch.index[owner]), static_cast<uint32_t>(first_pair >> 32));
    }
  }
  __syncthreads();
  if (shared_skip) return;  // the same answer for the whole block
  const AdamConstants c = without_maximize(shared_constants);
  const AdamScales& s = shared_scales;
  if (first < chunk.length) chunk.fetch_block_scale(first, pack);

  float new_param = 0.0f;  // this thread's largest exact |p'|
  uint32_t new_code = 0;   // with stochastic rounding: its largest stored code magnitude instead
  for (int u = 0; u < kPacks; ++u, pack = next) {
    const int i = (u * kThreads + static_cast<int>(threadIdx.x)) * N;
    if (i >= chunk.length) break;
    if (u + 1 < kPacks && i + kThreads * N < chunk.length) chunk.fetch(i + kThreads * N, next);
    const int valid = pack.valid;
    float g[N], p[N], m[N], v[N];
    chunk.decode(pack, g, p, m, v);
    AdamUpdate r[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      r[k] = adam_update(p[k], g[k], m[k], v[k], c);
      if (k < valid) new_param = fold_magnitude(new_param, r[k].param);
    }

    float x[N];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = kScaledExpAvg ? rn::mul(r[k].exp_avg, s.exp_avg.scale) : r[k].exp_avg;
    uint32_t wm[kWords<M, N>];
    encode_pack<M>(x, wm);
    store_pack<N>(chunk.exp_avg(i), wm, valid, chunk.vector_ok);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      x[k] = kScaledExpAvgSq ? rn::mul(r[k].exp_avg_sq, s.exp_avg_sq.scale) : r[k].exp_avg_sq;
    }
    uint32_t wv[kWords<V, N>];
    encode_pack<V>(x, wv);
    store_pack<N>(chunk.exp_avg_sq(i), wv, valid, chunk.vector_ok);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = kScaledParam ? rn::mul(r[k].param, s.param.scale) : r[k].param;
    uint32_t wp[kWords<P, N>];
    encode_pack<P>(x, wp);
    if constexpr (std::is_same_v<P, numerics::fp16>) {
      if (stochastic) {
        const uint32_t pair = static_cast<uint32_t>(first_pair) + static_cast<uint32_t>(i / 2);
        new_code = max(new_code, round_pack_stochastic<N>(x, shared_stream, pair, valid, wp));
      }
    }
    store_pack<N>(chunk.param(i), wp, valid, chunk.vector_ok);
    if (chunk.has_weight()) {
      // The copy of the master as stored: the codes just written, dequantized with the new scale.
      if constexpr (kScaledParam) decode_pack<P>(wp, x);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float stored = kScaledParam ? rn::mul(x[k], s.param.scale_inv) : r[k].param;
        x[k] = rn::mul(stored, s.weight.scale);
      }
      uint32_t ww[kWords<numerics::fp8_e4m3, N>];
      encode_pack<numerics::fp8_e4m3>(x, ww);
      store_pack<N>(chunk.weight(i), ww, valid, chunk.vector_ok);
    }
  }

  // The block's largest |p'|, one atomic max into new_param (pass 1 found every p' finite).
  if (stochastic) new_param = rn::mul(numerics::fp16_to_float(static_cast<uint16_t>(new_code)), s.param.scale_inv);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const uint32_t key = __reduce_max_sync(0xFFFFFFFFu, canonical_key(new_param));
  if (lane == 0) warp_keys[threadIdx.x / 32] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t block_key = 0;
    for (int w = 0; w < kWarps; ++w) block_key = max(block_key, warp_keys[w]);
    if (block_key != 0) atomicMax(reinterpret_cast<unsigned int*>(chunk.amax_row + kAdamAmaxNewParam), block_key);
  }
}

// The commit: thread t writes tensor t's new scale pairs (recomputed as pass 2 did) and advances
// its step count; the thread of tensor 0 also advances the call's step counter.
__global__ void __launch_bounds__(kMaxTensors)
    commit_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  const int t = static_cast<int>(threadIdx.x);
  if (t >= batch.count || *args.found_inf != 0.0f) return;
  const AdamTensorPtrs& tp = batch.tensors[t];
  const int64_t index = batch.index[t];
  commit_tensor(tp, args.amax + index * kAdamAmaxColumns, args.hyper.margin);
  if (index == 0 && args.step_tensor != nullptr) *args.step_tensor = rn::add(*args.step_tensor, 1.0f);
}

// Runs pass 1 or 2 over the tensors `indices` (one dtype combination), in as few launches as the
// batch size allows. Empty tensors have no elements to visit; the commit still sees them.
template <class G, class P, class M, class V, bool kBlocks>
void launch_pass(const std::vector<AdamTensorPtrs>& tensors, const std::vector<int32_t>& indices,
                 const AdamArgs& args, bool store, cudaStream_t stream) {
  AdamBatch batch{};
  int64_t blocks = 0;
  const auto launch = [&] {
    batch.block_begin[batch.count] = static_cast<int32_t>(blocks);
    if (store) {
      adam_store_kernel<G, P, M, V, kBlocks><<<grid_size(blocks, "adam_step"), kThreads, 0, stream>>>(batch, args);
    } else {
      adam_amax_kernel<G, P, M, V, kBlocks><<<grid_size(blocks, "adam_step"), kThreads, 0, stream>>>(batch, args);
    }
    FP8AMP_CUDA_CHECK_LAUNCH();
    batch.count = 0;
    blocks = 0;
  };
  for (const int32_t i : indices) {
    const int64_t chunk = int64_t{kThreads} * (store ? kStoreElementsPerThread : kAmaxElementsPerThread);
    const int64_t need = ceil_div(tensors[i].numel, chunk);
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
        using G = decltype(g);
        // Block scales come with FP8 grads only (adam.cpp): no other grad type gets the variant.
        if constexpr (kIsFp8<G>) {
          if (group.first.grad_blocks) {
            launch_pass<G, decltype(p), decltype(m), decltype(v), true>(tensors, group.second, args, store, s);
            return;
          }
        }
        launch_pass<G, decltype(p), decltype(m), decltype(v), false>(tensors, group.second, args, store, s);
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
