// Shared by the CPU Adam tests (test_adam_cpu.cpp, test_adam_low_precision_cpu.cpp): element
// codecs by runtime dtype, one parameter's buffers in any format combination and a step over them
// through the public core API (optim.h), and the documented operation order written out here.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/optim.h"

namespace fp8amp {

// ------------------------------------------------------------------------------------------------
// Element codecs by runtime dtype (the formats the optimizer stores).

inline uint32_t encode_as(DType d, float x) {
  switch (d) {
    case DType::kFloat32: return numerics::float_bits(x);
    case DType::kBFloat16: return numerics::float_to_bf16(x);
    case DType::kFloat16: return numerics::encode<numerics::FP16>(x, true);
    case DType::kFloat8E4M3: return numerics::encode<numerics::E4M3>(x, true);
    case DType::kFloat8E5M2: return numerics::encode<numerics::E5M2>(x, true);
    default: ADD_FAILURE() << "no codec"; return 0;
  }
}

inline float decode_as(DType d, uint32_t b) {
  switch (d) {
    case DType::kFloat32: return numerics::bits_float(b);
    case DType::kBFloat16: return numerics::bf16_to_float(static_cast<uint16_t>(b));
    case DType::kFloat16: return numerics::decode<numerics::FP16>(b);
    case DType::kFloat8E4M3: return numerics::decode<numerics::E4M3>(b);
    case DType::kFloat8E5M2: return numerics::decode<numerics::E5M2>(b);
    default: ADD_FAILURE() << "no codec"; return 0.0f;
  }
}

inline bool scaled(DType d) { return d != DType::kFloat32 && d != DType::kBFloat16; }

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

inline TensorView scalar_view(std::vector<float>& v) {
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
  std::vector<float> count;  // the param's step count (AdamTensors::step_count); empty: none
  std::vector<float> kept;   // its kept master amax (AdamTensors::param_amax); empty: none

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
    if (!scales_given) t.param_scale = t.exp_avg_scale = t.exp_avg_sq_scale = t.weight_scale = std::nullopt;
    if (!count.empty()) t.step_count = scalar_view(count);
    if (!kept.empty()) t.param_amax = scalar_view(kept);
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
    for (const std::vector<float>* s : {&count, &kept}) {
      const auto* raw = reinterpret_cast<const uint8_t*>(s->data());
      all.insert(all.end(), raw, raw + s->size() * sizeof(float));
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

inline AdamHyper hyper(double lr, double beta1, double beta2, double eps, double wd, bool adamw,
                       bool maximize = false) {
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

inline Param fp32_param(std::vector<float> p, std::vector<float> g, std::vector<float> m, std::vector<float> v) {
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

inline Expected documented_order(float p, float g, float m, float v, const AdamHyper& h, int64_t t) {
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

// n values: normal ones times 2^u, u uniform in [-spread_log2, spread_log2].
inline std::vector<float> random_values(std::mt19937& rng, int64_t n, float spread_log2) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> exponent(-spread_log2, spread_log2);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng) * std::exp2(exponent(rng));
  return x;
}

}  // namespace fp8amp
