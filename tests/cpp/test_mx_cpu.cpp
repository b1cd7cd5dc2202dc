// The MXFP8 ops' CPU reference (tiles.h quantize_mx / cast_transpose_mx / dequantize_mx, gemm.h
// gemm_mx) against hand-derived cases: OCP MX's E8M0 exponent per 1 x 32 block, saturation at the
// top of the block's binade, the zero and non-finite blocks, partial blocks, the transpose, the
// GEMM against a per-element sum, cuBLASLt's 128 x 4 scale layout, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/numerics.h"
#include "expect_error.h"
#include "fp8amp/gemm.h"
#include "fp8amp/tiles.h"
#include "gemm/gemm_tiles_kernels.h"
#include "host_view.h"

namespace fp8amp {
namespace {

struct Mx {
  std::vector<uint8_t> codes, scales;
};

int64_t blocks(int64_t cols) { return (cols + kMxBlock - 1) / kMxBlock; }

Mx quantize(std::vector<float>& x, int64_t rows, int64_t cols, DType fmt = DType::kFloat8E4M3) {
  Mx q{std::vector<uint8_t>(x.size()), std::vector<uint8_t>(static_cast<size_t>(rows * blocks(cols)))};
  quantize_mx(view(x, DType::kFloat32, {rows, cols}), view(q.codes, fmt, {rows, cols}),
              view(q.scales, DType::kUInt8, {rows, blocks(cols)}), nullptr);
  return q;
}

float e4m3(uint8_t code) { return numerics::decode<numerics::E4M3>(code); }

TEST(MxCpu, ScaleIsTheBlockAmaxExponentMinusTheFormatsEmax) {
  // One row of 70: blocks [0, 32), [32, 64) and a partial [64, 70).
  std::vector<float> x(70, 0.0f);
  x[3] = 1.0f;     // block 0: amax 1 -> floor(log2 1) - 8 = -8 -> code 119
  x[40] = -500.0f;  // block 1: amax 500 -> 8 - 8 = 0, and 500 > 448 * 2^0: 1 -> code 128
  x[41] = 3.0f;
  x[65] = 0.75f;   // block 2: amax 0.75 -> -1 - 8 = -9 -> code 118
  const Mx q = quantize(x, 1, 70);
  ASSERT_EQ(q.scales.size(), 3u);
  EXPECT_EQ(q.scales[0], 119);
  EXPECT_EQ(q.scales[1], 128);
  EXPECT_EQ(q.scales[2], 118);
  EXPECT_EQ(e4m3(q.codes[3]), 256.0f);    // 1 * 2^8
  EXPECT_EQ(e4m3(q.codes[40]), -256.0f);  // 250 rounds up to 256: no saturation (the floor rule would clip to 448)
  EXPECT_EQ(e4m3(q.codes[41]), 1.5f);
  EXPECT_EQ(e4m3(q.codes[65]), 384.0f);   // 0.75 * 2^9
  // E5M2's emax is 15.
  const Mx q5 = quantize(x, 1, 70, DType::kFloat8E5M2);
  EXPECT_EQ(q5.scales[0], 127 - 15);
  EXPECT_EQ(q5.scales[1], 127 + 8 - 15 + 1);  // 500 * 2^7 = 64000 > 57344 (1.75 * 2^15): one more
}

TEST(MxCpu, ZeroAndNonFiniteBlocksAndTheSmallestExponent) {
  std::vector<float> x(128, 0.5f);
  for (int i = 0; i < 32; ++i) x[i] = 0.0f;                   // block 0: zeros
  x[40] = std::numeric_limits<float>::infinity();              // block 1: an inf
  x[70] = std::numeric_limits<float>::quiet_NaN();             // block 2: a NaN
  for (int i = 96; i < 128; ++i) x[i] = std::ldexp(1.0f, -140);  // block 3: below 2^-119
  Mx q = quantize(x, 1, 128);
  EXPECT_EQ(q.scales[0], 127);  // X = 1
  EXPECT_EQ(q.codes[0], 0);
  EXPECT_EQ(q.scales[1], 0xFF);
  EXPECT_EQ(q.scales[2], 0xFF);
  EXPECT_EQ(q.scales[3], 0);  // clamped to 2^-127: the elements are 2^-13, E4M3's zero
  std::vector<float> back(128);
  dequantize_mx(view(q.codes, DType::kFloat8E4M3, {1, 128}), view(q.scales, DType::kUInt8, {1, 4}),
                view(back, DType::kFloat32, {1, 128}), nullptr);
  EXPECT_EQ(back[5], 0.0f);
  for (int i = 32; i < 96; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;
  EXPECT_EQ(back[100], 0.0f);
}

TEST(MxCpu, RoundTripAndTransposeAreQuantizeOfEachCopy) {
  const int64_t rows = 40, cols = 72;  // partial blocks both ways
  std::vector<float> x(static_cast<size_t>(rows * cols)), xt(x.size());
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = std::sin(0.37f * i) * std::ldexp(1.0f, static_cast<int>(i % 13) - 6);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
  }
  Mx q = quantize(x, rows, cols), qt = quantize(xt, cols, rows);
  std::vector<uint8_t> out(x.size()), scales(static_cast<size_t>(rows * blocks(cols))), out_t(x.size()),
      scales_t(static_cast<size_t>(cols * blocks(rows)));
  cast_transpose_mx(view(x, DType::kFloat32, {rows, cols}), view(out, DType::kFloat8E4M3, {rows, cols}),
                    view(scales, DType::kUInt8, {rows, blocks(cols)}), view(out_t, DType::kFloat8E4M3, {cols, rows}),
                    view(scales_t, DType::kUInt8, {cols, blocks(rows)}), nullptr);
  EXPECT_EQ(out, q.codes);
  EXPECT_EQ(scales, q.scales);
  EXPECT_EQ(out_t, qt.codes);
  EXPECT_EQ(scales_t, qt.scales);
  // Each element reads back within E4M3's half step (amax / X is at most 448: nothing saturates).
  std::vector<float> back(x.size());
  dequantize_mx(view(q.codes, DType::kFloat8E4M3, {rows, cols}), view(q.scales, DType::kUInt8, {rows, blocks(cols)}),
                view(back, DType::kFloat32, {rows, cols}), nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale_inv = std::ldexp(1.0f, q.scales[r * blocks(cols) + c / kMxBlock] - 127);
      const float v = x[r * cols + c], step = std::max(std::fabs(v) / 16.0f, scale_inv * std::ldexp(1.0f, -10));
      EXPECT_LE(std::fabs(back[r * cols + c] - v), step) << r << "," << c;
    }
  }
}

TEST(MxCpu, GemmIsTheSumOfScaledBlockProducts) {
  const int64_t m = 3, n = 16, k = 64;
  std::vector<uint8_t> a(m * k), b(n * k), sa(m * 2), sb(n * 2);
  for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<uint8_t>((i * 37 + 11) % 0x7E);  // finite E4M3
  for (int64_t i = 0; i < n * k; ++i) b[i] = static_cast<uint8_t>((i * 53 + 5) % 0x7E | ((i % 3 == 0) ? 0x80 : 0));
  for (int64_t i = 0; i < m * 2; ++i) sa[i] = static_cast<uint8_t>(120 + i);
  for (int64_t i = 0; i < n * 2; ++i) sb[i] = static_cast<uint8_t>(125 + i % 5);
  std::vector<float> out(m * n);
  GemmTilesOptions options;
  gemm_mx(view(a, DType::kFloat8E4M3, {m, k}), view(sa, DType::kUInt8, {m, 2}), view(b, DType::kFloat8E4M3, {n, k}),
          view(sb, DType::kUInt8, {n, 2}), nullptr, view(out, DType::kFloat32, {m, n}), options, nullptr);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double want = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        want += static_cast<double>(e4m3(a[i * k + kk])) * std::ldexp(1.0, sa[i * 2 + kk / 32] - 127) *
                e4m3(b[j * k + kk]) * std::ldexp(1.0, sb[j * 2 + kk / 32] - 127);
      }
      EXPECT_EQ(out[i * n + j], static_cast<float>(want)) << i << "," << j;
    }
  }
}

TEST(MxCpu, CublasScaleLayoutIsTiled128By4) {
  const MxScaleLayout l{130, 5};  // pads to 256 rows, 8 K-blocks
  EXPECT_EQ(l.bytes(), 256 * 8);
  EXPECT_EQ(l.offset(0, 0), 0);
  EXPECT_EQ(l.offset(0, 3), 3);
  EXPECT_EQ(l.offset(1, 0), 16);
  EXPECT_EQ(l.offset(32, 0), 4);
  EXPECT_EQ(l.offset(127, 3), 31 * 16 + 3 * 4 + 3);
  EXPECT_EQ(l.offset(0, 4), 512);       // the next tile along K
  EXPECT_EQ(l.offset(128, 0), 2 * 512);  // the next row tile, after both K tiles
}

TEST(MxCpu, ArgumentsAreChecked) {
  std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> codes(64), scales(2), wrong(3);
  std::vector<float> float_scales(2);
  expect_value_error(
      [&] {
        quantize_mx(view(x, DType::kFloat32, {1, 64}), view(codes, DType::kFloat8E4M3, {1, 64}),
                    view(float_scales, DType::kFloat32, {1, 2}), nullptr);
      },
      "scales");
  expect_value_error(
      [&] {
        quantize_mx(view(x, DType::kFloat32, {1, 64}), view(codes, DType::kFloat8E4M3, {1, 64}),
                    view(wrong, DType::kUInt8, {1, 3}), nullptr);
      },
      "uint8 [1, 2]");
  expect_value_error(
      [&] {
        quantize_mx(view(x, DType::kFloat32, {1, 64}), view(codes, DType::kUInt8, {1, 64}),
                    view(scales, DType::kUInt8, {1, 2}), nullptr);
      },
      "dtype");
  std::vector<uint8_t> a(4 * 48), sa(4), b(16 * 48), sb(16);
  std::vector<float> out(4 * 16);
  GemmTilesOptions options;
  expect_value_error(
      [&] {
        gemm_mx(view(a, DType::kFloat8E4M3, {4, 48}), view(sa, DType::kUInt8, {4, 1}),
                view(b, DType::kFloat8E4M3, {16, 48}), view(sb, DType::kUInt8, {16, 1}), nullptr,
                view(out, DType::kFloat32, {4, 16}), options, nullptr);
      },
      "multiple of 32");
}

}  // namespace
}  // namespace fp8amp
