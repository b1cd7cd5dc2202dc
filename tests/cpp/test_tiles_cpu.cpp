// The tile ops' CPU reference (tiles.h) against hand-derived cases: each tile its own power-of-two
// scale, partial tiles at the edges, a non-finite tile read as NaN without touching the others,
// the recipe's margin and TE rule, the round trip, and the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/numerics.h"
#include "expect_error.h"
#include "fp8amp/tiles.h"
#include "host_view.h"

namespace fp8amp {
namespace {

constexpr float kE4M3Max = 448.0f;

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};

Quantized quantize(std::vector<float>& x, int64_t rows, int64_t cols, int64_t tr, int64_t tc,
                   ScalingRecipe recipe = {}) {
  Quantized q{std::vector<uint8_t>(x.size()),
              std::vector<float>(static_cast<size_t>(((rows + tr - 1) / tr) * ((cols + tc - 1) / tc)))};
  quantize_tiles(view(x, DType::kFloat32, {rows, cols}), view(q.codes, DType::kFloat8E4M3, {rows, cols}),
                 view(q.scale_inv, DType::kFloat32, {(rows + tr - 1) / tr, (cols + tc - 1) / tc}), tr, tc, recipe,
                 nullptr);
  return q;
}

float decode(uint8_t code) { return numerics::decode<numerics::E4M3>(code); }

TEST(TilesCpu, EachTileHasItsOwnPowerOfTwoScale) {
  // 2 x 6 in 1 x 4 tiles: [0:4] and a partial [4:6] in each row. One outlier (3e4) in row 0's
  // first tile; the other tiles keep the scale of their own values.
  std::vector<float> x = {1.0f, 2.0f, 3e4f, -0.5f, 0.25f, -0.125f,  //
                          0.0f, 0.0f, 0.0f, 0.0f, 5.0f, 7.0f};
  const Quantized q = quantize(x, 2, 6, 1, 4);
  ASSERT_EQ(q.scale_inv.size(), 4u);
  // scale = 2^floor(log2(448 / amax)): 3e4 -> 2^-7, 0.25 -> 2^10, 0 -> 1, 7 -> 2^6.
  EXPECT_EQ(q.scale_inv[0], std::ldexp(1.0f, 7));
  EXPECT_EQ(q.scale_inv[1], std::ldexp(1.0f, -10));
  EXPECT_EQ(q.scale_inv[2], 1.0f);
  EXPECT_EQ(q.scale_inv[3], std::ldexp(1.0f, -6));
  // Every value is the E4M3 rounding of x * scale, and reads back within E4M3's relative step.
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t tile = (static_cast<int64_t>(i) / 6) * 2 + (static_cast<int64_t>(i) % 6) / 4;
    const float back = decode(q.codes[i]) * q.scale_inv[static_cast<size_t>(tile)];
    EXPECT_NEAR(back, x[i], std::fabs(x[i]) * 0.0625f) << i;
  }
  EXPECT_EQ(decode(q.codes[4]) * q.scale_inv[1], 0.25f);  // exact: a power of two
  EXPECT_EQ(decode(q.codes[0]) * q.scale_inv[0], 1.0f);   // a per-tensor scale of 2^-7 keeps 1.0 too,
  EXPECT_EQ(decode(q.codes[5]) * q.scale_inv[1], -0.125f);  // but would flush 0.125 * 2^-7 to zero
}

TEST(TilesCpu, BlocksCoverRowsAndColumns) {
  // 3 x 3 in 2 x 2 blocks: four blocks, three of them partial.
  std::vector<float> x = {1, 2, 300, 3, 4, 8, 0.5f, 0.25f, 0.125f};
  const Quantized q = quantize(x, 3, 3, 2, 2);
  ASSERT_EQ(q.scale_inv.size(), 4u);
  EXPECT_EQ(q.scale_inv[0], std::ldexp(1.0f, -6));  // amax 4 -> scale 2^6
  EXPECT_EQ(q.scale_inv[1], std::ldexp(1.0f, 0));   // amax 300 -> scale 1
  EXPECT_EQ(q.scale_inv[2], std::ldexp(1.0f, -9));  // amax 0.5 -> scale 2^9
  EXPECT_EQ(q.scale_inv[3], std::ldexp(1.0f, -11)); // amax 0.125 -> scale 2^11
}

TEST(TilesCpu, ANonFiniteTileReadsNanAndLeavesTheOthersAlone) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {1.0f, inf, 2.0f, 4.0f, 1.0f, std::nanf(""), 0.5f, 0.5f};
  const Quantized q = quantize(x, 2, 4, 1, 2);
  EXPECT_TRUE(std::isnan(q.scale_inv[0]));
  EXPECT_TRUE(std::isnan(q.scale_inv[2]));
  EXPECT_EQ(q.scale_inv[1], std::ldexp(1.0f, -6));
  EXPECT_EQ(q.scale_inv[3], std::ldexp(1.0f, -9));
  EXPECT_EQ(decode(q.codes[2]) * q.scale_inv[1], 2.0f);
  EXPECT_EQ(decode(q.codes[7]) * q.scale_inv[3], 0.5f);
}

TEST(TilesCpu, RecipeMarginAndTheTeRule) {
  std::vector<float> x = {3.0f, -1.0f};
  EXPECT_EQ(quantize(x, 1, 2, 1, 2, ScalingRecipe{2, true}).scale_inv[0], std::ldexp(1.0f, -5));  // 2^(7-2)
  const float te = quantize(x, 1, 2, 1, 2, ScalingRecipe{0, false}).scale_inv[0];
  EXPECT_EQ(te, 1.0f / (kE4M3Max / 3.0f));
}

TEST(TilesCpu, DequantizeIsTheRoundTrip) {
  std::vector<float> x(5 * 300);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i)) * std::ldexp(1.0f, static_cast<int>(i % 23) - 11);
  const Quantized q = quantize(x, 5, 300, 1, 128);
  std::vector<uint8_t> codes = q.codes;
  std::vector<float> scale_inv = q.scale_inv, back(x.size());
  dequantize_tiles(view(codes, DType::kFloat8E4M3, {5, 300}), view(scale_inv, DType::kFloat32, {5, 3}),
                   view(back, DType::kFloat32, {5, 300}), 1, 128, nullptr);
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t tile = (i / 300) * 3 + (i % 300) / 128;
    EXPECT_EQ(back[i], decode(codes[i]) * scale_inv[tile]) << i;
  }
}

TEST(TilesCpu, ArgumentsAreChecked) {
  std::vector<float> x(8), scale_inv(2), wrong_scales(3);
  std::vector<uint8_t> codes(8);
  std::vector<uint16_t> half(8);
  const auto run = [&](TensorView out, TensorView si, int64_t tr, int64_t tc) {
    quantize_tiles(view(x, DType::kFloat32, {2, 4}), out, si, tr, tc, ScalingRecipe{}, nullptr);
  };
  const TensorView out = view(codes, DType::kFloat8E4M3, {2, 4}), si = view(scale_inv, DType::kFloat32, {2, 1});
  expect_value_error([&] { run(out, si, 0, 4); }, "tile_rows and tile_cols must be positive");
  expect_value_error([&] { run(out, view(wrong_scales, DType::kFloat32, {3, 1}), 1, 4); }, "scale_inv must be float32 [2, 1]");
  expect_value_error([&] { run(view(half, DType::kFloat16, {2, 4}), si, 1, 4); }, "dtype must be float8_e4m3fn or float8_e5m2");
  expect_value_error([&] { run(view(codes, DType::kFloat8E4M3, {4, 2}), si, 1, 4); }, "x and out must have the same shape");
  expect_value_error(
      [&] {
        quantize_tiles(view(x, DType::kFloat32, {2, 4}), view(x, DType::kFloat8E4M3, {2, 4}), si, 1, 4,
                       ScalingRecipe{}, nullptr);
      },
      "x and out must not share memory");
  expect_value_error(
      [&] {
        dequantize_tiles(view(x, DType::kFloat32, {2, 4}), si, view(x, DType::kFloat32, {2, 4}), 1, 4, nullptr);
      },
      "x must be float8_e4m3fn or float8_e5m2");
}

}  // namespace
}  // namespace fp8amp
