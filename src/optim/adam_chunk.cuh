// The CUDA Adam passes' shared pieces (adam_cuda.cu's only include of it): launch constants, the
// batch of tensors a launch carries, and Chunk, what both passes read of the chunk a block owns.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/fast_divide.h"
#include "common/word_pack.cuh"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// The elements a thread takes in each pass; a block takes a chunk of kThreads times that, of one
// tensor. Pass 1, bound by its instructions, spreads each block's fixed work (the step's
// constants, the reductions, the exact evaluations of its first packs) over more elements; pass 2,
// bound by memory, ran slower with longer chunks (docs/benchmarks.md#optimizer-step).
constexpr int kAmaxElementsPerThread = 512;
constexpr int kStoreElementsPerThread = 64;

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
template <class G, class P, class M, class V, bool kBlocks, int kPerThread>
struct Chunk {
  static constexpr int N = kPackSize<G, P, M, V>;
  static constexpr int kPacks = kPerThread / N;  // a thread's packs
  static constexpr int64_t kSize = int64_t{kThreads} * kPerThread;  // a block's elements
  const AdamTensorPtrs& tp;
  float* amax_row;
  int64_t begin;  // the chunk's first element in the tensor
  int length;     // its elements: kSize, fewer in the tensor's last chunk
  float g_si, p_si, m_si;  // g_si negative for maximize: decode returns -g (exactly); +-1 with kBlocks
  float v_factor;  // exp_avg_sq_factor: decode returns v * b2
  bool vector_ok;  // every array aligned for one access per pack
  bool read_param;  // false: the param is not loaded (its words stay 0)

  // read_param: whether the pass reads the param (pass 1 does not with a kept master amax).
  __device__ Chunk(const AdamBatch& batch, const AdamArgs& args, int t, bool read_param)
      : tp(batch.tensors[t]),
        amax_row(args.amax + static_cast<int64_t>(batch.index[t]) * kAdamAmaxColumns),
        begin(static_cast<int64_t>(static_cast<int>(blockIdx.x) - batch.block_begin[t]) * kSize),
        length(static_cast<int>(min(tp.numel - begin, kSize))),
        g_si(signed_grad_scale_inv<G>(kBlocks ? nullptr : tp.grad_scale_inv, args.hyper.maximize)),
        p_si(scale_inv_or_1(tp.param_scale_inv)),
        m_si(scale_inv_or_1(tp.exp_avg_scale_inv)),
        v_factor(exp_avg_sq_factor(scale_inv_or_1(tp.exp_avg_sq_scale_inv), rn::to_float(args.hyper.beta2))),
        // kSize is a multiple of N: the chunk's packs are aligned iff the tensor's start is.
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

  // The dequantized inputs of the pack's valid elements (g negated for maximize, v as v * b2), and
  // 0.0f after them (whatever the scales), so that the amax pass can fold a whole pack into the g,
  // m', v' maxima: zero inputs give g = m' = v' = 0. Without kParam the params are 0 (pass 1 with a kept
  // amax, which does not read them).
  template <bool kParam = true>
  __device__ void decode(const Pack& w, float (&g)[N], float (&p)[N], float (&m)[N], float (&v)[N]) const {
    decode_array<G>(w.g, kIsFp8<G> || g_si < 0.0f, kBlocks ? w.g_si : g_si, g);
    if constexpr (kParam) {
      decode_array<P>(w.p, !std::is_same_v<P, float>, p_si, p);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) p[k] = 0.0f;
    }
    decode_array<M>(w.m, !std::is_same_v<M, float>, m_si, m);
    decode_array<V>(w.v, true, v_factor, v);
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

}  // namespace
}  // namespace cuda
}  // namespace fp8amp
