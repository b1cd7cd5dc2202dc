// Launch and memory-access helpers shared by the CUDA kernels (cast_cuda.cu, adam_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/numerics.h"
#include "fp8amp/error.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace cuda {

inline cudaStream_t cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

// A grid of `blocks` blocks in x (its limit is 2^31 - 1; y and z would stop at 65535).
inline unsigned grid_size(int64_t blocks, const char* op) {
  FP8AMP_CHECK(blocks <= INT_MAX, kNotImplemented, op, "too large for one launch: ", blocks, " blocks");
  return static_cast<unsigned>(blocks);
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The SMs of the current device (at least 1): grids of one wave are sized from it.
inline int64_t current_sm_count() {
  int device = 0, sms = 0;
  FP8AMP_CUDA_CHECK(cudaGetDevice(&device));
  FP8AMP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms > 0 ? sms : 1;
}

__host__ __device__ inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// sm_89+ converts FP8/FP16 in hardware with the bits numerics.h defines (test_cast_cuda proves
// it); older targets use the software codec.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHardwareConvert = true;
#else
constexpr bool kHardwareConvert = false;
#endif

using numerics::kIsFp8;

// The bits of one element (float, or a storage type of numerics.h), and back.
template <class T>
__device__ __forceinline__ uint32_t bits_of(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return numerics::float_bits(x);
  } else {
    return x.bits;
  }
}

template <class T>
__device__ __forceinline__ T from_bits(uint32_t b) {
  if constexpr (std::is_same_v<T, float>) {
    return numerics::bits_float(b);
  } else {
    return T{static_cast<decltype(T::bits)>(b)};
  }
}

// A pack of elements moves through global memory as one access of 4, 8 or 16 bytes, made of
// 32-bit words. Stores go through __stwb (st.global.wb, the default policy) because a plain store
// of a uint4 may still be split into 4-byte pieces by the compiler.
//
// kStreaming is for data a kernel touches once: loads through the non-coherent path without an L1
// line (ld.global.nc.L1::no_allocate; the kernel must not write what it reads), stores marked
// evict-first (st.global.cs): together they keep streamed data from displacing reused lines
// (docs/benchmarks_history.md has the dequantize measurements: either hint alone was slower).
enum class Access { kDefault, kStreaming };

template <Access A = Access::kDefault, int Words>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[Words]) {
  static_assert(Words == 1 || Words == 2 || Words == 4, "packs are 4, 8 or 16 bytes");
  if constexpr (A == Access::kStreaming) {
    if constexpr (Words == 4) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "l"(p));
    } else if constexpr (Words == 2) {
      asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    } else {
      asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
    }
  } else if constexpr (Words == 4) {
    const uint4 v = *static_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (Words == 2) {
    const uint2 v = *static_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *static_cast<const uint32_t*>(p);
  }
}

// One store of a vector type with A's policy.
template <Access A, class V>
__device__ __forceinline__ void store_with(V* p, V v) {
  if constexpr (A == Access::kStreaming) {
    __stcs(p, v);
  } else {
    __stwb(p, v);
  }
}

template <Access A = Access::kDefault, int Words>
__device__ __forceinline__ void store_words(void* p, const uint32_t (&w)[Words]) {
  static_assert(Words == 1 || Words == 2 || Words == 4, "packs are 4, 8 or 16 bytes");
  if constexpr (Words == 4) {
    store_with<A>(static_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
  } else if constexpr (Words == 2) {
    store_with<A>(static_cast<uint2*>(p), make_uint2(w[0], w[1]));
  } else {
    store_with<A>(static_cast<unsigned int*>(p), w[0]);
  }
}

// Multi-tensor launches: tensor t of a batch owns blocks [block_begin[t], block_begin[t + 1]).
// Returns the tensor that owns this block: the last t with block_begin[t] <= blockIdx.x.
template <class Batch>
__device__ __forceinline__ int owning_tensor(const Batch& batch) {
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

// The largest of the keys (amax_key bits, which order like their values) that the threads of a
// block of kThreads bring: in thread 0 (the others get their warp's). Called by every thread.
template <int kThreads>
__device__ __forceinline__ uint32_t block_max_key(uint32_t key) {
  __shared__ uint32_t warp_keys[kThreads / 32];
  key = __reduce_max_sync(0xFFFFFFFFu, key);
  if (threadIdx.x % 32 == 0) warp_keys[threadIdx.x / 32] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) key = max(key, warp_keys[w]);
  }
  return key;
}

}  // namespace cuda
}  // namespace fp8amp
