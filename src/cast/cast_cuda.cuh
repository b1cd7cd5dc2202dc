// Device helpers shared by the cast family's kernels (cast_cuda.cu, cast_transpose_cuda.cu): the
// block size, the amax folds and the scale a quantizing block uses; and the amax pre-pass of
// current scaling, which both run before they quantize.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cast/cast_kernels.h"
#include "common/cuda_utils.cuh"
#include "common/numerics.h"

namespace fp8amp {
namespace cuda {

inline constexpr int kThreads = 256;  // the block size of the cast kernels

template <class T>
__device__ uint32_t amax_key_from(uint32_t acc) {
  if constexpr (sizeof(T) == 1) acc = max(max(acc & 0xFFu, (acc >> 8) & 0xFFu), max((acc >> 16) & 0xFFu, acc >> 24));
  if constexpr (sizeof(T) == 2) acc = max(acc & 0xFFFFu, acc >> 16);
  return numerics::amax_key(numerics::to_float(from_bits<T>(acc)));
}

// cpu::fold_amax on the device: slot = amax_from_key(max(amax_key(slot), key)). A compare-and-swap
// loop instead of an integer atomicMax on the bits, because the slot may hold what amax_key
// normalizes (-0, a NaN of another payload, a negative value) and the CPU rewrites it canonical.
// It writes only when the value changes, so once the slot has settled a block just reads it.
__device__ inline void fold_amax(float* slot, uint32_t key) {
  unsigned int* bits = reinterpret_cast<unsigned int*>(slot);
  unsigned int seen = *reinterpret_cast<volatile unsigned int*>(bits);
  while (true) {
    const unsigned int want = max(numerics::amax_key(numerics::bits_float(seen)), key);
    if (want == seen) return;
    const unsigned int before = atomicCAS(bits, seen, want);
    if (before == seen) return;
    seen = before;
  }
}

// Every thread brings its key; one fold per block. Called by all threads of the block.
__device__ inline void fold_block_amax(float* slot, uint32_t key) {
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

// The pre-pass of current scaling (cast_cuda.cu): folds the amax of every tensor that is warming
// up (of every tensor, with s.current).
void warmup_amax(DType in_dtype, const std::vector<TensorSlice>& tensors, const ScalingPtrs& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace fp8amp
