// CUDA cast kernels against the CPU reference, bit for bit: the one-tensor ops quantize (every
// 16-bit and float32 pattern, tails, misaligned pointers, warm-up), amax (row runs too),
// quantize_current and dequantize run through the public API (cast.h) once on CPU tensors and once
// on CUDA tensors holding the same bytes, and every tensor involved must end up byte-identical
// (inputs too, and guard elements around each tensor, so a stray write shows). cast_transpose, the
// multi-tensor ops and the scale updates have their own files (test_cast_transpose_cuda.cu,
// test_cast_multi_cuda.cu, test_delayed_scaling_cuda.cu). Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cast_cuda_test_util.h"
#include "common/numerics.h"
#include "cuda_test_util.h"
#include "fp8amp/cast.h"
#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

using numerics::bits_float;

#define CUDA_OK(expr)                                                              \
  do {                                                                             \
    const cudaError_t status_ = (expr);                                            \
    ASSERT_EQ(cudaSuccess, status_) << #expr << ": " << cudaGetErrorString(status_); \
  } while (0)

// ------------------------------------------------------------------------------------------------
// quantize

// Quantizes x (already filled) into a fresh out with one scale, compares everything.
void check_quantize(MirroredTensor& x, DType out_dtype, float scale, const std::string& what, int64_t out_offset = 0) {
  MirroredTensor out(out_dtype, {x.numel()}, out_offset);
  ScalingTensors s(1, 0);
  s.scale.set_float(0, scale);
  s.amax.set_float(0, 0.0f);
  expect_cuda_matches_cpu(std::vector<MirroredTensor*>{&x, &out} + s.all(), [&](Device d) { quantize(x.view(d), out.view(d), s.on(d), nullptr); },
                          label(x.dtype(), out_dtype, what));
}

TEST(CastCuda, QuantizeEvery16BitPattern) {
  REQUIRE_GPU();
  for (DType in : {DType::kBFloat16, DType::kFloat16}) {
    MirroredTensor x(in, {65536});
    for (int64_t i = 0; i < 65536; ++i) x.set_bits(i, static_cast<uint32_t>(i));
    for (DType out : kScaled) {
      for (float scale : {1.0f, 0x1p-7f, 0x1p+9f, 3.7f, 0.0123f}) {
        check_quantize(x, out, scale, "all 65536 patterns, scale " + std::to_string(scale));
      }
    }
  }
}

TEST(CastCuda, QuantizeBoundaryAndRandomFloat32) {
  REQUIRE_GPU();
  std::vector<float> values = boundary_values();
  const std::vector<float> random = random_values(100000, 1);
  values.insert(values.end(), random.begin(), random.end());
  MirroredTensor x(DType::kFloat32, {static_cast<int64_t>(values.size())});
  fill(x, values);
  for (DType out : kScaled) {
    for (float scale : {1.0f, 0x1p-7f, 0x1p+20f, 3.7f, 1e-30f}) {
      check_quantize(x, out, scale, "boundary + random, scale " + std::to_string(scale));
    }
  }
}

TEST(CastCuda, QuantizeTailsAndMisalignedPointers) {
  REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4097}, int64_t{65537}, int64_t{(1 << 20) + 3}}) {
    const std::vector<float> values = random_values(n, static_cast<uint32_t>(n));
    for (DType in : kHighPrecision) {
      for (DType out : kScaled) {
        for (auto [in_offset, out_offset] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 1}, std::pair{3, 5}}) {
          MirroredTensor x(in, {n}, in_offset);
          fill(x, values);
          check_quantize(x, out, 0x1p-3f,
                         "numel " + std::to_string(n) + ", offsets " + std::to_string(in_offset) + "/" +
                             std::to_string(out_offset),
                         out_offset);
        }
      }
    }
  }
}

TEST(CastCuda, QuantizeEmptyTensorStillWritesScaleInv) {
  REQUIRE_GPU();
  for (DType out : kScaled) {
    MirroredTensor x(DType::kBFloat16, {0});
    check_quantize(x, out, 0.25f, "numel 0");
  }
}

// The GPU's saturating converters (cvt.rn.satfinite) against numerics' software codec, over every
// fp32 bit pattern. The CPU would take minutes for 2^32 values, so the reference here is the same
// numerics code run by a kernel of this test.
__global__ void iota_bits(uint32_t first, int64_t n, uint32_t* x) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = first + static_cast<uint32_t>(i);
  }
}

template <class Out>
__global__ void count_mismatches(uint32_t first, int64_t n, const void* got, unsigned long long* mismatches,
                                 uint32_t* first_bad) {
  const Out* codes = static_cast<const Out*>(got);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t bits = first + static_cast<uint32_t>(i);
    if (codes[i].bits != numerics::quantize_to<Out>(bits_float(bits)).bits) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, bits);
    }
  }
}

TEST(CastCuda, QuantizeEveryFloat32Pattern) {
  REQUIRE_GPU();
  constexpr int64_t kChunk = int64_t{1} << 28;
  uint32_t* x = nullptr;
  void* y = nullptr;
  float* scaling = nullptr;  // scale, amax, scale_inv
  unsigned long long* mismatches = nullptr;
  uint32_t* first_bad = nullptr;
  CUDA_OK(cudaMalloc(&x, kChunk * sizeof(uint32_t)));
  CUDA_OK(cudaMalloc(&y, kChunk * sizeof(uint16_t)));
  CUDA_OK(cudaMalloc(&scaling, 3 * sizeof(float)));
  CUDA_OK(cudaMalloc(&mismatches, sizeof(unsigned long long)));
  CUDA_OK(cudaMalloc(&first_bad, sizeof(uint32_t)));
  const float one[3] = {1.0f, 0.0f, 0.0f};
  CUDA_OK(cudaMemcpy(scaling, one, sizeof(one), cudaMemcpyHostToDevice));
  auto device_view = [](void* data, DType dtype, int64_t n) {
    TensorView v;
    v.data = data;
    v.dtype = dtype;
    v.shape = {n};
    v.device = Device::kCUDA;
    v.device_index = 0;
    return v;
  };
  for (DType out : kScaled) {
    CUDA_OK(cudaMemset(mismatches, 0, sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(first_bad, 0xFF, sizeof(uint32_t)));
    Scaling s;
    s.scale = device_view(scaling, DType::kFloat32, 1);
    s.amax = device_view(scaling + 1, DType::kFloat32, 1);
    s.scale_inv = device_view(scaling + 2, DType::kFloat32, 1);
    for (int64_t first = 0; first < (int64_t{1} << 32); first += kChunk) {
      iota_bits<<<1024, 256>>>(static_cast<uint32_t>(first), kChunk, x);
      CUDA_OK(cudaGetLastError());
      quantize(device_view(x, DType::kFloat32, kChunk), device_view(y, out, kChunk), s, nullptr);
      const auto check = out == DType::kFloat8E4M3   ? count_mismatches<numerics::fp8_e4m3>
                         : out == DType::kFloat8E5M2 ? count_mismatches<numerics::fp8_e5m2>
                                                     : count_mismatches<numerics::fp16>;
      check<<<1024, 256>>>(static_cast<uint32_t>(first), kChunk, y, mismatches, first_bad);
      CUDA_OK(cudaGetLastError());
    }
    unsigned long long count = 0;
    uint32_t bad = 0;
    CUDA_OK(cudaMemcpy(&count, mismatches, sizeof(count), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&bad, first_bad, sizeof(bad), cudaMemcpyDeviceToHost));
    EXPECT_EQ(count, 0u) << dtype_name(out) << ": first differing input bits 0x" << std::hex << bad;
  }
  cudaFree(x);
  cudaFree(y);
  cudaFree(scaling);
  cudaFree(mismatches);
  cudaFree(first_bad);
}

// ------------------------------------------------------------------------------------------------
// Current scaling (warm-up) and amax folding.

TEST(CastCuda, QuantizeWarmupBelowAndAboveSteps) {
  REQUIRE_GPU();
  const std::vector<float> values = random_values(70000, 7);
  // The amax slot starts below, above, at zero, non-canonical (-0, negative, NaN payloads) or inf.
  const float start_amax[] = {0.0f, 1e-3f, 1e30f, -0.0f, -5.0f, bits_float(0x7FC00000u), INFINITY};
  for (DType in : kHighPrecision) {
    MirroredTensor x(in, {static_cast<int64_t>(values.size())});
    fill(x, values);
    for (DType out : kScaled) {
      for (int counter : {0, 3, 4, 9}) {
        for (bool pow2_scale : {true, false}) {
          for (float a : start_amax) {
            MirroredTensor y(out, {x.numel()});
            ScalingTensors s(1, 4);
            s.scale.set_float(0, 0.5f);
            s.amax.set_float(0, a);
            s.amax.set_float(1, 123.0f);  // older history: never read here
            s.with_warmup_counter({counter}, 4);
            s.recipe.pow2_scale = pow2_scale;
            s.recipe.margin = pow2_scale ? 1 : 2;
            expect_cuda_matches_cpu(std::vector<MirroredTensor*>{&x, &y} + s.all(), [&](Device d) { quantize(x.view(d), y.view(d), s.on(d), nullptr); },
                                    label(in, out, "counter " + std::to_string(counter) + " of 4, pow2_scale " +
                                                       std::to_string(pow2_scale) + ", amax " + std::to_string(a)));
          }
        }
      }
    }
  }
}

TEST(CastCuda, AmaxWithAndWithoutCounter) {
  REQUIRE_GPU();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{4097}, int64_t{300001}}) {
    std::vector<float> values = random_values(n, 11);
    for (DType in : kHighPrecision) {
      for (int offset : {0, 1}) {
        MirroredTensor x(in, {n}, offset);
        fill(x, values);
        for (int counter : {-1, 2, 5}) {  // -1: no counter
          for (float start : {0.0f, -0.0f, 2.0f, -1e30f}) {
            MirroredTensor a(DType::kFloat32, {1});
            a.set_float(0, start);
            MirroredTensor c(DType::kInt32, {1});
            c.set_int(0, counter);
            expect_cuda_matches_cpu(
                {&x, &a, &c},
                [&](Device d) {
                  const TensorView cv = c.view(d);
                  amax(x.view(d), a.view(d), counter < 0 ? nullptr : &cv, 3, nullptr);
                },
                std::string(dtype_name(in)) + " numel " + std::to_string(n) + " offset " + std::to_string(offset) +
                    " counter " + std::to_string(counter) + " start " + std::to_string(start));
          }
        }
      }
    }
  }
  // NaN anywhere wins, whatever the payload.
  MirroredTensor x(DType::kFloat32, {100000});
  fill(x, random_values(100000, 3));
  x.set_float(77777, bits_float(0xFFC00001u));
  MirroredTensor a(DType::kFloat32, {1});
  a.set_float(0, 1.0f);
  expect_cuda_matches_cpu({&x, &a}, [&](Device d) { amax(x.view(d), a.view(d), nullptr, 0, nullptr); }, "NaN input");
  EXPECT_EQ(a.bits(0), numerics::kCanonicalNanBits);
}

// amax of row runs (strided views): only the runs are read, the gaps between them hold larger
// values and NaNs; shapes with tails, odd strides and misaligned starts (element-wise loads).
TEST(CastCuda, AmaxRowRuns) {
  REQUIRE_GPU();
  struct Case {
    int64_t rows, cols, row_stride, offset;
  };
  const Case cases[] = {{2, 1, 3, 0},       {5, 3, 7, 1},          {37, 1000, 1003, 0},  {37, 1000, 1008, 1},
                        {1000, 2048, 6144, 0}, {4097, 64, 192, 0}, {3, 5000, 5000 + 8, 0}};
  for (const Case& k : cases) {
    const int64_t span = (k.rows - 1) * k.row_stride + k.cols;
    std::vector<float> values = random_values(span, 17);
    for (float& v : values) v = std::isfinite(v) ? std::clamp(v, -6e4f, 6e4f) : 0.0f;  // finite in fp16 too
    for (int64_t r = 0; r < k.rows; ++r) {
      for (int64_t c = k.cols; c < k.row_stride && r * k.row_stride + c < span; ++c) {
        values[r * k.row_stride + c] = (c % 2 == 0) ? 1e6f : std::nanf("");
      }
    }
    for (DType in : kHighPrecision) {
      MirroredTensor x(in, {span}, k.offset);
      fill(x, values);
      for (int counter : {-1, 2, 5}) {  // -1: no counter
        MirroredTensor a(DType::kFloat32, {1});
        a.set_float(0, 0.5f);
        MirroredTensor c(DType::kInt32, {1});
        c.set_int(0, counter);
        expect_cuda_matches_cpu(
            {&x, &a, &c},
            [&](Device d) {
              TensorView xv = x.view(d, {k.rows, k.cols});
              xv.strides = {k.row_stride, 1};
              const TensorView cv = c.view(d);
              amax(xv, a.view(d), counter < 0 ? nullptr : &cv, 3, nullptr);
            },
            std::string(dtype_name(in)) + " runs " + std::to_string(k.rows) + " x " + std::to_string(k.cols) +
                " stride " + std::to_string(k.row_stride) + " offset " + std::to_string(k.offset) + " counter " +
                std::to_string(counter));
        EXPECT_TRUE(std::isfinite(a.get_float(0)));  // no gap was read
        EXPECT_LT(a.get_float(0), 1e6f);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// quantize_current: the amax pass, the scale from it and the NaN rule, on both sides.

TEST(CastCuda, QuantizeCurrent) {
  REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4097}, int64_t{300000}}) {
    for (DType in : kHighPrecision) {
      for (DType out : kScaled) {
        for (int special = 0; special < 4; ++special) {  // none, a zero tensor, an inf, a NaN
          std::vector<float> values = random_values(n, static_cast<uint32_t>(n + special));
          for (float& v : values) {
            if (!std::isfinite(v)) v = 1.0f;  // random_values' specials out: this loop places them
            if (special == 1) v = 0.0f;
          }
          if (n > 0 && special == 2) values[static_cast<size_t>(n / 2)] = -inf;
          if (n > 0 && special == 3) values[static_cast<size_t>(n - 1)] = std::nanf("");
          MirroredTensor x(in, {n});
          fill(x, values);
          for (bool nan_if_nonfinite : {false, true}) {
            for (int margin : {0, 2}) {
              MirroredTensor y(out, {n}), scale_inv(DType::kFloat32, {1}), amax(DType::kFloat32, {1});
              scale_inv.set_float(0, -7.0f);
              amax.set_float(0, -7.0f);  // an output: overwritten, not folded
              expect_cuda_matches_cpu(
                  {&x, &y, &scale_inv, &amax},
                  [&](Device d) {
                    quantize_current(x.view(d), y.view(d), scale_inv.view(d), amax.view(d), margin, nan_if_nonfinite,
                                     nullptr);
                  },
                  label(in, out, "n " + std::to_string(n) + " special " + std::to_string(special) + " margin " +
                                     std::to_string(margin) + (nan_if_nonfinite ? " nan_if_nonfinite" : "")));
            }
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// dequantize// ------------------------------------------------------------------------------------------------
// dequantize

TEST(CastCuda, DequantizeEveryCode) {
  REQUIRE_GPU();
  for (DType in : kScaled) {
    const int64_t codes = dtype_size(in) == 1 ? 256 : 65536;
    MirroredTensor x(in, {codes});
    for (int64_t i = 0; i < codes; ++i) x.set_bits(i, static_cast<uint32_t>(i));
    for (DType out : kHighPrecision) {
      for (float scale_inv : {1.0f, 0x1p-5f, 3.3e-3f, 1e30f, 0x1p-130f}) {
        MirroredTensor y(out, {codes});
        MirroredTensor si(DType::kFloat32, {1});
        si.set_float(0, scale_inv);
        expect_cuda_matches_cpu({&x, &y, &si}, [&](Device d) { dequantize(x.view(d), si.view(d), y.view(d), nullptr); },
                                label(in, out, "scale_inv " + std::to_string(scale_inv)));
      }
    }
  }
}

TEST(CastCuda, DequantizeTailsAndMisalignedPointers) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4097}, int64_t{65537}}) {
    for (DType in : kScaled) {
      for (DType out : kHighPrecision) {
        for (auto [in_offset, out_offset] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 3}}) {
          MirroredTensor x(in, {n}, in_offset);
          for (int64_t i = 0; i < n; ++i) x.set_bits(i, static_cast<uint32_t>(rng()));
          MirroredTensor y(out, {n}, out_offset);
          MirroredTensor si(DType::kFloat32, {1});
          si.set_float(0, 0.75f);
          expect_cuda_matches_cpu({&x, &y, &si},
                                  [&](Device d) { dequantize(x.view(d), si.view(d), y.view(d), nullptr); },
                                  label(in, out, "numel " + std::to_string(n)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace fp8amp
