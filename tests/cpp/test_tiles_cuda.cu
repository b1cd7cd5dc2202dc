// The tile ops (tiles.h) on CUDA against the CPU reference, bit for bit: every input/output dtype,
// rowwise, 1 x 128 and 128 x 128 tiles, partial tiles at both edges, values over many binades with
// zeros, tiles of zeros and non-finite tiles; cast_transpose_tiles (the one-pass kernel and the
// any-tile one, aligned and misaligned) and scaled_accumulate_tiles likewise. Skips cleanly on a
// machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/numerics.h"
#include "cuda_test_util.h"
#include "fp8amp/tiles.h"

namespace fp8amp {
namespace {

struct Case {
  DType in, out;
  int64_t rows, cols, tile_rows, tile_cols;
  ScalingRecipe recipe;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << dtype_name(c.in) << " -> " << dtype_name(c.out) << " [" << c.rows << ", " << c.cols << "] in " << c.tile_rows
    << " x " << c.tile_cols << " tiles, margin " << c.recipe.margin << ", pow2 " << c.recipe.pow2_scale;
  return s.str();
}

uint32_t value_bits(DType dtype, float v) {
  if (dtype == DType::kFloat32) return numerics::float_bits(v);
  return dtype == DType::kBFloat16 ? numerics::float_to_bf16(v) : numerics::float_to_fp16(v);
}

void check(const Case& c, uint32_t seed) {
  const int64_t grid_rows = (c.rows + c.tile_rows - 1) / c.tile_rows, grid_cols = (c.cols + c.tile_cols - 1) / c.tile_cols;
  MirroredTensor x(c.in, {c.rows, c.cols}), codes(c.out, {c.rows, c.cols}), scale_inv(DType::kFloat32, {grid_rows, grid_cols}),
      back(c.in, {c.rows, c.cols});
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-24, 14), pick(0, 99);
  const int64_t zero_tile_row = 0, zero_tile_col = grid_cols - 1;  // one tile of zeros
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t col = 0; col < c.cols; ++col) {
      float v = std::ldexp(mantissa(rng), exponent(rng)) * (pick(rng) < 50 ? -1.0f : 1.0f);
      if (pick(rng) < 3) v = 0.0f;
      if (r / c.tile_rows == zero_tile_row && col / c.tile_cols == zero_tile_col) v = 0.0f;
      x.set_bits(r * c.cols + col, value_bits(c.in, v));
    }
  }
  if (grid_rows * grid_cols > 2) {  // a non-finite value in the last tile, NaN in the one before
    x.set_bits(c.rows * c.cols - 1, value_bits(c.in, INFINITY));
    x.set_bits((c.rows - 1) * c.cols + ((grid_cols - 1) * c.tile_cols) - 1, value_bits(c.in, NAN));
  }
  expect_cuda_matches_cpu(
      {&x, &codes, &scale_inv, &back},
      [&](Device d) {
        quantize_tiles(x.view(d), codes.view(d), scale_inv.view(d), c.tile_rows, c.tile_cols, c.recipe, nullptr);
        dequantize_tiles(codes.view(d), scale_inv.view(d), back.view(d), c.tile_rows, c.tile_cols, nullptr);
      },
      describe(c));
}

TEST(TilesCuda, MatchCpuBitForBit) {
  REQUIRE_GPU();
  const DType ins[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType outs[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  uint32_t seed = 1;
  for (DType in : ins) {
    for (DType out : outs) {
      for (const auto& [rows, cols, tr, tc] :
           {std::tuple{7, 300, 1, 128}, std::tuple{1, 4096, 1, 4096}, std::tuple{33, 1000, 1, 1000},
            std::tuple{300, 260, 128, 128}, std::tuple{256, 384, 128, 128}, std::tuple{5, 3, 2, 2}}) {
        check(Case{in, out, rows, cols, tr, tc, ScalingRecipe{}}, seed++);
      }
      check(Case{in, out, 129, 257, 128, 128, ScalingRecipe{1, false}}, seed++);
    }
  }
}

TEST(TilesCuda, EmptyMatrices) {
  REQUIRE_GPU();
  check(Case{DType::kFloat32, DType::kFloat8E4M3, 0, 128, 1, 128, ScalingRecipe{}}, 7);
}

// x [rows, cols] of dtype: values over many binades, 3 % zeros, one tile (of tile_rows x tile_cols)
// of zeros, an inf in the last element and a NaN in row 0.
void fill(MirroredTensor& x, DType dtype, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
          uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-24, 14), pick(0, 99);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float v = std::ldexp(mantissa(rng), exponent(rng)) * (pick(rng) < 50 ? -1.0f : 1.0f);
      if (pick(rng) < 3 || (r < tile_rows && c >= cols - tile_cols)) v = 0.0f;
      x.set_bits(r * cols + c, value_bits(dtype, v));
    }
  }
  if (rows * cols > 4) {
    x.set_bits(rows * cols - 1, value_bits(dtype, INFINITY));
    x.set_bits(cols / 2, value_bits(dtype, NAN));
  }
}

int64_t grid(int64_t n, int64_t tile) { return (n + tile - 1) / tile; }

TEST(TilesCuda, CastTransposeTilesMatchCpuBitForBit) {
  REQUIRE_GPU();
  const DType ins[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType outs[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  uint32_t seed = 100;
  for (DType in : ins) {
    for (DType out : outs) {
      for (const auto& [rows, cols, offset] : {std::tuple{256, 384, 0}, std::tuple{300, 260, 0}, std::tuple{129, 257, 0},
                                               std::tuple{7, 300, 0}, std::tuple{1, 5, 0}, std::tuple{256, 256, 1},
                                               std::tuple{130, 136, 3}}) {
        // (1, 128) and (128, 128) take the one-pass kernel; rowwise and (3, 5) / (4, 2) the any-tile one.
        for (const std::array<int64_t, 4>& tiles :
             {std::array<int64_t, 4>{1, 128, 1, 128}, {128, 128, 128, 128}, {1, cols, 1, rows}, {3, 5, 4, 2}}) {
          const int64_t tr = tiles[0], tc = tiles[1], tr_t = tiles[2], tc_t = tiles[3];  // (lambdas capture these)
          MirroredTensor x(in, {rows, cols}, offset), codes(out, {rows, cols}, offset),
              scale_inv(DType::kFloat32, {grid(rows, tr), grid(cols, tc)}), codes_t(out, {cols, rows}, offset),
              scale_inv_t(DType::kFloat32, {grid(cols, tr_t), grid(rows, tc_t)});
          fill(x, in, rows, cols, tr, tc, seed++);
          std::ostringstream what;
          what << dtype_name(in) << " -> " << dtype_name(out) << " [" << rows << ", " << cols << "] at offset "
               << offset << ", tiles " << tr << " x " << tc << ", transposed " << tr_t << " x " << tc_t;
          expect_cuda_matches_cpu(
              {&x, &codes, &scale_inv, &codes_t, &scale_inv_t},
              [&](Device d) {
                cast_transpose_tiles(x.view(d), codes.view(d), scale_inv.view(d), codes_t.view(d), scale_inv_t.view(d),
                                     tr, tc, tr_t, tc_t, ScalingRecipe{}, nullptr);
              },
              what.str());
        }
      }
    }
  }
}

TEST(TilesCuda, ScaledAccumulateTilesMatchCpuBitForBit) {
  REQUIRE_GPU();
  const DType updates[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType accs[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  uint32_t seed = 500;
  for (DType update_dtype : updates) {
    for (DType acc_dtype : accs) {
      for (const std::array<int64_t, 4>& shape_and_tile :
           {std::array<int64_t, 4>{256, 384, 128, 128}, {300, 260, 128, 128}, {7, 300, 1, 128}, {5, 3, 2, 2}}) {
        const int64_t rows = shape_and_tile[0], cols = shape_and_tile[1], tr = shape_and_tile[2], tc = shape_and_tile[3];
        const std::vector<int64_t> scales{grid(rows, tr), grid(cols, tc)};
        MirroredTensor x(DType::kFloat32, {rows, cols}), acc(acc_dtype, {rows, cols}), acc_scale_inv(DType::kFloat32, scales),
            update(update_dtype, {rows, cols}), codes(acc_dtype, {rows, cols}), scale_inv(DType::kFloat32, scales);
        fill(x, DType::kFloat32, rows, cols, tr, tc, seed++);
        fill(update, update_dtype, rows, cols, 1, 1, seed++);
        std::ostringstream what;
        what << dtype_name(acc_dtype) << " + " << dtype_name(update_dtype) << " [" << rows << ", " << cols << "] in "
             << tr << " x " << tc << " tiles";
        expect_cuda_matches_cpu(
            {&x, &acc, &acc_scale_inv, &update, &codes, &scale_inv},
            [&](Device d) {
              quantize_tiles(x.view(d), acc.view(d), acc_scale_inv.view(d), tr, tc, ScalingRecipe{}, nullptr);
              scaled_accumulate_tiles(acc.view(d), acc_scale_inv.view(d), update.view(d), codes.view(d),
                                      scale_inv.view(d), tr, tc, ScalingRecipe{}, nullptr);
            },
            what.str());
      }
    }
  }
}

}  // namespace
}  // namespace fp8amp
