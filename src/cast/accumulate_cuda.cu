// CUDA twin of accumulate_cpu.cpp: scaled_accumulate (cast.h) bit for bit, without host syncs.
//
// The new scale depends on the amax of all the sums, so the op takes three launches on the stream:
// - amax_pass:  the sums, reduced to max amax_key per block and atomicMax'ed into amax (zeroed
//               by a cudaMemsetAsync first; amax keys are canonical, so an integer max is exact);
// - store_pass: every block derives the new scale from amax on the device, recomputes the sums
//               (with the old dst_scale_inv) and stores the quantized codes;
// - finish:     one thread writes dst_scale_inv, which store_pass still had to read.
// Both passes are grid-stride loops over packs of N elements (16 bytes of the wider of dst and
// src), moved as single vector accesses when both pointers are aligned to their pack; the tail,
// and whole tensors whose pointers are not aligned, go element by element. An element is read
// and written by the same thread, so src may be dst itself.
//
// The codecs are numerics.h's software ones: exactly the CPU reference's bits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cast/cast_kernels.h"
#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "common/dispatch.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // the grid-stride passes launch at most this many blocks per SM

template <class Dst, class Src>
constexpr int kPack = static_cast<int>(16 / std::max(sizeof(Dst), sizeof(Src)));

// N consecutive elements at p (aligned to N * sizeof(T), N * sizeof(T) a multiple of 4 bytes),
// read as one access of 32-bit words and split into elements, or joined and written back.
template <int N, class T>
__device__ __forceinline__ void read_pack(const T* p, T (&x)[N]) {
  constexpr int kPerWord = 4 / sizeof(T);
  uint32_t w[N / kPerWord];
  load_words(p, w);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if constexpr (kPerWord == 1) {
      x[k] = from_bits<T>(w[k]);
    } else {
      x[k] = from_bits<T>(w[k / kPerWord] >> (8 * sizeof(T) * (k % kPerWord)));
    }
  }
}

template <int N, class T>
__device__ __forceinline__ void write_pack(T* p, const T (&x)[N]) {
  constexpr int kPerWord = 4 / sizeof(T);
  static_assert(kPerWord > 1, "dst codes are 1 or 2 bytes");
  uint32_t w[N / kPerWord] = {};
#pragma unroll
  for (int k = 0; k < N; ++k) w[k / kPerWord] |= bits_of(x[k]) << (8 * sizeof(T) * (k % kPerWord));
  store_words(p, w);
}

struct Work {
  int64_t packs;    // whole packs done as vectors (0 when the pointers are not aligned)
  int64_t tail;     // first element done one by one
  int64_t threads;  // grid-stride step, in threads
  int64_t thread;   // this thread's index in the grid
};

template <int N>
__device__ __forceinline__ Work work(int64_t numel, bool vector_ok) {
  const int64_t packs = vector_ok ? numel / N : 0;
  return Work{packs, packs * N, int64_t{gridDim.x} * kThreads,
              static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x};
}

template <class Dst, class Src, bool kScaledSrc>
__global__ void __launch_bounds__(kThreads) amax_pass(const AccumulatePtrs p, bool vector_ok) {
  constexpr int N = kPack<Dst, Src>;
  const Dst* dst = static_cast<const Dst*>(p.dst);
  const Src* src = static_cast<const Src*>(p.src);
  const float dst_scale_inv = *p.dst_scale_inv;
  const float src_scale_inv = kScaledSrc ? *p.src_scale_inv : 1.0f;
  const Work w = work<N>(p.numel, vector_ok);

  uint32_t key = 0;
  for (int64_t q = w.thread; q < w.packs; q += w.threads) {
    Dst d[N];
    Src x[N];
    read_pack(dst + q * N, d);
    read_pack(src + q * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      key = max(key, numerics::amax_key(accumulate::sum<kScaledSrc>(d[k], x[k], dst_scale_inv, src_scale_inv, p.alpha)));
    }
  }
  for (int64_t i = w.tail + w.thread; i < p.numel; i += w.threads) {
    key = max(key, numerics::amax_key(accumulate::sum<kScaledSrc>(dst[i], src[i], dst_scale_inv, src_scale_inv, p.alpha)));
  }

  __shared__ uint32_t warp_keys[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, offset));
  if (threadIdx.x % 32 == 0) warp_keys[threadIdx.x / 32] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < kThreads / 32; ++k) key = max(key, warp_keys[k]);
    if (key != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax), key);
  }
}

template <class Dst, class Src, bool kScaledSrc>
__global__ void __launch_bounds__(kThreads) store_pass(const AccumulatePtrs p, bool vector_ok) {
  constexpr int N = kPack<Dst, Src>;
  Dst* dst = static_cast<Dst*>(p.dst);
  const Src* src = static_cast<const Src*>(p.src);
  const float dst_scale_inv = *p.dst_scale_inv;
  const float src_scale_inv = kScaledSrc ? *p.src_scale_inv : 1.0f;
  const float scale = accumulate::new_scale(*p.amax, numerics::format_max<Dst>(), p.margin, p.pow2).scale;
  const Work w = work<N>(p.numel, vector_ok);

  for (int64_t q = w.thread; q < w.packs; q += w.threads) {
    Dst d[N];
    Src x[N];
    read_pack(dst + q * N, d);
    read_pack(src + q * N, x);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      d[k] = numerics::quantize_to<Dst>(
          rn::mul(accumulate::sum<kScaledSrc>(d[k], x[k], dst_scale_inv, src_scale_inv, p.alpha), scale));
    }
    write_pack(dst + q * N, d);
  }
  for (int64_t i = w.tail + w.thread; i < p.numel; i += w.threads) {
    dst[i] = numerics::quantize_to<Dst>(
        rn::mul(accumulate::sum<kScaledSrc>(dst[i], src[i], dst_scale_inv, src_scale_inv, p.alpha), scale));
  }
}

template <class Dst>
__global__ void finish(const AccumulatePtrs p) {
  *p.dst_scale_inv = accumulate::new_scale(*p.amax, numerics::format_max<Dst>(), p.margin, p.pow2).scale_inv;
}

// Blocks for `units` grid-stride iterations of one thread each, at most kBlocksPerSm per SM.
unsigned blocks_for(int64_t units) {
  int device = 0, sms = 0;
  FP8AMP_CUDA_CHECK(cudaGetDevice(&device));
  FP8AMP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t cap = int64_t{std::max(sms, 1)} * kBlocksPerSm;
  return grid_size(std::max<int64_t>(1, std::min(ceil_div(units, kThreads), cap)), "scaled_accumulate");
}

template <class Dst, class Src, bool kScaledSrc>
void launch(const AccumulatePtrs& p, cudaStream_t stream) {
  FP8AMP_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  if (p.numel > 0) {
    constexpr int N = kPack<Dst, Src>;
    const bool vector_ok = is_aligned(p.dst, N * sizeof(Dst)) && is_aligned(p.src, N * sizeof(Src));
    // Vector packs plus the tail elements (< N), or every element one by one.
    const int64_t units = vector_ok ? p.numel / N + p.numel % N : p.numel;
    const unsigned blocks = blocks_for(units);
    amax_pass<Dst, Src, kScaledSrc><<<blocks, kThreads, 0, stream>>>(p, vector_ok);
    FP8AMP_CUDA_CHECK_LAUNCH();
    store_pass<Dst, Src, kScaledSrc><<<blocks, kThreads, 0, stream>>>(p, vector_ok);
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
