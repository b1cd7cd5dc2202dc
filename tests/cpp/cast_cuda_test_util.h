// Shared by the CUDA cast tests (test_cast_cuda.cu, test_cast_transpose_cuda.cu,
// test_cast_multi_cuda.cu, test_delayed_scaling_cuda.cu): lists of mirrored tensors, the scaling
// buffers on both sides, and the inputs: delicate and random values in the high-precision dtypes.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/numerics.h"
#include "cuda_test_util.h"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// The tensors of a, then those of b.
inline std::vector<MirroredTensor*> operator+(std::vector<MirroredTensor*> a, const std::vector<MirroredTensor*>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The tensors ts owns.
inline std::vector<MirroredTensor*> pointers(const std::vector<std::unique_ptr<MirroredTensor>>& ts) {
  std::vector<MirroredTensor*> r;
  for (const auto& t : ts) r.push_back(t.get());
  return r;
}

// The scaling buffers of n tensors, on both sides.
struct ScalingTensors {
  MirroredTensor scale, amax, scale_inv;
  std::unique_ptr<MirroredTensor> warmup_counter;
  int warmup_steps = 0;
  ScalingRecipe recipe;
  TensorView warmup_counter_view[2];

  ScalingTensors(int64_t n, int64_t history)
      : scale(DType::kFloat32, {n}),
        amax(DType::kFloat32, history == 0 ? std::vector<int64_t>{n} : std::vector<int64_t>{n, history}),
        scale_inv(DType::kFloat32, {n}) {
    for (int64_t i = 0; i < n; ++i) {
      scale.set_float(i, 1.0f);
      scale_inv.set_float(i, -7.0f);  // must be overwritten
    }
    for (int64_t i = 0; i < amax.numel(); ++i) amax.set_float(i, 0.0f);
  }

  void with_warmup_counter(std::vector<int32_t> values, int steps) {
    warmup_counter =
        std::make_unique<MirroredTensor>(DType::kInt32, std::vector<int64_t>{static_cast<int64_t>(values.size())});
    for (size_t i = 0; i < values.size(); ++i) warmup_counter->set_int(static_cast<int64_t>(i), values[i]);
    warmup_steps = steps;
  }

  Scaling on(Device d) {
    Scaling s;
    s.scale = scale.view(d);
    s.amax = amax.view(d);
    s.scale_inv = scale_inv.view(d);
    if (warmup_counter) {
      warmup_counter_view[static_cast<int>(d)] = warmup_counter->view(d);
      s.warmup_counter = &warmup_counter_view[static_cast<int>(d)];
    }
    s.warmup_steps = warmup_steps;
    s.recipe = recipe;
    return s;
  }

  std::vector<MirroredTensor*> all() {
    std::vector<MirroredTensor*> r{&scale, &amax, &scale_inv};
    if (warmup_counter) r.push_back(warmup_counter.get());
    return r;
  }
};

// ------------------------------------------------------------------------------------------------
// Inputs.

inline constexpr DType kHighPrecision[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
inline constexpr DType kScaled[] = {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kFloat16};

// The bits of v in a high-precision dtype (IEEE rounding).
inline uint32_t bits_in(DType dtype, float v) {
  if (dtype == DType::kFloat32) return numerics::float_bits(v);
  return dtype == DType::kBFloat16 ? numerics::float_to_bf16(v) : numerics::float_to_fp16(v);
}

// Values whose encoding is delicate in some format: format maxima and their rounding ties,
// subnormal boundaries, fp32 extremes and specials; each with both signs and fp32 neighbours.
inline std::vector<float> boundary_values() {
  const float anchors[] = {0.0f,        1.0f,         448.0f,        464.0f,       480.0f,       57344.0f,
                           61440.0f,    65504.0f,     65520.0f,      0x1p-6f,      0x1p-9f,      0x1p-10f,
                           0x3p-11f,    0x1p-14f,     0x1p-16f,      0x1p-17f,     0x3p-18f,     0x1p-24f,
                           0x1p-25f,    0x3p-26f,     FLT_MIN,       FLT_MAX,      FLT_TRUE_MIN, 0x1.fffffcp-127f,
                           INFINITY,    1e38f,        1.5f,          0.3f,         240.0f,       232.0f};
  std::vector<float> v;
  for (float a : anchors) {
    for (float x : {a, std::nextafter(a, 0.0f), std::nextafter(a, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7FFFFFFFu}) v.push_back(numerics::bits_float(nan));
  return v;
}

// Finite values over a wide range of magnitudes and both signs, with a few specials mixed in.
inline std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-40, 40), pick(0, 999), sign(0, 1);
  const std::vector<float> specials = boundary_values();
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    if (pick(rng) == 0) {
      x = specials[static_cast<size_t>(pick(rng)) % specials.size()];
    } else {
      x = std::ldexp(mantissa(rng), exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
    }
  }
  return v;
}

inline void fill(MirroredTensor& t, const std::vector<float>& values) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set_bits(i, bits_in(t.dtype(), values[static_cast<size_t>(i)]));
}

inline std::string label(DType in, DType out, const std::string& rest) {
  return std::string(dtype_name(in)) + " -> " + dtype_name(out) + ", " + rest;
}

}  // namespace fp8amp
