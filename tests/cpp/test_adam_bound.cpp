// The bounds of |p'| that the CUDA amax pass uses to skip the exact update (src/optim/adam_bound.h),
// on the CPU: the same code as the kernel's, with the approximate sqrt and reciprocal emulated
// adversarially (errors up to the 2^-16 the proof assumes, ftz flushing), against the reference's
// own p' (adam_param, the CPU step's operations), over millions of random and extreme elements and
// hyperparameters. Then the skip rule itself, simulated over whole tensors as the kernel applies it
// (ties, all-equal values, a large update on a small weight, NaN/inf, eps = 0): the maximum it
// finds must be the reference's, key for key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/optim.h"
#include "optim/adam_bound.h"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace {

using numerics::amax_key;
using numerics::bits_float;
using numerics::float_bits;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kMinNormal = 0x1p-126f;

// The approximate instructions as the proof assumes them, with the worst errors it allows: a
// relative error of up to 2^-16 (hardware: ~2^-23), of a random sign and size or at the extremes,
// subnormal inputs and outputs flushed to zero.
struct EmulatedApprox {
  std::mt19937* rng;
  int mode;  // 0: exact, 1: random in the allowed range, 2: always -max, 3: always +max

  double error() const {
    const double max = 0x1p-16 - 0x1p-23;  // leaves room for the rounding to float
    if (mode == 0) return 0.0;
    if (mode == 2) return -max;
    if (mode == 3) return max;
    return std::uniform_real_distribution<double>(-max, max)(*rng);
  }
  float sqrt(float x) const {
    if (std::isnan(x)) return kNan;
    if (std::fabs(x) < kMinNormal) return std::copysign(0.0f, x);  // flushed
    if (x < 0.0f) return kNan;
    if (std::isinf(x)) return kInf;
    return static_cast<float>(std::sqrt(static_cast<double>(x)) * (1.0 + error()));
  }
  float rcp(float x) const {
    if (std::isnan(x)) return kNan;
    if (std::fabs(x) < kMinNormal) return std::copysign(kInf, x);  // flushed input
    if (std::isinf(x)) return std::copysign(0.0f, x);
    const float r = static_cast<float>(1.0 / static_cast<double>(x) * (1.0 + error()));
    return std::fabs(r) < kMinNormal ? std::copysign(0.0f, r) : r;  // flushed output
  }
};

// Values from every corner of float32: ordinary magnitudes, tiny and huge ones, subnormals, zeros
// of both signs, infinities, NaN.
float any_value(std::mt19937& rng) {
  std::uniform_int_distribution<int> kind(0, 19);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  const float sign = rng() % 2 ? -1.0f : 1.0f;
  switch (kind(rng)) {
    case 0: return 0.0f * sign;
    case 1: return kInf * sign;
    case 2: return kNan;
    case 3: return std::numeric_limits<float>::max() * sign;
    case 4: return bits_float(1u + rng() % 0x7FFFFFu) * sign;  // subnormal
    case 5: return kMinNormal * sign;
    case 6: return std::ldexp(mant(rng), std::uniform_int_distribution<int>(-149, 127)(rng)) * sign;
    default: return std::ldexp(mant(rng), std::uniform_int_distribution<int>(-30, 8)(rng)) * sign;
  }
}

// Hyperparameters from typical to absurd (all valid for torch).
AdamHyper any_hyper(std::mt19937& rng) {
  const auto pick = [&rng](std::initializer_list<double> xs) { return xs.begin()[rng() % xs.size()]; };
  AdamHyper h;
  h.lr = pick({0.0, 1e-6, 1e-3, 3e-4, 0.5, 10.0, 1e10, 1e30});
  h.beta1 = pick({0.0, 0.5, 0.9, 0.99, 1.0 - 1e-9});
  h.beta2 = pick({0.0, 0.5, 0.999, 0.9999, 1.0 - 1e-12, 1.0 - 0x1p-53});
  h.eps = pick({0.0, 1e-45, 1e-40, 1e-30, 1e-12, 1e-8, 1e-3, 1.0, 1e30, 1e38, 1e39});
  h.weight_decay = pick({0.0, 0.01, 0.1, 1e3});
  h.adamw = rng() % 2;
  h.maximize = rng() % 8 == 0;
  return h;
}

int64_t any_step(std::mt19937& rng) {
  const int64_t steps[] = {1, 2, 3, 10, 1000, 1000000};
  return steps[rng() % 6];
}

// The bounds of one element, as the kernel computes them.
ParamBounds element_bounds(const AdamMoments& mo, const AdamConstants& c, const AdamBoundConstants& b,
                           const EmulatedApprox& approx) {
  return param_bounds(std::fabs(mo.param), update_bound(mo, c, b, approx));
}

// Lemmas 1 and 2 of adam_bound.h for one element.
void check_element(float p, float g, float m, float v, const AdamConstants& c, const AdamBoundConstants& b,
                   const EmulatedApprox& approx, int64_t* finite_bounds) {
  const AdamMoments mo = adam_moments(p, g, m, v, c);
  const float exact = adam_param(mo, c);  // the reference's p'
  const ParamBounds bounds = element_bounds(mo, c, b, approx);
  const auto where = [&] {
    return ::testing::Message() << std::hexfloat << "p " << p << " g " << g << " m " << m << " v " << v
                                << " -> |p'| " << std::fabs(exact) << " in [" << bounds.lower << ", "
                                << bounds.upper << "]";
  };
  if (bounds.upper < kInf) {  // what the skip rule trusts (Lemma 1)
    ++*finite_bounds;
    ASSERT_TRUE(std::isfinite(exact)) << where();
    ASSERT_LE(std::fabs(exact), bounds.upper) << where();
  }
  if (std::isfinite(exact)) {  // Lemma 2
    ASSERT_TRUE(std::isnan(bounds.lower) || bounds.lower <= std::fabs(exact)) << where();
  }
}

TEST(AdamBound, BoundsHoldForAnyElementAndHyperparameters) {
  std::mt19937 rng(11);
  int64_t finite = 0;
  for (int h = 0; h < 4000; ++h) {
    const AdamHyper hyper = any_hyper(rng);
    const AdamConstants c = adam_constants(hyper, any_step(rng));
    const AdamBoundConstants b = adam_bound_constants(c);
    for (int mode = 0; mode < 4; ++mode) {
      const EmulatedApprox approx{&rng, mode};
      for (int e = 0; e < 250; ++e) {
        // v >= 0 mostly (it is a stored square), sometimes anything (a corrupted state).
        float v = any_value(rng);
        if (rng() % 8 != 0) v = std::fabs(v);
        check_element(any_value(rng), any_value(rng), any_value(rng), v, c, b, approx, &finite);
        if (HasFatalFailure()) return;
      }
    }
  }
  EXPECT_GT(finite, 1000000);  // the bounds are usable for most of these
}

// Typical training values: the bounds are finite and tight enough for the skip to pay off.
TEST(AdamBound, BoundsAreTightForTypicalValues) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal;
  AdamHyper hyper;
  hyper.lr = 3e-4;
  hyper.weight_decay = 0.1;
  int64_t finite = 0;
  for (int64_t t : {int64_t{1}, int64_t{10}, int64_t{10000}}) {
    const AdamConstants c = adam_constants(hyper, t);
    const AdamBoundConstants b = adam_bound_constants(c);
    ASSERT_TRUE(std::isfinite(b.rel));
    for (int mode = 0; mode < 4; ++mode) {
      const EmulatedApprox approx{&rng, mode};
      for (int e = 0; e < 250000; ++e) {
        const float p = 0.02f * normal(rng);
        const float g = std::ldexp(normal(rng), -10);
        const float m = std::ldexp(normal(rng), -11);
        const float v = std::ldexp(std::fabs(normal(rng)), -22);
        check_element(p, g, m, v, c, b, approx, &finite);
        if (HasFatalFailure()) return;
        const AdamMoments mo = adam_moments(p, g, m, v, c);
        const ParamBounds bounds = element_bounds(mo, c, b, approx);
        // Width: twice the update (|p_d| +- w) and 2^-10 of it, plus a few ulps of p'.
        const float update = std::fabs(adam_param(mo, c) - mo.param);
        ASSERT_LE(bounds.upper - bounds.lower, (2.0f + 0x1p-10f) * update + 0x1p-20f * std::fabs(p))
            << p << " " << g << " " << m << " " << v;
      }
    }
  }
  EXPECT_EQ(finite, 3 * 4 * 250000);
}

// Hand-picked corners: eps = 0 with v' = 0 (0/0: p' NaN), a subnormal or negative v', a step that
// overflows, an infinite or disabling eps.
TEST(AdamBound, CornersOfTheProof) {
  std::mt19937 rng(13);
  int64_t finite = 0;
  const float vs[] = {0.0f, -0.0f, bits_float(1u), -bits_float(1u), bits_float(0x7FFFFFu), -bits_float(0x7FFFFFu),
                      kMinNormal, 1e-30f, 1.0f, 1e30f, std::numeric_limits<float>::max(), kInf, kNan, -1.0f};
  const float ms[] = {0.0f, -0.0f, bits_float(1u), 1e-40f, 1e-20f, 1.0f, -3e38f, kInf, kNan};
  const float ps[] = {0.0f, -0.0f, bits_float(1u), 1e-30f, 0.5f, -2.0f, 3e38f, -kInf, kNan};
  for (double eps : {0.0, 1e-45, 1e-38, 1e-8, 1.0, 0x1p100, 0x1p101, 1e39}) {
    for (double lr : {0.0, 1e-3, 1e30}) {
      for (double beta2 : {0.0, 0.999, 1.0 - 0x1p-53}) {
        AdamHyper h;
        h.lr = lr, h.eps = eps, h.beta2 = beta2, h.beta1 = 0.0;  // beta1 = 0: m' = g
        const AdamConstants c = adam_constants(h, 1);
        const AdamBoundConstants b = adam_bound_constants(c);
        for (int mode = 0; mode < 4; ++mode) {
          const EmulatedApprox approx{&rng, mode};
          for (float p : ps) {
            for (float g : ms) {
              for (float v : vs) {
                check_element(p, g, g, v, c, b, approx, &finite);
                if (HasFatalFailure()) return;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(finite, 0);
}

// ------------------------------------------------------------------------------------------------
// The skip rule over whole tensors, as the kernel applies it: packs of 8 elements for each of 32
// lanes, elements past the end being zeros; a pack's bounds are param_bounds of its largest |p_d|
// and ratio_bound of its largest |t|; per pack the threshold is the largest of the warp's pack
// lower bounds so far, nextup of each lane's exact maximum so far and nextup of a "known" value (an
// exact |p'| of an element evaluated elsewhere, as the amax row holds). When some lane's pack upper
// bound is not below it, the elements whose own upper bound is not below it are evaluated. The
// maximum key found must equal the reference's.

uint32_t skip_rule_max(const std::vector<AdamMoments>& mo, const AdamConstants& c, const AdamBoundConstants& b,
                       const EmulatedApprox& approx, uint32_t known, int64_t* evaluated) {
  constexpr int kLanes = 32, kPack = 8;
  const auto nextup = [](uint32_t key) { return static_cast<int32_t>(key + 1u); };
  const AdamMoments zero = adam_moments(0.0f, 0.0f, 0.0f, 0.0f, c);  // a lane past the end
  uint32_t found = known;  // the row already holds known (from another block's exact values)
  for (size_t w = 0; w < mo.size(); w += kLanes * kPack * 4) {  // a warp's 4 packs
    std::vector<uint32_t> lane_max(kLanes, 0);
    std::vector<float> lane_lower(kLanes, 0.0f);
    for (size_t pack = w; pack < std::min(mo.size(), w + kLanes * kPack * 4); pack += kLanes * kPack) {
      int32_t t = nextup(known);
      std::vector<float> lane_upper(kLanes);
      for (int lane = 0; lane < kLanes; ++lane) {
        float p_max = 0.0f, t_max = 0.0f;
        for (int k = 0; k < kPack; ++k) {
          const size_t j = pack + lane * kPack + k;
          const AdamMoments& x = j < mo.size() ? mo[j] : zero;
          p_max = max_nan(p_max, std::fabs(x.param));
          t_max = max_nan(t_max, std::fabs(update_ratio(x, c, approx)));
        }
        const ParamBounds bounds = param_bounds(p_max, ratio_bound(t_max, b));
        lane_lower[lane] = fmaxf(lane_lower[lane], bounds.lower);
        lane_upper[lane] = bounds.upper;
        t = std::max({t, static_cast<int32_t>(float_bits(lane_lower[lane])), nextup(lane_max[lane])});
      }
      const float threshold = bits_float(static_cast<uint32_t>(t));
      if (std::all_of(lane_upper.begin(), lane_upper.end(), [&](float u) { return u < threshold; })) continue;
      for (int lane = 0; lane < kLanes; ++lane) {
        for (int k = 0; k < kPack; ++k) {
          const size_t j = pack + lane * kPack + k;
          if (j >= mo.size() || element_bounds(mo[j], c, b, approx).upper < threshold) continue;
          ++*evaluated;
          lane_max[lane] = std::max(lane_max[lane], amax_key(adam_param(mo[j], c)));
        }
      }
    }
    for (uint32_t key : lane_max) found = std::max(found, key);
  }
  return found;
}

TEST(AdamBound, SkipRuleFindsTheExactMaximum) {
  std::mt19937 rng(14);
  std::normal_distribution<float> normal;
  int64_t evaluated = 0, typical_evaluated = 0, typical_elements = 0;
  for (int trial = 0; trial < 600; ++trial) {
    AdamHyper h = trial % 3 == 0 ? any_hyper(rng) : AdamHyper{};
    if (trial % 3 == 1) h.eps = 0.0;
    const AdamConstants c = adam_constants(h, any_step(rng));
    const AdamBoundConstants b = adam_bound_constants(c);
    const int n = 1 + static_cast<int>(rng() % 3000);
    std::vector<AdamMoments> mo(n);
    const int shape = (trial / 3) % 6;
    for (int j = 0; j < n; ++j) {
      float p = 0.02f * normal(rng), g = std::ldexp(normal(rng), -10), m = 0.0f, v = 0.0f;
      if (shape == 1) p = 0.5f, g = 1e-3f;                      // all equal
      if (shape == 2) p = (j % 2 ? 0.5f : -0.5f), g = (j % 3 ? 1e-3f : -1e-3f);  // ties of either sign
      if (shape == 3 && j == n / 2) p = 0.0f, g = 10.0f;        // a large update on a zero weight
      if (shape == 4) p = std::nextafter(0.5f, j % 2 ? 1.0f : 0.0f), g = 0.0f;  // 1-ulp neighbours
      if (shape == 5) p = any_value(rng), g = any_value(rng), m = any_value(rng), v = std::fabs(any_value(rng));
      mo[j] = adam_moments(p, g, m, v, c);
    }
    uint32_t expected = 0;
    for (const AdamMoments& x : mo) expected = std::max(expected, amax_key(adam_param(x, c)));
    // "known": nothing, or the exact value of a random element (as a finished block would give).
    const uint32_t known = trial % 2 ? 0u : amax_key(adam_param(mo[rng() % n], c));
    const EmulatedApprox approx{&rng, trial % 4};
    const int64_t before = evaluated;
    ASSERT_EQ(skip_rule_max(mo, c, b, approx, known, &evaluated), expected) << "trial " << trial << " shape " << shape;
    if (shape == 0 && trial % 3 != 0) typical_evaluated += evaluated - before, typical_elements += n;
  }
  // Gaussian weights, typical hyperparameters: a few exact values per warp, not per element (ties
  // and NaN/inf elements are evaluated in full, which the other shapes exercise).
  EXPECT_LT(typical_evaluated * 20, typical_elements);
}

}  // namespace
}  // namespace fp8amp
