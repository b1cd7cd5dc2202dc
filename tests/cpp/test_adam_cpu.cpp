// The fused Adam/AdamW step (optim.h) through the public core API on CPU: hand-derived single
// elements, the FP32 path against the documented operation order written out here, the
// low-precision state paths (power-of-two scales from the new amaxes, values within the formats'
// precision), the non-finite policy, the device step counter, and errors naming the argument.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/numerics.h"
#include "expect_error.h"
#include "fp8amp/error.h"
#include "fp8amp/optim.h"

namespace fp8amp {
namespace {

using numerics::float_bits;

// ------------------------------------------------------------------------------------------------
// Element codecs by runtime dtype (the formats the optimizer stores).

uint32_t encode_as(DType d, float x) {
  switch (d) {
    case DType::kFloat32: return float_bits(x);
    case DType::kBFloat16: return numerics::float_to_bf16(x);
    case DType::kFloat16: return numerics::encode<numerics::FP16>(x, true);
    case DType::kFloat8E4M3: return numerics::encode<numerics::E4M3>(x, true);
    case DType::kFloat8E5M2: return numerics::encode<numerics::E5M2>(x, true);
    default: ADD_FAILURE() << "no codec"; return 0;
  }
}

float decode_as(DType d, uint32_t b) {
  switch (d) {
    case DType::kFloat32: return numerics::bits_float(b);
    case DType::kBFloat16: return numerics::bf16_to_float(static_cast<uint16_t>(b));
    case DType::kFloat16: return numerics::decode<numerics::FP16>(b);
    case DType::kFloat8E4M3: return numerics::decode<numerics::E4M3>(b);
    case DType::kFloat8E5M2: return numerics::decode<numerics::E5M2>(b);
    default: ADD_FAILURE() << "no codec"; return 0.0f;
  }
}

bool scaled(DType d) { return d != DType::kFloat32 && d != DType::kBFloat16; }

// A buffer of n elements of one dtype, with its scale pair (used iff the format is scaled).
struct Buffer {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> bytes;
  std::vector<float> scale{1.0f}, scale_inv{1.0f};

  Buffer() = default;
  Buffer(DType d, int64_t n) : dtype(d), bytes(static_cast<size_t>(n) * dtype_size(d)) {}

  int64_t numel() const { return static_cast<int64_t>(bytes.size() / dtype_size(dtype)); }
  uint32_t code(int64_t j) const {
    uint32_t b = 0;
    std::memcpy(&b, bytes.data() + j * dtype_size(dtype), dtype_size(dtype));
    return b;
  }
  void set_code(int64_t j, uint32_t b) { std::memcpy(bytes.data() + j * dtype_size(dtype), &b, dtype_size(dtype)); }
  // The real value: decode * scale_inv (one float product) for scaled formats.
  float real(int64_t j) const {
    const float f = decode_as(dtype, code(j));
    return scaled(dtype) ? f * scale_inv[0] : f;
  }
  // Stores x as quantize(x * scale) (scaled) or rounded (float32, bf16).
  void set_real(int64_t j, float x) { set_code(j, encode_as(dtype, scaled(dtype) ? x * scale[0] : x)); }
  void set_scale(float s) {
    scale[0] = s;
    scale_inv[0] = 1.0f / s;
  }

  TensorView view(std::vector<int64_t> shape) {
    TensorView t;
    t.data = bytes.data();
    t.dtype = dtype;
    t.shape = std::move(shape);
    return t;
  }
};

TensorView scalar_view(std::vector<float>& v) {
  TensorView t;
  t.data = v.data();
  t.dtype = DType::kFloat32;
  t.shape = {static_cast<int64_t>(v.size())};
  return t;
}

// One parameter's buffers in any supported format combination.
struct Param {
  Buffer p, g, m, v, w;
  bool weight = false;
  int64_t n = 0;
  bool scales_given = true;  // false: only the scale_invs (the op derives the old scales)

  Param(int64_t numel, DType pd, DType gd, DType md, DType vd, bool with_weight)
      : p(pd, numel), g(gd, numel), m(md, numel), v(vd, numel), w(DType::kFloat8E4M3, numel), weight(with_weight),
        n(numel) {}

  AdamTensors tensors() {
    AdamTensors t;
    const std::vector<int64_t> shape{n};
    t.param = p.view(shape);
    t.grad = g.view(shape);
    t.exp_avg = m.view(shape);
    t.exp_avg_sq = v.view(shape);
    if (scaled(p.dtype)) t.param_scale = scalar_view(p.scale), t.param_scale_inv = scalar_view(p.scale_inv);
    if (is_fp8(g.dtype)) t.grad_scale_inv = scalar_view(g.scale_inv);  // fp16 grads are unscaled
    if (scaled(m.dtype)) t.exp_avg_scale = scalar_view(m.scale), t.exp_avg_scale_inv = scalar_view(m.scale_inv);
    if (scaled(v.dtype)) t.exp_avg_sq_scale = scalar_view(v.scale), t.exp_avg_sq_scale_inv = scalar_view(v.scale_inv);
    if (weight) {
      t.weight_fp8 = w.view(shape);
      t.weight_scale = scalar_view(w.scale);
      t.weight_scale_inv = scalar_view(w.scale_inv);
    }
    if (!scales_given) {
      for (std::optional<TensorView>* scale : {&t.param_scale, &t.exp_avg_scale, &t.exp_avg_sq_scale, &t.weight_scale}) {
        scale->reset();
      }
    }
    return t;
  }

  std::vector<uint8_t> snapshot() const {
    std::vector<uint8_t> all;
    for (const Buffer* b : {&p, &g, &m, &v, &w}) {
      all.insert(all.end(), b->bytes.begin(), b->bytes.end());
      for (const std::vector<float>* s : {&b->scale, &b->scale_inv}) {
        const auto* raw = reinterpret_cast<const uint8_t*>(s->data());
        all.insert(all.end(), raw, raw + sizeof(float));
      }
    }
    return all;
  }
};

// Runs one step over `params` (host step t, or the step counter when given).
struct Step {
  AdamHyper hyper;
  int64_t t = 1;
  std::vector<float> found_inf{0.0f};
  std::vector<float> counter;  // empty: host step
  std::vector<float> amax;

  void run(std::vector<Param*> params) {
    std::vector<AdamTensors> ts;
    for (Param* p : params) ts.push_back(p->tensors());
    amax.assign(params.size() * kAdamAmaxColumns, -1.0f);
    TensorView amax_view;
    amax_view.data = amax.data();
    amax_view.shape = {static_cast<int64_t>(params.size()), kAdamAmaxColumns};
    TensorView counter_view;
    if (!counter.empty()) counter_view = scalar_view(counter);
    adam_step(ts, hyper, counter.empty() ? t : 0, counter.empty() ? nullptr : &counter_view,
              scalar_view(found_inf), amax_view, nullptr);
  }
};

AdamHyper hyper(double lr, double beta1, double beta2, double eps, double wd, bool adamw, bool maximize = false) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = wd;
  h.adamw = adamw;
  h.maximize = maximize;
  return h;
}

Param fp32_param(std::vector<float> p, std::vector<float> g, std::vector<float> m, std::vector<float> v) {
  Param x(static_cast<int64_t>(p.size()), DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat32, false);
  for (int64_t j = 0; j < x.n; ++j) {
    x.p.set_real(j, p[j]);
    x.g.set_real(j, g[j]);
    x.m.set_real(j, m[j]);
    x.v.set_real(j, v[j]);
  }
  return x;
}

// ------------------------------------------------------------------------------------------------
// The documented operation order (optim.h), written out independently of the core: per-step
// constants in double with libm's pow, then float32 with every operation rounded once.

struct Expected {
  float m, v, p;
};

Expected documented_order(float p, float g, float m, float v, const AdamHyper& h, int64_t t) {
  const float w1 = static_cast<float>(1.0 - h.beta1);
  const float w2 = static_cast<float>(1.0 - h.beta2);
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(t));
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.0) {
    if (h.adamw) {
      p = p * static_cast<float>(1.0 - h.lr * h.weight_decay);
    } else {
      g = std::fma(p, static_cast<float>(h.weight_decay), g);
    }
  }
  Expected e;
  e.m = std::fabs(w1) < 0.5f ? std::fma(w1, g - m, m) : std::fma(w1 - 1.0f, g - m, g);
  e.v = std::fma(w2 * g, g, v * static_cast<float>(h.beta2));
  const float den = std::fma(std::sqrt(e.v), static_cast<float>(1.0 / std::sqrt(bc2)), static_cast<float>(h.eps));
  e.p = p + static_cast<float>(-(h.lr / bc1)) * e.m / den;
  return e;
}

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
  EXPECT_EQ(s.amax, (std::vector<float>{2.0f, 1.0f, 1.0f, 0.625f}));
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
// The FP32 path against the operation order above, bit for bit, over many elements and steps.

std::vector<float> random_values(std::mt19937& rng, int64_t n, float spread_log2) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> exponent(-spread_log2, spread_log2);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng) * std::exp2(exponent(rng));
  return x;
}

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
                     "amax must be [1, 4]");
}

}  // namespace
}  // namespace fp8amp
