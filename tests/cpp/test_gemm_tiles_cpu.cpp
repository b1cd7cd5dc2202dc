// The tile-scaled FP8 GEMM's CPU reference (gemm.h, gemm_tiles) through the public API: every
// accepted pair against an independent per-element loop on shapes with partial tiles in every
// direction, each K-block's scales applied to that block only, rowwise, bias and output rounding,
// the empty sum, the layouts the CUDA path copies the scales into, and clear errors for every
// tiling and pair cuBLASLt has no scale mode for.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "expect_error.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"
#include "gemm/gemm_tiles_kernels.h"
#include "host_view.h"

namespace fp8amp {
namespace {

struct Tile {
  int64_t rows, cols;
};
constexpr Tile kRow128{1, 128}, kBlock{128, 128};

// Operands with tile scales, and the reference computed here by the definition of gemm.h with no
// shared code: per element, per K-block, decoded codes times the two scales.
struct TileProblem {
  int64_t m, n, k;
  Tile a_tile, b_tile;
  DType a_dtype = DType::kFloat8E4M3, b_dtype = DType::kFloat8E4M3;
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;

  TileProblem(int64_t m_, int64_t n_, int64_t k_, Tile at, Tile bt, uint32_t seed = 1) : m(m_), n(n_), k(k_), a_tile(at), b_tile(bt) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> code(0, 255), exponent(-6, 6);
    a.resize(m * k);
    b.resize(n * k);
    // Finite codes of both formats: no E4M3 NaN (0x7F, 0xFF), no E5M2 inf or NaN (0x7C-0x7F, 0xFC-0xFF).
    const auto finite = [&] {
      const int c = code(rng);
      return static_cast<uint8_t>((c & 0x7F) >= 0x7C ? c & 0xBF : c);
    };
    for (auto& c : a) c = finite();
    for (auto& c : b) c = finite();
    sa.resize(grid(m, a_tile.rows) * grid(k, a_tile.cols));
    sb.resize(grid(n, b_tile.rows) * grid(k, b_tile.cols));
    for (auto& s : sa) s = std::ldexp(1.0f, exponent(rng)) * 1.25f;
    for (auto& s : sb) s = std::ldexp(1.0f, exponent(rng)) * 0.75f;
  }
  static int64_t grid(int64_t extent, int64_t tile) { return (extent + tile - 1) / tile; }
  double decode(DType d, uint8_t c) const {
    return d == DType::kFloat8E4M3 ? numerics::decode<numerics::E4M3>(c) : numerics::decode<numerics::E5M2>(c);
  }
  // The value out[i, j] must round to (before bias).
  double exact(int64_t i, int64_t j) const {
    const int64_t block = a_tile.cols == 128 ? 128 : k;
    double sum = 0.0;
    for (int64_t k0 = 0; k0 < k; k0 += block) {
      double dot = 0.0;
      for (int64_t kk = k0; kk < std::min(k, k0 + block); ++kk)
        dot += decode(a_dtype, a[i * k + kk]) * decode(b_dtype, b[j * k + kk]);
      const double s_a = sa[(i / a_tile.rows) * grid(k, a_tile.cols) + k0 / a_tile.cols];
      const double s_b = sb[(j / b_tile.rows) * grid(k, b_tile.cols) + k0 / b_tile.cols];
      sum += dot * (s_a * s_b);
    }
    return sum;
  }
  template <class T>
  void run(std::vector<T>& out, DType out_dtype, const TensorView* bias = nullptr) {
    gemm_tiles(view(a, a_dtype, {m, k}), view(sa, DType::kFloat32, {grid(m, a_tile.rows), grid(k, a_tile.cols)}),
               a_tile.rows, a_tile.cols, view(b, b_dtype, {n, k}),
               view(sb, DType::kFloat32, {grid(n, b_tile.rows), grid(k, b_tile.cols)}), b_tile.rows, b_tile.cols,
               bias, view(out, out_dtype, {m, n}), GemmTilesOptions{}, nullptr);
  }
};

TEST(GemmTilesCpu, EveryPairMatchesThePerElementDefinition) {
  // M = 130 and N = 144: partial 128-row blocks; K = 272: a partial third K-block.
  const Tile pairs[][2] = {{kRow128, kBlock}, {kRow128, kRow128}, {kBlock, kRow128}, {{1, 272}, {1, 272}}};
  for (const auto& pair : pairs) {
    for (const DType a_dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
      TileProblem p(130, 144, 272, pair[0], pair[1], static_cast<uint32_t>(pair[0].rows + pair[1].rows));
      p.a_dtype = a_dtype;
      std::vector<float> out(p.m * p.n);
      p.run(out, DType::kFloat32);
      for (int64_t i = 0; i < p.m; ++i) {
        for (int64_t j = 0; j < p.n; ++j) {
          // Each block's sum is exact and the scales are powers of two times 1.25 or 0.75: the
          // double sum of at most 3 blocks is within an ulp of float, which the rounding hides.
          ASSERT_EQ(out[i * p.n + j], static_cast<float>(p.exact(i, j)))
              << "a_tile (" << pair[0].rows << ", " << pair[0].cols << "), b_tile (" << pair[1].rows << ", "
              << pair[1].cols << ") at " << i << ", " << j;
        }
      }
    }
  }
}

TEST(GemmTilesCpu, EachKBlockTakesItsOwnScales) {
  // One row of ones against one row of ones over K = 256: the two K-blocks sum to 128 each, and
  // the result is 128 * (sa0 * sb0 + sa1 * sb1): a shared or swapped scale gives another value.
  TileProblem p(1, 16, 256, kRow128, kRow128);
  for (auto& c : p.a) c = numerics::quantize_to<numerics::fp8_e4m3>(1.0f).bits;
  for (auto& c : p.b) c = numerics::quantize_to<numerics::fp8_e4m3>(1.0f).bits;
  p.sa = {2.0f, 8.0f};
  for (int64_t j = 0; j < 16; ++j) {
    p.sb[j * 2] = 1.0f;          // b's scales are [16, 2]: row j, K-block 0
    p.sb[j * 2 + 1] = 0.5f * j;  // and K-block 1
  }
  std::vector<float> out(16);
  p.run(out, DType::kFloat32);
  for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(out[j], 128.0f * (2.0f + 8.0f * 0.5f * j)) << j;
}

TEST(GemmTilesCpu, BiasAndOutputRoundingHappenOnce) {
  TileProblem p(3, 16, 128, {1, 128}, {128, 128});
  std::vector<uint16_t> bias(16), out(3 * 16);
  for (int64_t j = 0; j < 16; ++j) bias[j] = numerics::float_to_bf16(0.25f * j - 1.0f);
  const TensorView bias_view = view(bias, DType::kBFloat16, {16});
  p.run(out, DType::kBFloat16, &bias_view);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 16; ++j) {
      const double want = p.exact(i, j) + numerics::bf16_to_float(bias[j]);
      EXPECT_EQ(out[i * 16 + j], numerics::float_to_bf16(static_cast<float>(want))) << i << ", " << j;
    }
  }
}

TEST(GemmTilesCpu, EmptySumIsTheBias) {
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;
  std::vector<uint16_t> bias(16), out(2 * 16, 0x7FC0);
  for (int64_t j = 0; j < 16; ++j) bias[j] = numerics::float_to_bf16(static_cast<float>(j));
  const TensorView bias_view = view(bias, DType::kBFloat16, {16});
  gemm_tiles(view(a, DType::kFloat8E4M3, {2, 0}), view(sa, DType::kFloat32, {2, 0}), 1, 128,
             view(b, DType::kFloat8E4M3, {16, 0}), view(sb, DType::kFloat32, {1, 0}), 128, 128, &bias_view,
             view(out, DType::kBFloat16, {2, 16}), GemmTilesOptions{}, nullptr);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 16; ++j) EXPECT_EQ(out[i * 16 + j], bias[j]);
}

TEST(GemmTilesCpu, CublasScaleLayouts) {
  // (1, 128) tiles of 5 rows over K = 300: 3 runs (K-blocks) of the rows, padded to 8.
  const CublasScaleLayout tile = cublas_scale_layout(TileScaling::kTile1x128, 5, 300);
  EXPECT_EQ(tile.outer, 3);
  EXPECT_EQ(tile.ld, 8);
  EXPECT_EQ(tile.inner, 5);
  EXPECT_TRUE(tile.transposed);
  // (128, 128) blocks of 300 rows over K = 640: 3 runs (row blocks) of 5 K-blocks, padded to 8.
  const CublasScaleLayout block = cublas_scale_layout(TileScaling::kBlock128x128, 300, 640);
  EXPECT_EQ(block.outer, 3);
  EXPECT_EQ(block.ld, 8);
  EXPECT_EQ(block.inner, 5);
  EXPECT_FALSE(block.transposed);
  const CublasScaleLayout row = cublas_scale_layout(TileScaling::kRowwise, 7, 640);
  EXPECT_EQ(row.elements(), 7);
  // Which of the caller's row-major scales cuBLASLt can read in place: only those that are the
  // layout already, element for element.
  EXPECT_FALSE(tile.same_as(3));                                                          // a transpose
  EXPECT_FALSE(block.same_as(5));                                                         // re-pitched to 8
  EXPECT_TRUE(cublas_scale_layout(TileScaling::kBlock128x128, 300, 1024).same_as(8));     // 8 K-blocks
  EXPECT_FALSE(cublas_scale_layout(TileScaling::kBlock128x128, 300, 1024).same_as(9));    // another pitch
  EXPECT_TRUE(row.same_as(1));
  EXPECT_TRUE(cublas_scale_layout(TileScaling::kTile1x128, 8, 128).same_as(1));           // one K-block
  EXPECT_FALSE(cublas_scale_layout(TileScaling::kTile1x128, 5, 128).same_as(1));          // rows padded
  // What the CUDA path asks of the workspace: 256 bytes of slack plus each copy in 256-byte units.
  EXPECT_EQ(gemm_tiles_scale_bytes(5, 300, 300, 1, 128, 128, 128), 256u + 256u + 256u);
  EXPECT_EQ(gemm_tiles_scale_bytes(1000, 16, 4096, 1, 128, 1, 128), 256u + 32u * 1000 * 4 + 32u * 16 * 4);
}

TEST(GemmTilesCpu, ArgumentsAreChecked) {
  TileProblem p(4, 16, 256, kRow128, kBlock);
  std::vector<float> out(4 * 16), wrong(3);
  const auto run = [&](int64_t atr, int64_t atc, int64_t btr, int64_t btc, std::vector<float>& sa,
                       std::vector<int64_t> sa_shape, std::vector<float>& sb, std::vector<int64_t> sb_shape) {
    gemm_tiles(view(p.a, DType::kFloat8E4M3, {4, 256}), view(sa, DType::kFloat32, sa_shape), atr, atc,
               view(p.b, DType::kFloat8E4M3, {16, 256}), view(sb, DType::kFloat32, sb_shape), btr, btc, nullptr,
               view(out, DType::kFloat32, {4, 16}), GemmTilesOptions{}, nullptr);
  };
  expect_value_error([&] { run(64, 64, 128, 128, p.sa, {1, 4}, p.sb, {1, 2}); },
                     "a_tile must be (1, 128), (128, 128) or rowwise (1, c) with c >= K = 256, got (64, 64)");
  expect_value_error([&] { run(1, 128, 1, 64, p.sa, {4, 2}, p.sb, {16, 4}); }, "b_tile must be (1, 128)");
  std::vector<float> blocks(2), rows(16);
  expect_value_error([&] { run(128, 128, 128, 128, blocks, {1, 2}, p.sb, {1, 2}); },
                     "a_tile (128, 128) with b_tile (128, 128) is not a pair cuBLASLt can multiply");
  expect_value_error([&] { run(1, 256, 1, 128, p.sa, {4, 1}, rows, {16, 2}); },
                     "a_tile rowwise with b_tile (1, 128) is not a pair");
  expect_value_error([&] { run(1, 128, 128, 128, wrong, {3}, p.sb, {1, 2}); },
                     "a_scale_inv must be float32 [4, 2] (one per 1 x 128 tile of a [M, K]");
  expect_value_error([&] { run(1, 128, 128, 128, p.sa, {4, 2}, wrong, {3, 1}); }, "b_scale_inv must be float32 [1, 2]");
  std::vector<uint8_t> e5m2(4 * 256);
  expect_value_error(
      [&] {
        gemm_tiles(view(e5m2, DType::kFloat8E5M2, {4, 256}), view(p.sa, DType::kFloat32, {4, 2}), 1, 128,
                   view(p.b, DType::kFloat8E5M2, {16, 256}), view(p.sb, DType::kFloat32, {1, 2}), 128, 128, nullptr,
                   view(out, DType::kFloat32, {4, 16}), GemmTilesOptions{}, nullptr);
      },
      "a and b are both float8_e5m2");
  std::vector<uint8_t> odd_k(4 * 24), odd_kb(16 * 24);
  std::vector<float> s1(4), s2(1);
  expect_value_error(
      [&] {
        gemm_tiles(view(odd_k, DType::kFloat8E4M3, {4, 24}), view(s1, DType::kFloat32, {4, 1}), 1, 128,
                   view(odd_kb, DType::kFloat8E4M3, {16, 24}), view(s2, DType::kFloat32, {1, 1}), 128, 128, nullptr,
                   view(out, DType::kFloat32, {4, 16}), GemmTilesOptions{}, nullptr);
      },
      "K (the columns of a and b) must be a multiple of 16");
  // out must not share memory with an input: here it is a's scales.
  std::vector<float> shared(4 * 16);
  expect_value_error(
      [&] {
        gemm_tiles(view(p.a, DType::kFloat8E4M3, {4, 256}), view(shared, DType::kFloat32, {4, 2}), 1, 128,
                   view(p.b, DType::kFloat8E4M3, {16, 256}), view(p.sb, DType::kFloat32, {1, 2}), 128, 128, nullptr,
                   view(shared, DType::kFloat32, {4, 16}), GemmTilesOptions{}, nullptr);
      },
      "must not share memory");
}

}  // namespace
}  // namespace fp8amp
