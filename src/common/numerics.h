// Scalar numerics shared bit for bit by the CPU reference and the CUDA kernels (docs/numerics.md#numerics):
// the FP8/FP16 codecs, bf16 conversion, amax ordering and the scale rules.
// Everything here is plain integer and IEEE fp32 arithmetic, so host and device agree exactly;
// the rn:: helpers at the end are how kernels' element math spells an IEEE operation.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fp8amp/dtype.h"

#if defined(__CUDACC__)
#define FP8AMP_HD __host__ __device__ __forceinline__
#else
#define FP8AMP_HD inline
#endif

namespace fp8amp {
namespace numerics {

FP8AMP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FP8AMP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FP8AMP_HD bool is_nan(float f) { return (float_bits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
FP8AMP_HD bool is_finite(float f) { return (float_bits(f) & 0x7FFFFFFFu) < 0x7F800000u; }

constexpr uint32_t kCanonicalNanBits = 0x7FFFFFFFu;

// Small binary floating-point storage formats, as types so device code can read the constants.
// Widths, infinities and max come from the dtype table (fp8amp/dtype.h); the codes are tied to
// them by the static_asserts below. E4M3 (fn) has no infinities: its all-ones exponent still
// holds normals except the NaN 0x7F. nan_code is what a NaN encodes to (sign discarded, as CUDA's
// converters do).
template <DType kDType>
struct TableFormat {
  static constexpr DType dtype = kDType;
  static constexpr int exp_bits = dtype_info(kDType).exponent_bits;
  static constexpr int man_bits = dtype_info(kDType).mantissa_bits;
  static constexpr int bias = (1 << (exp_bits - 1)) - 1;
  static constexpr bool has_inf = dtype_info(kDType).has_inf;
  static constexpr float max = dtype_info(kDType).max_finite;
};
struct E4M3 : TableFormat<DType::kFloat8E4M3> {
  static constexpr uint32_t max_code = 0x7Eu, nan_code = 0x7Fu;
};
struct E5M2 : TableFormat<DType::kFloat8E5M2> {
  static constexpr uint32_t max_code = 0x7Bu, nan_code = 0x7Fu;
};
struct FP16 : TableFormat<DType::kFloat16> {
  static constexpr uint32_t max_code = 0x7BFFu, nan_code = 0x7FFFu;
};

namespace detail {
// max_code is the largest finite code and has the table's max_finite as its value; nan_code is
// the all-ones code.
template <class F>
constexpr bool codes_match_table() {
  const uint32_t man_mask = (1u << F::man_bits) - 1u;
  const uint32_t exp_all_ones = ((1u << F::exp_bits) - 1u) << F::man_bits;
  const uint32_t largest = F::has_inf ? exp_all_ones - 1u : exp_all_ones | (man_mask - 1u);
  const float value = ::fp8amp::detail::times_pow2(
      1.0f + static_cast<float>(F::max_code & man_mask) / static_cast<float>(man_mask + 1u),
      static_cast<int>(F::max_code >> F::man_bits) - F::bias);
  return F::max_code == largest && value == F::max && F::nan_code == (exp_all_ones | man_mask);
}
static_assert(codes_match_table<E4M3>() && codes_match_table<E5M2>() && codes_match_table<FP16>(),
              "a format's max_code or nan_code disagrees with the dtype table");
}  // namespace detail

// float -> format, round to nearest even. saturate=true: finite magnitudes above max become
// +-max, as __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...), but an infinity becomes nan_code: a
// saturated code would pass an overflow on as a finite value (docs/numerics.md#non-finite-values).
// saturate=false: IEEE overflow to infinity (only for formats that have one). NaN -> nan_code.
template <class F>
FP8AMP_HD uint32_t encode(float f, bool saturate) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 31) << (F::exp_bits + F::man_bits);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return F::nan_code;
  const uint32_t inf_code = ((1u << F::exp_bits) - 1u) << F::man_bits;
  if (ax == 0x7F800000u) return saturate ? F::nan_code : sign | (F::has_inf ? inf_code : F::max_code);

  // The value is mant * 2^(exp - 150). Count it in units of the target's ulp at its magnitude,
  // 2^(max(e, emin) - man_bits), and round that count to nearest even.
  const int exp_field = static_cast<int>(ax >> 23);
  const uint32_t mant = (ax & 0x7FFFFFu) | (exp_field ? 0x800000u : 0u);
  const int e = (exp_field ? exp_field : 1) - 127;
  const int emin = 1 - F::bias;
  const int e_eff = e > emin ? e : emin;
  int shift = e_eff - F::man_bits - (e - 23);  // >= 23 - man_bits > 0
  if (shift > 31) shift = 31;                  // mant < 2^24: rounds to zero either way
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // For subnormal targets e_eff + bias - 1 == 0 and the code is q; a carry into the next
  // binade lands in the exponent field by itself.
  const int64_t code = (static_cast<int64_t>(e_eff + F::bias - 1) << F::man_bits) + q;
  if (code > static_cast<int64_t>(F::max_code)) {
    return sign | (saturate || !F::has_inf ? F::max_code : inf_code);
  }
  return sign | static_cast<uint32_t>(code);
}

// format -> float, exact. NaN -> canonical fp32 NaN.
template <class F>
FP8AMP_HD float decode(uint32_t code) {
  const uint32_t mag_bits = F::exp_bits + F::man_bits;
  const uint32_t sign = ((code >> mag_bits) & 1u) << 31;
  const uint32_t mag = code & ((1u << mag_bits) - 1u);
  const uint32_t exp_field = mag >> F::man_bits;
  const uint32_t man = mag & ((1u << F::man_bits) - 1u);
  const uint32_t exp_max = (1u << F::exp_bits) - 1u;
  if (F::has_inf) {
    if (exp_field == exp_max) return bits_float(man ? kCanonicalNanBits : (sign | 0x7F800000u));
  } else if (mag == F::nan_code) {
    return bits_float(kCanonicalNanBits);
  }
  if (exp_field == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: man * 2^(1 - bias - man_bits), exact in fp32
    const float v = static_cast<float>(man) * bits_float(static_cast<uint32_t>(127 + 1 - F::bias - F::man_bits) << 23);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | ((exp_field - F::bias + 127u) << 23) | (man << (23 - F::man_bits));
  return bits_float(bits);
}

// bf16 <-> float. float -> bf16 rounds to nearest even, overflows to infinity (IEEE, like
// torch's .to(torch.bfloat16)), NaN -> canonical 0x7FFF.
FP8AMP_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
FP8AMP_HD uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
FP8AMP_HD float fp16_to_float(uint16_t h) { return decode<FP16>(h); }
FP8AMP_HD uint16_t float_to_fp16(float f) { return static_cast<uint16_t>(encode<FP16>(f, false)); }

// Key for max-of-magnitudes: for |x| the IEEE bit pattern orders like the value, and NaN maps
// to the largest key, so a max over keys propagates NaN and does not depend on order.
FP8AMP_HD uint32_t amax_key(float f) { return is_nan(f) ? kCanonicalNanBits : (float_bits(f) & 0x7FFFFFFFu); }
FP8AMP_HD float amax_from_key(uint32_t key) { return bits_float(key); }

// floor(log2(q)) of a positive finite-or-infinite q, by its bits (subnormals included).
FP8AMP_HD int floor_log2(float q) {
  const uint32_t b = float_bits(q);
  const int exp_field = static_cast<int>(b >> 23);
  if (exp_field != 0) return exp_field - 127;  // normals; infinity gives 128
  uint32_t m = b & 0x7FFFFFu;
  int e = -127;
  while (m < 0x800000u) { m <<= 1; --e; }
  return e + 1;
}

FP8AMP_HD float pow2(int e) { return bits_float(static_cast<uint32_t>(e + 127) << 23); }  // e in [-126, 127]

// Scale exponents are kept within [-126, 126] so that scale and scale_inv are both normal floats.
constexpr int kMaxScaleExponent = 126;

struct ScalePair {
  float scale;
  float scale_inv;
};

// New scale from amax (docs/numerics.md#numerics). pow2 (default, MS-AMP compatible):
// scale = 2^(floor(log2(fmax / amax)) - margin), clamped to 2^+-126, so scale_inv is exact.
// Otherwise TE's rule: scale = fmax / amax / 2^margin (FLT_MAX if that overflows),
// scale_inv = 1 / scale. amax = 0 or non-finite: the previous pair is kept.
FP8AMP_HD ScalePair scale_from_amax(float amax, float fmax, int margin, bool pow2_scale,
                                    ScalePair previous) {
  if (!(amax > 0.0f) || !is_finite(amax)) return previous;
  const float q = fmax / amax;
  if (pow2_scale) {
    int e = floor_log2(q) - margin;
    e = e > kMaxScaleExponent ? kMaxScaleExponent : (e < -kMaxScaleExponent ? -kMaxScaleExponent : e);
    return {pow2(e), pow2(-e)};
  }
  const int m = margin > 126 ? 126 : (margin < -126 ? -126 : margin);
  float scale = q * pow2(-m);
  // Keep the scale a finite normal float, so that scale_inv is finite too.
  if (!is_finite(scale)) scale = bits_float(0x7F7FFFFFu);
  if (!(scale >= bits_float(0x00800000u))) scale = bits_float(0x00800000u);
  return {scale, 1.0f / scale};
}

// Storage types. Each knows how to become a float exactly; the scaled formats are written by
// quantize_to (saturating, docs/numerics.md#numerics), the high-precision ones by round_to (IEEE).
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };
struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };

template <class T>
constexpr bool kIsFp8 = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;

FP8AMP_HD float to_float(float x) { return x; }
FP8AMP_HD float to_float(bf16 x) { return bf16_to_float(x.bits); }
FP8AMP_HD float to_float(fp16 x) { return fp16_to_float(x.bits); }
FP8AMP_HD float to_float(fp8_e4m3 x) { return decode<E4M3>(x.bits); }
FP8AMP_HD float to_float(fp8_e5m2 x) { return decode<E5M2>(x.bits); }

template <class T> struct FormatOf;
template <> struct FormatOf<fp8_e4m3> { using type = E4M3; };
template <> struct FormatOf<fp8_e5m2> { using type = E5M2; };
template <> struct FormatOf<fp16> { using type = FP16; };

// Largest finite magnitude of a scaled storage type.
template <class T>
FP8AMP_HD constexpr float format_max() { return FormatOf<T>::type::max; }

template <class T>
FP8AMP_HD T quantize_to(float f) {
  using F = typename FormatOf<T>::type;
  using Bits = decltype(T::bits);
  return T{static_cast<Bits>(encode<F>(f, true))};
}

template <class T> FP8AMP_HD T round_to(float f);
template <> FP8AMP_HD float round_to<float>(float f) { return f; }
template <> FP8AMP_HD bf16 round_to<bf16>(float f) { return bf16{float_to_bf16(f)}; }
template <> FP8AMP_HD fp16 round_to<fp16>(float f) { return fp16{float_to_fp16(f)}; }

// Stochastic rounding to FP16 (docs/numerics.md#stochastic-rounding). An update smaller than half
// an FP16 unit of a stored value is lost to round-to-nearest at every step; rounded up in
// magnitude with probability (distance to the truncation) / (spacing), it moves the value by its
// exact size on average.
//
// random_bits: a 32-bit hash of the counter; a bijection (murmur3's finalizer), so distinct
// counters of one stream give distinct values.
FP8AMP_HD uint32_t random_bits(uint32_t counter) {
  uint32_t h = counter;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The FP16 code of a scaled value x with 13 random bits r (their low 13 are used): FP16 keeps 10
// of float32's 23 fraction bits, and adding r below them carries into the kept ones with
// probability (dropped bits) / 2^13, exactly the distance over the spacing. Below FP16's normal
// range (2^-14), and for NaN, it is `nearest`, x's code rounded to nearest (quantize_to; the CUDA
// kernels pass the hardware conversion's); beyond 65504 it saturates as quantize_to does.
FP8AMP_HD uint16_t fp16_stochastic_code(float x, uint32_t r, uint16_t nearest) {
  const uint32_t bits = float_bits(x);
  const uint32_t sign = bits & 0x80000000u;
  uint32_t magnitude = bits ^ sign;
  if (magnitude < 0x38800000u || magnitude > 0x7F800000u) return nearest;
  magnitude = (magnitude < 0x477FE000u ? magnitude : 0x477FE000u) + (r & 0x1FFFu);  // 0x477FE000: 65504
  // float32 exponent 127 + e to FP16's 15 + e: the shifted code less 112 << 10
  return static_cast<uint16_t>((sign >> 16) | ((magnitude >> 13) - 0x1C000u));
}

FP8AMP_HD fp16 quantize_fp16_stochastic(float x, uint32_t r) {
  return fp16{fp16_stochastic_code(x, r, quantize_to<fp16>(x).bits)};
}

}  // namespace numerics

// ------------------------------------------------------------------------------------------------
// Correctly rounded float32 / float64 operations, for element math that host and device must
// compute bit for bit alike: one IEEE rounding per operation, never contracted into an fma. On the
// device CUDA's _rn intrinsics (which nvcc never contracts); on the host plain operations, as the
// core builds with -ffp-contract=off (CMakeLists.txt), since GCC would otherwise fuse a product
// into a later add on targets with FMA (aarch64, x86 with -mfma). An fma is written as rn::fma.
namespace rn {

#if defined(__CUDA_ARCH__)
FP8AMP_HD float add(float a, float b) { return __fadd_rn(a, b); }
FP8AMP_HD float sub(float a, float b) { return __fsub_rn(a, b); }
FP8AMP_HD float mul(float a, float b) { return __fmul_rn(a, b); }
FP8AMP_HD float div(float a, float b) { return __fdiv_rn(a, b); }
FP8AMP_HD float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
FP8AMP_HD float sqrt(float a) { return __fsqrt_rn(a); }
FP8AMP_HD double add(double a, double b) { return __dadd_rn(a, b); }
FP8AMP_HD double sub(double a, double b) { return __dsub_rn(a, b); }
FP8AMP_HD double mul(double a, double b) { return __dmul_rn(a, b); }
FP8AMP_HD double div(double a, double b) { return __ddiv_rn(a, b); }
FP8AMP_HD double sqrt(double a) { return __dsqrt_rn(a); }
FP8AMP_HD float to_float(double a) { return __double2float_rn(a); }
#else
FP8AMP_HD float add(float a, float b) { return a + b; }
FP8AMP_HD float sub(float a, float b) { return a - b; }
FP8AMP_HD float mul(float a, float b) { return a * b; }
FP8AMP_HD float div(float a, float b) { return a / b; }
FP8AMP_HD float fma(float a, float b, float c) { return std::fma(a, b, c); }
FP8AMP_HD float sqrt(float a) { return std::sqrt(a); }
FP8AMP_HD double add(double a, double b) { return a + b; }
FP8AMP_HD double sub(double a, double b) { return a - b; }
FP8AMP_HD double mul(double a, double b) { return a * b; }
FP8AMP_HD double div(double a, double b) { return a / b; }
FP8AMP_HD double sqrt(double a) { return std::sqrt(a); }
FP8AMP_HD float to_float(double a) { return static_cast<float>(a); }
#endif

}  // namespace rn
}  // namespace fp8amp
