// Stochastic rounding of float16 masters (optim.h, "Stochastic rounding of the master") on the CPU
// reference: updates below half an FP16 unit move the master by their size on average (lost to
// round-to-nearest), a run repeats bit for bit, the kept amax stays the largest stored magnitude,
// and nothing else changes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "adam_test_util.h"
#include "fp8amp/optim.h"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace {

// n elements of a float16 master at `value` (scale 2^14, so 1.0 is stored mid-range), float32
// grad g, m and v zero: the first AdamW step's update is lr * g / (|g| + eps * ...) ~ lr.
Param master(int64_t n, float value, float g) {
  Param x(n, DType::kFloat16, DType::kFloat32, DType::kFloat32, DType::kFloat32, false);
  x.p.set_scale(16384.0f);
  for (int64_t j = 0; j < n; ++j) {
    x.p.set_real(j, value);
    x.g.set_real(j, g);
  }
  return x;
}

Step stochastic_step(double lr, uint64_t seed) {
  Step s;
  s.hyper = hyper(lr, 0.9, 0.999, 1e-8, 0.0, true);
  s.hyper.stochastic_rounding = true;
  s.hyper.rounding_seed = seed;
  return s;
}

float stored_amax(const Param& x) {
  float a = 0.0f;
  for (int64_t j = 0; j < x.n; ++j) a = std::max(a, std::fabs(x.p.real(j)));
  return a;
}

TEST(AdamStochastic, UpdatesBelowHalfAUnitMoveTheMasterOnAverage) {
  constexpr int64_t kN = 65536;
  const double lr = 0.1 * std::exp2(-11.0);  // a tenth of FP16's spacing just below 1.0
  Param nearest = master(kN, 1.0f, 1.0f);
  Step rn;
  rn.hyper = stochastic_step(lr, 0).hyper;
  rn.hyper.stochastic_rounding = false;
  rn.run({&nearest});
  Param x = master(kN, 1.0f, 1.0f);
  Step s = stochastic_step(lr, 7);
  s.run({&x});
  ASSERT_EQ(s.found_inf[0], 0.0f);

  const float exact = documented_order(1.0f, 1.0f, 0.0f, 0.0f, s.hyper, 1).p;
  ASSERT_LT(exact, 1.0f);
  int64_t moved = 0;
  double sum = 0.0;
  for (int64_t j = 0; j < kN; ++j) {
    ASSERT_EQ(nearest.p.real(j), 1.0f) << j;  // round to nearest loses the update everywhere
    const float p = x.p.real(j);
    ASSERT_TRUE(p == 1.0f || p == 1.0f - 0x1p-11f) << j << " " << p;
    moved += p != 1.0f;
    sum += p;
  }
  // P(down) = (1 - exact) / 2^-11 ~ 0.1; the binomial's sigma over 65536 elements is 0.0012.
  const double share = static_cast<double>(moved) / kN;
  EXPECT_NEAR(share, (1.0 - exact) / 0x1p-11, 0.01);
  EXPECT_NEAR(sum / kN, exact, 5e-6);
}

TEST(AdamStochastic, ARunRepeatsAndSeedsStepsAndTensorsDrawDifferentBits) {
  constexpr int64_t kN = 4099;  // odd: a last pair of one element
  const double lr = 0.5 * std::exp2(-11.0);
  auto run = [&](uint64_t seed, int64_t t) {
    Param a = master(kN, 1.0f, 1.0f), b = master(kN, 1.0f, 1.0f);
    Step s = stochastic_step(lr, seed);
    s.t = t;
    s.run({&a, &b});
    return std::make_pair(a.p.bytes, b.p.bytes);
  };
  const auto first = run(3, 5);
  EXPECT_EQ(first, run(3, 5));
  EXPECT_NE(first.first, first.second);  // two equal tensors of one call round apart
  EXPECT_NE(first.first, run(4, 5).first);
  EXPECT_NE(first.first, run(3, 6).first);
  EXPECT_NE(first.first, run(uint64_t{3} | (uint64_t{1} << 40), 5).first);  // the seed's high bits count
}

TEST(AdamStochastic, StreamsOfNearbyKeysShareNoStructure) {
  // With bits = random_bits(key ^ pair), keys differing by d gave a tensor pair p^d's bits at pair p:
  // whole tensors drew the same bits, permuted (found for seed 62687505, d = 30). Now a stream
  // matches another's at a pair only by chance: 2^-32 a pair, so none of these 2^16 pairs.
  constexpr uint32_t kPairs = 1u << 16;
  const RoundingStream a = rounding_stream(62687505, 1, 0, 0);
  for (const uint32_t d : {1u, 30u, 255u, 4096u}) {
    const uint32_t key = a.key ^ d;  // a stream whose key differs by d, its offset made as rounding_stream makes it
    const RoundingStream b{key, numerics::random_bits(key ^ 0x9E3779B9u)};
    int shared = 0;
    for (uint32_t p = 0; p < kPairs; ++p) shared += pair_random_bits(b, p) == pair_random_bits(a, p ^ d);
    EXPECT_EQ(shared, 0) << d;
  }
}

TEST(AdamStochastic, KeptAmaxIsTheLargestStoredMagnitudeAndNothingSaturates) {
  // An O2 tensor stepped 30 times with its kept amax, weights whose largest element sits on the
  // scale grid's edges; each commit keeps the largest stored magnitude, which bounds the next step.
  constexpr int64_t kN = 1000;
  std::mt19937 rng(5);
  Param x(kN, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  x.p.set_scale(1.0f);
  x.g.set_scale(8192.0f);
  x.m.set_scale(65536.0f);
  const std::vector<float> p = random_values(rng, kN, 2.0f);
  for (int64_t j = 0; j < kN; ++j) x.p.set_real(j, 0.05f * p[j]);
  x.p.set_real(0, 65504.0f / 65536.0f);  // 0.99951..., on FP16's top code with scale 65536 after the step
  x.kept = {std::nanf("")};
  Step s = stochastic_step(1e-4, 11);
  s.counter = {0.0f};
  for (int step = 0; step < 30; ++step) {
    const std::vector<float> g = random_values(rng, kN, 3.0f);
    for (int64_t j = 0; j < kN; ++j) x.g.set_real(j, (step % 2 ? 1e-3f : -1e-3f) * std::fabs(g[j]));
    s.run({&x});
    ASSERT_EQ(s.found_inf[0], 0.0f) << step;
    EXPECT_EQ(x.kept[0], stored_amax(x)) << step;
    EXPECT_EQ(s.amax[kAdamAmaxNewParam], stored_amax(x)) << step;
    for (int64_t j = 0; j < kN; ++j) ASSERT_LE(std::fabs(x.p.real(j)) * x.p.scale[0], 65504.0f) << step << " " << j;
  }
}

TEST(AdamStochastic, OnlyFloat16MastersChange) {
  // Moments, E4M3 copies of unchanged masters and float32 params are as round-to-nearest makes them.
  constexpr int64_t kN = 513;
  std::mt19937 rng(2);
  auto o2 = [&]() {
    std::mt19937 r(rng);
    Param x(kN, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
    x.p.set_scale(1024.0f);
    x.g.set_scale(4096.0f);
    x.m.set_scale(65536.0f);
    const std::vector<float> p = random_values(r, kN, 3.0f), g = random_values(r, kN, 3.0f);
    for (int64_t j = 0; j < kN; ++j) x.p.set_real(j, 0.02f * p[j]), x.g.set_real(j, 1e-3f * g[j]);
    return x;
  };
  auto fp32 = [&]() {
    std::mt19937 r(rng);
    const std::vector<float> p = random_values(r, kN, 3.0f), g = random_values(r, kN, 3.0f);
    return fp32_param(p, g, std::vector<float>(kN, 0.0f), std::vector<float>(kN, 0.0f));
  };
  Param a = o2(), b = o2(), c = fp32(), d = fp32();
  Step sr = stochastic_step(1e-3, 9), rn = stochastic_step(1e-3, 9);
  rn.hyper.stochastic_rounding = false;
  sr.run({&a, &c});
  rn.run({&b, &d});
  EXPECT_EQ(a.m.bytes, b.m.bytes);
  EXPECT_EQ(a.v.bytes, b.v.bytes);
  EXPECT_EQ(a.p.scale, b.p.scale);  // from the same amax of p'
  EXPECT_NE(a.p.bytes, b.p.bytes);
  EXPECT_EQ(c.snapshot(), d.snapshot());
  for (int64_t j = 0; j < kN; ++j) {  // one FP16 unit at most between the two roundings
    const int diff = static_cast<int>(a.p.code(j) & 0x7FFFu) - static_cast<int>(b.p.code(j) & 0x7FFFu);
    ASSERT_LE(std::abs(diff), 1) << j;
  }
}

}  // namespace
}  // namespace fp8amp
