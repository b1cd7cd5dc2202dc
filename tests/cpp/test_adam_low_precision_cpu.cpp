// The fused Adam/AdamW step (optim.h) through the public core API on CPU, beyond FP32: the
// low-precision state paths (power-of-two scales from the new amaxes, values within the formats'
// precision, scales derived from the scale_invs), the non-finite policy, the device step counter,
// and errors naming the argument. The hand-derived and FP32 cases are in test_adam_cpu.cpp.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "adam_test_util.h"
#include "expect_error.h"
#include "fp8amp/error.h"
#include "fp8amp/optim.h"

namespace fp8amp {
namespace {

// ------------------------------------------------------------------------------------------------
// Low-precision paths: FP16 master, FP8 grad, E4M3 m, FP16 v, FP8 weight copy.

float pow2_scale(float amax, float fmax) { return std::exp2(std::floor(std::log2(static_cast<double>(fmax) / amax))); }

// |decoded * scale_inv - x| within half an ulp of the format at x * scale, or half its smallest
// subnormal (scaled back) below the normal range.
void expect_within_format(DType d, float stored_real, float x, float scale, const std::string& what) {
  const int man_bits = d == DType::kFloat8E4M3 ? 3 : 10;
  const int min_exp = d == DType::kFloat8E4M3 ? -6 : -14;
  const double xs = std::fabs(static_cast<double>(x) * scale);
  const int e = xs > 0 ? std::max(static_cast<int>(std::floor(std::log2(xs))), min_exp) : min_exp;
  const double half_ulp = std::ldexp(1.0, e - man_bits - 1) / scale;
  EXPECT_LE(std::fabs(static_cast<double>(stored_real) - x), half_ulp) << what << ": stored " << stored_real
                                                                       << " for " << x;
}

TEST(AdamLowPrecision, ScalesFromNewAmaxesAndValuesWithinFormatPrecision) {
  std::mt19937 rng(11);
  const int64_t n = 777;
  const AdamHyper h = hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, true);
  Param x(n, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  // A master of magnitude ~4, grads ~2^-8 (stored with scale 2^12), states from earlier steps.
  x.p.set_scale(8192.0f);
  x.g.set_scale(4096.0f);
  x.m.set_scale(65536.0f);
  x.v.set_scale(1073741824.0f);  // 2^30
  x.w.set_scale(32.0f);
  const std::vector<float> p0 = random_values(rng, n, 1), g0 = random_values(rng, n, 1);
  for (int64_t j = 0; j < n; ++j) {
    x.p.set_real(j, p0[j]);
    x.g.set_real(j, g0[j] * 0.004f);
    x.m.set_real(j, g0[(j + 1) % n] * 0.001f);
    x.v.set_real(j, 1e-6f * std::fabs(g0[(j + 2) % n]) + 1e-9f);
  }
  // The expected new values from the dequantized inputs.
  std::vector<Expected> e(n);
  float amax[kAdamAmaxColumns] = {};
  for (int64_t j = 0; j < n; ++j) {
    e[j] = documented_order(x.p.real(j), x.g.real(j), x.m.real(j), x.v.real(j), h, 3);
    amax[kAdamAmaxGrad] = std::max(amax[kAdamAmaxGrad], std::fabs(x.g.real(j)));
    amax[kAdamAmaxExpAvg] = std::max(amax[kAdamAmaxExpAvg], std::fabs(e[j].m));
    amax[kAdamAmaxExpAvgSq] = std::max(amax[kAdamAmaxExpAvgSq], std::fabs(e[j].v));
    amax[kAdamAmaxParam] = std::max(amax[kAdamAmaxParam], std::fabs(e[j].p));
  }
  amax[kAdamAmaxNewParam] = amax[kAdamAmaxParam];  // no kept amax: pass 1 read the master
  Step s;
  s.hyper = h;
  s.t = 3;
  s.run({&x});
  ASSERT_EQ(s.found_inf[0], 0.0f);
  EXPECT_EQ(s.amax, std::vector<float>(amax, amax + kAdamAmaxColumns));

  // Powers of two from the new amaxes; scale_inv exact.
  EXPECT_EQ(x.m.scale[0], pow2_scale(amax[kAdamAmaxExpAvg], 448.0f));
  EXPECT_EQ(x.v.scale[0], pow2_scale(amax[kAdamAmaxExpAvgSq], 65504.0f));
  EXPECT_EQ(x.p.scale[0], pow2_scale(amax[kAdamAmaxParam], 65504.0f));
  for (const Buffer* b : {&x.m, &x.v, &x.p, &x.w}) {
    int e2;
    EXPECT_EQ(std::frexp(b->scale[0], &e2), 0.5f);
    EXPECT_EQ(b->scale_inv[0], 1.0f / b->scale[0]);
  }
  EXPECT_EQ(x.g.scale_inv[0], 1.0f / 4096.0f);  // the grad's scale is an input

  // The weight copy: from the stored master, scale from its amax, bit-exact quantize.
  float stored_amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) stored_amax = std::max(stored_amax, std::fabs(x.p.real(j)));
  EXPECT_EQ(x.w.scale[0], pow2_scale(stored_amax, 448.0f));
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_EQ(x.w.code(j), encode_as(DType::kFloat8E4M3, x.p.real(j) * x.w.scale[0])) << j;
    expect_within_format(DType::kFloat8E4M3, x.m.real(j), e[j].m, x.m.scale[0], "exp_avg");
    expect_within_format(DType::kFloat16, x.v.real(j), e[j].v, x.v.scale[0], "exp_avg_sq");
    expect_within_format(DType::kFloat16, x.p.real(j), e[j].p, x.p.scale[0], "param");
    expect_within_format(DType::kFloat8E4M3, x.w.real(j), x.p.real(j), x.w.scale[0], "weight_fp8");
    // And exactly the codes quantize() gives.
    EXPECT_EQ(x.m.code(j), encode_as(DType::kFloat8E4M3, e[j].m * x.m.scale[0]));
    EXPECT_EQ(x.v.code(j), encode_as(DType::kFloat16, e[j].v * x.v.scale[0]));
    EXPECT_EQ(x.p.code(j), encode_as(DType::kFloat16, e[j].p * x.p.scale[0]));
  }
}

TEST(AdamLowPrecision, Float16VEntersAsCodeTimesScaleInvTimesBeta2) {
  // v * b2 is code * f32(scale_inv * b2) (optim.h): one product, which for the power-of-two
  // scale_invs of the test above is (code * scale_inv) * b2 exactly. With a scale_inv of 1/3 the
  // two forms differ for some codes, and the step follows the documented one.
  const int64_t n = 512;
  const AdamHyper h = hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, true);
  Param x(n, DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat16, false);
  x.v.set_scale(3.0f);
  for (int64_t j = 0; j < n; ++j) {
    x.p.set_real(j, 1.0f);
    x.g.set_real(j, 1e-3f * static_cast<float>(j % 7 + 1));
    x.v.set_code(j, encode_as(DType::kFloat16, 0.25f + static_cast<float>(j) / 64.0f));
  }
  const float factor = x.v.scale_inv[0] * static_cast<float>(h.beta2);
  const float w2 = static_cast<float>(1.0 - h.beta2);
  std::vector<float> expected(n);
  int two_forms_differ = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float code = decode_as(DType::kFloat16, x.v.code(j)), g = x.g.real(j);
    expected[j] = std::fma(w2 * g, g, code * factor);
    two_forms_differ += expected[j] != std::fma(w2 * g, g, x.v.real(j) * static_cast<float>(h.beta2));
  }
  ASSERT_GT(two_forms_differ, 0);
  Step s;
  s.hyper = h;
  s.run({&x});
  float amax = 0.0f;
  for (const float v : expected) amax = std::max(amax, v);
  EXPECT_EQ(s.amax[kAdamAmaxExpAvgSq], amax);
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_EQ(x.v.code(j), encode_as(DType::kFloat16, expected[j] * x.v.scale[0])) << j;
  }
}

TEST(AdamLowPrecision, Fp8GradColumnIsTheLargestCodeTimesTheScaleInv) {
  // max |code| * |scale_inv|: the largest |g| for a finite scale_inv (rounding is monotonic); with
  // an infinite one, inf even beside zero codes (whose g, 0 * inf, is NaN), and the step is skipped.
  for (const float scale_inv : {-0.25f, 0.25f, INFINITY}) {
    Param x(3, DType::kFloat32, DType::kFloat8E4M3, DType::kFloat32, DType::kFloat32, false);
    x.g.set_code(0, encode_as(DType::kFloat8E4M3, 0.0f));
    x.g.set_code(1, encode_as(DType::kFloat8E4M3, -3.0f));
    x.g.set_code(2, encode_as(DType::kFloat8E4M3, 1.5f));
    x.g.scale_inv[0] = scale_inv;
    const std::vector<uint8_t> before = x.snapshot();
    Step s;
    s.hyper = hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, true);
    s.run({&x});
    EXPECT_EQ(s.amax[kAdamAmaxGrad], 3.0f * std::fabs(scale_inv)) << scale_inv;
    EXPECT_EQ(s.found_inf[0], std::isinf(scale_inv) ? 1.0f : 0.0f) << scale_inv;
    if (std::isinf(scale_inv)) EXPECT_EQ(x.snapshot(), before);
  }
}

TEST(AdamLowPrecision, ZeroStateKeepsPreviousScale) {
  // grad 0, m 0, v 0: m' = v' = 0, so their scales stay as they were (amax 0 keeps the pair).
  Param x(4, DType::kFloat32, DType::kFloat32, DType::kFloat8E4M3, DType::kFloat16, false);
  x.m.set_scale(0.125f);
  x.v.set_scale(2.0f);
  for (int j = 0; j < 4; ++j) x.p.set_real(j, 1.0f);
  Step s;
  s.run({&x});
  EXPECT_EQ(x.m.scale[0], 0.125f);
  EXPECT_EQ(x.v.scale[0], 2.0f);
  EXPECT_EQ(x.m.scale_inv[0], 8.0f);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(x.p.real(j), 1.0f);  // update 0 / (0 + eps) = 0
}

TEST(AdamLowPrecision, ScalesLeftOutAreDerivedFromTheScaleInvs) {
  // The same three steps with and without the scales: the same codes and scale_invs bit for bit,
  // and the scales left out are neither read nor written. The zero state keeps its pair either way.
  std::mt19937 rng(5);
  const int64_t n = 300;
  Param given(n, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  Param zero(3, DType::kFloat32, DType::kFloat32, DType::kFloat8E4M3, DType::kFloat16, false);
  given.p.set_scale(1024.0f);
  given.g.set_scale(2048.0f);
  given.m.set_scale(0.5f);
  zero.m.set_scale(0.125f);
  const std::vector<float> p0 = random_values(rng, n, 1), g0 = random_values(rng, n, 1);
  for (int64_t j = 0; j < n; ++j) {
    given.p.set_real(j, p0[j]);
    given.g.set_real(j, g0[j] * 0.01f);
  }
  Param derived = given, zero_derived = zero;
  derived.scales_given = zero_derived.scales_given = false;
  for (Buffer* b : {&derived.p, &derived.m, &derived.v, &derived.w, &zero_derived.m, &zero_derived.v,
                    &zero_derived.w}) {
    b->scale[0] = NAN;  // never read
  }
  for (int64_t t = 1; t <= 3; ++t) {
    Step a, b;
    a.t = b.t = t;
    a.run({&given, &zero});
    b.run({&derived, &zero_derived});
    EXPECT_EQ(a.amax, b.amax);
  }
  for (const auto& [x, y] : {std::pair{&given, &derived}, {&zero, &zero_derived}}) {
    for (const auto& [bx, by] : {std::pair{&x->p, &y->p}, {&x->m, &y->m}, {&x->v, &y->v}, {&x->w, &y->w}}) {
      EXPECT_EQ(bx->bytes, by->bytes);
      EXPECT_EQ(bx->scale_inv, by->scale_inv);
      if (scaled(by->dtype)) EXPECT_TRUE(std::isnan(by->scale[0]));
    }
  }
  EXPECT_NE(derived.m.scale_inv[0], 2.0f);  // the scales moved
  EXPECT_EQ(zero_derived.m.scale_inv[0], 8.0f);
}

TEST(AdamLowPrecision, MixedFormatsInOneCallAndEmptyTensors) {
  Param a = fp32_param({1.0f, 2.0f}, {0.5f, -0.5f}, {0.0f, 0.0f}, {0.0f, 0.0f});
  Param b(3, DType::kFloat16, DType::kFloat8E5M2, DType::kFloat8E4M3, DType::kFloat16, true);
  Param empty(0, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  empty.p.set_scale(4.0f);
  for (int j = 0; j < 3; ++j) {
    b.p.set_real(j, 0.25f * (j + 1));
    b.g.set_real(j, 1.0f);
  }
  Step s;
  s.hyper = hyper(0.1, 0.9, 0.999, 1e-8, 0.0, true);
  s.run({&a, &empty, &b});
  EXPECT_EQ(a.p.real(0), documented_order(1.0f, 0.5f, 0.0f, 0.0f, s.hyper, 1).p);
  EXPECT_EQ(s.amax[kAdamAmaxColumns * 1 + kAdamAmaxParam], 0.0f);  // the empty tensor's row
  EXPECT_EQ(empty.p.scale[0], 4.0f);
  EXPECT_EQ(s.amax[kAdamAmaxColumns * 2 + kAdamAmaxGrad], 1.0f);
  EXPECT_NEAR(b.p.real(2), 0.75f - 0.1f, 1e-3f);
}

// ------------------------------------------------------------------------------------------------
// Non-finite values and the step counter.

TEST(AdamNonFinite, FoundInfOnEntryIsANoOp) {
  Param x(5, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  for (int j = 0; j < 5; ++j) {
    x.p.set_real(j, 1.0f + j);
    x.g.set_real(j, 0.5f);
  }
  x.count = {4.0f};
  const std::vector<uint8_t> before = x.snapshot();
  Step s;
  s.counter = {4.0f};
  s.found_inf[0] = 1.0f;
  s.run({&x});
  EXPECT_EQ(x.snapshot(), before);
  EXPECT_EQ(s.counter[0], 4.0f);
  EXPECT_EQ(s.found_inf[0], 1.0f);
  EXPECT_EQ(s.amax[kAdamAmaxGrad], 0.5f);  // still reported
}

TEST(AdamNonFinite, AnyNonFiniteValueSkipsTheWholeCall) {
  struct Bad {
    const char* what;
    float grad;
  };
  for (const Bad bad : {Bad{"nan grad", std::nanf("")}, Bad{"inf grad", INFINITY}, Bad{"(1 - beta2) g^2 overflows", 1e21f}}) {
    SCOPED_TRACE(bad.what);
    Param ok = fp32_param({1.0f, 2.0f}, {0.5f, 0.5f}, {0.1f, 0.1f}, {0.2f, 0.2f});
    Param x = fp32_param({1.0f, 2.0f, 3.0f}, {0.5f, bad.grad, 0.5f}, {0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f});
    ok.count = {0.0f};
    const std::vector<uint8_t> ok_before = ok.snapshot(), x_before = x.snapshot();
    Step s;
    s.counter = {0.0f};
    s.run({&ok, &x});
    EXPECT_EQ(s.found_inf[0], 1.0f);
    EXPECT_EQ(ok.snapshot(), ok_before);
    EXPECT_EQ(x.snapshot(), x_before);
    EXPECT_EQ(s.counter[0], 0.0f);
    EXPECT_FALSE(std::isfinite(s.amax[kAdamAmaxColumns + kAdamAmaxExpAvgSq]));
  }
  // An FP8 grad holding the E4M3 NaN code, with low-precision states.
  Param x(2, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  x.g.set_code(1, 0x7F);
  const std::vector<uint8_t> before = x.snapshot();
  Step s;
  s.run({&x});
  EXPECT_EQ(s.found_inf[0], 1.0f);
  EXPECT_EQ(x.snapshot(), before);
}

TEST(AdamStepCounter, MatchesHostStepAndIncrements) {
  const auto make = [] { return fp32_param({1.0f, -2.0f}, {0.3f, 0.7f}, {0.01f, -0.02f}, {0.001f, 0.002f}); };
  Param host = make(), device = make();
  Step hs, ds;
  hs.hyper = ds.hyper = hyper(1e-2, 0.9, 0.999, 1e-8, 0.1, true);
  ds.counter = {6.0f};  // six steps taken: this is step 7
  hs.t = 7;
  hs.run({&host});
  ds.run({&device});
  EXPECT_EQ(host.snapshot(), device.snapshot());
  EXPECT_EQ(ds.counter[0], 7.0f);
  ds.counter = {-3.0f};  // nonsense counts as 0: step 1
  hs.t = 1;
  hs.run({&host});
  ds.run({&device});
  EXPECT_EQ(host.snapshot(), device.snapshot());
}

TEST(AdamStepCounter, EachParamsCountAdvancesWithTheCounter) {
  // Each given count is incremented from its own value (as torch's per-param state["step"]); t
  // comes from the call's counter alone; a param without a count has none written.
  Param a = fp32_param({1.0f}, {0.3f}, {0.0f}, {0.0f}), b = fp32_param({2.0f}, {0.7f}, {0.0f}, {0.0f});
  Param c = fp32_param({3.0f}, {0.1f}, {0.0f}, {0.0f});
  Param a_alone = fp32_param({1.0f}, {0.3f}, {0.0f}, {0.0f});
  a.count = {2.0f};
  b.count = {5.0f};
  Step s, alone;
  s.counter = alone.counter = {2.0f};
  s.run({&a, &b, &c});
  alone.run({&a_alone});
  EXPECT_EQ(s.counter[0], 3.0f);
  EXPECT_EQ(a.count[0], 3.0f);
  EXPECT_EQ(b.count[0], 6.0f);
  EXPECT_EQ(a.p.bytes, a_alone.p.bytes);  // the count changes nothing else
  // With the host step number, too.
  Step host;
  host.t = 4;
  host.run({&a, &b});
  EXPECT_EQ(a.count[0], 4.0f);
  EXPECT_EQ(b.count[0], 7.0f);
}

// ------------------------------------------------------------------------------------------------
// Errors name the argument.

TEST(AdamErrors, NameTheArgument) {
  const auto run_with = [](const std::function<void(std::vector<AdamTensors>&, AdamHyper&, Step&)>& edit) {
    return [edit] {
      Param x(2, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
      Param y = fp32_param({1.0f, 2.0f}, {0.1f, 0.1f}, {0.0f, 0.0f}, {0.0f, 0.0f});
      std::vector<AdamTensors> ts{y.tensors(), x.tensors()};
      Step s;
      AdamHyper h;
      edit(ts, h, s);
      s.amax.assign(ts.size() * kAdamAmaxColumns, 0.0f);
      TensorView amax;
      amax.data = s.amax.data();
      amax.shape = {static_cast<int64_t>(ts.size()), kAdamAmaxColumns};
      TensorView counter;
      if (!s.counter.empty()) counter = scalar_view(s.counter);
      adam_step(ts, h, s.t, s.counter.empty() ? nullptr : &counter, scalar_view(s.found_inf), amax, nullptr);
    };
  };
  expect_value_error(run_with([&](auto& ts, auto&, auto&) { ts[0].param.dtype = DType::kBFloat16; }),
                     "params[0] must be float32, or float16 with a scale");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].param_scale_inv.reset(); }),
                     "param_scale_invs[1] is required: its param is float16");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[0].exp_avg_scale = ts[1].exp_avg_scale; }),
                     "exp_avg_scales[0] must be None: its exp_avg is float32");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].grad_scale_inv.reset(); }),
                     "grad_scale_invs[1] is required: its grad is float8");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].weight_scale_inv.reset(); }),
                     "weight_scale_invs[1] is required");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].exp_avg.dtype = DType::kFloat8E5M2; }),
                     "exp_avgs[1] must be float32 or float8_e4m3fn");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].exp_avg_sq.dtype = DType::kBFloat16; }),
                     "exp_avg_sqs[1] must be float32 or float16");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[0].grad.shape = {1, 2}; }),
                     "grads[0] and its param must have the same shape");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].grad.strides = {2}; }), "grads[1] must be contiguous");
  expect_value_error(run_with([](auto& ts, auto&, auto&) {
                       ts[1].exp_avg.device = Device::kCUDA;
                       ts[1].exp_avg.device_index = 0;
                     }),
                     "exp_avgs[1] and its param must be on the same device");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[1].param_scale->shape = {2}; }),
                     "param_scales[1] must have 1 element(s)");
  expect_value_error(run_with([](auto& ts, auto&, auto&) {
                       ts[1].step_count = ts[1].param_scale;
                       ts[1].step_count->shape = {2};
                     }),
                     "step_counts[1] must have 1 element(s)");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts[0].step_count = ts[1].exp_avg; }),
                     "step_counts[0] must be float32");
  expect_value_error(run_with([](auto& ts, auto&, auto&) { ts.clear(); }), "params must hold at least one tensor");
  expect_value_error(run_with([](auto&, auto& h, auto&) { h.lr = -1.0; }), "lr must be finite and >= 0");
  expect_value_error(run_with([](auto&, auto& h, auto&) { h.beta1 = 1.0; }), "beta1 must be in [0, 1)");
  expect_value_error(run_with([](auto&, auto& h, auto&) { h.beta2 = -0.1; }), "beta2 must be in [0, 1)");
  expect_value_error(run_with([](auto&, auto& h, auto&) { h.eps = NAN; }), "eps must be finite and >= 0");
  expect_value_error(run_with([](auto&, auto& h, auto&) { h.weight_decay = -1.0; }), "weight_decay must be finite");
  expect_value_error(run_with([](auto&, auto& h, auto&) { h.margin = 127; }), "margin must be in [0, 126]");
  expect_value_error(run_with([](auto&, auto&, auto& s) { s.t = 0; }), "step must be >= 1");
  expect_value_error(run_with([](auto&, auto&, auto& s) { s.counter = {0.0f}; }),
                     "step must be 0 when step_tensor is given");
  expect_value_error(run_with([](auto&, auto&, auto& s) { s.found_inf = {0.0f, 0.0f}; }),
                     "found_inf must have 1 element(s)");
}

TEST(AdamErrors, AmaxShape) {
  Param x = fp32_param({1.0f}, {0.1f}, {0.0f}, {0.0f});
  std::vector<float> amax(3), found{0.0f};
  TensorView a;
  a.data = amax.data();
  a.shape = {3};
  expect_value_error([&] { adam_step({x.tensors()}, AdamHyper{}, 1, nullptr, scalar_view(found), a, nullptr); },
                     "amax must be [1, 5]");
}

}  // namespace
}  // namespace fp8amp
