// AdamPlan (optim.h): the fused Adam step over buffers checked once. Its steps equal adam_step's
// bit for bit, and each step still checks what it brings (the grads, the step's own buffers).

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "adam_test_util.h"
#include "expect_error.h"
#include "fp8amp/error.h"
#include "fp8amp/optim.h"

namespace fp8amp {
namespace {

// The mixed formats of one call: an O2 tensor (FP16 master and its E4M3 copy, E4M3 grad and m,
// FP16 v), a float32 one and an O1 one with a bfloat16 grad, of odd sizes; the last two keep a step
// count each.
std::vector<Param> mixed_params(uint32_t seed) {
  std::vector<Param> ps;
  ps.emplace_back(37, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  ps.emplace_back(5, DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat32, false);
  ps.emplace_back(130, DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat32, false);
  ps[1].count = {0.0f};
  ps[2].count = {0.0f};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Param& p : ps) {
    p.p.set_scale(1024.0f);
    for (int64_t j = 0; j < p.n; ++j) p.p.set_real(j, 0.1f * normal(rng));
  }
  return ps;
}

// This step's grads of `ps`, the same values for the same (seed, step).
void set_grads(std::vector<Param>& ps, uint32_t step) {
  std::mt19937 rng(step);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Param& p : ps) {
    p.g.set_scale(16.0f);
    for (int64_t j = 0; j < p.n; ++j) p.g.set_real(j, normal(rng));
  }
}

TEST(AdamPlan, StepsEqualAdamStepBitForBit) {
  std::vector<Param> planned = mixed_params(1), direct = mixed_params(1);
  std::vector<AdamTensors> tensors;
  for (Param& p : planned) tensors.push_back(p.tensors());
  const AdamPlan plan(tensors);
  ASSERT_EQ(plan.size(), 3u);
  for (uint32_t t = 1; t <= 4; ++t) {
    set_grads(planned, t);
    set_grads(direct, t);
    Step s;
    s.hyper = hyper(1e-2 * t, 0.9, 0.99, 1e-8, 0.1, t % 2 == 1);  // the numbers change every step
    s.t = t;
    s.run({&direct[0], &direct[1], &direct[2]});

    std::vector<TensorView> grads;
    std::vector<std::optional<TensorView>> grad_scale_invs;
    for (Param& p : planned) {
      const AdamTensors now = p.tensors();
      grads.push_back(now.grad);
      grad_scale_invs.push_back(now.grad_scale_inv);
    }
    std::vector<float> found{0.0f}, amax(3 * kAdamAmaxColumns, -1.0f);
    TensorView amax_view = scalar_view(amax);
    amax_view.shape = {3, kAdamAmaxColumns};
    plan.step(grads, grad_scale_invs, s.hyper, t, nullptr, scalar_view(found), amax_view, nullptr);
    EXPECT_EQ(amax, s.amax) << "step " << t;
    EXPECT_EQ(found, s.found_inf) << "step " << t;
    for (size_t i = 0; i < planned.size(); ++i) {
      EXPECT_EQ(planned[i].snapshot(), direct[i].snapshot()) << "tensor " << i << ", step " << t;
    }
    EXPECT_EQ(planned[2].count[0], static_cast<float>(t));
  }
}

TEST(AdamPlan, EachStepChecksWhatItBrings) {
  std::vector<Param> ps = mixed_params(2);
  set_grads(ps, 1);
  std::vector<AdamTensors> tensors;
  for (Param& p : ps) tensors.push_back(p.tensors());
  const AdamPlan plan(tensors);
  const std::vector<std::vector<uint8_t>> before{ps[0].snapshot(), ps[1].snapshot(), ps[2].snapshot()};

  std::vector<float> found{0.0f}, amax(3 * kAdamAmaxColumns);
  TensorView amax_view = scalar_view(amax);
  amax_view.shape = {3, kAdamAmaxColumns};
  const auto step_with = [&](std::vector<TensorView> grads, std::vector<std::optional<TensorView>> scale_invs) {
    return [&plan, &found, amax_view, grads, scale_invs] {
      plan.step(grads, scale_invs, AdamHyper{}, 1, nullptr, scalar_view(found), amax_view, nullptr);
    };
  };
  const std::vector<TensorView> grads{tensors[0].grad, tensors[1].grad, tensors[2].grad};
  const std::vector<std::optional<TensorView>> scale_invs{tensors[0].grad_scale_inv, std::nullopt, std::nullopt};

  expect_value_error(step_with({grads[0], grads[1]}, scale_invs), "grads must hold one tensor per param (3), got 2");
  expect_value_error(step_with(grads, {scale_invs[0]}), "grad_scale_invs must be empty or hold one entry per param");
  expect_value_error(step_with(grads, {}), "grad_scale_invs[0] is required: its grad is float8");
  std::vector<TensorView> wrong = grads;
  wrong[2].shape = {129};
  expect_value_error(step_with(wrong, scale_invs), "grads[2] and its param must have the same shape");
  wrong = grads;
  wrong[1].dtype = DType::kUInt8;
  expect_value_error(step_with(wrong, scale_invs), "grads[1] must be float32, bfloat16, float16");
  wrong = grads;
  wrong[1] = tensors[1].exp_avg;  // a grad inside a buffer the plan writes
  expect_value_error(step_with(wrong, scale_invs), "grads[1] and exp_avgs[1] must not share memory");
  std::vector<std::optional<TensorView>> wrong_scales = scale_invs;
  wrong_scales[0] = tensors[0].exp_avg_scale_inv;
  expect_value_error(step_with(grads, wrong_scales), "grad_scale_invs[0] and exp_avg_scale_invs[0] must not share");
  expect_value_error([&] { plan.step(grads, scale_invs, AdamHyper{}, 1, nullptr, *tensors[2].param_scale,
                                     amax_view, nullptr); },
                     "found_inf and param_scales[2] must not share memory");
  const TensorView count = *tensors[1].step_count;  // the plan's: it writes it
  expect_value_error([&] { plan.step(grads, scale_invs, AdamHyper{}, 0, &count, scalar_view(found), amax_view,
                                     nullptr); },
                     "step_tensor and step_counts[1] must not share memory");
  expect_value_error([&] { plan.step({grads[0], grads[1], scalar_view(found)}, scale_invs, AdamHyper{}, 1, nullptr,
                                     scalar_view(found), amax_view, nullptr); },
                     "grads[2] and its param must have the same shape");
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ps[i].snapshot(), before[i]) << "tensor " << i;  // nothing written
}

TEST(AdamPlan, MakingOneChecksTheBuffersAsAdamStepDoes) {
  std::vector<Param> ps = mixed_params(3);
  std::vector<AdamTensors> tensors;
  for (Param& p : ps) tensors.push_back(p.tensors());
  expect_value_error([] { AdamPlan(std::vector<AdamTensors>{}); }, "params must hold at least one tensor");
  std::vector<AdamTensors> wrong = tensors;
  wrong[1].exp_avg_sq = wrong[1].exp_avg;
  expect_value_error([&] { AdamPlan{wrong}; }, "exp_avgs[1] and exp_avg_sqs[1] must not share memory");
  wrong = tensors;
  wrong[0].weight_scale_inv.reset();
  expect_value_error([&] { AdamPlan{wrong}; }, "weight_scale_invs[0] is required");
  wrong = tensors;
  wrong[0].param_scale_inv.reset();
  expect_value_error([&] { AdamPlan{wrong}; }, "param_scale_invs[0] is required: its param is float16");
  // The grads are not the plan's: an empty or absent one is no error when it is made.
  for (AdamTensors& t : tensors) t.grad = TensorView{};
  EXPECT_NO_THROW(AdamPlan{tensors});
}

}  // namespace
}  // namespace fp8amp
