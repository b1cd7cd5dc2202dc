// The scalar numerics (src/common/numerics.h) against hand-derived cases and, where the CUDA
// headers are present, bit for bit against NVIDIA's own host converters in cuda_fp8.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/numerics.h"

#ifdef FP8AMP_HAVE_CUDA_FP8_HEADER
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace fp8amp::numerics {
namespace {

uint32_t e4m3(float f) { return encode<E4M3>(f, true); }
uint32_t e5m2(float f) { return encode<E5M2>(f, true); }

TEST(Codec, E4M3HandDerived) {
  EXPECT_EQ(e4m3(0.0f), 0x00u);
  EXPECT_EQ(e4m3(-0.0f), 0x80u);
  EXPECT_EQ(e4m3(1.0f), 0x38u);
  EXPECT_EQ(e4m3(448.0f), 0x7Eu);
  EXPECT_EQ(e4m3(-448.0f), 0xFEu);
  // Saturation: finite magnitudes beyond max become +-max; infinities become NaN, never a finite code.
  EXPECT_EQ(e4m3(464.0f), 0x7Eu);  // exact tie between 448 and 480 (not representable): even -> 448
  EXPECT_EQ(e4m3(500.0f), 0x7Eu);
  EXPECT_EQ(e4m3(1e30f), 0x7Eu);
  EXPECT_EQ(e4m3(std::numeric_limits<float>::max()), 0x7Eu);
  EXPECT_EQ(e4m3(std::numeric_limits<float>::infinity()), 0x7Fu);
  EXPECT_EQ(e4m3(-std::numeric_limits<float>::infinity()), 0x7Fu);
  EXPECT_EQ(e4m3(std::nanf("")), 0x7Fu);
  EXPECT_EQ(e4m3(-std::nanf("")), 0x7Fu);
  // Round to nearest even: 1.0625 is halfway between 1.0 (even) and 1.125.
  EXPECT_EQ(e4m3(1.0625f), 0x38u);
  EXPECT_EQ(e4m3(1.1875f), 0x3Au);  // halfway between 1.125 (odd) and 1.25 -> 1.25
  EXPECT_EQ(e4m3(std::nextafter(1.0625f, 2.0f)), 0x39u);
  // Subnormals: min subnormal 2^-9; half of it ties to zero, 1.5x rounds up.
  EXPECT_EQ(e4m3(std::ldexp(1.0f, -9)), 0x01u);
  EXPECT_EQ(e4m3(std::ldexp(1.0f, -10)), 0x00u);
  EXPECT_EQ(e4m3(std::ldexp(1.5f, -10)), 0x01u);
  EXPECT_EQ(e4m3(std::ldexp(3.0f, -10)), 0x02u);  // 1.5 ulp: tie, odd 1 -> even 2
  EXPECT_EQ(e4m3(std::ldexp(1.0f, -6)), 0x08u);   // min normal
  EXPECT_EQ(e4m3(std::ldexp(15.5f, -10)), 0x08u); // 7.75 ulp rounds up into the normal range
}

TEST(Codec, E5M2HandDerived) {
  EXPECT_EQ(e5m2(1.0f), 0x3Cu);
  EXPECT_EQ(e5m2(57344.0f), 0x7Bu);
  EXPECT_EQ(e5m2(61440.0f), 0x7Bu);  // tie with the would-be 65536: saturates
  EXPECT_EQ(e5m2(-std::numeric_limits<float>::max()), 0xFBu);
  EXPECT_EQ(e5m2(std::numeric_limits<float>::infinity()), 0x7Fu);
  EXPECT_EQ(e5m2(-std::numeric_limits<float>::infinity()), 0x7Fu);
  EXPECT_EQ(e5m2(std::nanf("")), 0x7Fu);
  EXPECT_EQ(e5m2(std::ldexp(1.0f, -16)), 0x01u);
  EXPECT_EQ(e5m2(std::ldexp(1.0f, -17)), 0x00u);
  // IEEE mode (no saturation) overflows to infinity.
  EXPECT_EQ(encode<E5M2>(61440.0f, false), 0x7Cu);
  EXPECT_EQ(encode<FP16>(65520.0f, false), 0x7C00u);
  EXPECT_EQ(encode<FP16>(65520.0f, true), 0x7BFFu);
  EXPECT_EQ(encode<FP16>(-std::numeric_limits<float>::infinity(), true), 0x7FFFu);
  EXPECT_EQ(encode<FP16>(-std::numeric_limits<float>::infinity(), false), 0xFC00u);
}

TEST(Codec, EveryCodeDecodesAndReencodes) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float f4 = decode<E4M3>(c);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(f4)) << c;
    } else {
      EXPECT_EQ(e4m3(f4), c) << c;
    }
    const float f5 = decode<E5M2>(c);
    if ((c & 0x7F) > 0x7C) {
      EXPECT_TRUE(std::isnan(f5)) << c;
    } else if ((c & 0x7F) == 0x7C) {
      EXPECT_TRUE(std::isinf(f5)) << c;
      EXPECT_EQ(encode<E5M2>(f5, false), c) << c;
    } else {
      EXPECT_EQ(e5m2(f5), c) << c;
    }
  }
  EXPECT_EQ(decode<E4M3>(0x7E), 448.0f);
  EXPECT_EQ(decode<E4M3>(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(decode<E5M2>(0x7B), 57344.0f);
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = fp16_to_float(static_cast<uint16_t>(c));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_fp16(f), c) << c;
  }
}

TEST(ScaleRule, HandDerived) {
  const ScalePair prev{4.0f, 0.25f};
  // fmax 448: amax 10 -> 2^floor(log2 44.8) = 32; amax 1e4 -> 2^floor(log2 0.0448) = 1/32.
  EXPECT_EQ(scale_from_amax(10.0f, 448.0f, 0, true, prev).scale, 32.0f);
  EXPECT_EQ(scale_from_amax(10.0f, 448.0f, 0, true, prev).scale_inv, 1.0f / 32.0f);
  EXPECT_EQ(scale_from_amax(1e4f, 448.0f, 0, true, prev).scale, 1.0f / 32.0f);
  EXPECT_EQ(scale_from_amax(1e4f, 448.0f, 0, true, prev).scale_inv, 32.0f);
  EXPECT_EQ(scale_from_amax(10.0f, 448.0f, 2, true, prev).scale, 8.0f);  // margin 2
  EXPECT_EQ(scale_from_amax(448.0f, 448.0f, 0, true, prev).scale, 1.0f);
  EXPECT_EQ(scale_from_amax(1.0f, 65504.0f, 0, true, prev).scale, 32768.0f);  // FP16 master rule
  // amax 0, Inf, NaN keep the previous scale.
  for (float bad : {0.0f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    const ScalePair p = scale_from_amax(bad, 448.0f, 0, true, prev);
    EXPECT_EQ(p.scale, 4.0f);
    EXPECT_EQ(p.scale_inv, 0.25f);
  }
  // Extreme amax clamp to 2^+-126 so both scale and scale_inv stay normal floats.
  EXPECT_EQ(scale_from_amax(1e-45f, 448.0f, 0, true, prev).scale, std::ldexp(1.0f, 126));
  EXPECT_EQ(scale_from_amax(1.0f, 448.0f, -200, true, prev).scale, std::ldexp(1.0f, 126));
  EXPECT_EQ(scale_from_amax(1.0f, 448.0f, 200, true, prev).scale, std::ldexp(1.0f, -126));
  // TE's exact rule.
  EXPECT_EQ(scale_from_amax(10.0f, 448.0f, 0, false, prev).scale, 44.8f);
  EXPECT_EQ(scale_from_amax(10.0f, 448.0f, 1, false, prev).scale, 22.4f);
  EXPECT_EQ(scale_from_amax(1e-45f, 448.0f, 0, false, prev).scale, std::numeric_limits<float>::max());
}

TEST(ScaleRule, Pow2ScaleNeverSaturatesAmax) {
  // The chosen scale is the largest power of two with fl(fmax / amax) >= scale.
  for (float amax = 1e-6f; amax < 1e6f; amax *= 1.013f) {
    const float s = scale_from_amax(amax, 448.0f, 0, true, {1.0f, 1.0f}).scale;
    EXPECT_LE(s, 448.0f / amax);
    EXPECT_GT(2.0f * s, 448.0f / amax);
  }
}

TEST(Amax, KeyOrdersLikeMagnitudeAndNaNWins) {
  EXPECT_LT(amax_key(1.0f), amax_key(-2.0f));
  EXPECT_LT(amax_key(std::numeric_limits<float>::infinity()), amax_key(std::nanf("")));
  EXPECT_EQ(amax_key(-0.0f), amax_key(0.0f));
  EXPECT_TRUE(std::isnan(amax_from_key(amax_key(-std::nanf("")))));
}

#ifdef FP8AMP_HAVE_CUDA_FP8_HEADER
// Floats that exercise every rounding case: a strided sweep of all bit patterns, plus every
// sign, exponent and top-10 mantissa bits combined with low bits around each format's ties.
std::vector<uint32_t> probe_floats() {
  std::vector<uint32_t> bits;
  for (uint64_t b = 0; b < (1ull << 32); b += 997) bits.push_back(static_cast<uint32_t>(b));
  const uint32_t lows[] = {0x0, 0x1, 0xFFF, 0x1000, 0x1001, 0x1FFF};
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t exp = 0; exp < 256; ++exp)
      for (uint32_t top = 0; top < 1024; ++top)
        for (uint32_t low : lows) bits.push_back((sign << 31) | (exp << 23) | (top << 13) | low);
  return bits;
}

TEST(Codec, MatchesNvidiaHostConvertersBitForBit) {
  size_t mismatches = 0;
  for (uint32_t b : probe_floats()) {
    const float f = bits_float(b);
    // The kernels turn an infinity into NaN before the SATFINITE conversion (word_pack.cuh).
    const float f_sat = std::isinf(f) ? std::nanf("") : f;
    const uint32_t ref4 = __nv_cvt_float_to_fp8(f_sat, __NV_SATFINITE, __NV_E4M3);
    const uint32_t ref5 = __nv_cvt_float_to_fp8(f_sat, __NV_SATFINITE, __NV_E5M2);
    if (e4m3(f) != ref4 || e5m2(f) != ref5) {
      if (++mismatches < 10) ADD_FAILURE() << std::hex << "bits 0x" << b << ": e4m3 " << e4m3(f) << " vs " << ref4
                                           << ", e5m2 " << e5m2(f) << " vs " << ref5;
    }
    const uint16_t h = __half_raw(__float2half_rn(f)).x;
    const bool h_nan = std::isnan(f);
    if ((h_nan ? (float_to_fp16(f) & 0x7FFF) > 0x7C00 : float_to_fp16(f) == h) == false) {
      if (++mismatches < 10) ADD_FAILURE() << std::hex << "fp16 bits 0x" << b;
    }
    const uint16_t bf = __nv_bfloat16_raw(__float2bfloat16_rn(f)).x;
    if ((h_nan ? (float_to_bf16(f) & 0x7FFF) > 0x7F80 : float_to_bf16(f) == bf) == false) {
      if (++mismatches < 10) ADD_FAILURE() << std::hex << "bf16 bits 0x" << b;
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(Codec, DecodeMatchesNvidia) {
  for (uint32_t c = 0; c < 256; ++c) {
    for (auto interp : {__NV_E4M3, __NV_E5M2}) {
      const __half h = __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), interp));
      const float ref = __half2float(h);
      const float ours = interp == __NV_E4M3 ? decode<E4M3>(c) : decode<E5M2>(c);
      if (std::isnan(ref)) {
        EXPECT_TRUE(std::isnan(ours)) << c;
      } else {
        EXPECT_EQ(float_bits(ours), float_bits(ref)) << c;
      }
    }
  }
}
#endif

// Stochastic rounding to FP16 (numerics.h): over all 2^13 random values a normal-range x rounds
// up exactly (dropped bits) times, so its mean code is x itself; below the normal range, and for
// NaN, the nearest code; beyond 65504 it saturates.
TEST(StochasticRounding, MeanOverEveryRandomValueIsExact) {
  for (const float x : {1.0f, 1.0001f, -3.14159f, 6.2e-5f, 65503.9f, 65504.0f, -0.333333f, 1.5e-3f, 2049.7f}) {
    const uint16_t down = fp16_stochastic_code(x, 0, 0);
    double sum = 0.0;
    for (uint32_t r = 0; r < 8192; ++r) {
      const uint16_t code = fp16_stochastic_code(x, r, 0);
      ASSERT_TRUE(code == down || code == down + 1) << x << " " << r;
      sum += static_cast<double>(fp16_to_float(code));
    }
    EXPECT_EQ(sum / 8192.0, static_cast<double>(x)) << x;
    EXPECT_LE(std::fabs(fp16_to_float(down)), std::fabs(x)) << x;  // the truncation
  }
  EXPECT_EQ(fp16_stochastic_code(1.0f, 0x1FFF, 0), 0x3C00);  // exact values never move
  EXPECT_EQ(fp16_stochastic_code(0x1p-15f, 0x1FFF, 0x1234), 0x1234);  // below 2^-14: `nearest`
  EXPECT_EQ(fp16_stochastic_code(std::nanf(""), 0, 0x7FFF), 0x7FFF);
  EXPECT_EQ(fp16_stochastic_code(1e6f, 0x1FFF, 0), 0x7BFF);  // saturates at 65504
  EXPECT_EQ(fp16_stochastic_code(-1e6f, 0, 0), 0xFBFF);
  EXPECT_EQ(quantize_fp16_stochastic(0x1p-15f, 0x1FFF).bits, quantize_to<fp16>(0x1p-15f).bits);
}

TEST(StochasticRounding, RandomBitsAreUniformAndDistinct) {
  // random_bits is a bijection: consecutive counters give distinct values, and their low 13 bits
  // (the ones rounding takes) average (2^13 - 1) / 2.
  double sum = 0.0;
  uint32_t previous = random_bits(0);
  constexpr uint32_t kCount = 1u << 20;
  for (uint32_t c = 1; c <= kCount; ++c) {
    const uint32_t h = random_bits(c);
    ASSERT_NE(h, previous);
    previous = h;
    sum += static_cast<double>(h & 0x1FFFu) + static_cast<double>((h >> 16) & 0x1FFFu);
  }
  EXPECT_NEAR(sum / (2.0 * kCount), 4095.5, 4095.5 * 0.002);
}

}  // namespace
}  // namespace fp8amp::numerics
