// cast_transpose_rescaled's CUDA kernel against the CPU reference, bit for bit (as
// test_cast_cuda.cu does for the other cast ops): every FP16 code, shapes with partial tiles and
// misaligned tensors, and scale pairs whose product is a power of two, rounds, overflows,
// underflows or is NaN. Inputs, the scales and the guards around out_t must stay as they were.
// Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "fp8amp/cast.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

const DType kScaled[] = {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kFloat16};

// x [rows, cols] of FP16 codes (`codes(i)` for element i) into out_t, on both devices.
template <class Codes>
void check_rescaled(int64_t rows, int64_t cols, DType out, float scale_inv, float scale, Codes&& codes,
                    int64_t x_offset = 0, int64_t out_t_offset = 0) {
  MirroredTensor x(DType::kFloat16, {rows, cols}, x_offset);
  for (int64_t i = 0; i < x.numel(); ++i) x.set_bits(i, codes(i));
  MirroredTensor out_t(out, {cols, rows}, out_t_offset);
  MirroredTensor si(DType::kFloat32, {1}), s(DType::kFloat32, {1});
  si.set_float(0, scale_inv);
  s.set_float(0, scale);
  expect_cuda_matches_cpu(
      {&x, &out_t, &si, &s},
      [&](Device d) { cast_transpose_rescaled(x.view(d), si.view(d), s.view(d), out_t.view(d), nullptr); },
      std::string(dtype_name(out)) + ", " + std::to_string(rows) + "x" + std::to_string(cols) + " offsets " +
          std::to_string(x_offset) + "/" + std::to_string(out_t_offset) + ", scale_inv " + std::to_string(scale_inv) +
          ", scale " + std::to_string(scale));
}

uint32_t random_code(std::mt19937& rng) { return std::uniform_int_distribution<uint32_t>(0, 0xFFFF)(rng); }

TEST(CastRescaledCuda, EveryFp16CodeWithEachScalePair) {
  REQUIRE_GPU();
  const std::pair<float, float> pairs[] = {{0x1p-8f, 0x1p+4f},  {0x1p-20f, 0x1p+9f}, {1.0f, 1.0f},
                                           {3.0f, 1.0f / 3.0f}, {0x1p+100f, 0x1p+100f},   // overflows to inf
                                           {0x1p-100f, 0x1p-40f},                          // a subnormal product
                                           {0x1p-100f, 0x1p-100f},                         // zero
                                           {NAN, 1.0f}};
  for (DType out : kScaled) {
    for (auto [scale_inv, scale] : pairs) {
      check_rescaled(256, 256, out, scale_inv, scale, [](int64_t i) { return static_cast<uint32_t>(i); });
    }
  }
}

TEST(CastRescaledCuda, Shapes) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  const auto code = [&](int64_t) { return random_code(rng); };
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},   {1, 17},  {17, 1},     {33, 65},   {128, 128},
                                                {64, 48}, {48, 64}, {257, 1031}, {768, 3072}, {0, 5}, {5, 0}};
  for (DType out : kScaled) {
    for (auto [rows, cols] : shapes) check_rescaled(rows, cols, out, 0x1p-12f, 0x1p+6f, code);
    check_rescaled(128, 256, out, 0x1p-12f, 0x1p+6f, code, 1, 0);  // misaligned x: element-wise loads
    check_rescaled(128, 256, out, 0x1p-12f, 0x1p+6f, code, 0, 1);  // misaligned out_t: element-wise stores
  }
  check_rescaled(4096, 4096, DType::kFloat8E4M3, 0x1p-14f, 0x1p+7f, code);
}

}  // namespace
}  // namespace fp8amp
