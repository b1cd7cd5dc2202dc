// The comm ops (comm.h) through the public core API on CPU: hand-derived codes, scales and sums,
// the non-finite rules, and clear errors for bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "expect_error.h"
#include "host_view.h"
#include "fp8amp/comm.h"

namespace fp8amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(CommQuantize, SharedScalesPerTensorIntoOneBufferWithZeroedTail) {
  std::vector<float> a{1.0f, -2.0f, 3.0f}, b{0.5f};
  std::vector<float> amax{3.0f, 0.5f}, scale_inv{-1.0f, -1.0f};
  std::vector<uint8_t> out(6, 0xAA);
  comm_quantize({view(a, DType::kFloat32), view(b, DType::kFloat32)}, view(amax, DType::kFloat32), 448.0f,
                view(out, DType::kFloat8E4M3), view(scale_inv, DType::kFloat32), nullptr);
  // 448 / 3 -> scale 128: 128, -256, 384; 448 / 0.5 -> 512: 256. Then the zeroed tail.
  EXPECT_EQ(out, (std::vector<uint8_t>{0x70, 0xF8, 0x7C, 0x78, 0x00, 0x00}));
  EXPECT_EQ(scale_inv, (std::vector<float>{1.0f / 128, 1.0f / 512}));
}

TEST(CommQuantize, HeadroomLowersTheScale) {
  std::vector<float> a{3.0f};
  std::vector<float> amax{3.0f}, scale_inv{0.0f};
  std::vector<uint8_t> out(1);
  comm_quantize({view(a, DType::kFloat32)}, view(amax, DType::kFloat32), 448.0f / 2, view(out, DType::kFloat8E4M3),
                view(scale_inv, DType::kFloat32), nullptr);
  EXPECT_EQ(scale_inv[0], 1.0f / 64);  // 224 / 3 -> 64: 192
  EXPECT_EQ(out[0], 0x74);
}

TEST(CommQuantize, ANonFiniteAmaxMakesEveryScaleInvNaN) {
  std::vector<float> a{2.0f}, b{kInf};
  std::vector<float> amax{2.0f, kInf}, scale_inv{0.0f, 0.0f};
  std::vector<uint8_t> out(2);
  comm_quantize({view(a, DType::kFloat32), view(b, DType::kFloat32)}, view(amax, DType::kFloat32), 448.0f,
                view(out, DType::kFloat8E4M3), view(scale_inv, DType::kFloat32), nullptr);
  EXPECT_TRUE(std::isnan(scale_inv[0]) && std::isnan(scale_inv[1]));
  EXPECT_EQ(out[0], 0x78);  // 2 * 128 (the scale of a finite amax is still the rule's)
  EXPECT_EQ(out[1], 0x7F);  // an inf is coded as NaN, never saturated (numerics::encode)
}

TEST(CommQuantize, RefusesBadArguments) {
  std::vector<float> a{1.0f, 2.0f}, amax{2.0f}, scale_inv{0.0f};
  std::vector<uint8_t> out(1);
  expect_value_error([&] { comm_quantize({view(a, DType::kFloat32)}, view(amax, DType::kFloat32), 448.0f,
                                         view(out, DType::kFloat8E4M3), view(scale_inv, DType::kFloat32), nullptr); },
                     "out must hold at least the 2 elements");
  std::vector<uint8_t> out2(2);
  expect_value_error([&] { comm_quantize({view(a, DType::kFloat32)}, view(amax, DType::kFloat32), 0.0f,
                                         view(out2, DType::kFloat8E4M3), view(scale_inv, DType::kFloat32), nullptr); },
                     "fmax must be positive");
  std::vector<float> amax2{1.0f, 1.0f};
  expect_value_error([&] { comm_quantize({view(a, DType::kFloat32)}, view(amax2, DType::kFloat32), 448.0f,
                                         view(out2, DType::kFloat8E4M3), view(scale_inv, DType::kFloat32), nullptr); },
                     "amax");
  expect_value_error([&] { comm_quantize({}, view(amax, DType::kFloat32), 448.0f, view(out2, DType::kFloat8E4M3),
                                         view(scale_inv, DType::kFloat32), nullptr); },
                     "xs must hold at least one tensor");
}

// Two received copies of a 3-column shard: E4M3 1, 2, 0 and 1, 1, 3.
struct Shards {
  std::vector<uint8_t> codes{0x38, 0x40, 0x00, 0x38, 0x38, 0x44};
  TensorView view_codes() { return view(codes, DType::kFloat8E4M3, {2, 3}); }
};

TEST(CommSumShards, SumsInFloat32PerPieceScaleAndDivides) {
  Shards s;
  std::vector<float> scale_inv{0.5f, 4.0f}, out(3);
  comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), {0, 2, 3}, 2.0f, view(out, DType::kFloat32),
                  nullptr, nullptr, nullptr);
  EXPECT_EQ(out, (std::vector<float>{0.5f, 0.75f, 6.0f}));
}

TEST(CommSumShards, PerRowScalesAndAnOffsetFirstColumn) {
  Shards s;
  // Row 0's piece 0 at 1, row 1's at 2; piece 1 at 1 and 8; only columns 1..2 are written.
  std::vector<float> scale_inv{1.0f, 1.0f, 2.0f, 8.0f}, out(2);
  comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), {1, 2, 3}, 1.0f, view(out, DType::kFloat32),
                  nullptr, nullptr, nullptr);
  EXPECT_EQ(out, (std::vector<float>{2.0f + 2.0f, 0.0f + 24.0f}));
}

TEST(CommSumShards, RequantizesEachPieceWithItsOwnScale) {
  Shards s;
  std::vector<float> scale_inv{0.5f, 4.0f}, out_scale_inv(2), out_amax(2, -1.0f);
  std::vector<uint8_t> out(3);
  TensorView osi = view(out_scale_inv, DType::kFloat32), oa = view(out_amax, DType::kFloat32);
  comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), {0, 2, 3}, 2.0f, view(out, DType::kFloat8E4M3),
                  &osi, &oa, nullptr);
  // Piece 0: 0.5, 0.75, amax 0.75 -> scale 512: 256, 384. Piece 1: 6 -> 64: 384.
  EXPECT_EQ(out_amax, (std::vector<float>{0.75f, 6.0f}));
  EXPECT_EQ(out_scale_inv, (std::vector<float>{1.0f / 512, 1.0f / 64}));
  EXPECT_EQ(out, (std::vector<uint8_t>{0x78, 0x7C, 0x7C}));
}

TEST(CommSumShards, ANaNScaleMakesItsPieceNaN) {
  Shards s;
  std::vector<float> scale_inv{std::nanf(""), 1.0f}, out_scale_inv(2), out_amax(2);
  std::vector<uint8_t> out(3);
  TensorView osi = view(out_scale_inv, DType::kFloat32), oa = view(out_amax, DType::kFloat32);
  comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), {0, 2, 3}, 1.0f, view(out, DType::kFloat8E4M3),
                  &osi, &oa, nullptr);
  EXPECT_TRUE(std::isnan(out_amax[0]) && std::isnan(out_scale_inv[0]));
  EXPECT_EQ(out[0], 0x7F);  // the NaN code
  EXPECT_EQ(out[1], 0x7F);
  EXPECT_EQ(out_scale_inv[1], 1.0f / 128);  // 3 -> scale 128: 384
  EXPECT_EQ(out[2], 0x7C);
  std::vector<float> hp(3);
  comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), {0, 2, 3}, 1.0f, view(hp, DType::kFloat32),
                  nullptr, nullptr, nullptr);
  EXPECT_TRUE(std::isnan(hp[0]) && std::isnan(hp[1]));
  EXPECT_EQ(hp[2], 3.0f);
}

TEST(CommSumShards, RefusesBadArguments) {
  Shards s;
  std::vector<float> scale_inv{1.0f, 1.0f}, out(3);
  const auto run = [&](std::vector<int64_t> bounds, float divisor) {
    comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), bounds, divisor, view(out, DType::kFloat32),
                    nullptr, nullptr, nullptr);
  };
  expect_value_error([&] { run({0, 2, 1}, 1.0f); }, "bounds must be non-decreasing");
  expect_value_error([&] { run({0, 2, 4}, 1.0f); }, "bounds must be non-decreasing offsets in [0, 3]");
  expect_value_error([&] { run({0, 1, 3}, 0.0f); }, "divisor must be positive");
  expect_value_error([&] { run({0, 1, 2}, 1.0f); }, "out");
  std::vector<uint8_t> q(3);
  expect_value_error([&] { comm_sum_shards(s.view_codes(), view(scale_inv, DType::kFloat32), {0, 1, 3}, 1.0f,
                                           view(q, DType::kFloat8E4M3), nullptr, nullptr, nullptr); },
                     "out_scale_inv and out_amax are required");
  std::vector<float> three{1.0f, 1.0f, 1.0f};
  expect_value_error([&] { comm_sum_shards(s.view_codes(), view(three, DType::kFloat32), {0, 1, 3}, 1.0f,
                                           view(out, DType::kFloat32), nullptr, nullptr, nullptr); },
                     "scale_inv must hold one value per piece (2) or per row and piece (4)");
}

}  // namespace
}  // namespace fp8amp
