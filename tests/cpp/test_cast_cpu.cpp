// The cast ops through the public core API on CPU: hand-derived results, layouts, the delayed
// scaling sequence, and clear errors for bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fp8amp/accumulate.h"
#include "fp8amp/cast.h"
#include "fp8amp/scaling.h"
#include "expect_error.h"
#include "host_view.h"
#include "fp8amp/error.h"

namespace fp8amp {
namespace {

struct State {
  std::vector<float> scale{1.0f}, amax{0.0f}, scale_inv{0.0f};
  Scaling scaling() {
    return Scaling{view(scale, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1}),
                   view(scale_inv, DType::kFloat32, {1})};
  }
};

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

TEST(CastTranspose, LayoutsAgreeWithQuantize) {
  const int64_t rows = 3, cols = 5;
  std::vector<float> x(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) - 7.0f;
  std::vector<uint8_t> y(x.size()), yt(x.size()), ref(x.size());
  State a, b;
  a.scale[0] = b.scale[0] = 8.0f;
  cast_transpose(view(x, DType::kFloat32, {rows, cols}), view(y, DType::kFloat8E5M2, {rows, cols}),
                 view(yt, DType::kFloat8E5M2, {cols, rows}), a.scaling(), nullptr);
  quantize(view(x, DType::kFloat32, {rows, cols}), view(ref, DType::kFloat8E5M2, {rows, cols}), b.scaling(),
           nullptr);
  EXPECT_EQ(y, ref);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(yt[c * rows + r], y[r * cols + c]);
  EXPECT_EQ(a.amax[0], 7.0f);
}

TEST(CastTranspose, EmptyColumnsTransposeToColsByRows) {
  std::vector<float> x;
  std::vector<uint8_t> y, yt;
  State st;
  st.scale[0] = 4.0f;
  cast_transpose(view(x, DType::kFloat32, {5, 0}), view(y, DType::kFloat8E4M3, {5, 0}),
                 view(yt, DType::kFloat8E4M3, {0, 5}), st.scaling(), nullptr);
  EXPECT_EQ(st.scale_inv[0], 0.25f);
  EXPECT_THROW(cast_transpose(view(x, DType::kFloat32, {5, 0}), view(y, DType::kFloat8E4M3, {5, 0}),
                              view(yt, DType::kFloat8E4M3, {0, 0}), st.scaling(), nullptr),
               Error);
}

// cast_transpose_dbias: x [rows, cols] float32 in, E5M2 out; returns dbias.
std::vector<float> cast_transpose_dbias_of(std::vector<float> x, int64_t rows, int64_t cols, State& st,
                                           std::vector<uint8_t>* codes = nullptr) {
  std::vector<uint8_t> y(x.size()), yt(x.size());
  std::vector<float> dbias(static_cast<size_t>(cols), -1.0f);
  std::vector<float> workspace(static_cast<size_t>(cast_transpose_dbias_workspace(rows, cols)), -1.0f);
  cast_transpose_dbias(view(x, DType::kFloat32, {rows, cols}), view(y, DType::kFloat8E5M2, {rows, cols}),
                       view(yt, DType::kFloat8E5M2, {cols, rows}), view(dbias, DType::kFloat32, {cols}),
                       view(workspace, DType::kFloat32, {static_cast<int64_t>(workspace.size())}), st.scaling(),
                       nullptr);
  if (codes != nullptr) *codes = y;
  return dbias;
}

TEST(CastTransposeDbias, ExactSumsAndTheCodesOfCastTranspose) {
  const int64_t rows = 600, cols = 3;  // 3 bands, the last one partial
  std::vector<float> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    x[r * cols + 0] = 1.0f;
    x[r * cols + 1] = static_cast<float>(r % 7) - 3.0f;
    x[r * cols + 2] = r == 599 ? -2.5f : 0.0f;
  }
  State a, b;
  a.scale[0] = b.scale[0] = 4.0f;
  std::vector<uint8_t> codes, ref(x.size()), ref_t(x.size());
  EXPECT_EQ(cast_transpose_dbias_of(x, rows, cols, a, &codes), (std::vector<float>{600.0f, -5.0f, -2.5f}));
  cast_transpose(view(x, DType::kFloat32, {rows, cols}), view(ref, DType::kFloat8E5M2, {rows, cols}),
                 view(ref_t, DType::kFloat8E5M2, {cols, rows}), b.scaling(), nullptr);
  EXPECT_EQ(codes, ref);
  EXPECT_EQ(a.amax[0], b.amax[0]);
  EXPECT_EQ(a.scale_inv[0], b.scale_inv[0]);
}

// The order cast_kernels.h documents, written out column by column; with values over 2^-30..2^30
// it differs from adding the rows in order, so the test can tell the two apart.
TEST(CastTransposeDbias, AddsInTheDocumentedOrder) {
  const int64_t rows = 700, cols = 4;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 30), sign(0, 1);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = std::ldexp(mantissa(rng), exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
  State st;
  const std::vector<float> dbias = cast_transpose_dbias_of(x, rows, cols, st);
  int differs_from_row_order = 0;
  for (int64_t c = 0; c < cols; ++c) {
    float total = 0.0f, in_row_order = 0.0f;
    for (int64_t band = 0; band * 256 < rows; ++band) {
      float band_sum = 0.0f;
      for (int64_t g = 0; g < 32; ++g) {
        float group = 0.0f;
        for (int64_t k = 0; k < 2; ++k)
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t r = band * 256 + k * 128 + g * 4 + i;
            if (r < rows) group += x[r * cols + c];
          }
        band_sum += group;
      }
      total += band_sum;
    }
    for (int64_t r = 0; r < rows; ++r) in_row_order += x[r * cols + c];
    EXPECT_EQ(dbias[c], total) << "column " << c;
    differs_from_row_order += dbias[c] != in_row_order;
  }
  EXPECT_GT(differs_from_row_order, 0);
}

TEST(CastTransposeDbias, NaNAndInfStayInTheirColumn) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x{1.0f, std::nanf(""), 2.0f, inf, 3.0f, -1.0f, -inf, 1.0f, 0.5f, 1.0f, 1.0f, inf};
  State st;
  const std::vector<float> dbias = cast_transpose_dbias_of(x, 4, 3, st);
  EXPECT_TRUE(std::isnan(dbias[0]));  // inf - inf
  EXPECT_TRUE(std::isnan(dbias[1]));
  EXPECT_EQ(dbias[2], inf);
  EXPECT_EQ(cast_transpose_dbias_of(std::vector<float>{}, 0, 3, st), (std::vector<float>{0.0f, 0.0f, 0.0f}));
}

TEST(CastTransposeDbias, RefusesBadDbiasAndWorkspace) {
  std::vector<float> x(8 * 4, 1.0f), dbias(4), small(3), workspace(static_cast<size_t>(cast_transpose_dbias_workspace(8, 4)));
  std::vector<uint16_t> dbias16(4);
  std::vector<uint8_t> y(32), yt(32);
  State st;
  const auto run = [&](const TensorView& d, const TensorView& w) {
    cast_transpose_dbias(view(x, DType::kFloat32, {8, 4}), view(y, DType::kFloat8E4M3, {8, 4}),
                         view(yt, DType::kFloat8E4M3, {4, 8}), d, w, st.scaling(), nullptr);
  };
  const TensorView ws = view(workspace, DType::kFloat32, {static_cast<int64_t>(workspace.size())});
  EXPECT_EQ(workspace.size(), 4u);  // one band
  expect_value_error([&] { run(view(dbias16, DType::kFloat16, {4}), ws); }, "cast_transpose_dbias: dbias");
  expect_value_error([&] { run(view(small, DType::kFloat32, {3}), ws); }, "cast_transpose_dbias: dbias");
  expect_value_error([&] { run(view(dbias, DType::kFloat32, {4}), view(small, DType::kFloat32, {3})); },
                     "cast_transpose_dbias: workspace");
  expect_value_error([&] { run(view(dbias, DType::kFloat32, {4}), view(dbias, DType::kFloat32, {4})); },
                     "cast_transpose_dbias: dbias and workspace must not share memory");
  run(view(dbias, DType::kFloat32, {4}), ws);
  EXPECT_EQ(dbias, (std::vector<float>{8.0f, 8.0f, 8.0f, 8.0f}));
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
  for (int i = 0; i < 5; ++i) step();
  EXPECT_EQ(counter[0], 3);  // capped at the history length
}

TEST(Errors, NameTheArgument) {
  std::vector<float> x{1.0f, 2.0f};
  std::vector<uint8_t> y(2);
  std::vector<int32_t> wrong(2);
  State st;
  expect_value_error([&] { quantize(view(wrong, DType::kInt32, {2}), view(y, DType::kFloat8E4M3, {2}), st.scaling(), nullptr); },
                     "x must be float32, bfloat16 or float16");
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kBFloat16, {2}), st.scaling(), nullptr); },
                     "dtype must be float8_e4m3fn, float8_e5m2 or float16");
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {1, 2}), st.scaling(), nullptr); },
                     "must have the same shape");
  Scaling bad = st.scaling();
  bad.scale.shape = {};
  bad.scale.dtype = DType::kInt32;
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {2}), bad, nullptr); },
                     "scale must be float32");
  TensorView strided = view(x, DType::kFloat32, {2});
  strided.strides = {2};
  expect_value_error([&] { quantize(strided, view(y, DType::kFloat8E4M3, {2}), st.scaling(), nullptr); },
                     "must be contiguous");
  for (int margin : {-2, 127}) {
    Scaling wide = st.scaling();
    wide.recipe.margin = margin;
    expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {2}), wide, nullptr); },
                       "margin must be in [0, 126]");
  }
  TensorView on_gpu = view(y, DType::kFloat8E4M3, {2});
  on_gpu.device = Device::kCUDA;
  on_gpu.device_index = 0;
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), on_gpu, st.scaling(), nullptr); },
                     "must be on the same device");
}

// The caller's outputs of multi_dequantize: count, dtype, shape, device and layout, each error
// naming the output by its index.
TEST(Errors, MultiDequantizeNamesTheOutput) {
  std::vector<uint8_t> x0(2), x1(3);
  std::vector<float> scale_inv{1.0f, 1.0f}, y0(2), y1(3);
  std::vector<uint16_t> half(3);
  const std::vector<TensorView> xs{view(x0, DType::kFloat8E4M3), view(x1, DType::kFloat8E4M3)};
  auto run = [&](std::vector<TensorView> outs) {
    multi_dequantize(xs, view(scale_inv, DType::kFloat32), outs, nullptr);
  };
  expect_value_error([&] { run({view(y0, DType::kFloat32)}); }, "outs must hold as many tensors as xs (2), got 1");
  expect_value_error([&] { run({}); }, "outs must hold as many tensors as xs");
  expect_value_error([&] { run({view(y0, DType::kFloat32), view(half, DType::kBFloat16)}); },
                     "outs must share one dtype: outs[0] is float32[2] on cpu, outs[1] is bfloat16[3] on cpu");
  expect_value_error([&] { run({view(x0, DType::kFloat8E4M3), view(x1, DType::kFloat8E4M3)}); },
                     "outs must be float32, bfloat16 or float16, got float8_e4m3fn[2] on cpu");
  expect_value_error([&] { run({view(y0, DType::kFloat32), view(y1, DType::kFloat32, {1, 3})}); },
                     "xs[1] and outs[1] must have the same shape, got float8_e4m3fn[3] on cpu and float32[1, 3] on cpu");
  TensorView on_gpu = view(y1, DType::kFloat32);
  on_gpu.device = Device::kCUDA;
  on_gpu.device_index = 0;
  expect_value_error([&] { run({view(y0, DType::kFloat32), on_gpu}); }, "xs[1] and outs[1] must be on the same device");
  std::vector<float> wide(6);
  expect_value_error([&] { run({view(y0, DType::kFloat32), view(wide, DType::kFloat32, {3}, {2})}); },
                     "outs[1] must be contiguous");
}

// Outputs that share memory with an input or another output are refused, naming both; inputs may
// share memory with each other (they are only read); scaled_accumulate's src may be dst itself.
TEST(Errors, OutputsMustNotShareMemory) {
  std::vector<float> buf(64, 1.0f), scale_inv{1.0f, 1.0f}, scale{1.0f}, amax(4, 0.0f), out_f(16);
  const auto at = [&](int64_t byte, DType dtype, int64_t n) {
    TensorView t;
    t.data = reinterpret_cast<uint8_t*>(buf.data()) + byte;
    t.dtype = dtype;
    t.shape = {n};
    return t;
  };
  Scaling s{view(scale, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1, 4}), view(scale_inv, DType::kFloat32, {1})};
  // quantize: out inside x's bytes.
  expect_value_error([&] { quantize(at(0, DType::kFloat32, 8), at(4, DType::kFloat8E4M3, 8), s, nullptr); },
                     "quantize: x and out must not share memory");
  // dequantize: out over the codes.
  expect_value_error([&] { dequantize(at(0, DType::kFloat8E4M3, 8), view(scale_inv, DType::kFloat32, {1}),
                                      at(6, DType::kFloat32, 8), nullptr); },
                     "dequantize: x and out must not share memory");
  // multi_dequantize: two outs overlapping each other; an out over another tensor's codes; xs sharing is fine.
  const TensorView codes0 = at(0, DType::kFloat8E4M3, 4), codes1 = at(2, DType::kFloat8E4M3, 4);
  const TensorView si2 = view(scale_inv, DType::kFloat32, {2});
  expect_value_error([&] { multi_dequantize({codes0, codes1}, si2, {at(64, DType::kFloat32, 4), at(72, DType::kFloat32, 4)}, nullptr); },
                     "multi_dequantize: outs[0] and outs[1] must not share memory");
  expect_value_error([&] { multi_dequantize({codes0, at(128, DType::kFloat8E4M3, 4)}, si2,
                                            {at(64, DType::kFloat32, 4), at(126, DType::kFloat32, 4)}, nullptr); },
                     "multi_dequantize: xs[1] and outs[1] must not share memory");
  multi_dequantize({codes0, codes1}, si2, {at(64, DType::kFloat32, 4), at(80, DType::kFloat32, 4)}, nullptr);
  // cast_transpose: out_t over out.
  TensorView out = at(0, DType::kFloat8E4M3, 16), out_t = at(8, DType::kFloat8E4M3, 16);
  out.shape = out_t.shape = {4, 4};
  expect_value_error([&] { cast_transpose(view(out_f, DType::kFloat32, {4, 4}), out, out_t, s, nullptr); },
                     "cast_transpose: out and out_t must not share memory");
  // scaled_accumulate: src part of dst is refused, src = dst accepted; amax must be its own.
  std::vector<float> acc_amax{0.0f}, dst_si{1.0f};
  const TensorView dst = at(0, DType::kFloat8E4M3, 8);
  const TensorView src_si = view(scale_inv, DType::kFloat32, {1});
  expect_value_error([&] { scaled_accumulate(dst, view(dst_si, DType::kFloat32), at(1, DType::kFloat8E4M3, 8), &src_si, 1.0f,
                                             view(acc_amax, DType::kFloat32), ScalingRecipe{}, nullptr); },
                     "scaled_accumulate: dst and src must not share memory");
  scaled_accumulate(dst, view(dst_si, DType::kFloat32), dst, &src_si, 1.0f, view(acc_amax, DType::kFloat32), ScalingRecipe{},
                    nullptr);
  expect_value_error([&] { scaled_accumulate(dst, view(dst_si, DType::kFloat32), at(64, DType::kFloat32, 8), nullptr, 1.0f,
                                             view(dst_si, DType::kFloat32), ScalingRecipe{}, nullptr); },
                     "scaled_accumulate: amax and dst_scale_inv must not share memory");
}

// check::disjoint_writes against the pairwise definition, over random layouts in one buffer.
TEST(Errors, DisjointWritesMatchesPairwiseOverlap) {
  std::mt19937 rng(3);
  std::vector<uint8_t> buf(4096);
  const auto names = [](bool written, size_t i) { return std::string(written ? "outs" : "xs") + "[" + std::to_string(i) + "]"; };
  int refused = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const auto random_views = [&](size_t n) {
      std::vector<TensorView> v(n);
      for (auto& t : v) {
        t.data = buf.data() + rng() % 4000;
        t.dtype = rng() % 2 ? DType::kFloat32 : DType::kFloat8E4M3;
        t.shape = {static_cast<int64_t>(rng() % 24)};  // empty views too
      }
      return v;
    };
    const std::vector<TensorView> outs = random_views(1 + rng() % 12), xs = random_views(rng() % 12);
    const auto range = [](const TensorView& t) {
      const auto b = reinterpret_cast<uintptr_t>(t.data);
      return std::make_pair(b, b + static_cast<uintptr_t>(t.numel()) * dtype_size(t.dtype));
    };
    const auto overlap = [&](const TensorView& a, const TensorView& b) {
      const auto [a0, a1] = range(a);
      const auto [b0, b1] = range(b);
      return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;  // empty views share no byte
    };
    bool expected = false;
    for (size_t i = 0; i < outs.size(); ++i) {
      for (size_t j = i + 1; j < outs.size(); ++j) expected = expected || overlap(outs[i], outs[j]);
      for (const TensorView& x : xs) expected = expected || overlap(outs[i], x);
    }
    std::vector<const TensorView*> written, read;
    for (const TensorView& t : outs) written.push_back(&t);
    for (const TensorView& t : xs) read.push_back(&t);
    bool threw = false;
    try {
      check::disjoint_writes(written, read, {}, {}, "op", names);
    } catch (const Error& e) {
      threw = e.kind() == ErrorKind::kValue;
    }
    ASSERT_EQ(threw, expected) << "trial " << trial;
    refused += threw;
  }
  EXPECT_GT(refused, 100);
  EXPECT_LT(refused, 2900);
}

}  // namespace
}  // namespace fp8amp
