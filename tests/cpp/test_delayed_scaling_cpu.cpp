// The delayed scaling sequence (scaling.h) through the public core API on CPU: the multi-tensor
// update against the single one, the history roll, the warm-up counter and non-finite amaxes.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "expect_error.h"
#include "fp8amp/scaling.h"
#include "host_view.h"

namespace fp8amp {
namespace {

// The multi-tensor update is the single one applied to each state; overlapping states are refused.
TEST(DelayedScaling, MultiUpdateIsEachStatesUpdate) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> amax(0.0f, 1000.0f);
  struct State {
    std::vector<float> hist, scale, scale_inv;
    std::vector<int32_t> counter;
    int64_t n, h;
  };
  std::vector<State> states, refs;
  for (int i = 0; i < 5; ++i) {
    State st{{}, {}, {}, {}, 1 + i % 2, 1 + 3 * i};
    for (int64_t j = 0; j < st.n * st.h; ++j) st.hist.push_back(amax(rng));
    if (i == 3) st.hist[0] = std::numeric_limits<float>::infinity();
    st.scale.assign(st.n, 2.0f);
    st.scale_inv.assign(st.n, 0.5f);
    st.counter.assign(st.n, i);
    states.push_back(st);
  }
  refs = states;
  const auto views = [](std::vector<State>& sts) {
    std::vector<TensorView> h, s, si, c;
    for (State& st : sts) {
      h.push_back(view(st.hist, DType::kFloat32, {st.n, st.h}));
      s.push_back(view(st.scale, DType::kFloat32, {st.n}));
      si.push_back(view(st.scale_inv, DType::kFloat32, {st.n}));
      c.push_back(view(st.counter, DType::kInt32, {st.n}));
    }
    return std::tuple{h, s, si, c};
  };
  for (int step = 0; step < 3; ++step) {
    auto [h, s, si, c] = views(states);
    multi_update_delayed_scaling(h, s, si, c, 448.0f, ScalingRecipe{1, true}, nullptr);
    for (State& r : refs) {
      update_delayed_scaling(view(r.hist, DType::kFloat32, {r.n, r.h}), view(r.scale, DType::kFloat32, {r.n}),
                             view(r.scale_inv, DType::kFloat32, {r.n}), view(r.counter, DType::kInt32, {r.n}), 448.0f,
                             ScalingRecipe{1, true}, nullptr);
    }
    for (size_t i = 0; i < states.size(); ++i) {
      EXPECT_EQ(states[i].hist, refs[i].hist);
      EXPECT_EQ(states[i].scale, refs[i].scale);
      EXPECT_EQ(states[i].scale_inv, refs[i].scale_inv);
      EXPECT_EQ(states[i].counter, refs[i].counter);
    }
  }
  auto [h, s, si, c] = views(states);
  expect_value_error([&] { multi_update_delayed_scaling(h, s, si, {c[0]}, 448.0f, ScalingRecipe{}, nullptr); },
                     "as many tensors each");
  si[2] = s[0];  // state 2's scale_inv is state 0's scale
  expect_value_error([&] { multi_update_delayed_scaling(h, s, si, c, 448.0f, ScalingRecipe{}, nullptr); },
                     "must not share memory");
  expect_value_error([&] { multi_update_delayed_scaling(h, s, si, c, 448.0f, ScalingRecipe{}, nullptr); },
                     "scales[0]");
  expect_value_error([&] { multi_update_delayed_scaling(h, s, si, c, 448.0f, ScalingRecipe{}, nullptr); },
                     "scale_invs[2]");
  si = std::get<2>(views(states));
  c[4] = view(states[4].hist, DType::kFloat32, {states[4].n});
  expect_value_error([&] { multi_update_delayed_scaling(h, s, si, c, 448.0f, ScalingRecipe{}, nullptr); },
                     "counters[4]");
}

TEST(DelayedScaling, HistoryRollCounterAndNonFinite) {
  const int64_t h = 3;
  std::vector<float> hist{10.0f, 0.0f, 0.0f};
  std::vector<float> scale{1.0f}, scale_inv{1.0f};
  std::vector<int32_t> counter{0};
  auto step = [&] {
    update_delayed_scaling(view(hist, DType::kFloat32, {1, h}), view(scale, DType::kFloat32, {1}),
                           view(scale_inv, DType::kFloat32, {1}), view(counter, DType::kInt32, {1}), 448.0f,
                           ScalingRecipe{}, nullptr);
  };
  step();
  EXPECT_EQ(hist, (std::vector<float>{0.0f, 10.0f, 0.0f}));
  EXPECT_EQ(scale[0], 32.0f);
  EXPECT_EQ(counter[0], 1);
  hist[0] = 1e4f;
  step();
  EXPECT_EQ(scale[0], 1.0f / 32.0f);
  hist[0] = std::numeric_limits<float>::infinity();
  step();  // inf is dropped, resets the counter; the window still holds 1e4 and 10
  EXPECT_EQ(counter[0], 0);
  EXPECT_EQ(scale[0], 1.0f / 32.0f);
  EXPECT_EQ(hist, (std::vector<float>{0.0f, 0.0f, 1e4f}));
  step();
  step();  // 1e4 has left the window, everything is 0: previous scale kept
  EXPECT_EQ(scale[0], 1.0f / 32.0f);
  EXPECT_EQ(counter[0], 0);  // steps that recorded no amax (a layer not cast) do not end the warm-up
  for (int i = 0; i < 5; ++i) {
    hist[0] = 1.0f;
    step();
  }
  EXPECT_EQ(counter[0], 3);  // capped at the history length
}

}  // namespace
}  // namespace fp8amp
