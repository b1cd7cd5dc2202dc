// The tile ops' CPU reference (tiles.h) against hand-derived cases: each tile its own power-of-two
// scale, partial tiles at the edges, a non-finite tile read as NaN without touching the others,
// the recipe's margin and TE rule, the round trip, cast_transpose_tiles as quantize_tiles of x and
// of its transpose, scaled_accumulate_tiles' sums, multi_norm_tiles' norms, and the argument checks.
#include <gtest/gtest.h>

#include <array>
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

struct CastTransposed {
  Quantized q, q_t;
};

CastTransposed cast_transpose(std::vector<float>& x, int64_t rows, int64_t cols, int64_t tr, int64_t tc, int64_t tr_t,
                              int64_t tc_t) {
  const int64_t gr = (rows + tr - 1) / tr, gc = (cols + tc - 1) / tc;
  const int64_t gr_t = (cols + tr_t - 1) / tr_t, gc_t = (rows + tc_t - 1) / tc_t;
  CastTransposed r{{std::vector<uint8_t>(x.size()), std::vector<float>(static_cast<size_t>(gr * gc))},
                   {std::vector<uint8_t>(x.size()), std::vector<float>(static_cast<size_t>(gr_t * gc_t))}};
  cast_transpose_tiles(view(x, DType::kFloat32, {rows, cols}), view(r.q.codes, DType::kFloat8E4M3, {rows, cols}),
                       view(r.q.scale_inv, DType::kFloat32, {gr, gc}), view(r.q_t.codes, DType::kFloat8E4M3, {cols, rows}),
                       view(r.q_t.scale_inv, DType::kFloat32, {gr_t, gc_t}), tr, tc, tr_t, tc_t, ScalingRecipe{},
                       nullptr);
  return r;
}

TEST(TilesCpu, CastTransposeTilesQuantizesXAndItsTransposeByTheirOwnTiles) {
  // 3 x 5; x in 1 x 2 tiles, its transpose (5 x 3) in 1 x 2 tiles too: along x's columns.
  std::vector<float> x = {1.0f, 2.0f, 3e4f, -0.5f, 0.25f,  //
                          0.0f, 0.0f, 7.0f, 0.0f, 0.0f,    //
                          -3.0f, 0.5f, 0.125f, 1e-3f, 4.0f};
  std::vector<float> x_t(x.size());
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t c = 0; c < 5; ++c) x_t[static_cast<size_t>(c * 3 + r)] = x[static_cast<size_t>(r * 5 + c)];
  }
  for (const auto& [tr, tc, tr_t, tc_t] : {std::array<int64_t, 4>{1, 2, 1, 2}, {2, 2, 2, 2}, {1, 5, 1, 3}, {2, 3, 4, 1}}) {
    const CastTransposed got = cast_transpose(x, 3, 5, tr, tc, tr_t, tc_t);
    const Quantized want = quantize(x, 3, 5, tr, tc), want_t = quantize(x_t, 5, 3, tr_t, tc_t);
    EXPECT_EQ(got.q.codes, want.codes) << tr << " x " << tc;
    EXPECT_EQ(got.q.scale_inv, want.scale_inv) << tr << " x " << tc;
    EXPECT_EQ(got.q_t.codes, want_t.codes) << tr_t << " x " << tc_t;
    EXPECT_EQ(got.q_t.scale_inv, want_t.scale_inv) << tr_t << " x " << tc_t;
  }
  // Column 2 of x (3e4, 7, 0.125) is the transpose's row 2: its tiles [3e4, 7] and [0.125].
  const CastTransposed rowwise = cast_transpose(x, 3, 5, 1, 2, 1, 2);
  EXPECT_EQ(rowwise.q_t.scale_inv[2 * 2 + 0], std::ldexp(1.0f, 7));   // amax 3e4 -> scale 2^-7
  EXPECT_EQ(rowwise.q_t.scale_inv[2 * 2 + 1], std::ldexp(1.0f, -11)); // amax 0.125 -> scale 2^11
  EXPECT_EQ(rowwise.q_t.scale_inv[1 * 2 + 0], std::ldexp(1.0f, -7));  // column 1's [2, 0]: amax 2 -> scale 2^7
  EXPECT_EQ(decode(rowwise.q_t.codes[2 * 3 + 2]) * rowwise.q_t.scale_inv[2 * 2 + 1], 0.125f);
}

TEST(TilesCpu, ScaledAccumulateTilesAddsAndRequantizesEachTile) {
  // acc [1, 2, 1, 0.5] in 1 x 2 tiles (exact in E4M3) plus update [3, -0.5, 0, 0.25]: sums
  // [4, 1.5] (amax 4: scale 2^6) and [1, 0.75] (amax 1: scale 2^8), all exact.
  std::vector<float> x = {1.0f, 2.0f, 1.0f, 0.5f}, update = {3.0f, -0.5f, 0.0f, 0.25f};
  Quantized acc = quantize(x, 1, 4, 1, 2);
  std::vector<uint8_t> codes(4);
  std::vector<float> scale_inv(2);
  scaled_accumulate_tiles(view(acc.codes, DType::kFloat8E4M3, {1, 4}), view(acc.scale_inv, DType::kFloat32, {1, 2}),
                          view(update, DType::kFloat32, {1, 4}), view(codes, DType::kFloat8E4M3, {1, 4}),
                          view(scale_inv, DType::kFloat32, {1, 2}), 1, 2, ScalingRecipe{}, nullptr);
  EXPECT_EQ(scale_inv[0], std::ldexp(1.0f, -6));
  EXPECT_EQ(scale_inv[1], std::ldexp(1.0f, -8));
  const float sums[] = {4.0f, 1.5f, 1.0f, 0.75f};
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(decode(codes[i]) * scale_inv[i / 2], sums[i]) << i;
  // A NaN acc_scale_inv (a poisoned tile) poisons that tile again, and only that one.
  acc.scale_inv[1] = std::nanf("");
  scaled_accumulate_tiles(view(acc.codes, DType::kFloat8E4M3, {1, 4}), view(acc.scale_inv, DType::kFloat32, {1, 2}),
                          view(update, DType::kFloat32, {1, 4}), view(codes, DType::kFloat8E4M3, {1, 4}),
                          view(scale_inv, DType::kFloat32, {1, 2}), 1, 2, ScalingRecipe{}, nullptr);
  EXPECT_EQ(scale_inv[0], std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(scale_inv[1]));
}

TEST(TilesCpu, NewOpsCheckTheirArguments) {
  std::vector<float> x(6), scale_inv(3), scale_inv_t(2), new_scale_inv(3);
  std::vector<uint8_t> codes(6), codes_t(6);
  const TensorView xv = view(x, DType::kFloat32, {3, 2}), out = view(codes, DType::kFloat8E4M3, {3, 2}),
                   si = view(scale_inv, DType::kFloat32, {3, 1}), si_t = view(scale_inv_t, DType::kFloat32, {2, 1});
  const auto run = [&](TensorView out_t, TensorView scales_t, int64_t tr_t) {
    cast_transpose_tiles(xv, out, si, out_t, scales_t, 1, 2, tr_t, 3, ScalingRecipe{}, nullptr);
  };
  run(view(codes_t, DType::kFloat8E4M3, {2, 3}), si_t, 1);  // accepted
  expect_value_error([&] { run(view(codes_t, DType::kFloat8E4M3, {3, 2}), si_t, 1); },
                     "out_t must be float8_e4m3fn[2, 3]");
  expect_value_error([&] { run(view(codes_t, DType::kFloat8E4M3, {2, 3}), si_t, 0); },
                     "tile_t's tile_rows and tile_cols must be positive");
  expect_value_error([&] { run(view(codes_t, DType::kFloat8E4M3, {2, 3}), si, 1); }, "scale_inv_t must be float32 [2, 1]");
  expect_value_error([&] { run(view(codes, DType::kFloat8E4M3, {2, 3}), si_t, 1); }, "out and out_t must not share memory");
  const auto accumulate = [&](TensorView update, TensorView result) {
    scaled_accumulate_tiles(out, si, update, result, view(new_scale_inv, DType::kFloat32, {3, 1}), 1, 2,
                            ScalingRecipe{}, nullptr);
  };
  expect_value_error([&] { accumulate(xv, view(codes_t, DType::kFloat8E5M2, {3, 2})); },
                     "out must be float8_e4m3fn (acc's format)");
  expect_value_error([&] { accumulate(view(x, DType::kFloat32, {2, 3}), view(codes_t, DType::kFloat8E4M3, {3, 2})); },
                     "acc and update must have the same shape");
  expect_value_error([&] { accumulate(xv, out); }, "acc and out must not share memory");
}

// multi_norm_tiles: 2 x 5 E4M3 codes in 1 x 4 tiles (a partial tile at each row's end), with
// scales of their own; and with one scale for the whole matrix (a tile larger than it).
TEST(TilesCpu, NormsOfTileScaledCodes) {
  const std::vector<float> values = {1.0f, -2.0f, 0.5f, 3.0f, 4.0f, 0.0f, 0.25f, -1.5f, 8.0f, -6.0f};
  std::vector<uint8_t> codes;
  for (float v : values) codes.push_back(static_cast<uint8_t>(numerics::encode<numerics::E4M3>(v, true)));
  std::vector<float> tile_scales = {2.0f, 0.5f, 4.0f, 0.25f}, one = {3.0f}, out(1);
  const TensorView x = view(codes, DType::kFloat8E4M3, {2, 5});
  std::vector<uint8_t> workspace(static_cast<size_t>(multi_norm_tiles_workspace({x})));
  EXPECT_EQ(workspace.size(), sizeof(double));  // one work item of the CUDA kernel: one partial
  multi_norm_tiles({x}, {view(tile_scales, DType::kFloat32, {2, 2})}, 1, 4, view(out, DType::kFloat32),
                   view(workspace, DType::kUInt8), nullptr);
  double tiled = 0.0, whole = 0.0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double s = tile_scales[(i / 5) * 2 + (i % 5) / 4];
    tiled += values[i] * s * values[i] * s;
    whole += values[i] * 3.0 * values[i] * 3.0;
  }
  EXPECT_EQ(out[0], static_cast<float>(std::sqrt(tiled)));  // these squares and sums are exact
  std::vector<float> whole_out(1);
  multi_norm_tiles({x}, {view(one, DType::kFloat32)}, int64_t{1} << 40, int64_t{1} << 40,
                   view(whole_out, DType::kFloat32), view(workspace, DType::kUInt8), nullptr);
  EXPECT_EQ(whole_out[0], static_cast<float>(std::sqrt(whole)));
}

TEST(TilesCpu, NormsCheckTheirArguments) {
  std::vector<uint8_t> codes(10), workspace(64);
  std::vector<float> scales(4), out(1), x32(10);
  const TensorView x = view(codes, DType::kFloat8E4M3, {2, 5}), ws = view(workspace, DType::kUInt8);
  const TensorView si = view(scales, DType::kFloat32, {2, 2}), o = view(out, DType::kFloat32);
  multi_norm_tiles({x}, {si}, 1, 4, o, ws, nullptr);  // accepted
  expect_value_error([&] { multi_norm_tiles({x}, {si}, 2, 4, o, ws, nullptr); }, "scale_invs[0] must hold 2 float32");
  expect_value_error([&] { multi_norm_tiles({x}, {}, 1, 4, o, ws, nullptr); }, "scale_invs must hold as many");
  expect_value_error([&] { multi_norm_tiles({view(x32, DType::kFloat32, {2, 5})}, {si}, 1, 4, o, ws, nullptr); },
                     "xs");
  expect_value_error([&] { multi_norm_tiles({x}, {si}, 0, 4, o, ws, nullptr); }, "must be positive");
  expect_value_error([&] { multi_norm_tiles({x, x}, {si, si}, 1, 4, o, ws, nullptr); }, "out");
  expect_value_error([&] { multi_norm_tiles({x}, {si}, 1, 4, o, view(workspace, DType::kUInt8, {4}), nullptr); },
                     "workspace");
  expect_value_error([&] { multi_norm_tiles({x}, {si}, 1, 4, view(scales, DType::kFloat32, {1}), ws, nullptr); },
                     "must not share memory");
}

}  // namespace
}  // namespace fp8amp
