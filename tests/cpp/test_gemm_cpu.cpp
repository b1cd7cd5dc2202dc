// The FP8 GEMM's CPU reference through the public API: hand-derived results (identity, scales,
// bias, accumulation, output rounding, the empty sum, strided views), an independent naive loop
// on random operands, and clear errors for everything cuBLASLt FP8 cannot take.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "expect_error.h"
#include "host_view.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"

namespace fp8amp {
namespace {

uint8_t e4m3(float x) { return numerics::quantize_to<numerics::fp8_e4m3>(x).bits; }
uint8_t e5m2(float x) { return numerics::quantize_to<numerics::fp8_e5m2>(x).bits; }
uint16_t bf16(float x) { return numerics::float_to_bf16(x); }
float from_bf16(uint16_t x) { return numerics::bf16_to_float(x); }

// An FP8 matrix [rows, cols] filled by f(r, c) (values must be representable).
std::vector<uint8_t> fp8_matrix(int64_t rows, int64_t cols, const std::function<float(int64_t, int64_t)>& f,
                                uint8_t (*encode)(float) = e4m3) {
  std::vector<uint8_t> m(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m[r * cols + c] = encode(f(r, c));
  return m;
}

// The problem of most tests: a [M, 16] E4M3, b [16, 16] E4M3 identity, scales 1.
struct Problem {
  int64_t m = 2, n = 16, k = 16;
  std::vector<uint8_t> a, b;
  std::vector<float> sa{1.0f}, sb{1.0f};
  Problem() {
    a = fp8_matrix(m, k, [](int64_t r, int64_t c) { return (r + 1) * (c % 5 - 2.0f); });
    b = fp8_matrix(n, k, [](int64_t r, int64_t c) { return r == c ? 1.0f : 0.0f; });
  }
  float a_value(int64_t r, int64_t c) const { return numerics::decode<numerics::E4M3>(a[r * k + c]); }

  template <class T>
  void run(std::vector<T>& out, DType out_dtype, const TensorView* bias = nullptr, GemmOptions o = {}) {
    gemm(view(a, DType::kFloat8E4M3, {m, k}), view(b, DType::kFloat8E4M3, {n, k}), view(sa, DType::kFloat32, {1}),
         view(sb, DType::kFloat32, {1}), bias, view(out, out_dtype, {m, n}), o, nullptr);
  }
};

TEST(Gemm, IdentityGivesTheDequantizedA) {
  Problem p;
  std::vector<float> out(p.m * p.n, -1.0f);
  p.run(out, DType::kFloat32);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t c = 0; c < p.n; ++c) EXPECT_EQ(out[r * p.n + c], p.a_value(r, c)) << r << "," << c;
}

TEST(Gemm, ScaleInvsMultiplyTheProduct) {
  Problem p;
  p.sa[0] = 0.5f;
  p.sb[0] = 8.0f;
  std::vector<float> out(p.m * p.n);
  p.run(out, DType::kFloat32);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t c = 0; c < p.n; ++c) EXPECT_EQ(out[r * p.n + c], 4.0f * p.a_value(r, c));
}

TEST(Gemm, DotProductsAndTransposedB) {
  // a = [[1, 2, 0...], [3, 4, 0...]] (E5M2), b[j, 0] = j, b[j, 1] = -1 (E4M3):
  // out[i, j] = a[i, 0] * j - a[i, 1].
  const int64_t m = 2, n = 16, k = 16;
  std::vector<uint8_t> a = fp8_matrix(m, k, [](int64_t r, int64_t c) { return c < 2 ? 2.0f * r + c + 1 : 0.0f; }, e5m2);
  std::vector<uint8_t> b = fp8_matrix(n, k, [](int64_t r, int64_t c) { return c == 0 ? float(r) : (c == 1 ? -1.0f : 0.0f); });
  std::vector<float> sa{1.0f}, sb{1.0f}, out(m * n);
  gemm(view(a, DType::kFloat8E5M2, {m, k}), view(b, DType::kFloat8E4M3, {n, k}), view(sa, DType::kFloat32, {1}),
       view(sb, DType::kFloat32, {1}), nullptr, view(out, DType::kFloat32, {m, n}), {}, nullptr);
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_EQ(out[j], 1.0f * j - 2.0f);
    EXPECT_EQ(out[n + j], 3.0f * j - 4.0f);
  }
}

TEST(Gemm, BiasIsAddedPerColumn) {
  Problem p;
  std::vector<uint16_t> bias(p.n), out(p.m * p.n);
  for (int64_t j = 0; j < p.n; ++j) bias[j] = bf16(0.25f * j);
  TensorView bv = view(bias, DType::kBFloat16, {p.n});
  p.run(out, DType::kBFloat16, &bv);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t c = 0; c < p.n; ++c) EXPECT_EQ(from_bf16(out[r * p.n + c]), p.a_value(r, c) + 0.25f * c);
}

TEST(Gemm, Float32OutTakesABfloat16Bias) {
  Problem p;
  std::vector<uint16_t> bias(p.n, bf16(-0.5f));
  std::vector<float> out(p.m * p.n);
  TensorView bv = view(bias, DType::kBFloat16, {p.n});
  p.run(out, DType::kFloat32, &bv);
  EXPECT_EQ(out[3], p.a_value(0, 3) - 0.5f);
}

TEST(Gemm, AccumulateAddsToOut) {
  Problem p;
  std::vector<float> out(p.m * p.n);
  for (size_t i = 0; i < out.size(); ++i) out[i] = 100.0f + i;
  std::vector<uint16_t> bias(p.n, bf16(1.0f));
  TensorView bv = view(bias, DType::kBFloat16, {p.n});
  GemmOptions o;
  o.accumulate = true;
  o.fast_accum = true;  // the reference ignores it
  p.run(out, DType::kFloat32, &bv, o);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t c = 0; c < p.n; ++c) EXPECT_EQ(out[r * p.n + c], 100.0f + (r * p.n + c) + p.a_value(r, c) + 1.0f);
}

TEST(Gemm, OutputIsRoundedOnceToNearestEven) {
  // Row sums 256 + 1 = 257 and 256 + 3 = 259, exact in float32; bfloat16 (8 significant bits)
  // has spacing 2 there: 257 ties to 256 (even), 259 ties to 260 (even).
  const int64_t m = 2, n = 16, k = 16;
  std::vector<uint8_t> a = fp8_matrix(m, k, [](int64_t r, int64_t c) { return c == 0 ? 256.0f : (c == 1 ? 1.0f + 2 * r : 0.0f); });
  std::vector<uint8_t> b = fp8_matrix(n, k, [](int64_t, int64_t) { return 1.0f; });
  std::vector<float> sa{1.0f}, sb{1.0f};
  std::vector<uint16_t> out(m * n);
  auto run = [&](DType dtype) {
    gemm(view(a, DType::kFloat8E4M3, {m, k}), view(b, DType::kFloat8E4M3, {n, k}), view(sa, DType::kFloat32, {1}),
         view(sb, DType::kFloat32, {1}), nullptr, view(out, dtype, {m, n}), {}, nullptr);
  };
  run(DType::kBFloat16);
  EXPECT_EQ(from_bf16(out[0]), 256.0f);
  EXPECT_EQ(from_bf16(out[n]), 260.0f);
  // float16 (11 significant bits) has spacing 2 from 2048: with a_scale_inv 8, rows
  // 256 + 0.125 and 256 + 0.375 give 2049 (ties to 2048) and 2051 (ties to 2052).
  a = fp8_matrix(m, k, [](int64_t r, int64_t c) { return c == 0 ? 256.0f : (c == 1 ? 0.125f * (1 + 2 * r) : 0.0f); });
  sa[0] = 8.0f;
  run(DType::kFloat16);
  EXPECT_EQ(numerics::fp16_to_float(out[0]), 2048.0f);  // 2049 -> 2048
  EXPECT_EQ(numerics::fp16_to_float(out[n]), 2052.0f);  // 2051 -> 2052
}

TEST(Gemm, AccumulationRoundsTheResultBeforeAddingIt) {
  // The product row sum is 256 + 1 = 257, the old value 1. The result is rounded to bfloat16
  // first (257 ties to 256), then added: 256 + 1 = 257 ties to 256 again. One rounding of the
  // exact 258 would give 258; cuBLASLt gives 256.
  const int64_t m = 1, n = 16, k = 16;
  std::vector<uint8_t> a = fp8_matrix(m, k, [](int64_t, int64_t c) { return c == 0 ? 256.0f : (c == 1 ? 1.0f : 0.0f); });
  std::vector<uint8_t> b = fp8_matrix(n, k, [](int64_t, int64_t) { return 1.0f; });
  std::vector<float> sa{1.0f}, sb{1.0f};
  std::vector<uint16_t> out(m * n, bf16(1.0f));
  GemmOptions o;
  o.accumulate = true;
  gemm(view(a, DType::kFloat8E4M3, {m, k}), view(b, DType::kFloat8E4M3, {n, k}), view(sa, DType::kFloat32, {1}),
       view(sb, DType::kFloat32, {1}), nullptr, view(out, DType::kBFloat16, {m, n}), o, nullptr);
  EXPECT_EQ(from_bf16(out[0]), 256.0f);
}

TEST(Gemm, NaNPropagatesAlongItsRow) {
  Problem p;
  p.a[3] = 0x7F;  // E4M3 NaN in row 0
  std::vector<float> out(p.m * p.n);
  p.run(out, DType::kFloat32);
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_EQ(out[p.n + 3], p.a_value(1, 3));
}

TEST(Gemm, StridedOperandsAndOutLeaveThePaddingAlone) {
  Problem p;
  const int64_t lda = 32, ldo = 48;
  std::vector<uint8_t> a(p.m * lda, 0xAB);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t c = 0; c < p.k; ++c) a[r * lda + c] = p.a[r * p.k + c];
  std::vector<float> out(p.m * ldo, -7.0f);
  gemm(view(a, DType::kFloat8E4M3, {p.m, p.k}, {lda, 1}), view(p.b, DType::kFloat8E4M3, {p.n, p.k}),
       view(p.sa, DType::kFloat32, {1}), view(p.sb, DType::kFloat32, {1}), nullptr,
       view(out, DType::kFloat32, {p.m, p.n}, {ldo, 1}), {}, nullptr);
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t c = 0; c < ldo; ++c) {
      EXPECT_EQ(out[r * ldo + c], c < p.n ? p.a_value(r, c) : -7.0f) << r << "," << c;
    }
  }
}

TEST(Gemm, EmptyDimensions) {
  std::vector<uint8_t> a(3 * 16), b(16 * 16);
  std::vector<float> sa{std::nanf("")}, sb{1.0f}, out(3 * 16, 5.0f);
  std::vector<uint16_t> bias(16, bf16(2.0f));
  TensorView bv = view(bias, DType::kBFloat16, {16});
  auto run = [&](int64_t m, int64_t n, int64_t k, const TensorView* bias_view, bool accumulate) {
    GemmOptions o;
    o.accumulate = accumulate;
    gemm(view(a, DType::kFloat8E4M3, {m, k}), view(b, DType::kFloat8E4M3, {n, k}), view(sa, DType::kFloat32, {1}),
         view(sb, DType::kFloat32, {1}), bias_view, view(out, DType::kFloat32, {m, n}), o, nullptr);
  };
  run(0, 16, 16, nullptr, false);  // M == 0 and N == 0: nothing to write
  run(3, 0, 16, nullptr, false);
  EXPECT_EQ(out, std::vector<float>(3 * 16, 5.0f));
  // K == 0: the empty sum is 0, even with a NaN scale.
  run(3, 16, 0, &bv, true);
  EXPECT_EQ(out, std::vector<float>(3 * 16, 7.0f));
  run(3, 16, 0, &bv, false);
  EXPECT_EQ(out, std::vector<float>(3 * 16, 2.0f));
  run(3, 16, 0, nullptr, false);
  EXPECT_EQ(out, std::vector<float>(3 * 16, 0.0f));
}

// An independent naive loop (k innermost, double) on random operands of every accepted format
// pair, at a size that crosses the reference's 256-column blocks; odd M.
TEST(Gemm, MatchesANaiveLoopOnRandomOperands) {
  const int64_t m = 7, n = 272, k = 48;
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> code(0, 255);
  const std::pair<DType, DType> formats[] = {{DType::kFloat8E4M3, DType::kFloat8E4M3},
                                             {DType::kFloat8E4M3, DType::kFloat8E5M2},
                                             {DType::kFloat8E5M2, DType::kFloat8E4M3}};
  auto decode = [](DType dtype, uint8_t c) {
    return dtype == DType::kFloat8E4M3 ? numerics::decode<numerics::E4M3>(c) : numerics::decode<numerics::E5M2>(c);
  };
  for (const auto& [fa, fb] : formats) {
    std::vector<uint8_t> a(m * k), b(n * k);
    for (auto* v : {&a, &b})
      for (uint8_t& x : *v) {
        do x = static_cast<uint8_t>(code(rng));
        while (!std::isfinite(decode(v == &a ? fa : fb, x)));
      }
    std::vector<float> sa{0.25f}, sb{3.0f};
    std::vector<uint16_t> bias(n), out(m * n, bf16(1.5f));
    for (int64_t j = 0; j < n; ++j) bias[j] = bf16(0.01f * j - 1.0f);
    TensorView bv = view(bias, DType::kBFloat16, {n});
    const std::vector<uint16_t> old = out;
    GemmOptions o;
    o.accumulate = true;
    gemm(view(a, fa, {m, k}), view(b, fb, {n, k}), view(sa, DType::kFloat32, {1}), view(sb, DType::kFloat32, {1}),
         &bv, view(out, DType::kBFloat16, {m, n}), o, nullptr);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0.0;
        for (int64_t kk = 0; kk < k; ++kk) acc += double(decode(fa, a[i * k + kk])) * decode(fb, b[j * k + kk]);
        // Rounded to bfloat16, then added to the old value and rounded again (gemm.h).
        const float result = from_bf16(bf16(static_cast<float>(acc * 0.75 + from_bf16(bias[j]))));
        const double v = double(result) + from_bf16(old[i * n + j]);
        ASSERT_EQ(out[i * n + j], bf16(static_cast<float>(v))) << dtype_name(fa) << " x " << dtype_name(fb) << " at " << i << "," << j;
      }
    }
  }
}

struct Args {
  std::vector<uint8_t> a = std::vector<uint8_t>(64 * 64), b = std::vector<uint8_t>(64 * 64);
  std::vector<float> sa{1.0f}, sb{1.0f}, out = std::vector<float>(64 * 64), scales = std::vector<float>(8, 1.0f);
  std::vector<uint16_t> bias = std::vector<uint16_t>(64);
  TensorView va = view(a, DType::kFloat8E4M3, {4, 32});
  TensorView vb = view(b, DType::kFloat8E4M3, {16, 32});
  TensorView vsa = view(sa, DType::kFloat32, {1});
  TensorView vsb = view(sb, DType::kFloat32, {1});
  TensorView vout = view(out, DType::kFloat32, {4, 16});
  TensorView vbias = view(bias, DType::kBFloat16, {16});
  const TensorView* bias_ptr = nullptr;
  void run() { gemm(va, vb, vsa, vsb, bias_ptr, vout, {}, nullptr); }
};

void expect_gemm_value_error(const std::function<void(Args&)>& setup, const std::string& needle) {
  Args args;
  setup(args);
  expect_error(ErrorKind::kValue, [&] { args.run(); }, needle);
}

TEST(GemmErrors, NameTheArgumentAndTheRule) {
  expect_gemm_value_error([](Args& x) { x.va.shape = {4, 24}; x.vb.shape = {16, 24}; },
                     "K (the columns of a and b) must be a multiple of 16 for cuBLASLt FP8, got K = 24");
  expect_gemm_value_error([](Args& x) { x.vb.shape = {24, 32}; x.vout.shape = {4, 24}; },
                     "N (the rows of b) must be a multiple of 16 for cuBLASLt FP8, got N = 24");
  expect_gemm_value_error([](Args& x) { x.va.strides = {40, 1}; }, "a row stride (leading dimension) must be a multiple of 16");
  expect_gemm_value_error([](Args& x) { x.vout.strides = {24, 1}; }, "out row stride (leading dimension) must be a multiple of 16");
  expect_gemm_value_error([](Args& x) { x.vb.strides = {16, 1}; }, "b rows must not overlap");
  expect_gemm_value_error([](Args& x) { x.va.strides = {1, 4}; }, "a must be row-major (last stride 1)");
  expect_gemm_value_error([](Args& x) { x.vb.data = x.b.data() + 1; }, "b must start at a 16-byte aligned address");
  expect_gemm_value_error([](Args& x) { x.va.dtype = x.vb.dtype = DType::kFloat8E5M2; },
                     "a and b are both float8_e5m2, which cuBLASLt cannot multiply");
  expect_gemm_value_error([](Args& x) { x.va.dtype = DType::kBFloat16; }, "a must be float8_e4m3fn or float8_e5m2");
  expect_gemm_value_error([](Args& x) { x.va.shape = {1, 4, 32}; }, "a must be 2-D");
  expect_gemm_value_error([](Args& x) { x.vb.shape = {16, 48}; }, "a [M, K] and b [N, K] must share K");
  expect_gemm_value_error([](Args& x) { x.vout.shape = {4, 32}; }, "out must be [M, N] = [4, 16]");
  expect_gemm_value_error([](Args& x) { x.vout.dtype = DType::kFloat8E4M3; }, "out must be float32, bfloat16 or float16");
  expect_gemm_value_error([](Args& x) { x.vsa.dtype = DType::kBFloat16; }, "a_scale_inv must be float32");
  expect_gemm_value_error([](Args& x) { x.vsb.shape = {0}; }, "b_scale_inv must have 1 element(s)");
  // scales[1], scales[2]: 4 and 8 bytes past the vector's 16-byte aligned start (malloc's alignment).
  expect_gemm_value_error([](Args& x) { x.vsb.data = x.scales.data() + 1; },
                          "b_scale_inv must start at a 16-byte aligned address");
  expect_gemm_value_error([](Args& x) { x.vsa.data = x.scales.data() + 2; },
                          "a_scale_inv must start at a 16-byte aligned address");
  expect_gemm_value_error([](Args& x) { x.vbias.dtype = DType::kFloat32; x.bias_ptr = &x.vbias; },
                     "bias must be bfloat16 for a float32 out (cuBLASLt's FP8 bias type)");
  expect_gemm_value_error([](Args& x) { x.vout.dtype = DType::kFloat16; x.bias_ptr = &x.vbias; },
                     "bias must be float16 for a float16 out");
  expect_gemm_value_error([](Args& x) { x.vbias.shape = {32}; x.bias_ptr = &x.vbias; }, "bias must be [N] = [16]");
  expect_gemm_value_error([](Args& x) { x.vbias.data = x.bias.data() + 1; x.bias_ptr = &x.vbias; },
                     "bias must start at a 16-byte aligned address");
  expect_gemm_value_error([](Args& x) { x.vb.device = Device::kCUDA; x.vb.device_index = 0; },
                     "b and a must be on the same device");
}

}  // namespace
}  // namespace fp8amp
