// scaled_accumulate (accumulate.h) through the public core API on CPU: hand-derived sums, scales and
// codes, the non-finite and zero rules, and clear errors for bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "expect_error.h"
#include "host_view.h"
#include "fp8amp/accumulate.h"
#include "fp8amp/error.h"

namespace fp8amp {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// dst and its buffers; amax starts at a value the op must overwrite.
struct Acc {
  std::vector<float> scale_inv{1.0f}, amax{-123.0f};
  std::vector<float> src_scale_inv{1.0f};

  template <class D, class S>
  void run(std::vector<D>& dst, DType dst_dtype, std::vector<S>& src, DType src_dtype, bool scaled_src, float alpha,
           ScalingRecipe recipe = {}) {
    TensorView ssi = view(src_scale_inv, DType::kFloat32);
    scaled_accumulate(view(dst, dst_dtype), view(scale_inv, DType::kFloat32), view(src, src_dtype),
                      scaled_src ? &ssi : nullptr, alpha, view(amax, DType::kFloat32), recipe, nullptr);
  }
};

TEST(ScaledAccumulate, E4M3PlusFloat32HandDerived) {
  // dst reals with scale_inv 1/8: codes 8 -> 1, -8 -> -1, 0 -> 0, 448 -> 56.
  std::vector<uint8_t> dst{0x50, 0xD0, 0x00, 0x7E};
  std::vector<float> src{3.0f, 0.5f, -0.0f, 1.0f};
  Acc a;
  a.scale_inv[0] = 0.125f;
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 1.0f);
  // sums 4, -0.5, +0 (0 + -0), 57; amax 57: 448 / 57 = 7.86 -> scale 4.
  EXPECT_EQ(a.amax[0], 57.0f);
  EXPECT_EQ(a.scale_inv[0], 0.25f);
  // codes of 16, -2, 0, 228 (-> 224, the nearer of 224 and 240).
  EXPECT_EQ(dst, (std::vector<uint8_t>{0x58, 0xC0, 0x00, 0x76}));
}

TEST(ScaledAccumulate, RoundingTiesToEvenWithAlpha) {
  // scale_inv 1; alpha 0.5: sums 16 + 1 = 17, 16 + 3 = 19, 320 + 0 = 320. amax 320 -> scale 1.
  std::vector<uint8_t> dst{0x58, 0x58, 0x7A};
  std::vector<float> src{2.0f, 6.0f, 0.0f};
  Acc a;
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 0.5f);
  EXPECT_EQ(a.amax[0], 320.0f);
  EXPECT_EQ(a.scale_inv[0], 1.0f);
  // 17 is halfway between 16 (0x58) and 18 (0x59): even 0x58; 19 between 18 and 20 (0x5A): 0x5A.
  EXPECT_EQ(dst, (std::vector<uint8_t>{0x58, 0x5A, 0x7A}));
}

TEST(ScaledAccumulate, Fp16PlusScaledE5M2WithMargin) {
  // dst FP16 1.0 with scale_inv 2 -> 2; src E5M2 2.0 (0x40) with scale_inv 4 -> 8; alpha -1.
  std::vector<uint16_t> dst{0x3C00};
  std::vector<uint8_t> src{0x40};
  Acc a;
  a.scale_inv[0] = 2.0f;
  a.src_scale_inv[0] = 4.0f;
  a.run(dst, DType::kFloat16, src, DType::kFloat8E5M2, true, -1.0f, ScalingRecipe{1, true});
  // sum -6; 65504 / 6 = 10917.3 -> 2^13, margin 1 -> scale 2^12; -6 * 4096 = -24576 = FP16 0xF600.
  EXPECT_EQ(a.amax[0], 6.0f);
  EXPECT_EQ(a.scale_inv[0], std::ldexp(1.0f, -12));
  EXPECT_EQ(dst[0], 0xF600);
}

TEST(ScaledAccumulate, BFloat16SrcAndTeRule) {
  // E5M2 dst 3.0 (0x42) with scale_inv 0.5 -> 1.5; bf16 src 1.5 (0x3FC0): sum 3.
  std::vector<uint8_t> dst{0x42, 0x00};
  std::vector<uint16_t> src{0x3FC0, 0x0000};
  Acc a;
  a.scale_inv[0] = 0.5f;
  a.run(dst, DType::kFloat8E5M2, src, DType::kBFloat16, false, 1.0f, ScalingRecipe{0, false});
  // TE: scale = fl(57344 / 3), scale_inv = fl(1 / scale); 3 * scale rounds to 57344 or just above:
  // either way the code saturates to the max, 0x7B.
  const float scale = 57344.0f / 3.0f;
  EXPECT_EQ(a.amax[0], 3.0f);
  EXPECT_EQ(bits(a.scale_inv[0]), bits(1.0f / scale));
  EXPECT_EQ(dst, (std::vector<uint8_t>{0x7B, 0x00}));
}

TEST(ScaledAccumulate, SrcMayBeDst) {
  std::vector<uint8_t> dst{0x50, 0x48};  // 8, 4 with scale_inv 1/8 -> 1, 0.5
  Acc a;
  a.scale_inv[0] = 0.125f;
  a.src_scale_inv = a.scale_inv;
  TensorView d = view(dst, DType::kFloat8E4M3);
  TensorView si = view(a.scale_inv, DType::kFloat32);
  TensorView ssi = view(a.src_scale_inv, DType::kFloat32);
  scaled_accumulate(d, si, d, &ssi, 1.0f, view(a.amax, DType::kFloat32), {}, nullptr);
  // sums 2, 1; amax 2 -> 448 / 2 = 224 -> scale 128: codes 256 (0x78), 128 (0x70).
  EXPECT_EQ(a.amax[0], 2.0f);
  EXPECT_EQ(a.scale_inv[0], 1.0f / 128.0f);
  EXPECT_EQ(dst, (std::vector<uint8_t>{0x78, 0x70}));
}

TEST(ScaledAccumulate, InfInSrcMakesEverythingNaN) {
  for (DType dst_dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    std::vector<uint8_t> dst{0x50, 0x38, 0x00};
    std::vector<float> src{1.0f, std::numeric_limits<float>::infinity(), 0.0f};
    Acc a;
    a.run(dst, dst_dtype, src, DType::kFloat32, false, 1.0f);
    EXPECT_EQ(a.amax[0], std::numeric_limits<float>::infinity());
    EXPECT_TRUE(std::isnan(a.scale_inv[0]));
    EXPECT_EQ(dst, (std::vector<uint8_t>{0x7F, 0x7F, 0x7F})) << dtype_name(dst_dtype);
  }
}

TEST(ScaledAccumulate, NaNInSrcAndOverflowingSumGiveNaNScaleInv) {
  std::vector<uint16_t> dst{0x3C00, 0x3C00};
  std::vector<float> src{std::nanf(""), 2.0f};
  Acc a;
  a.run(dst, DType::kFloat16, src, DType::kFloat32, false, 1.0f);
  EXPECT_TRUE(std::isnan(a.amax[0]));
  EXPECT_TRUE(std::isnan(a.scale_inv[0]));
  EXPECT_EQ(dst, (std::vector<uint16_t>{0x7FFF, 0x7FFF}));

  // Finite terms whose float32 sum overflows: inf, NaN scale_inv.
  std::vector<uint8_t> big{0x7E};  // 448
  std::vector<float> huge{3.0e38f};
  Acc b;
  b.scale_inv[0] = 1.0e36f;  // 448e36 overflows float32 by itself: inf
  b.run(big, DType::kFloat8E4M3, huge, DType::kFloat32, false, 1.0f);
  EXPECT_EQ(b.amax[0], std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(b.scale_inv[0]));
  EXPECT_EQ(big[0], 0x7F);

  // alpha 0 does not hide an infinite src: 0 * inf is NaN.
  std::vector<uint8_t> one{0x38};
  std::vector<float> inf{-std::numeric_limits<float>::infinity()};
  Acc c;
  c.run(one, DType::kFloat8E4M3, inf, DType::kFloat32, false, 0.0f);
  EXPECT_TRUE(std::isnan(c.amax[0]));
  EXPECT_TRUE(std::isnan(c.scale_inv[0]));
}

TEST(ScaledAccumulate, NaNScaleInvStaysNaN) {
  std::vector<uint8_t> dst{0x00, 0x38};
  std::vector<float> src{1.0f, 1.0f};
  Acc a;
  a.scale_inv[0] = std::nanf("");
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 1.0f);
  EXPECT_TRUE(std::isnan(a.amax[0]));
  EXPECT_TRUE(std::isnan(a.scale_inv[0]));
  // A later accumulation into it stays NaN.
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 1.0f);
  EXPECT_TRUE(std::isnan(a.scale_inv[0]));
  EXPECT_EQ(dst, (std::vector<uint8_t>{0x7F, 0x7F}));
}

TEST(ScaledAccumulate, AllZeroGivesScaleInvOne) {
  std::vector<uint8_t> dst{0x00, 0x80, 0x00};
  std::vector<float> src{0.0f, -0.0f, -0.0f};
  Acc a;
  a.scale_inv[0] = 0.25f;
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 1.0f);
  EXPECT_EQ(bits(a.amax[0]), 0u);
  EXPECT_EQ(a.scale_inv[0], 1.0f);
  EXPECT_EQ(dst, (std::vector<uint8_t>{0x00, 0x80, 0x00}));  // -0 + -0 = -0, 0 + -0 = +0
}

TEST(ScaledAccumulate, EmptyTensor) {
  std::vector<uint8_t> dst;
  std::vector<float> src;
  Acc a;
  a.scale_inv[0] = std::nanf("");
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 1.0f);
  EXPECT_EQ(bits(a.amax[0]), 0u);
  EXPECT_EQ(a.scale_inv[0], 1.0f);
}

TEST(ScaledAccumulate, TinyAmaxClampsTheScale) {
  // amax = the smallest subnormal: fmax / amax is inf, the exponent clamps to 126.
  std::vector<uint8_t> dst{0x00};
  std::vector<float> src{std::numeric_limits<float>::denorm_min()};
  Acc a;
  a.run(dst, DType::kFloat8E4M3, src, DType::kFloat32, false, 1.0f);
  EXPECT_EQ(a.scale_inv[0], std::ldexp(1.0f, -126));
  EXPECT_EQ(dst[0], 0x00);  // 2^-149 * 2^126 = 2^-23 underflows E4M3 (smallest 2^-9)
}

TEST(ScaledAccumulate, Errors) {
  std::vector<uint8_t> dst(4), dst3(3);
  std::vector<float> src(4), f1{1.0f}, f2{1.0f, 1.0f}, amax{0.0f};
  std::vector<uint16_t> h1{0};
  std::vector<int32_t> i4(4);
  const auto run = [&](const TensorView& d, const TensorView& si, const TensorView& s, const TensorView* ssi,
                       const TensorView& a, ScalingRecipe r = {}) {
    return [=] { scaled_accumulate(d, si, s, ssi, 1.0f, a, r, nullptr); };
  };
  const TensorView d = view(dst, DType::kFloat8E4M3), si = view(f1, DType::kFloat32);
  const TensorView s = view(src, DType::kFloat32), a = view(amax, DType::kFloat32);
  expect_value_error(run(view(src, DType::kFloat32), si, s, nullptr, a), "dst must be float8_e4m3fn");
  expect_value_error(run(view(dst, DType::kFloat8E4M3, {2, 2}), si, view(dst3, DType::kFloat8E4M3), &si, a),
                     "src must have as many elements as dst (4)");
  expect_value_error(run(d, view(f2, DType::kFloat32), s, nullptr, a), "dst_scale_inv must have 1 element");
  expect_value_error(run(d, view(h1, DType::kFloat16), s, nullptr, a), "dst_scale_inv must be float32");
  expect_value_error(run(d, si, view(i4, DType::kInt32), nullptr, a), "src must be float32, bfloat16 or float16");
  expect_value_error(run(d, si, view(dst, DType::kFloat8E4M3), nullptr, a), "src_scale_inv");
  expect_value_error(run(d, si, s, &si, a), "src must be float8_e4m3fn, float8_e5m2 or float16");
  TensorView bad_ssi = view(f2, DType::kFloat32);
  expect_value_error(run(d, si, view(dst, DType::kFloat8E5M2), &bad_ssi, a), "src_scale_inv must have 1 element");
  expect_value_error(run(d, si, s, nullptr, view(f2, DType::kFloat32)), "amax must have 1 element");
  expect_value_error(run(d, si, s, nullptr, a, ScalingRecipe{-1, true}), "margin");
  TensorView strided = view(dst, DType::kFloat8E4M3, {2});
  strided.strides = {2};
  expect_value_error(run(strided, si, view(f2, DType::kFloat32), nullptr, a), "dst must be contiguous");
  TensorView on_gpu = si;
  on_gpu.device = Device::kCUDA;
  on_gpu.device_index = 0;
  expect_value_error(run(d, on_gpu, s, nullptr, a), "dst_scale_inv and dst must be on the same device");
}

}  // namespace
}  // namespace fp8amp
