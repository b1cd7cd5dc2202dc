// The fused Adam/AdamW step (optim.h) through the public core API on CPU: hand-derived single
// elements and the FP32 path against the documented operation order (adam_test_util.h). The
// low-precision state paths, the non-finite policy, the step counter and the errors are in
// test_adam_low_precision_cpu.cpp.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "adam_test_util.h"
#include "common/numerics.h"
#include "fp8amp/optim.h"

namespace fp8amp {
namespace {

using numerics::float_bits;

// ------------------------------------------------------------------------------------------------
// Hand-derived single elements. beta1 = 0.5, beta2 = 0.75, lr = 0.25 keep every value exact.

TEST(AdamHand, AdamWFirstStep) {
  // g = 2: m' = 1, v' = 1; bc1 = 1/2, sqrt(bc2) = 1/2; den = 1/(1/2) = 2; step = lr/bc1 = 1/2;
  // p' = 1 * (1 - 0.25 * 0.5) - 0.5 * 1 / 2 = 0.875 - 0.25.
  Param x = fp32_param({1.0f}, {2.0f}, {0.0f}, {0.0f});
  Step s;
  s.hyper = hyper(0.25, 0.5, 0.75, 0.0, 0.5, /*adamw=*/true);
  s.run({&x});
  EXPECT_EQ(x.m.real(0), 1.0f);
  EXPECT_EQ(x.v.real(0), 1.0f);
  EXPECT_EQ(x.p.real(0), 0.625f);
  EXPECT_EQ(s.amax, (std::vector<float>{2.0f, 1.0f, 1.0f, 0.625f, 0.625f}));
  EXPECT_EQ(s.found_inf[0], 0.0f);
}

TEST(AdamHand, AdamWMaximize) {
  // g -> -2: m' = -1, v' = 1, p' = 0.875 + 0.25.
  Param x = fp32_param({1.0f}, {2.0f}, {0.0f}, {0.0f});
  Step s;
  s.hyper = hyper(0.25, 0.5, 0.75, 0.0, 0.5, true, /*maximize=*/true);
  s.run({&x});
  EXPECT_EQ(x.m.real(0), -1.0f);
  EXPECT_EQ(x.v.real(0), 1.0f);
  EXPECT_EQ(x.p.real(0), 1.125f);
}

TEST(AdamHand, AdamL2FirstStep) {
  // g = 2 + 0.5 * 1 = 2.5: m' = 1.25, v' = 0.25 * 6.25 = 1.5625, sqrt = 1.25; den = 2.5;
  // p' = 1 - 0.5 * 1.25 / 2.5 = 0.75 (no decoupled decay).
  Param x = fp32_param({1.0f}, {2.0f}, {0.0f}, {0.0f});
  Step s;
  s.hyper = hyper(0.25, 0.5, 0.75, 0.0, 0.5, /*adamw=*/false);
  s.run({&x});
  EXPECT_EQ(x.m.real(0), 1.25f);
  EXPECT_EQ(x.v.real(0), 1.5625f);
  EXPECT_EQ(x.p.real(0), 0.75f);
}

TEST(AdamHand, BiasCorrectionAtStepTen) {
  // m = 0.5, v = 0.25, g = 1, t = 10: m' = 0.75, v' = 0.4375, bc1 = 1 - 2^-10,
  // bc2 = 1 - 0.75^10; p' = p - lr / bc1 * m' / (sqrt(v') / sqrt(bc2) + eps), here in double.
  for (const bool adamw : {true, false}) {
    Param x = fp32_param({1.0f}, {1.0f}, {0.5f}, {0.25f});
    Step s;
    s.hyper = hyper(0.25, 0.5, 0.75, 1e-8, 0.0, adamw);
    s.t = 10;
    s.run({&x});
    EXPECT_EQ(x.m.real(0), 0.75f);
    EXPECT_EQ(x.v.real(0), 0.4375f);
    const double bc1 = 1.0 - std::ldexp(1.0, -10), bc2 = 1.0 - std::pow(0.75, 10);
    const double want = 1.0 - 0.25 / bc1 * 0.75 / (std::sqrt(0.4375) / std::sqrt(bc2) + 1e-8);
    // Five float roundings after exact inputs: within 3 ulps of p' (~0.79).
    EXPECT_NEAR(x.p.real(0), want, 3 * std::ldexp(1.0, -24));
    EXPECT_EQ(x.p.real(0), documented_order(1.0f, 1.0f, 0.5f, 0.25f, s.hyper, 10).p);
  }
}

TEST(AdamHand, TypicalBetasStepOneAndTen) {
  // beta1 = 0.9 takes torch's other lerp branch (|1 - beta1| < 0.5); at t = 1 the update is
  // -lr * g / (|g| + eps) up to rounding.
  for (const int64_t t : {int64_t{1}, int64_t{10}}) {
    for (const bool adamw : {true, false}) {
      Param x = fp32_param({0.5f}, {-0.03f}, {0.01f}, {4e-4f});
      Step s;
      s.hyper = hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, adamw);
      s.t = t;
      s.run({&x});
      const Expected e = documented_order(0.5f, -0.03f, 0.01f, 4e-4f, s.hyper, t);
      EXPECT_EQ(float_bits(x.m.real(0)), float_bits(e.m));
      EXPECT_EQ(float_bits(x.v.real(0)), float_bits(e.v));
      EXPECT_EQ(float_bits(x.p.real(0)), float_bits(e.p));
      // And the math itself, in double, within a few float roundings.
      const double g = adamw ? -0.03 : -0.03 + 0.01 * 0.5;
      const double m = 0.9 * 0.01 + 0.1 * g, v = 0.999 * 4e-4 + 0.001 * g * g;
      const double bc1 = 1 - std::pow(0.9, t), bc2 = 1 - std::pow(0.999, t);
      const double p = (adamw ? 0.5 * (1 - 1e-3 * 0.01) : 0.5) - 1e-3 / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + 1e-8);
      EXPECT_NEAR(x.p.real(0), p, 4 * std::ldexp(0.5, -24));
      EXPECT_NEAR(x.m.real(0), m, 1e-8);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The FP32 path against the documented operation order, bit for bit, over many elements and steps.

TEST(AdamFp32, MatchesTheDocumentedOrderBitForBit) {
  std::mt19937 rng(7);
  struct Case {
    bool adamw, maximize;
    double wd, beta1;
  };
  for (const Case c : {Case{true, false, 0.01, 0.9}, Case{false, false, 0.01, 0.9}, Case{true, true, 0.0, 0.9},
                       Case{false, true, 0.1, 0.3}}) {
    const int64_t n = 1000;
    std::vector<float> p = random_values(rng, n, 4), m(n, 0.0f), v(n, 0.0f);
    Param x = fp32_param(p, std::vector<float>(n, 0.0f), m, v);
    Step s;
    s.hyper = hyper(3e-3, c.beta1, 0.999, 1e-8, c.wd, c.adamw, c.maximize);
    for (int64_t t = 1; t <= 10; ++t) {
      const std::vector<float> g = random_values(rng, n, 6);
      for (int64_t j = 0; j < n; ++j) {
        x.g.set_real(j, g[j]);
        const Expected e = documented_order(p[j], g[j], m[j], v[j], s.hyper, t);
        p[j] = e.p, m[j] = e.m, v[j] = e.v;
      }
      s.t = t;
      s.run({&x});
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(float_bits(x.p.real(j)), float_bits(p[j])) << "step " << t << " element " << j;
        ASSERT_EQ(float_bits(x.m.real(j)), float_bits(m[j])) << "step " << t << " element " << j;
        ASSERT_EQ(float_bits(x.v.real(j)), float_bits(v[j])) << "step " << t << " element " << j;
      }
    }
  }
}

TEST(AdamFp32, Bf16AndFp16GradsConvertExactly) {
  for (const DType gd : {DType::kBFloat16, DType::kFloat16}) {
    Param x(3, DType::kFloat32, gd, DType::kFloat32, DType::kFloat32, false);
    const float gs[3] = {0.375f, -1.5f, 3.0f};
    for (int j = 0; j < 3; ++j) {
      x.p.set_real(j, 1.0f);
      x.g.set_real(j, gs[j]);
    }
    Step s;
    s.hyper = hyper(1e-2, 0.9, 0.999, 1e-8, 0.0, true);
    s.run({&x});
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(float_bits(x.p.real(j)), float_bits(documented_order(1.0f, gs[j], 0.0f, 0.0f, s.hyper, 1).p));
    }
    EXPECT_EQ(s.amax[kAdamAmaxGrad], 3.0f);
  }
}

}  // namespace
}  // namespace fp8amp
