// CUDA twin of accumulate_cpu.cpp: scaled_accumulate (accumulate.h) bit for bit, without host syncs.
//
// The new scale depends on the amax of all the sums, so the op takes three launches on the stream:
// - the amax pass:  the sums, reduced to max amax_key per block and atomicMax'ed into amax (zeroed
//                   by a cudaMemsetAsync first; amax keys are canonical, so an integer max is exact);
// - the store pass: every block derives the new scale from amax on the device, recomputes the sums
//                   (with the old dst_scale_inv) and stores the quantized codes;
// - finish:         one thread writes dst_scale_inv, which the store pass still had to read.
// Both passes are one kernel template, accumulate_pass<..., kPass>: a grid-stride loop over packs
// of N elements (16 bytes of the wider of dst and src) through common/word_pack.cuh, moved as
// single vector accesses when the pack is whole and both pointers are aligned to their pack; the
// last, partial pack, and every pack of a tensor whose pointers are not aligned, go element by
// element. A pack is read (dst and src) and written by the same thread, its loads before its
// store, so src may be dst itself.
//
// word_pack.cuh's codecs give numerics.h's bits (the conversion instructions on sm_89+, proven by
// test_cast_cuda), so the sums and codes are the CPU reference's. A decoded NaN may keep its
// payload; a NaN sum only reaches amax_key and encode_pack, which treat every NaN alike.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "accumulate/accumulate_kernels.h"
#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"
#include "common/word_pack.cuh"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // the grid-stride passes launch at most this many blocks per SM

template <class Dst, class Src>
constexpr int kPack = static_cast<int>(16 / std::max(sizeof(Dst), sizeof(Src)));

enum class Pass { kAmax, kStore };

template <class Dst, class Src, bool kScaledSrc, Pass kPass>
__global__ void __launch_bounds__(kThreads) accumulate_pass(const AccumulatePtrs p, bool vector_ok) {
  constexpr int N = kPack<Dst, Src>;
  Dst* dst = static_cast<Dst*>(p.dst);
  const Src* src = static_cast<const Src*>(p.src);
  const float dst_scale_inv = *p.dst_scale_inv;
  const float src_scale_inv = kScaledSrc ? *p.src_scale_inv : 1.0f;
  float scale = 0.0f;
  if constexpr (kPass == Pass::kStore) {
    scale = accumulate::new_scale(*p.amax, numerics::format_max<Dst>(), p.margin, p.pow2_scale).scale;
  }

  uint32_t key = 0;
  const int64_t packs = ceil_div(p.numel, N);
  const int64_t threads = int64_t{gridDim.x} * kThreads;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; q < packs; q += threads) {
    const int64_t j = q * N;
    const int valid = valid_count<N>(j, p.numel);
    uint32_t wd[kWords<Dst, N>], ws[kWords<Src, N>];
    load_pack<N>(dst + j, valid, vector_ok, wd);
    load_pack<N>(src + j, valid, vector_ok, ws);
    float d[N], x[N];
    decode_pack<Dst>(wd, d);
    decode_pack<Src>(ws, x);
    // accumulate::sum on the decoded values (to_float of a float is the float itself).
    float s[N];
#pragma unroll
    for (int k = 0; k < N; ++k) s[k] = accumulate::sum<kScaledSrc>(d[k], x[k], dst_scale_inv, src_scale_inv, p.alpha);
    if constexpr (kPass == Pass::kAmax) {
      // Only the valid elements: the zeros past them need not sum to 0 (0 * an infinite dst_scale_inv).
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (k < valid) key = max(key, numerics::amax_key(s[k]));
      }
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) s[k] = rn::mul(s[k], scale);
      encode_pack<Dst>(s, wd);
      store_pack<N>(dst + j, wd, valid, vector_ok);
    }
  }

  if constexpr (kPass == Pass::kAmax) {
    key = block_max_key<kThreads>(key);
    if (threadIdx.x == 0 && key != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax), key);
  }
}

template <class Dst>
__global__ void finish(const AccumulatePtrs p) {
  *p.dst_scale_inv = accumulate::new_scale(*p.amax, numerics::format_max<Dst>(), p.margin, p.pow2_scale).scale_inv;
}

// Blocks for `packs` grid-stride iterations of one thread each, at most kBlocksPerSm per SM.
unsigned blocks_for(int64_t packs) {
  const int64_t cap = current_sm_count() * kBlocksPerSm;
  return grid_size(std::max<int64_t>(1, std::min(ceil_div(packs, kThreads), cap)), "scaled_accumulate");
}

template <class Dst, class Src, bool kScaledSrc>
void launch(const AccumulatePtrs& p, cudaStream_t stream) {
  FP8AMP_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  if (p.numel > 0) {
    constexpr int N = kPack<Dst, Src>;
    const bool vector_ok = is_aligned(p.dst, N * sizeof(Dst)) && is_aligned(p.src, N * sizeof(Src));
    const unsigned blocks = blocks_for(ceil_div(p.numel, N));
    accumulate_pass<Dst, Src, kScaledSrc, Pass::kAmax><<<blocks, kThreads, 0, stream>>>(p, vector_ok);
    FP8AMP_CUDA_CHECK_LAUNCH();
    accumulate_pass<Dst, Src, kScaledSrc, Pass::kStore><<<blocks, kThreads, 0, stream>>>(p, vector_ok);
    FP8AMP_CUDA_CHECK_LAUNCH();
  }
  finish<Dst><<<1, 1, 0, stream>>>(p);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void scaled_accumulate(DType dst_dtype, DType src_dtype, const AccumulatePtrs& p, Stream stream) {
  visit(ScaledFormatTypes{}, dst_dtype, [&](auto d) {
    using Dst = decltype(d);
    if (p.src_scale_inv != nullptr) {
      visit(ScaledFormatTypes{}, src_dtype, [&](auto s) { launch<Dst, decltype(s), true>(p, cuda_stream(stream)); });
    } else {
      visit(HighPrecisionTypes{}, src_dtype,
            [&](auto s) { launch<Dst, decltype(s), false>(p, cuda_stream(stream)); });
    }
  });
}

}  // namespace cuda
}  // namespace fp8amp
