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
constexpr int kElementsPerThread = 64;  // per block: a chunk of kThreads * 64 elements of one tensor
constexpr int64_t kChunk = int64_t{kThreads} * kElementsPerThread;

// Tensors per launch: the batch travels in the kernel parameters, which may take 32,764 bytes
// since CUDA 12.1 (on Volta and later; fp8amp needs CUDA 13). 128 covers the params of a typical
// model's call in one launch a pass: each launch costs the host a few microseconds.
constexpr int kMaxTensors = 128;

// Blocks the passes keep resident an SM: 4 (half occupancy) caps them at 64 registers a thread,
// what they used before holding a second pack; 3 would leave them their 70-73.
constexpr int kBlocksPerSm = 4;

struct AdamBatch {
  AdamTensorPtrs tensors[kMaxTensors];
  int32_t index[kMaxTensors];  // the tensor's position in the call: its row of amax
  int32_t block_begin[kMaxTensors + 1];
  int32_t count;
};
static_assert(sizeof(AdamBatch) + sizeof(AdamArgs) <= 32764, "kernel parameters must stay within 32,764 bytes");

// ------------------------------------------------------------------------------------------------
// The passes.

template <class G, class P, class M, class V>
constexpr int kPackSize =
    static_cast<int>(16 / std::max({sizeof(G), sizeof(P), sizeof(M), sizeof(V)}));

// The scale_inv of a scaled input, 1 (unused) otherwise.
__device__ float scale_inv_or_1(const float* p) { return p != nullptr ? *p : 1.0f; }

// What the chunk multiplies decoded grads by: the scale_inv of an FP8 grad (1 for others), negated
// for maximize, which the kernels' constants then leave out (x * -s = -(x * s) exactly).
template <class G>
__device__ float signed_grad_scale_inv(const float* scale_inv, bool maximize) {
  const float s = kIsFp8<G> ? scale_inv_or_1(scale_inv) : 1.0f;
  return maximize ? -s : s;
}

// The step's constants for element math on the chunk's decoded (already negated) grads; applied to
// the copy in registers, so that the compiler knows maximize is off.
__device__ AdamConstants without_maximize(AdamConstants c) {
  c.maximize = false;
  return c;
}

// Calls f(known), a copy of c whose lerp_small the compiler knows (so that m' is one fma, not two
// predicated ones): one call in each branch of a uniform branch.
template <class F>
__device__ void with_known_lerp(const AdamConstants& c, F&& f) {
  AdamConstants known = c;
  if (c.lerp_small) {
    known.lerp_small = true;
    f(known);
  } else {
    known.lerp_small = false;
    f(known);
  }
}

// Read from shared memory at each use rather than held in registers, which bound the passes'
// occupancy (see Chunk::make_blocks).
__shared__ FastDivisor shared_blocks_per_row;

// The pointers, input scales and chunk of the tensor that owns this block, as both passes read them.
// The kernels index the chunk's elements with 32-bit offsets. With kBlocks (an FP8 grad with 128 x
// 128 block scales) each pack reads its block's grad scale_inv: a pack lies in one block, as the
// grad's cols are a multiple of 128 and of the pack size.
template <class G, class P, class M, class V, bool kBlocks>
struct Chunk {
  static constexpr int N = kPackSize<G, P, M, V>;
  const AdamTensorPtrs& tp;
  float* amax_row;
  int64_t begin;  // the chunk's first element in the tensor
  int length;     // its elements: kChunk, fewer in the tensor's last chunk
  float g_si, p_si, m_si, v_si;  // g_si negative for maximize: decode returns -g (exactly); +-1 with kBlocks
  bool vector_ok;  // every array aligned for one access per pack
  bool read_param;  // false: the param is not loaded (its words stay 0)

  // read_param: whether the pass reads the param (pass 1 does not with a kept master amax).
  __device__ Chunk(const AdamBatch& batch, const AdamArgs& args, int t, bool read_param)
      : tp(batch.tensors[t]),
        amax_row(args.amax + static_cast<int64_t>(batch.index[t]) * kAdamAmaxColumns),
        begin(static_cast<int64_t>(static_cast<int>(blockIdx.x) - batch.block_begin[t]) * kChunk),
        length(static_cast<int>(min(tp.numel - begin, kChunk))),
        g_si(signed_grad_scale_inv<G>(kBlocks ? nullptr : tp.grad_scale_inv, args.hyper.maximize)),
        p_si(scale_inv_or_1(tp.param_scale_inv)),
        m_si(scale_inv_or_1(tp.exp_avg_scale_inv)),
        v_si(scale_inv_or_1(tp.exp_avg_sq_scale_inv)),
        // kChunk is a multiple of N: the chunk's packs are aligned iff the tensor's start is.
        vector_ok(is_aligned(tp.grad, N * sizeof(G)) && is_aligned(tp.param, N * sizeof(P)) &&
                  is_aligned(tp.exp_avg, N * sizeof(M)) && is_aligned(tp.exp_avg_sq, N * sizeof(V)) &&
                  is_aligned(tp.weight_fp8, N)),
        read_param(read_param) {}

  // Element i of the chunk in each array, from the kernel parameters at each use: five 64-bit
  // pointers held in registers would cost the passes registers, which limit their occupancy.
  __device__ const G* grad(int i) const { return static_cast<const G*>(tp.grad) + (begin + i); }
  __device__ P* param(int i) const { return static_cast<P*>(tp.param) + (begin + i); }
  __device__ M* exp_avg(int i) const { return static_cast<M*>(tp.exp_avg) + (begin + i); }
  __device__ V* exp_avg_sq(int i) const { return static_cast<V*>(tp.exp_avg_sq) + (begin + i); }
  __device__ bool has_weight() const { return tp.weight_fp8 != nullptr; }
  __device__ numerics::fp8_e4m3* weight(int i) const {
    return static_cast<numerics::fp8_e4m3*>(tp.weight_fp8) + (begin + i);
  }

  // With kBlocks: the grad's blocks per row as a divisor (shared_blocks_per_row), made by thread 0
  // before the block's first barrier.
  __device__ void make_blocks() const {
    if constexpr (kBlocks) shared_blocks_per_row = FastDivisor::of(tp.grad_blocks_per_row);
  }

  // The grad scale_inv of the pack at element i (kBlocks), signed as g_si.
  __device__ float block_grad_scale_inv(int i) const {
    const auto run = static_cast<uint32_t>(static_cast<uint64_t>(begin + i) / kGradBlock);
    const FastDivisor& blocks = shared_blocks_per_row;
    return tp.grad_scale_inv[grad_block_index(run, blocks.divide(run), blocks.divisor)] * g_si;
  }

  // One pack of every input as loaded. The passes fetch the next pack before they compute on this
  // one: Nsight Compute found them at half occupancy (register-bound) with ~40 % of warp cycles
  // waiting for their loads, so a thread keeps a second round trip in flight.
  struct Pack {
    uint32_t g[kWords<G, N>], p[kWords<P, N>], m[kWords<M, N>], v[kWords<V, N>];
    int valid;  // elements of the pack before the chunk's end (<= 0 past it)
    float g_si;  // with kBlocks: the block's grad scale_inv, signed
  };

  // The pack at element i of the chunk: its arrays, then with kBlocks its block scale, which needs
  // make_blocks' divisor. The passes fetch their first pack's arrays before the first barrier, so
  // that thread 0's per-step constants (float64 arithmetic, a load of the amax row) overlap them.
  __device__ void fetch(int i, Pack& w) const {
    fetch_arrays(i, w);
    fetch_block_scale(i, w);
  }
  __device__ void fetch_block_scale(int i, Pack& w) const {
    if constexpr (kBlocks) w.g_si = w.valid > 0 ? block_grad_scale_inv(i) : 0.0f;
  }
  __device__ void fetch_arrays(int i, Pack& w) const {
    // Negative past the chunk's end, which every use treats as 0. Not clamped: with max(0, .) here
    // nvcc 13.0 emitted a VIMNMX.RELU whose predicate feeds the whole-pack branch, and the H200
    // failed the bit-exact AdamCuda tests (found by bisection; the unclamped form passes).
    w.valid = min(N, length - i);
    if (vector_ok && w.valid == N) {  // one branch for the usual whole pack, not one per array
      load_words(grad(i), w.g);
      load_words(exp_avg(i), w.m);
      load_words(exp_avg_sq(i), w.v);
      if (read_param) load_words(param(i), w.p);
      return;
    }
    load_pack<N>(grad(i), w.valid, vector_ok, w.g);
    load_pack<N>(exp_avg(i), w.valid, vector_ok, w.m);
    load_pack<N>(exp_avg_sq(i), w.valid, vector_ok, w.v);
    if (read_param) load_pack<N>(param(i), w.valid, vector_ok, w.p);
  }

  // The dequantized inputs of the pack's valid elements (g negated for maximize), and 0.0f after
  // them (whatever the scales), so that the amax pass can fold a whole pack into the g, m', v'
  // maxima: zero inputs give g = m' = v' = 0.
  __device__ void decode(const Pack& w, float (&g)[N], float (&p)[N], float (&m)[N], float (&v)[N]) const {
    decode_array<G>(w.g, kIsFp8<G> || g_si < 0.0f, kBlocks ? w.g_si : g_si, g);
    decode_array<P>(w.p, !std::is_same_v<P, float>, p_si, p);
    decode_array<M>(w.m, !std::is_same_v<M, float>, m_si, m);
    decode_array<V>(w.v, !std::is_same_v<V, float>, v_si, v);
    if (w.valid < N) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k >= w.valid) g[k] = p[k] = m[k] = v[k] = 0.0f;
      }
    }
  }

  template <class T>
  __device__ void decode_array(const uint32_t (&w)[kWords<T, N>], bool scaled, float scale_inv, float (&x)[N]) const {
    decode_pack<T>(w, x);
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = scaled ? rn::mul(x[k], scale_inv) : x[k];
  }
};

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
  using C = Chunk<G, P, M, V, kBlocks>;
  constexpr int N = C::N;
  __shared__ AdamConstants shared_constants;
  __shared__ AdamBoundConstants shared_bound;
  __shared__ int32_t shared_known;
  __shared__ float shared_kept;

  const int t = owning_tensor(batch);
  const C chunk(batch, args, t, !uses_kept_amax(batch.tensors[t], args.hyper.adamw, args.hyper.weight_decay != 0.0));
  const int lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kPacks = kElementsPerThread / N;
  typename C::Pack pack{}, next{};
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
  for (int u = 0; u < kPacks; ++u, pack = next) {
    // The warp goes through its packs together: the warp-wide votes below need every lane.
    const int warp_i = u * kThreads * N + warp_first;
    if (warp_i >= chunk.length) break;
    if (u + 1 < kPacks && warp_i + kThreads * N < chunk.length) chunk.fetch(warp_i + (kThreads + lane) * N, next);
    const int valid = pack.valid;
    float g[N], p[N], m[N], v[N];
    chunk.decode(pack, g, p, m, v);

    AdamMoments mo[N];
    float p_max = 0.0f, w_max = 0.0f;  // the pack's largest |p_d| and w, NaN if any is NaN
    with_known_lerp(c, [&](const AdamConstants& ck) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        mo[k] = adam_moments(p[k], g[k], m[k], v[k], ck);
        if (kept >= 0.0f) mo[k] = bound_moments(mo[k], kept);
        // Elements past the end (zeros) add 0 to these four and a w of 2^-149, or NaN when eps is
        // 0 (0/0), which sends the pack to the exact path below; they are never evaluated there.
        amax[kAdamAmaxGrad] = fold_magnitude(amax[kAdamAmaxGrad], g[k]);
        amax[kAdamAmaxExpAvg] = fold_magnitude(amax[kAdamAmaxExpAvg], mo[k].exp_avg);
        amax[kAdamAmaxExpAvgSq] = fold_magnitude(amax[kAdamAmaxExpAvgSq], mo[k].exp_avg_sq);
        p_max = fold_magnitude(p_max, mo[k].param);
        w_max = max_nan(w_max, update_bound(mo[k], c, bound, HardwareApprox{}));
      }
    });
    const ParamBounds pack_bounds = param_bounds(p_max, w_max);
    lower = fmaxf(lower, pack_bounds.lower);
    // T as bits: non-negative floats order like signed ints; the NaN key + 1 is INT_MIN.
    const int32_t mine = max(static_cast<int32_t>(numerics::float_bits(lower)),
                             static_cast<int32_t>(canonical_key(amax[kAdamAmaxParam]) + 1u));
    const float threshold =
        numerics::bits_float(static_cast<uint32_t>(max(known, __reduce_max_sync(0xFFFFFFFFu, mine))));
    if (__any_sync(0xFFFFFFFFu, !(pack_bounds.upper < threshold))) {  // rare: adam_bound.h, "The skip rule"
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float w = update_bound(mo[k], c, bound, HardwareApprox{});
        if (k < valid && !(param_bounds(fabsf(mo[k].param), w).upper < threshold)) {
          amax[kAdamAmaxParam] = fold_magnitude(amax[kAdamAmaxParam], adam_param(mo[k], c));
        }
      }
    }
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

// Pass 2: unless found_inf is set, recompute m', v', p' as the reference does and store them and
// the weight copy with the new scales.
template <class G, class P, class M, class V, bool kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    adam_store_kernel(const __grid_constant__ AdamBatch batch, const __grid_constant__ AdamArgs args) {
  using C = Chunk<G, P, M, V, kBlocks>;
  constexpr int N = C::N;
  constexpr bool kScaledParam = !std::is_same_v<P, float>;
  constexpr bool kScaledExpAvg = !std::is_same_v<M, float>;
  constexpr bool kScaledExpAvgSq = !std::is_same_v<V, float>;
  __shared__ AdamConstants shared_constants;
  __shared__ AdamScales shared_scales;
  __shared__ bool shared_skip;
  __shared__ uint32_t warp_keys[kWarps];

  const C chunk(batch, args, owning_tensor(batch), true);
  constexpr int kPacks = kElementsPerThread / N;
  typename C::Pack pack{}, next{};
  const int first = static_cast<int>(threadIdx.x) * N;
  if (first < chunk.length) chunk.fetch_arrays(first, pack);
  if (threadIdx.x == 0) {
    chunk.make_blocks();
    shared_constants = adam_constants(args.hyper, call_step(args));
    shared_skip = *args.found_inf != 0.0f;
    if (!shared_skip) shared_scales = adam_new_scales(chunk.tp, chunk.amax_row, args.hyper.margin);
  }
  __syncthreads();
  if (shared_skip) return;  // the same answer for the whole block
  const AdamConstants c = without_maximize(shared_constants);
  const AdamScales& s = shared_scales;
  if (first < chunk.length) chunk.fetch_block_scale(first, pack);

  float new_param = 0.0f;  // this thread's largest exact |p'|
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
