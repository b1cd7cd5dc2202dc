// The MXFP8 ops on CUDA against the CPU reference, bit for bit: quantize_mx, cast_transpose_mx and
// dequantize_mx for every input and element dtype, partial blocks at the row ends, values over
// many binades with zeros, a block of zeros and non-finite blocks; and gemm_mx's refusal on a GPU
// below Blackwell (on a Blackwell GPU: the product against the CPU reference within FP32
// accumulation; that branch has never run). Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/numerics.h"
#include "cuda_test_util.h"
#include "expect_error.h"
#include "fp8amp/gemm.h"
#include "fp8amp/tiles.h"

namespace fp8amp {
namespace {

int64_t blocks(int64_t cols) { return (cols + kMxBlock - 1) / kMxBlock; }

uint32_t value_bits(DType dtype, float v) {
  if (dtype == DType::kFloat32) return numerics::float_bits(v);
  return dtype == DType::kBFloat16 ? numerics::float_to_bf16(v) : numerics::float_to_fp16(v);
}

void fill(MirroredTensor& x, DType in, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-24, 14), pick(0, 99);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float v = std::ldexp(mantissa(rng), exponent(rng)) * (pick(rng) < 50 ? -1.0f : 1.0f);
      if (pick(rng) < 3 || (r == 0 && c < kMxBlock)) v = 0.0f;  // and one block of zeros
      x.set_bits(r * cols + c, value_bits(in, v));
    }
  }
  if (rows * cols > 2 * kMxBlock) {  // an inf in the last block, a NaN in the middle
    x.set_bits(rows * cols - 1, value_bits(in, INFINITY));
    x.set_bits(rows * cols / 2, value_bits(in, NAN));
  }
}

TEST(MxCuda, CastsMatchCpuBitForBit) {
  REQUIRE_GPU();
  const DType ins[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType outs[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};
  uint32_t seed = 1;
  for (DType in : ins) {
    for (DType out : outs) {
      for (const auto& [rows, cols] : {std::tuple{256, 512}, std::tuple{7, 300}, std::tuple{129, 33},
                                       std::tuple{1, 5}, std::tuple{64, 4096}}) {
        std::ostringstream what;
        what << dtype_name(in) << " -> " << dtype_name(out) << " [" << rows << ", " << cols << "]";
        MirroredTensor x(in, {rows, cols}), codes(out, {rows, cols}), scales(DType::kUInt8, {rows, blocks(cols)}),
            codes_t(out, {cols, rows}), scales_t(DType::kUInt8, {cols, blocks(rows)}), back(in, {rows, cols}),
            only_codes(out, {rows, cols}), only_scales(DType::kUInt8, {rows, blocks(cols)});
        fill(x, in, rows, cols, seed++);
        expect_cuda_matches_cpu(
            {&x, &codes, &scales, &codes_t, &scales_t, &back, &only_codes, &only_scales},
            [&](Device d) {
              cast_transpose_mx(x.view(d), codes.view(d), scales.view(d), codes_t.view(d), scales_t.view(d), nullptr);
              quantize_mx(x.view(d), only_codes.view(d), only_scales.view(d), nullptr);
              dequantize_mx(codes.view(d), scales.view(d), back.view(d), nullptr);
            },
            what.str());
      }
    }
  }
}

TEST(MxCuda, GemmNeedsBlackwell) {
  REQUIRE_GPU();
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  const int64_t m = 128, n = 64, k = 256;
  MirroredTensor a(DType::kFloat8E4M3, {m, k}), sa(DType::kUInt8, {m, k / kMxBlock}), b(DType::kFloat8E4M3, {n, k}),
      sb(DType::kUInt8, {n, k / kMxBlock}), out(DType::kFloat32, {m, n});
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> code(0, 0x7D), scale(120, 130);
  for (int64_t i = 0; i < m * k; ++i) a.set_bits(i, static_cast<uint32_t>(code(rng)));
  for (int64_t i = 0; i < n * k; ++i) b.set_bits(i, static_cast<uint32_t>(code(rng) | (i % 2 ? 0x80 : 0)));
  for (int64_t i = 0; i < m * k / kMxBlock; ++i) sa.set_bits(i, static_cast<uint32_t>(scale(rng)));
  for (int64_t i = 0; i < n * k / kMxBlock; ++i) sb.set_bits(i, static_cast<uint32_t>(scale(rng)));
  for (MirroredTensor* t : {&a, &sa, &b, &sb, &out}) t->upload();
  const size_t bytes = kGemmWorkspaceBytes + gemm_mx_scale_bytes(m, n, k);
  void* workspace = nullptr;
  ASSERT_EQ(cudaMalloc(&workspace, bytes), cudaSuccess);
  GemmTilesOptions options;
  options.workspace = workspace;
  options.workspace_bytes = bytes;
  const auto run = [&] {
    gemm_mx(a.view(Device::kCUDA), sa.view(Device::kCUDA), b.view(Device::kCUDA), sb.view(Device::kCUDA), nullptr,
            out.view(Device::kCUDA), options, nullptr);
  };
  if (major < 10) {
    std::ostringstream want;
    want << "mxfp8 needs a Blackwell GPU (sm_100+); this GPU is sm_" << major << minor;
    expect_error(ErrorKind::kNotImplemented, run, want.str());
    EXPECT_TRUE(out.same_on_both("out")) << "nothing may be written before the refusal";
  } else {
    run();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got(m * n);
    ASSERT_EQ(cudaMemcpy(got.data(), out.view(Device::kCUDA).data, got.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    GemmTilesOptions cpu_options;
    gemm_mx(a.view(Device::kCPU), sa.view(Device::kCPU), b.view(Device::kCPU), sb.view(Device::kCPU), nullptr,
            out.view(Device::kCPU), cpu_options, nullptr);
    float largest = 0.0f;
    for (int64_t i = 0; i < m * n; ++i) largest = std::fmax(largest, std::fabs(out.get_float(i)));
    // FP32 accumulation over K = 256 products: well within 1e-5 of the largest output.
    for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(got[i], out.get_float(i), 1e-5f * largest) << i;
  }
  cudaFree(workspace);
}

}  // namespace
}  // namespace fp8amp
