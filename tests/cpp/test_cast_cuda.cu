// CUDA cast kernels against the CPU reference, bit for bit: every op runs through the public API
// (cast.h) once on CPU tensors and once on CUDA tensors holding the same bytes, and every tensor
// involved must end up byte-identical (inputs too, and guard elements around each tensor, so a
// stray write shows). Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "common/numerics.h"
#include "fp8amp/cast.h"
#include "fp8amp/scaling.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

using numerics::bits_float;
using numerics::float_bits;

#define CUDA_OK(expr)                                                              \
  do {                                                                             \
    const cudaError_t status_ = (expr);                                            \
    ASSERT_EQ(cudaSuccess, status_) << #expr << ": " << cudaGetErrorString(status_); \
  } while (0)

std::vector<MirroredTensor*> operator+(std::vector<MirroredTensor*> a, const std::vector<MirroredTensor*>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<MirroredTensor*> pointers(const std::vector<std::unique_ptr<MirroredTensor>>& ts) {
  std::vector<MirroredTensor*> r;
  for (const auto& t : ts) r.push_back(t.get());
  return r;
}

// The scaling buffers of n tensors, on both sides.
struct ScalingTensors {
  MirroredTensor scale, amax, scale_inv;
  std::unique_ptr<MirroredTensor> warmup_counter;
  int warmup_steps = 0;
  ScalingRecipe recipe;
  TensorView warmup_counter_view[2];

  ScalingTensors(int64_t n, int64_t history)
      : scale(DType::kFloat32, {n}),
        amax(DType::kFloat32, history == 0 ? std::vector<int64_t>{n} : std::vector<int64_t>{n, history}),
        scale_inv(DType::kFloat32, {n}) {
    for (int64_t i = 0; i < n; ++i) {
      scale.set_float(i, 1.0f);
      scale_inv.set_float(i, -7.0f);  // must be overwritten
    }
    for (int64_t i = 0; i < amax.numel(); ++i) amax.set_float(i, 0.0f);
  }

  void with_warmup_counter(std::vector<int32_t> values, int steps) {
    warmup_counter =
        std::make_unique<MirroredTensor>(DType::kInt32, std::vector<int64_t>{static_cast<int64_t>(values.size())});
    for (size_t i = 0; i < values.size(); ++i) warmup_counter->set_int(static_cast<int64_t>(i), values[i]);
    warmup_steps = steps;
  }

  Scaling on(Device d) {
    Scaling s;
    s.scale = scale.view(d);
    s.amax = amax.view(d);
    s.scale_inv = scale_inv.view(d);
    if (warmup_counter) {
      warmup_counter_view[static_cast<int>(d)] = warmup_counter->view(d);
      s.warmup_counter = &warmup_counter_view[static_cast<int>(d)];
    }
    s.warmup_steps = warmup_steps;
    s.recipe = recipe;
    return s;
  }

  std::vector<MirroredTensor*> all() {
    std::vector<MirroredTensor*> r{&scale, &amax, &scale_inv};
    if (warmup_counter) r.push_back(warmup_counter.get());
    return r;
  }
};

// ------------------------------------------------------------------------------------------------
// Inputs.

const DType kHighPrecision[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const DType kScaled[] = {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kFloat16};

// The bits of v in a high-precision dtype (IEEE rounding).
uint32_t bits_in(DType dtype, float v) {
  if (dtype == DType::kFloat32) return float_bits(v);
  return dtype == DType::kBFloat16 ? numerics::float_to_bf16(v) : numerics::float_to_fp16(v);
}

// Values whose encoding is delicate in some format: format maxima and their rounding ties,
// subnormal boundaries, fp32 extremes and specials; each with both signs and fp32 neighbours.
std::vector<float> boundary_values() {
  const float anchors[] = {0.0f,        1.0f,         448.0f,        464.0f,       480.0f,       57344.0f,
                           61440.0f,    65504.0f,     65520.0f,      0x1p-6f,      0x1p-9f,      0x1p-10f,
                           0x3p-11f,    0x1p-14f,     0x1p-16f,      0x1p-17f,     0x3p-18f,     0x1p-24f,
                           0x1p-25f,    0x3p-26f,     FLT_MIN,       FLT_MAX,      FLT_TRUE_MIN, 0x1.fffffcp-127f,
                           INFINITY,    1e38f,        1.5f,          0.3f,         240.0f,       232.0f};
  std::vector<float> v;
  for (float a : anchors) {
    for (float x : {a, std::nextafter(a, 0.0f), std::nextafter(a, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7FFFFFFFu}) v.push_back(bits_float(nan));
  return v;
}

// Finite values over a wide range of magnitudes and both signs, with a few specials mixed in.
std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-40, 40), pick(0, 999), sign(0, 1);
  const std::vector<float> specials = boundary_values();
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    if (pick(rng) == 0) {
      x = specials[static_cast<size_t>(pick(rng)) % specials.size()];
    } else {
      x = std::ldexp(mantissa(rng), exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
    }
  }
  return v;
}

void fill(MirroredTensor& t, const std::vector<float>& values) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set_bits(i, bits_in(t.dtype(), values[static_cast<size_t>(i)]));
}

std::string label(DType in, DType out, const std::string& rest) {
  return std::string(dtype_name(in)) + " -> " + dtype_name(out) + ", " + rest;
}

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

// ------------------------------------------------------------------------------------------------
// Multi-tensor ops: 300 tensors (several launches' worth), sizes from 0 up, each with its own
// row of the scaling buffers.

std::vector<int64_t> varied_sizes() {
  std::vector<int64_t> sizes;
  std::mt19937 rng(9);
  std::uniform_int_distribution<int64_t> small(0, 5000), large(5000, 300000);
  for (int i = 0; i < 300; ++i) sizes.push_back(i % 10 == 0 ? 0 : (i % 3 == 0 ? large(rng) : small(rng)));
  return sizes;
}

template <class Make>
std::vector<std::unique_ptr<MirroredTensor>> make_tensors(const std::vector<int64_t>& sizes, Make&& make) {
  std::vector<std::unique_ptr<MirroredTensor>> r;
  for (size_t i = 0; i < sizes.size(); ++i) r.push_back(make(i, sizes[i]));
  return r;
}

std::vector<TensorView> views(const std::vector<std::unique_ptr<MirroredTensor>>& ts, Device d) {
  std::vector<TensorView> r;
  for (const auto& t : ts) r.push_back(t->view(d));
  return r;
}

TEST(CastCuda, MultiTensorOps) {
  REQUIRE_GPU();
  const std::vector<int64_t> sizes = varied_sizes();
  const int64_t n = static_cast<int64_t>(sizes.size());
  for (DType in : kHighPrecision) {
    auto xs = make_tensors(sizes, [&](size_t i, int64_t size) {
      auto t = std::make_unique<MirroredTensor>(in, std::vector<int64_t>{size}, static_cast<int64_t>(i % 3));
      fill(*t, random_values(size, static_cast<uint32_t>(i)));
      return t;
    });
    for (DType out : kScaled) {
      auto ys = make_tensors(sizes, [&](size_t i, int64_t size) {
        return std::make_unique<MirroredTensor>(out, std::vector<int64_t>{size}, static_cast<int64_t>(i % 2));
      });
      ScalingTensors s(n, 3);
      std::vector<int32_t> counters;
      for (int64_t i = 0; i < n; ++i) {
        s.scale.set_float(i, std::ldexp(1.0f, static_cast<int>(i % 11) - 5));
        s.amax.set_float(i * 3, i % 4 == 0 ? 0.0f : 0.5f * static_cast<float>(i));
        counters.push_back(static_cast<int32_t>(i % 7));
      }
      s.with_warmup_counter(counters, 4);
      expect_cuda_matches_cpu(pointers(xs) + pointers(ys) + s.all(),
                              [&](Device d) { multi_quantize(views(xs, d), views(ys, d), s.on(d), nullptr); },
                              label(in, out, "multi_quantize of 300 tensors"));
    }
    for (int64_t history : {int64_t{0}, int64_t{5}}) {
      MirroredTensor a(DType::kFloat32, history == 0 ? std::vector<int64_t>{n} : std::vector<int64_t>{n, history});
      for (int64_t i = 0; i < a.numel(); ++i) a.set_float(i, i % 5 == 0 ? -0.0f : 0.25f * static_cast<float>(i % 9));
      expect_cuda_matches_cpu(pointers(xs) + std::vector<MirroredTensor*>{&a},
                              [&](Device d) { multi_amax(views(xs, d), a.view(d), nullptr); },
                              std::string(dtype_name(in)) + " multi_amax, history " + std::to_string(history));
    }
  }
  std::mt19937 rng(13);
  for (DType in : kScaled) {
    auto xs = make_tensors(sizes, [&](size_t i, int64_t size) {
      auto t = std::make_unique<MirroredTensor>(in, std::vector<int64_t>{size}, static_cast<int64_t>(i % 2));
      for (int64_t j = 0; j < size; ++j) t->set_bits(j, static_cast<uint32_t>(rng()));
      return t;
    });
    MirroredTensor si(DType::kFloat32, {n});
    for (int64_t i = 0; i < n; ++i) si.set_float(i, std::ldexp(1.3f, static_cast<int>(i % 13) - 6));
    for (DType out : kHighPrecision) {
      auto ys = make_tensors(sizes, [&](size_t i, int64_t size) {
        return std::make_unique<MirroredTensor>(out, std::vector<int64_t>{size}, static_cast<int64_t>(i % 3));
      });
      expect_cuda_matches_cpu(pointers(xs) + pointers(ys) + std::vector<MirroredTensor*>{&si},
                              [&](Device d) { multi_dequantize(views(xs, d), si.view(d), views(ys, d), nullptr); },
                              label(in, out, "multi_dequantize of 300 tensors"));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Scale updates over histories full of awkward amaxes.

float awkward_amax(std::mt19937& rng) {
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, bits_float(0x7FC00000u), bits_float(0xFFFFFFFFu),
                            FLT_TRUE_MIN, FLT_MAX, 1e-40f, -3.0f, 448.0f, 65504.0f};
  std::uniform_int_distribution<int> pick(0, 3), which(0, 11), exponent(-130, 130);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  if (pick(rng) == 0) return specials[which(rng)];
  return std::ldexp(mantissa(rng), exponent(rng));
}

TEST(CastCuda, ComputeScale) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  const int64_t n = 1000;
  for (int64_t history : {int64_t{0}, int64_t{4}}) {
    for (float fmax : {448.0f, 57344.0f, 65504.0f}) {
      for (bool pow2_scale : {true, false}) {
        for (int margin : {0, 3, 126}) {  // the accepted range is [0, 126]
          MirroredTensor a(DType::kFloat32, history == 0 ? std::vector<int64_t>{n} : std::vector<int64_t>{n, history});
          for (int64_t i = 0; i < a.numel(); ++i) a.set_float(i, awkward_amax(rng));
          MirroredTensor scale(DType::kFloat32, {n}), scale_inv(DType::kFloat32, {n});
          for (int64_t i = 0; i < n; ++i) {
            scale.set_float(i, std::ldexp(1.0f, static_cast<int>(i % 9) - 4));
            scale_inv.set_float(i, 1.0f / std::ldexp(1.0f, static_cast<int>(i % 9) - 4));
          }
          const ScalingRecipe recipe{margin, pow2_scale};
          expect_cuda_matches_cpu(
              {&a, &scale, &scale_inv},
              [&](Device d) { compute_scale(a.view(d), scale.view(d), scale_inv.view(d), fmax, recipe, nullptr); },
              "fmax " + std::to_string(fmax) + " pow2_scale " + std::to_string(pow2_scale) + " margin " + std::to_string(margin));
        }
      }
    }
  }
}

TEST(CastCuda, UpdateDelayedScaling) {
  REQUIRE_GPU();
  std::mt19937 rng(19);
  for (int64_t n : {int64_t{1}, int64_t{1000}}) {
    for (int64_t history : {int64_t{1}, int64_t{16}, int64_t{33}}) {
      for (bool pow2_scale : {true, false}) {
        MirroredTensor h(DType::kFloat32, {n, history});
        for (int64_t i = 0; i < h.numel(); ++i) h.set_float(i, awkward_amax(rng));
        MirroredTensor scale(DType::kFloat32, {n}), scale_inv(DType::kFloat32, {n}), counter(DType::kInt32, {n});
        std::uniform_int_distribution<int32_t> count(-2, static_cast<int32_t>(history) + 2);
        for (int64_t i = 0; i < n; ++i) {
          scale.set_float(i, 2.0f);
          scale_inv.set_float(i, 0.5f);
          counter.set_int(i, i == 0 ? INT32_MAX : count(rng));
        }
        const ScalingRecipe recipe{1, pow2_scale};
        // Several steps in a row, so rolled histories and counters feed the next update.
        for (int step = 0; step < 3; ++step) {
          expect_cuda_matches_cpu({&h, &scale, &scale_inv, &counter},
                                  [&](Device d) {
                                    update_delayed_scaling(h.view(d), scale.view(d), scale_inv.view(d),
                                                           counter.view(d), 448.0f, recipe, nullptr);
                                  },
                                  "n " + std::to_string(n) + " H " + std::to_string(history) + " pow2_scale " +
                                      std::to_string(pow2_scale) + " step " + std::to_string(step));
        }
      }
    }
  }
}

// 150 states of different row counts and history lengths: three launches of up to 64 states.
TEST(CastCuda, MultiUpdateDelayedScaling) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  std::vector<std::unique_ptr<MirroredTensor>> hs, scales, scale_invs, counters;
  for (int i = 0; i < 150; ++i) {
    const int64_t n = i % 7 == 0 ? 3 : 1, history = 1 + i % 17;
    hs.push_back(std::make_unique<MirroredTensor>(DType::kFloat32, std::vector<int64_t>{n, history}));
    scales.push_back(std::make_unique<MirroredTensor>(DType::kFloat32, std::vector<int64_t>{n}));
    scale_invs.push_back(std::make_unique<MirroredTensor>(DType::kFloat32, std::vector<int64_t>{n}));
    counters.push_back(std::make_unique<MirroredTensor>(DType::kInt32, std::vector<int64_t>{n}));
    for (int64_t j = 0; j < hs.back()->numel(); ++j) hs.back()->set_float(j, awkward_amax(rng));
    for (int64_t j = 0; j < n; ++j) {
      scales.back()->set_float(j, 2.0f);
      scale_invs.back()->set_float(j, 0.5f);
      counters.back()->set_int(j, static_cast<int32_t>(rng() % 20));
    }
  }
  const auto views_on = [](const std::vector<std::unique_ptr<MirroredTensor>>& ts, Device d) {
    std::vector<TensorView> v;
    for (const auto& t : ts) v.push_back(t->view(d));
    return v;
  };
  for (int step = 0; step < 3; ++step) {
    expect_cuda_matches_cpu(pointers(hs) + pointers(scales) + pointers(scale_invs) + pointers(counters),
                            [&](Device d) {
                              multi_update_delayed_scaling(views_on(hs, d), views_on(scales, d),
                                                           views_on(scale_invs, d), views_on(counters, d), 57344.0f,
                                                           ScalingRecipe{0, true}, nullptr);
                            },
                            "step " + std::to_string(step));
  }
}

}  // namespace
}  // namespace fp8amp
