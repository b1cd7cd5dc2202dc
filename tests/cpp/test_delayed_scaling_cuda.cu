// The CUDA scale updates (compute_scale, update_delayed_scaling, multi_update_delayed_scaling)
// against the CPU reference, bit for bit, through the public API (scaling.h), over histories full
// of awkward amaxes and several steps in a row; every buffer, guard elements included, must end up
// byte-identical. Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cast_cuda_test_util.h"
#include "common/numerics.h"
#include "cuda_test_util.h"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

using numerics::bits_float;

// ------------------------------------------------------------------------------------------------
// Scale updates over histories full of awkward amaxes.

float awkward_amax(std::mt19937& rng) {
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, bits_float(0x7FC00000u), bits_float(0xFFFFFFFFu),
                            FLT_TRUE_MIN, FLT_MAX, 1e-40f, -3.0f, 448.0f, 65504.0f};
  std::uniform_int_distribution<int> pick(0, 3), which(0, 11), exponent(-130, 130);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  if (pick(rng) == 0) return specials[which(rng)];
  return std::ldexp(mantissa(rng), exponent(rng));
}

TEST(CastCuda, ComputeScale) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  const int64_t n = 1000;
  for (int64_t history : {int64_t{0}, int64_t{4}}) {
    for (float fmax : {448.0f, 57344.0f, 65504.0f}) {
      for (bool pow2_scale : {true, false}) {
        for (int margin : {0, 3, 126}) {  // the accepted range is [0, 126]
          MirroredTensor a(DType::kFloat32, history == 0 ? std::vector<int64_t>{n} : std::vector<int64_t>{n, history});
          for (int64_t i = 0; i < a.numel(); ++i) a.set_float(i, awkward_amax(rng));
          MirroredTensor scale(DType::kFloat32, {n}), scale_inv(DType::kFloat32, {n});
          for (int64_t i = 0; i < n; ++i) {
            scale.set_float(i, std::ldexp(1.0f, static_cast<int>(i % 9) - 4));
            scale_inv.set_float(i, 1.0f / std::ldexp(1.0f, static_cast<int>(i % 9) - 4));
          }
          const ScalingRecipe recipe{margin, pow2_scale};
          expect_cuda_matches_cpu(
              {&a, &scale, &scale_inv},
              [&](Device d) { compute_scale(a.view(d), scale.view(d), scale_inv.view(d), fmax, recipe, nullptr); },
              "fmax " + std::to_string(fmax) + " pow2_scale " + std::to_string(pow2_scale) + " margin " + std::to_string(margin));
        }
      }
    }
  }
}

TEST(CastCuda, UpdateDelayedScaling) {
  REQUIRE_GPU();
  std::mt19937 rng(19);
  for (int64_t n : {int64_t{1}, int64_t{1000}}) {
    for (int64_t history : {int64_t{1}, int64_t{16}, int64_t{33}}) {
      for (bool pow2_scale : {true, false}) {
        MirroredTensor h(DType::kFloat32, {n, history});
        for (int64_t i = 0; i < h.numel(); ++i) h.set_float(i, awkward_amax(rng));
        MirroredTensor scale(DType::kFloat32, {n}), scale_inv(DType::kFloat32, {n}), counter(DType::kInt32, {n});
        std::uniform_int_distribution<int32_t> count(-2, static_cast<int32_t>(history) + 2);
        for (int64_t i = 0; i < n; ++i) {
          scale.set_float(i, 2.0f);
          scale_inv.set_float(i, 0.5f);
          counter.set_int(i, i == 0 ? INT32_MAX : count(rng));
        }
        const ScalingRecipe recipe{1, pow2_scale};
        // Several steps in a row, so rolled histories and counters feed the next update.
        for (int step = 0; step < 3; ++step) {
          expect_cuda_matches_cpu({&h, &scale, &scale_inv, &counter},
                                  [&](Device d) {
                                    update_delayed_scaling(h.view(d), scale.view(d), scale_inv.view(d),
                                                           counter.view(d), 448.0f, recipe, nullptr);
                                  },
                                  "n " + std::to_string(n) + " H " + std::to_string(history) + " pow2_scale " +
                                      std::to_string(pow2_scale) + " step " + std::to_string(step));
        }
      }
    }
  }
}

// 150 states of different row counts and history lengths: three launches of up to 64 states.
TEST(CastCuda, MultiUpdateDelayedScaling) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  std::vector<std::unique_ptr<MirroredTensor>> hs, scales, scale_invs, counters;
  for (int i = 0; i < 150; ++i) {
    const int64_t n = i % 7 == 0 ? 3 : 1, history = 1 + i % 17;
    hs.push_back(std::make_unique<MirroredTensor>(DType::kFloat32, std::vector<int64_t>{n, history}));
    scales.push_back(std::make_unique<MirroredTensor>(DType::kFloat32, std::vector<int64_t>{n}));
    scale_invs.push_back(std::make_unique<MirroredTensor>(DType::kFloat32, std::vector<int64_t>{n}));
    counters.push_back(std::make_unique<MirroredTensor>(DType::kInt32, std::vector<int64_t>{n}));
    for (int64_t j = 0; j < hs.back()->numel(); ++j) hs.back()->set_float(j, awkward_amax(rng));
    for (int64_t j = 0; j < n; ++j) {
      scales.back()->set_float(j, 2.0f);
      scale_invs.back()->set_float(j, 0.5f);
      counters.back()->set_int(j, static_cast<int32_t>(rng() % 20));
    }
  }
  const auto views_on = [](const std::vector<std::unique_ptr<MirroredTensor>>& ts, Device d) {
    std::vector<TensorView> v;
    for (const auto& t : ts) v.push_back(t->view(d));
    return v;
  };
  for (int step = 0; step < 3; ++step) {
    expect_cuda_matches_cpu(pointers(hs) + pointers(scales) + pointers(scale_invs) + pointers(counters),
                            [&](Device d) {
                              multi_update_delayed_scaling(views_on(hs, d), views_on(scales, d),
                                                           views_on(scale_invs, d), views_on(counters, d), 57344.0f,
                                                           ScalingRecipe{0, true}, nullptr);
                            },
                            "step " + std::to_string(step));
  }
}

}  // namespace
}  // namespace fp8amp
