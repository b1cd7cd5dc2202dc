// The kept master amax of the fused Adam step (optim.h, "Kept master amax") on the CPU reference:
// the bound pass 1 takes instead of reading the master, written out independently here; the
// exact amax the commit keeps; when the bound is not used; and that a skipped step keeps it.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "adam_test_util.h"
#include "fp8amp/optim.h"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace {

constexpr int64_t kN = 777;

// An O2 tensor: FP16 master, E4M3 grad and m, FP16 v, the E4M3 weight copy; its kept amax NaN.
Param o2_param(std::mt19937& rng) {
  Param x(kN, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true);
  x.p.set_scale(1024.0f);
  x.g.set_scale(8192.0f);
  x.m.set_scale(65536.0f);
  x.v.set_scale(1.0f);
  const std::vector<float> p = random_values(rng, kN, 4.0f);
  for (int64_t j = 0; j < kN; ++j) x.p.set_real(j, 0.05f * p[j]);
  x.kept = {std::nanf("")};
  return x;
}

void new_grads(Param& x, std::mt19937& rng) {
  const std::vector<float> g = random_values(rng, kN, 3.0f);
  for (int64_t j = 0; j < kN; ++j) x.g.set_real(j, 1e-3f * g[j]);
}

float stored_amax(const Param& x) {
  float a = 0.0f;
  for (int64_t j = 0; j < kN; ++j) a = std::max(a, std::fabs(x.p.real(j)));
  return a;
}

float pow2_scale(float amax, float fmax) { return std::exp2(std::floor(std::log2(static_cast<double>(fmax) / amax))); }

TEST(AdamKeptAmax, SecondStepBoundsTheMasterWithoutReadingIt) {
  std::mt19937 rng(11);
  Param x = o2_param(rng);
  Step s;
  s.hyper = hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, true);
  s.counter = {0.0f};

  // Step 1: unknown (NaN): pass 1 reads the master; the commit keeps the stored amax.
  new_grads(x, rng);
  s.run({&x});
  ASSERT_EQ(s.found_inf[0], 0.0f);
  EXPECT_EQ(s.amax[kAdamAmaxParam], s.amax[kAdamAmaxNewParam]);
  EXPECT_EQ(x.kept[0], stored_amax(x));

  // Step 2: the bound max_j rn(A * decay + |q_j|), q_j the update the documented order gives a
  // master value of 0 (AdamW decays p alone, so p_d = 0 leaves p' = q).
  new_grads(x, rng);
  const float a = x.kept[0];
  const float a_d = a * static_cast<float>(1.0 - s.hyper.lr * s.hyper.weight_decay);
  float bound = 0.0f, exact = 0.0f;
  for (int64_t j = 0; j < kN; ++j) {
    const float q = documented_order(0.0f, x.g.real(j), x.m.real(j), x.v.real(j), s.hyper, 2).p;
    bound = std::max(bound, a_d + std::fabs(q));
    exact = std::max(exact, std::fabs(documented_order(x.p.real(j), x.g.real(j), x.m.real(j), x.v.real(j), s.hyper, 2).p));
  }
  // The smallest 448 * 2^k or 65504 * 2^k >= bound (powers of two scale both exactly).
  float top448 = 448.0f, top65504 = 65504.0f;
  for (float* t : {&top448, &top65504}) {
    while (*t / 2.0f >= bound) *t /= 2.0f;
    while (*t < bound) *t *= 2.0f;
  }
  const float top = std::min(top448, top65504);
  s.run({&x});
  ASSERT_EQ(s.found_inf[0], 0.0f);
  EXPECT_EQ(s.amax[kAdamAmaxParam], top);
  EXPECT_EQ(s.amax[kAdamAmaxNewParam], exact);
  EXPECT_GE(bound, exact);
  EXPECT_LE(bound, exact * 1.01f);  // the update is small next to the weights
  EXPECT_EQ(x.p.scale[0], pow2_scale(bound, 65504.0f));
  EXPECT_EQ(x.p.scale[0], pow2_scale(top, 65504.0f));
  EXPECT_EQ(x.w.scale[0], pow2_scale(top, 448.0f));  // the E4M3 copy's, from the stored top (exact in FP16)
  EXPECT_EQ(x.w.scale[0], pow2_scale(bound, 448.0f));
  EXPECT_EQ(x.kept[0], stored_amax(x));
  for (int64_t j = 0; j < kN; ++j) ASSERT_NE(x.p.code(j) & 0x7FFFu, 0x7BFFu) << j;  // no code saturated at 65504
}

// The same call with no param_amax, with a NaN one, and (Adam with weight decay, which reads p
// before den) with a finite one: the same bytes but the kept amax itself.
TEST(AdamKeptAmax, ScaleGridTop) {
  EXPECT_EQ(scale_grid_top(65504.0f), 65504.0f);
  EXPECT_EQ(scale_grid_top(65505.0f), 114688.0f);  // 448 * 256
  EXPECT_EQ(scale_grid_top(448.0f), 448.0f);
  EXPECT_EQ(scale_grid_top(449.0f), 511.75f);  // 65504 / 128
  EXPECT_EQ(scale_grid_top(0.1f), 0.109375f);  // 448 * 2^-12
  EXPECT_EQ(scale_grid_top(0x1.ffcp-101f), 0x1.ffcp-101f);  // below 2^-100: itself
  EXPECT_EQ(scale_grid_top(0.0f), 0.0f);
  EXPECT_EQ(scale_grid_top(65504.0f * 0x1p112f), 65504.0f * 0x1p112f);
  EXPECT_TRUE(std::isinf(scale_grid_top(std::nextafter(65504.0f * 0x1p112f, INFINITY))));
  EXPECT_TRUE(std::isnan(scale_grid_top(std::nanf(""))));
  // Both scales from the top are those from x.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-90.0f, 120.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(u(rng));
    const float top = scale_grid_top(x);
    ASSERT_GE(top, x);
    ASSERT_LT(top / 1.752f, x);  // within one step of the grid (tops 1.142 and 1.751 times apart)
    ASSERT_EQ(pow2_scale(top, 65504.0f), pow2_scale(x, 65504.0f)) << x;
    ASSERT_EQ(pow2_scale(top, 448.0f), pow2_scale(x, 448.0f)) << x;
  }
}

TEST(AdamKeptAmax, UnknownOrAdamL2ReadsTheMaster) {
  for (const bool adamw : {true, false}) {
    std::mt19937 rng(12);
    Param base = o2_param(rng);
    new_grads(base, rng);
    Param none = base, unknown = base, kept = base;
    none.kept.clear();
    kept.kept = {adamw ? std::nanf("") : 0.0f};  // AdamW: NaN; Adam + L2: a wrong value, unused
    Step s;
    s.hyper = hyper(1e-2, 0.8, 0.9, 1e-6, 0.5, adamw);
    std::vector<std::vector<float>> amaxes;
    for (Param* x : {&none, &unknown, &kept}) {
      s.run({x});
      amaxes.push_back(s.amax);
      x->kept.clear();
    }
    EXPECT_EQ(none.snapshot(), unknown.snapshot());
    EXPECT_EQ(none.snapshot(), kept.snapshot());
    EXPECT_EQ(amaxes[0], amaxes[1]);
    EXPECT_EQ(amaxes[0], amaxes[2]);
  }
}

TEST(AdamKeptAmax, SkippedStepKeepsItAndTheBoundStillFindsNonFiniteGrads) {
  std::mt19937 rng(13);
  Param x = o2_param(rng);
  Step s;
  s.hyper = hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, true);
  new_grads(x, rng);
  s.run({&x});
  const float kept = x.kept[0];
  ASSERT_TRUE(std::isfinite(kept));
  x.g.scale_inv[0] = std::numeric_limits<float>::infinity();  // an inf grad, with the bound in use
  const std::vector<uint8_t> before = x.snapshot();
  s.t = 2;
  s.run({&x});
  EXPECT_EQ(s.found_inf[0], 1.0f);
  EXPECT_EQ(x.snapshot(), before);
  EXPECT_EQ(x.kept[0], kept);
}

}  // namespace
}  // namespace fp8amp
