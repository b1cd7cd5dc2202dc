// CUDA cast_transpose and cast_transpose_dbias against the CPU reference, bit for bit, through the
// public API (cast.h): shapes with partial tiles and bands, empty ones, misaligned inputs and the
// warm-up counter; the transposed codes, dbias and the band sums in its workspace must end up
// byte-identical, guard elements included. Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cast_cuda_test_util.h"
#include "cuda_test_util.h"
#include "fp8amp/cast.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

// ------------------------------------------------------------------------------------------------
// cast_transpose

// With column_sums, cast_transpose_dbias: dbias and the band sums in its workspace compared too.
void check_cast_transpose(DType in, DType out, int64_t rows, int64_t cols, int64_t x_offset, int counter,
                          bool column_sums = false) {
  MirroredTensor x(in, {rows, cols}, x_offset);
  fill(x, random_values(rows * cols, static_cast<uint32_t>(rows * 131 + cols)));
  MirroredTensor y(out, {rows, cols});
  MirroredTensor yt(out, {cols, rows});  // cast.h views x as [rows, cols], rows the product of the leading dims
  MirroredTensor dbias(DType::kFloat32, {cols});
  MirroredTensor workspace(DType::kFloat32, {cast_transpose_dbias_workspace(rows, cols)});
  ScalingTensors s(1, 0);
  s.scale.set_float(0, 0x1p-4f);
  s.amax.set_float(0, 1.0f);
  if (counter >= 0) s.with_warmup_counter({counter}, 2);
  std::vector<MirroredTensor*> tensors{&x, &y, &yt};
  if (column_sums) tensors.insert(tensors.end(), {&dbias, &workspace});
  expect_cuda_matches_cpu(
      tensors + s.all(),
      [&](Device d) {
        if (column_sums) {
          cast_transpose_dbias(x.view(d), y.view(d), yt.view(d), dbias.view(d), workspace.view(d), s.on(d), nullptr);
        } else {
          cast_transpose(x.view(d), y.view(d), yt.view(d), s.on(d), nullptr);
        }
      },
      label(in, out,
            std::to_string(rows) + "x" + std::to_string(cols) + " offset " + std::to_string(x_offset) +
                " counter " + std::to_string(counter) + (column_sums ? " with column sums" : "")));
}

TEST(CastCuda, CastTransposeShapes) {
  REQUIRE_GPU();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},   {1, 17},  {17, 1},     {33, 65},  {128, 128},
                                                {64, 48}, {48, 64}, {257, 1031}, {0, 5},    {5, 0}};
  for (DType in : kHighPrecision) {
    for (DType out : kScaled) {
      for (auto [rows, cols] : shapes) check_cast_transpose(in, out, rows, cols, 0, -1);
      check_cast_transpose(in, out, 128, 256, 1, -1);  // misaligned x: element-wise loads
      check_cast_transpose(in, out, 96, 160, 0, 1);    // warming up
      check_cast_transpose(in, out, 96, 160, 0, 2);    // warmed up
    }
  }
  check_cast_transpose(DType::kBFloat16, DType::kFloat8E4M3, 4096, 4096, 0, -1);
  check_cast_transpose(DType::kFloat32, DType::kFloat8E5M2, 4096, 4096, 0, 0);
}

// Column sums over bands (256 rows) and column tiles: whole, partial and single ones; NaN and inf
// from random_values' specials land in some columns.
TEST(CastCuda, CastTransposeDbiasShapes) {
  REQUIRE_GPU();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},    {255, 63}, {256, 64},  {257, 65}, {3000, 72},
                                                {513, 1031}, {16, 8192}, {0, 5},  {5, 0}};
  for (DType in : kHighPrecision) {
    for (DType out : kScaled) {
      for (auto [rows, cols] : shapes) check_cast_transpose(in, out, rows, cols, 0, -1, true);
      check_cast_transpose(in, out, 300, 256, 1, -1, true);  // misaligned x: element-wise loads
      check_cast_transpose(in, out, 96, 160, 0, 1, true);    // warming up
    }
  }
  check_cast_transpose(DType::kBFloat16, DType::kFloat8E5M2, 16384, 512, 0, 2, true);
}

}  // namespace
}  // namespace fp8amp
