// The element-wise cast ops through the public core API on CPU: hand-derived results of quantize
// (delayed scaling and warm-up), amax over row runs, quantize_current against the ops it replaces,
// dequantize, and the multi-tensor forms. cast_transpose is tested in test_cast_transpose_cpu.cpp,
// the scale updates in test_delayed_scaling_cpu.cpp, bad arguments in test_cast_errors_cpu.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "cast_test_util.h"
#include "expect_error.h"
#include "fp8amp/cast.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"
#include "host_view.h"

namespace fp8amp {
namespace {

TEST(Quantize, E4M3WithScaleAndAmax) {
  std::vector<float> x{1.0f, -3.0f, 10.0f, 0.0f, std::ldexp(1.0f, -20)};
  std::vector<uint8_t> y(x.size(), 0xAA);
  State st;
  st.scale[0] = 32.0f;  // the pow2 scale of amax 10
  st.amax[0] = 2.0f;    // accumulated from an earlier micro-batch
  quantize(view(x, DType::kFloat32, {5}), view(y, DType::kFloat8E4M3, {5}), st.scaling(), nullptr);
  EXPECT_EQ(y, (std::vector<uint8_t>{0x60, 0xEC, 0x7A, 0x00, 0x00}));  // 32, -96, 320, 0, 2^-15 -> 0
  EXPECT_EQ(st.amax[0], 10.0f);
  EXPECT_EQ(st.scale_inv[0], 1.0f / 32.0f);
}

TEST(Quantize, AmaxPropagatesNaN) {
  std::vector<float> x{1.0f, std::nanf(""), 3.0f};
  std::vector<uint8_t> y(3);
  State st;
  quantize(view(x, DType::kFloat32, {3}), view(y, DType::kFloat8E5M2, {3}), st.scaling(), nullptr);
  EXPECT_TRUE(std::isnan(st.amax[0]));
  EXPECT_EQ(y[1], 0x7F);
}

// row_runs: which layouts an order-free reduction reads in place, and as which runs.
TEST(RowRuns, OfLayouts) {
  std::vector<float> buf(1);
  const auto runs = [&](std::vector<int64_t> shape, std::vector<int64_t> strides) {
    return row_runs(view(buf, DType::kFloat32, std::move(shape), std::move(strides)));
  };
  const auto expect_runs = [](std::optional<RowRuns> got, int64_t rows, int64_t cols, int64_t row_stride) {
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->rows, rows);
    EXPECT_EQ(got->cols, cols);
    EXPECT_EQ(got->row_stride, row_stride);
  };
  expect_runs(runs({3, 4}, {}), 1, 12, 12);                // contiguous, no strides given
  expect_runs(runs({3, 4}, {4, 1}), 1, 12, 12);            // contiguous
  expect_runs(runs({2, 3, 4}, {4, 8, 1}), 1, 24, 24);      // a permutation of a contiguous tensor
  expect_runs(runs({4, 3}, {5, 1}), 4, 3, 5);              // columns 0-2 of a 4 x 5 matrix
  expect_runs(runs({2, 2, 3, 4}, {72, 4, 24, 1}), 6, 8, 24);  // SDPA's q: (B, H, T, D) of a (B, T, 3, H, D) output
  expect_runs(runs({1, 4, 1}, {99, 1, 7}), 1, 4, 4);       // dims of size 1 have any stride
  expect_runs(runs({1, 1}, {5, 9}), 1, 1, 1);
  expect_runs(runs({0, 4}, {9, 1}), 1, 0, 0);              // empty
  expect_runs(runs({4}, {2}), 4, 1, 2);                   // every other element: runs of one
  expect_runs(runs({1, 3}, {1, 7}), 3, 1, 7);              // a column
  EXPECT_FALSE(runs({3, 4}, {0, 1}).has_value());          // broadcast rows
  EXPECT_FALSE(runs({3}, {0}).has_value());
  EXPECT_FALSE(runs({3, 4}, {2, 1}).has_value());          // overlapping rows
  EXPECT_FALSE(runs({2, 3}, {1, 1}).has_value());
  EXPECT_FALSE(runs({2, 3, 4}, {40, 10, 1}).has_value());  // two outer strides
  EXPECT_FALSE(runs({2, 3}, {10, 2}).has_value());         // every other column of rows: two strides
}

TEST(Amax, ReadsOnlyTheRuns) {
  // A 4 x 5 matrix whose columns 3 and 4 hold larger values and a NaN: columns 0-2 have amax 7.
  std::vector<float> m(20, 100.0f);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 3; ++c) m[r * 5 + c] = static_cast<float>(r * 2 - c);
  }
  m[9] = std::nanf("");
  std::vector<float> amax{1.0f};
  fp8amp::amax(view(m, DType::kFloat32, {4, 3}, {5, 1}), view(amax, DType::kFloat32, {1}), nullptr, 0, nullptr);
  EXPECT_EQ(amax[0], 6.0f);
  fp8amp::amax(view(m, DType::kFloat32, {3, 4}, {1, 3}), view(amax, DType::kFloat32, {1}), nullptr, 0, nullptr);
  EXPECT_TRUE(std::isnan(amax[0]));  // a transposed (permuted) view of elements 0-11 holds m[9]
  std::vector<float> fresh{0.0f};
  const TensorView two_strides = view(m, DType::kFloat32, {2, 3, 2}, {10, 3, 1});
  expect_value_error([&] { fp8amp::amax(two_strides, view(fresh, DType::kFloat32, {1}), nullptr, 0, nullptr); },
                     "amax: x must be contiguous, a permutation of a contiguous tensor, or rows of equal length");
  EXPECT_EQ(fresh[0], 0.0f);
}

TEST(Quantize, WarmupUsesCurrentScaling) {
  std::vector<float> x{10.0f, -1.0f};
  std::vector<uint8_t> y(2);
  std::vector<int32_t> counter{0};
  State st;
  st.scale[0] = 1.0f;
  TensorView c = view(counter, DType::kInt32, {1});
  Scaling s = st.scaling();
  s.warmup_counter = &c;
  s.warmup_steps = 16;
  quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {2}), s, nullptr);
  EXPECT_EQ(st.scale_inv[0], 1.0f / 32.0f);  // from amax 10, not the stored scale 1
  EXPECT_EQ(st.scale[0], 1.0f);              // the stored scale is the update's to change
  counter[0] = 16;                           // warmed up: delayed scale is used as is
  quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {2}), s, nullptr);
  EXPECT_EQ(st.scale_inv[0], 1.0f);
  EXPECT_EQ(y[0], 0x52);  // 10.0 in E4M3
}

// quantize_current against what it replaces: amax into a zero, compute_scale from (1, 1), quantize
// with that scale; then the NaN rule for scale_inv.
void expect_quantize_current_is_the_composition(std::vector<float> x, DType out_dtype, int margin) {
  const int64_t n = static_cast<int64_t>(x.size());
  const size_t code_bytes = out_dtype == DType::kFloat16 ? 2 : 1;
  for (bool nan_if_nonfinite : {false, true}) {
    std::vector<uint8_t> got(x.size() * code_bytes, 0xAA), want(x.size() * code_bytes, 0x55);
    std::vector<float> scale_inv{-7.0f}, amax{-7.0f};
    quantize_current(view(x, DType::kFloat32, {n}), view(got, out_dtype, {n}), view(scale_inv, DType::kFloat32, {1}),
                     view(amax, DType::kFloat32, {1}), margin, nan_if_nonfinite, nullptr);
    std::vector<float> ref_amax{0.0f}, scale{1.0f}, ref_scale_inv{1.0f};
    fp8amp::amax(view(x, DType::kFloat32, {n}), view(ref_amax, DType::kFloat32, {1}), nullptr, 0, nullptr);
    compute_scale(view(ref_amax, DType::kFloat32, {1}), view(scale, DType::kFloat32, {1}),
                  view(ref_scale_inv, DType::kFloat32, {1}), format_max(out_dtype), ScalingRecipe{margin, true}, nullptr);
    Scaling s{view(scale, DType::kFloat32, {1}), view(ref_amax, DType::kFloat32, {1}),
              view(ref_scale_inv, DType::kFloat32, {1})};
    quantize(view(x, DType::kFloat32, {n}), view(want, out_dtype, {n}), s, nullptr);
    EXPECT_EQ(got, want);
    EXPECT_EQ(std::memcmp(&amax[0], &ref_amax[0], 4), 0) << amax[0] << " vs " << ref_amax[0];
    if (nan_if_nonfinite && !std::isfinite(ref_amax[0])) {
      uint32_t bits;
      std::memcpy(&bits, &scale_inv[0], 4);
      EXPECT_EQ(bits, 0x7FC00000u);
    } else {
      EXPECT_EQ(scale_inv[0], ref_scale_inv[0]);
    }
  }
}

TEST(QuantizeCurrent, EqualsAmaxComputeScaleQuantize) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 30.0f);
  std::vector<float> x(1000);
  for (float& v : x) v = normal(rng);
  const float inf = std::numeric_limits<float>::infinity();
  for (DType out : {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kFloat16}) {
    expect_quantize_current_is_the_composition(x, out, 0);
    expect_quantize_current_is_the_composition(x, out, 3);
    expect_quantize_current_is_the_composition({0.0f, -0.0f, 0.0f}, out, 0);  // amax 0: scale 1
    expect_quantize_current_is_the_composition({1.0f, inf, -2.0f}, out, 0);   // scale 1, scale_inv NaN with the rule
    expect_quantize_current_is_the_composition({1.0f, std::nanf(""), 1e-30f}, out, 1);
    expect_quantize_current_is_the_composition({}, out, 0);
  }
}

TEST(QuantizeCurrent, RefusesBadArguments) {
  std::vector<float> x(4, 1.0f), scale_inv(1), amax(1), two(2);
  std::vector<uint8_t> y(4);
  const auto run = [&](const TensorView& out, const TensorView& si, const TensorView& a, int margin) {
    quantize_current(view(x, DType::kFloat32, {4}), out, si, a, margin, false, nullptr);
  };
  const TensorView out = view(y, DType::kFloat8E4M3, {4});
  expect_value_error([&] { run(view(x, DType::kFloat32, {4}), view(scale_inv, DType::kFloat32, {1}),
                               view(amax, DType::kFloat32, {1}), 0); }, "quantize_current: dtype");
  expect_value_error([&] { run(out, view(two, DType::kFloat32, {2}), view(amax, DType::kFloat32, {1}), 0); },
                     "quantize_current: scale_inv");
  expect_value_error([&] { run(out, view(scale_inv, DType::kFloat32, {1}), view(two, DType::kFloat32, {2}), 0); },
                     "quantize_current: amax");
  expect_value_error([&] { run(out, view(scale_inv, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1}), -1); },
                     "quantize_current: margin");
  expect_value_error([&] { run(out, view(scale_inv, DType::kFloat32, {1}), view(scale_inv, DType::kFloat32, {1}), 0); },
                     "quantize_current: scale_inv and amax must not share memory");
}

TEST(Dequantize, AllE4M3CodesToFloat32) {
  std::vector<uint8_t> x(256);
  for (int i = 0; i < 256; ++i) x[i] = static_cast<uint8_t>(i);
  std::vector<float> y(256);
  std::vector<float> scale_inv{0.5f};
  dequantize(view(x, DType::kFloat8E4M3, {256}), view(scale_inv, DType::kFloat32, {1}),
             view(y, DType::kFloat32, {256}), nullptr);
  EXPECT_EQ(y[0x38], 0.5f);
  EXPECT_EQ(y[0x7E], 224.0f);
  EXPECT_EQ(y[0xFE], -224.0f);
  EXPECT_TRUE(std::isnan(y[0x7F]));
  EXPECT_TRUE(std::isnan(y[0xFF]));
}

TEST(MultiTensor, EachTensorUsesItsRow) {
  std::vector<float> x0{1.0f, 2.0f}, x1{}, x2{-120.0f};
  std::vector<uint8_t> y0(2), y1(0), y2(1);
  std::vector<float> scale{1.0f, 2.0f, 4.0f}, amax(3 * 4, 0.0f), scale_inv(3, 0.0f);
  Scaling s{view(scale, DType::kFloat32, {3}), view(amax, DType::kFloat32, {3, 4}),
            view(scale_inv, DType::kFloat32, {3})};
  multi_quantize({view(x0, DType::kFloat32, {2}), view(x1, DType::kFloat32, {0}), view(x2, DType::kFloat32, {1})},
                 {view(y0, DType::kFloat8E4M3, {2}), view(y1, DType::kFloat8E4M3, {0}),
                  view(y2, DType::kFloat8E4M3, {1})},
                 s, nullptr);
  EXPECT_EQ(amax[0], 2.0f);
  EXPECT_EQ(amax[4], 0.0f);
  EXPECT_EQ(amax[8], 120.0f);
  EXPECT_EQ(amax[9], 0.0f);  // only column 0 of the history is touched
  EXPECT_EQ(scale_inv, (std::vector<float>{1.0f, 0.5f, 0.25f}));
  EXPECT_EQ(y2[0], 0xFE);  // -480 saturates to -448
}

// multi_amax of FP8 codes: the largest magnitude of the codes' values (the sign ignored), NaN for
// a NaN code (E4M3's 0x7F / 0xFF; E5M2's infinities count as infinite), folded into the rows.
TEST(MultiTensor, AmaxOfCodes) {
  std::vector<uint8_t> e4m3_0{0x38, 0xC0, 0x01}, e4m3_1{}, e4m3_2{0xFE, 0x7F}, e5m2{0x3C, 0xFC};
  std::vector<float> amax{0.5f, 7.0f, 0.0f};  // folds: max(row, amax of the codes)
  multi_amax({view(e4m3_0, DType::kFloat8E4M3, {3}), view(e4m3_1, DType::kFloat8E4M3, {0}),
              view(e4m3_2, DType::kFloat8E4M3, {2})},
             view(amax, DType::kFloat32, {3}), nullptr);
  EXPECT_EQ(amax[0], 2.0f);  // E4M3: 1, -2, 2^-9
  EXPECT_EQ(amax[1], 7.0f);  // empty: the row as it was
  EXPECT_TRUE(std::isnan(amax[2]));  // -448 and NaN
  std::vector<float> one{0.0f};
  multi_amax({view(e5m2, DType::kFloat8E5M2, {2})}, view(one, DType::kFloat32, {1}), nullptr);
  EXPECT_TRUE(std::isinf(one[0]));  // E5M2: 1 and -inf
}

// outs[i] may be views into one buffer (fp8amp.distributed dequantizes a shard's pieces into the
// rows of one matrix): each is written exactly where it lies, nothing around it.
TEST(MultiTensor, DequantizeIntoViewsOfOneBuffer) {
  std::vector<uint8_t> x0{0x38, 0xC0}, x1{}, x2{0x7E, 0x01, 0x40};  // E4M3: 1, -2 | | 448, 2^-9, 2
  std::vector<float> scale_inv{0.5f, 8.0f, 4.0f};
  std::vector<float> buf(7, -99.0f);
  auto at = [&](int64_t offset, int64_t n) {
    TensorView t = view(buf, DType::kFloat32, {n});
    t.data = buf.data() + offset;
    return t;
  };
  multi_dequantize({view(x0, DType::kFloat8E4M3), view(x1, DType::kFloat8E4M3), view(x2, DType::kFloat8E4M3)},
                   view(scale_inv, DType::kFloat32), {at(0, 2), at(2, 0), at(3, 3)}, nullptr);
  EXPECT_EQ(buf, (std::vector<float>{0.5f, -1.0f, -99.0f, 1792.0f, std::ldexp(1.0f, -7), 8.0f, -99.0f}));
}

}  // namespace
}  // namespace fp8amp
