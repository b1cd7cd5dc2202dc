// cast_transpose and cast_transpose_dbias through the public core API on CPU: the layouts agree
// with quantize, empty shapes, dbias summed exactly in the documented order, NaN and inf kept in
// their column, and clear errors for a bad dbias or workspace.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cast_test_util.h"
#include "expect_error.h"
#include "fp8amp/cast.h"
#include "fp8amp/error.h"
#include "host_view.h"

namespace fp8amp {
namespace {

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

}  // namespace
}  // namespace fp8amp
