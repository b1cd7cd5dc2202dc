// Packs of elements as the 32-bit words they occupy in memory, and the numerics of numerics.h on
// them: the element-wise kernels (cast_cuda.cu, accumulate_cuda.cu, adam_cuda.cu) and the tiled ones
// (cast_transpose_cuda.cu, tiles_region_cuda.cu) load, convert and store packs through these alone.
//
// A pack of N elements of T travels as kWords<T, N> 32-bit words (4, 8 or 16 bytes), element k in
// bytes [k * sizeof(T), (k + 1) * sizeof(T)) of the little-endian words. The conversions work on the
// words directly, two or four elements at a time: splitting a pack into one register per element
// and joining it again costs integer operations per element that made a kernel as light as
// dequantize instruction-bound (Nsight Compute: 77 % SM throughput at 61 % of DRAM bandwidth).
//
// numerics.h defines every result; on sm_89+ the conversion instructions give the same bits
// (test_cast_cuda proves each one: the saturating encoders over every fp32 input, the decoders over
// every code) and replace the software codec, which costs ~20 integer operations an element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/numerics.h"

namespace fp8amp {
namespace cuda {

template <class T, int N>
constexpr int kWords = static_cast<int>(N * sizeof(T) / 4);

template <class T>
__host__ __device__ constexpr int kShift(int k) { return static_cast<int>(8 * ((k * sizeof(T)) % 4)); }

// How many of the N elements starting at index j lie before `end`.
template <int N>
__device__ __forceinline__ int valid_count(int64_t j, int64_t end) {
  return static_cast<int>(max(int64_t{0}, min(int64_t{N}, end - j)));
}

// The first `valid` elements at p, zeros after them (a zero changes no amax). One vector access when
// the pack is whole and `vector_ok` (the caller checked alignment), else element by element: the
// tails and misaligned tensors. A: the whole-pack access's cache policy (cuda_utils.cuh).
template <int N, Access A = Access::kDefault, class T>
__device__ void load_pack(const T* p, int valid, bool vector_ok, uint32_t (&w)[kWords<T, N>]) {
  if (vector_ok && valid == N) {
    load_words<A>(p, w);
    return;
  }
#pragma unroll
  for (int i = 0; i < kWords<T, N>; ++i) w[i] = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < valid) w[k * sizeof(T) / 4] |= bits_of(p[k]) << kShift<T>(k);
  }
}

template <int N, Access A = Access::kDefault, class T>
__device__ void store_pack(T* p, const uint32_t (&w)[kWords<T, N>], int valid, bool vector_ok) {
  if (vector_ok && valid == N) {
    store_words<A>(p, w);
    return;
  }
  constexpr uint32_t kMask = sizeof(T) == 4 ? 0xFFFFFFFFu : (1u << (8 * sizeof(T))) - 1u;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < valid) p[k] = from_bits<T>((w[k * sizeof(T) / 4] >> kShift<T>(k)) & kMask);
  }
}

// load_pack and store_pack for a matrix whose every pack the caller knows to be aligned and wholly
// inside or wholly outside it (kWhole: the launcher checked the pointers' alignment and that both
// dimensions are whole numbers of packs): then valid is 0 or N, and no element-wise code is
// compiled. Otherwise (the edges, misaligned tensors) load_pack and store_pack themselves. The
// tiled kernels (cast_transpose_cuda.cu, tiles_region_cuda.cu) read and write through these.
template <bool kWhole, int N, class T>
__device__ __forceinline__ void load_matrix_pack(const T* p, int valid, bool vector_ok, uint32_t (&w)[kWords<T, N>]) {
  if constexpr (kWhole) {
    if (valid == N) {
      load_words(p, w);
    } else {
#pragma unroll
      for (int i = 0; i < kWords<T, N>; ++i) w[i] = 0;
    }
  } else {
    load_pack<N>(p, valid, vector_ok, w);
  }
}

template <bool kWhole, int N, class T>
__device__ __forceinline__ void store_matrix_pack(T* p, const uint32_t (&w)[kWords<T, N>], int valid, bool vector_ok) {
  if constexpr (kWhole) {
    if (valid == N) store_words(p, w);
  } else {
    store_pack<N>(p, w, valid, vector_ok);
  }
}

// The two fp16 halves of a word as floats (exact).
__device__ __forceinline__ void fp16x2_to_float(uint32_t word, float& lo, float& hi) {
  asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(word));
}

// The four FP8 codes of a word as two fp16 pairs (exact), the low byte the low half of h01.
template <class T>
__device__ __forceinline__ void fp8x4_to_fp16x2(uint32_t word, uint32_t& h01, uint32_t& h23) {
  if constexpr (std::is_same_v<T, numerics::fp8_e4m3>) {
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(h01), "=r"(h23)
        : "r"(word));
  } else {
    static_assert(std::is_same_v<T, numerics::fp8_e5m2>, "FP8 codes: E4M3 or E5M2");
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e5m2x2 %0, l;\n cvt.rn.f16x2.e5m2x2 %1, h;\n}"
        : "=r"(h01), "=r"(h23)
        : "r"(word));
  }
}

// Per half, max(acc, |x|) over the fp16 pairs of a pack of FP8 codes, NaN if any is NaN (two
// 3-input VHMNMX.NAN with |.| operands for eight codes). The decoded magnitudes' maximum is the
// larger half, exactly.
template <class T, int N>
__device__ __forceinline__ uint32_t fold_code_magnitudes(const uint32_t (&w)[kWords<T, N>], uint32_t acc) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    uint32_t h01, h23;
    fp8x4_to_fp16x2<T>(w[i], h01, h23);
    asm("{.reg .b32 a, b;\n abs.f16x2 a, %1;\n abs.f16x2 b, %2;\n max.NaN.f16x2 %0, %0, a;\n max.NaN.f16x2 %0, %0, b;\n}"
        : "+r"(acc)
        : "r"(h01), "r"(h23));
  }
  return acc;
}

// numerics::to_float of each element, except that a NaN may keep its payload: callers multiply
// (the GPU's arithmetic returns the canonical NaN, numerics' kCanonicalNanBits), store a code (every
// NaN encodes alike) or take amax keys (canonical).
template <class T, int N>
__device__ void decode_pack(const uint32_t (&w)[kWords<T, N>], float (&x)[N]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = numerics::bits_float(w[k]);
  } else if constexpr (std::is_same_v<T, numerics::bf16>) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      x[2 * i] = numerics::bits_float(w[i] << 16);
      x[2 * i + 1] = numerics::bits_float(w[i] & 0xFFFF0000u);
    }
  } else if constexpr (kHardwareConvert && std::is_same_v<T, numerics::fp16>) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) fp16x2_to_float(w[i], x[2 * i], x[2 * i + 1]);
  } else if constexpr (kHardwareConvert) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      uint32_t h01, h23;
      fp8x4_to_fp16x2<T>(w[i], h01, h23);
      fp16x2_to_float(h01, x[4 * i], x[4 * i + 1]);
      fp16x2_to_float(h23, x[4 * i + 2], x[4 * i + 3]);
    }
  } else {
    constexpr uint32_t kMask = (1u << (8 * sizeof(T))) - 1u;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      x[k] = numerics::to_float(from_bits<T>((w[k * sizeof(T) / 4] >> kShift<T>(k)) & kMask));
    }
  }
}

// fma(0, v, v): v itself for every finite v (zeros keep their sign), NaN for an infinity. cvt.satfinite
// saturates infinities; numerics::encode makes them NaN, and this one FFMA an element gives its bits.
__device__ __forceinline__ float infinity_to_nan(float v) { return __fmaf_rn(0.0f, v, v); }

// The stored codes of x (already multiplied by its scale): float32 as is, the scaled formats (E4M3,
// E5M2, FP16) by numerics::quantize_to: round to nearest even, saturate finite values to +-max,
// infinities and NaN -> the format's NaN code, as cvt.rn.satfinite does two at a time (after
// infinity_to_nan).
template <class T, int N>
__device__ void encode_pack(const float (&x_in)[N], uint32_t (&w)[kWords<T, N>]) {
  constexpr bool kPatchInfinities = kHardwareConvert && !std::is_same_v<T, float>;
  float x[N];
#pragma unroll
  for (int k = 0; k < N; ++k) x[k] = kPatchInfinities ? infinity_to_nan(x_in[k]) : x_in[k];
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = numerics::float_bits(x[k]);
  } else if constexpr (kHardwareConvert && std::is_same_v<T, numerics::fp16>) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {  // x[2i] in the low half
      asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(x[2 * i + 1]), "f"(x[2 * i]));
    }
  } else if constexpr (kHardwareConvert && std::is_same_v<T, numerics::fp8_e4m3>) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {  // x[4i] in the low byte
      asm("{.reg .b16 l, h;\n cvt.rn.satfinite.e4m3x2.f32 l, %2, %1;\n cvt.rn.satfinite.e4m3x2.f32 h, %4, %3;\n"
          " mov.b32 %0, {l, h};\n}"
          : "=r"(w[i])
          : "f"(x[4 * i]), "f"(x[4 * i + 1]), "f"(x[4 * i + 2]), "f"(x[4 * i + 3]));
    }
  } else if constexpr (kHardwareConvert && std::is_same_v<T, numerics::fp8_e5m2>) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      asm("{.reg .b16 l, h;\n cvt.rn.satfinite.e5m2x2.f32 l, %2, %1;\n cvt.rn.satfinite.e5m2x2.f32 h, %4, %3;\n"
          " mov.b32 %0, {l, h};\n}"
          : "=r"(w[i])
          : "f"(x[4 * i]), "f"(x[4 * i + 1]), "f"(x[4 * i + 2]), "f"(x[4 * i + 3]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kWords<T, N>; ++i) w[i] = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) w[k * sizeof(T) / 4] |= numerics::quantize_to<T>(x[k]).bits << kShift<T>(k);
  }
}

// The codes of x times scale, each product rounded once (rn::mul), as the quantizing kernels
// store them.
template <class T, int N>
__device__ __forceinline__ void encode_scaled_pack(const float (&x)[N], float scale, uint32_t (&w)[kWords<T, N>]) {
  float q[N];
#pragma unroll
  for (int k = 0; k < N; ++k) q[k] = rn::mul(x[k], scale);
  encode_pack<T>(q, w);
}

// numerics::round_to of each value into a high-precision output (float32, bf16, fp16): IEEE round
// to nearest even, overflow to infinity, NaN -> canonical, as cvt.rn.{bf16x2,f16x2}.f32 does two at
// a time.
template <class T, int N>
__device__ void round_pack(const float (&x)[N], uint32_t (&w)[kWords<T, N>]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = numerics::float_bits(numerics::round_to<float>(x[k]));
  } else if constexpr (kHardwareConvert && std::is_same_v<T, numerics::bf16>) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(x[2 * i + 1]), "f"(x[2 * i]));
  } else if constexpr (kHardwareConvert) {
    static_assert(std::is_same_v<T, numerics::fp16>, "outputs: float32, bf16, fp16");
#pragma unroll
    for (int i = 0; i < N / 2; ++i) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(x[2 * i + 1]), "f"(x[2 * i]));
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      w[i] = numerics::round_to<T>(x[2 * i]).bits | uint32_t{numerics::round_to<T>(x[2 * i + 1]).bits} << 16;
    }
  }
}

// Amax without converting: |x| as the bits of x's own type (sign cleared) orders like |x|, with
// every NaN above infinity, so a running unsigned max of those bits finds the largest element
// (amax_key of its value is taken once, at the end). 16-bit types go two at a time through the
// packed max, a word's halves at once, FP8 codes four at a time (E4M3's NaN, 0x7F, and E5M2's
// infinities and NaNs also sit above every finite magnitude).
template <class T, int N>
__device__ __forceinline__ uint32_t abs_max_pack(const uint32_t (&w)[kWords<T, N>], uint32_t acc) {
  if constexpr (sizeof(T) == 1) {
#pragma unroll
    for (int i = 0; i < kWords<T, N>; ++i) acc = __vmaxu4(acc, w[i] & 0x7F7F7F7Fu);
  } else if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < kWords<T, N>; ++i) acc = __vmaxu2(acc, w[i] & 0x7FFF7FFFu);
  } else {
    static_assert(sizeof(T) == 4, "amax reads fp32, bf16, fp16 or FP8 codes");
#pragma unroll
    for (int i = 0; i < kWords<T, N>; ++i) acc = max(acc, w[i] & 0x7FFFFFFFu);
  }
  return acc;
}

}  // namespace cuda
}  // namespace fp8amp
