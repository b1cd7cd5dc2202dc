// cast_transpose_rescaled through the public core API on CPU: the same codes as the path it
// replaces (the scale product made beforehand, then cast_transpose with an amax scratch), the
// float32 rounding of that product, and errors that name the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "expect_error.h"
#include "fp8amp/cast.h"
#include "fp8amp/error.h"
#include "host_view.h"

namespace fp8amp {
namespace {

// FP16 codes of `values` (quantize with scale 1: exact for values FP16 holds).
std::vector<uint16_t> fp16_codes(std::vector<float> values, int64_t rows, int64_t cols) {
  std::vector<uint16_t> codes(values.size());
  std::vector<float> scale{1.0f}, amax{0.0f}, scale_inv{0.0f};
  quantize(view(values, DType::kFloat32, {rows, cols}), view(codes, DType::kFloat16, {rows, cols}),
           Scaling{view(scale, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1}),
                   view(scale_inv, DType::kFloat32, {1})},
           nullptr);
  return codes;
}

// Values spread over many binades, both signs, with zeros, and one large enough to saturate E4M3.
std::vector<float> spread_values(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-20, 12);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& e : v) e = std::ldexp(normal(gen), exponent(gen));
  v[0] = 0.0f;
  v[1] = -0.0f;
  v[2] = 60000.0f;
  return v;
}

// What _transposed_copy did before the op existed: the product in float32, then cast_transpose
// into out (unused) and out_t, folding x's amax into a scratch.
template <class Code>
std::vector<Code> old_path(std::vector<uint16_t>& x, int64_t rows, int64_t cols, float scale_inv, float scale,
                           DType dtype) {
  std::vector<float> product{scale_inv * scale}, amax{0.0f}, written_inv{0.0f};
  std::vector<Code> out(x.size()), out_t(x.size());
  cast_transpose(view(x, DType::kFloat16, {rows, cols}), view(out, dtype, {rows, cols}),
                 view(out_t, dtype, {cols, rows}),
                 Scaling{view(product, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1}),
                         view(written_inv, DType::kFloat32, {1})},
                 nullptr);
  return out_t;
}

template <class Code>
std::vector<Code> rescaled(std::vector<uint16_t>& x, int64_t rows, int64_t cols, float scale_inv, float scale,
                           DType dtype) {
  std::vector<float> si{scale_inv}, s{scale};
  std::vector<Code> out_t(x.size(), Code{0x55});
  cast_transpose_rescaled(view(x, DType::kFloat16, {rows, cols}), view(si, DType::kFloat32, {1}),
                          view(s, DType::kFloat32, {1}), view(out_t, dtype, {cols, rows}), nullptr);
  return out_t;
}

TEST(CastTransposeRescaled, EqualsTheProductThenCastTranspose) {
  const int64_t rows = 37, cols = 24;
  std::vector<uint16_t> x = fp16_codes(spread_values(rows * cols, 1), rows, cols);
  // Powers of two (a MasterWeight's scales), and a pair whose float32 product is rounded (3 * 1/3).
  for (const auto& [scale_inv, scale] : {std::pair{0.125f, 32.0f}, std::pair{0x1p-20f, 0x1p+9f},
                                         std::pair{4.0f, 0.25f}, std::pair{3.0f, 1.0f / 3.0f}}) {
    SCOPED_TRACE(::testing::Message() << "scale_inv " << scale_inv << ", scale " << scale);
    EXPECT_EQ((rescaled<uint8_t>(x, rows, cols, scale_inv, scale, DType::kFloat8E4M3)),
              (old_path<uint8_t>(x, rows, cols, scale_inv, scale, DType::kFloat8E4M3)));
    EXPECT_EQ((rescaled<uint8_t>(x, rows, cols, scale_inv, scale, DType::kFloat8E5M2)),
              (old_path<uint8_t>(x, rows, cols, scale_inv, scale, DType::kFloat8E5M2)));
    EXPECT_EQ((rescaled<uint16_t>(x, rows, cols, scale_inv, scale, DType::kFloat16)),
              (old_path<uint16_t>(x, rows, cols, scale_inv, scale, DType::kFloat16)));
  }
}

// With power-of-two scales the codes are those of quantizing the real values x * scale_inv with
// `scale`, transposed: the E4M3 copy of a master weight.
TEST(CastTransposeRescaled, IsTheTransposeOfTheRealValuesQuantized) {
  const int64_t rows = 5, cols = 16;
  std::vector<uint16_t> x = fp16_codes(spread_values(rows * cols, 2), rows, cols);
  const float scale_inv = 0x1p-6f, scale = 0x1p+3f;
  std::vector<float> real(x.size()), si{scale_inv}, s{scale}, amax{0.0f}, written_inv{0.0f};
  dequantize(view(x, DType::kFloat16, {rows, cols}), view(si, DType::kFloat32, {1}),
             view(real, DType::kFloat32, {rows, cols}), nullptr);
  std::vector<uint8_t> copy(x.size());
  quantize(view(real, DType::kFloat32, {rows, cols}), view(copy, DType::kFloat8E4M3, {rows, cols}),
           Scaling{view(s, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1}),
                   view(written_inv, DType::kFloat32, {1})},
           nullptr);
  const std::vector<uint8_t> out_t = rescaled<uint8_t>(x, rows, cols, scale_inv, scale, DType::kFloat8E4M3);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(out_t[c * rows + r], copy[r * cols + c]) << r << ", " << c;
  }
}

TEST(CastTransposeRescaled, EmptyWritesNothing) {
  std::vector<uint16_t> x;
  std::vector<uint8_t> out_t;
  std::vector<float> si{1.0f}, s{1.0f};
  cast_transpose_rescaled(view(x, DType::kFloat16, {0, 8}), view(si, DType::kFloat32, {1}),
                          view(s, DType::kFloat32, {1}), view(out_t, DType::kFloat8E4M3, {8, 0}), nullptr);
}

TEST(CastTransposeRescaled, RefusesBadArguments) {
  std::vector<uint16_t> x(8);
  std::vector<float> x_f(8), si{1.0f}, s{1.0f}, two{1.0f, 1.0f};
  std::vector<uint8_t> out_t(8);
  std::vector<int32_t> ints{1};
  const TensorView codes = view(x, DType::kFloat16, {2, 4});
  const TensorView si_v = view(si, DType::kFloat32, {1}), s_v = view(s, DType::kFloat32, {1});
  const TensorView out_t_v = view(out_t, DType::kFloat8E4M3, {4, 2});
  const auto call = [](const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& d) {
    return [=] { cast_transpose_rescaled(a, b, c, d, nullptr); };
  };
  expect_value_error(call(view(x_f, DType::kFloat32, {2, 4}), si_v, s_v, out_t_v),
                     "cast_transpose_rescaled: x must hold float16 codes");
  expect_value_error(call(codes, view(ints, DType::kInt32, {1}), s_v, out_t_v), "scale_inv must be float32");
  expect_value_error(call(codes, si_v, view(two, DType::kFloat32, {2}), out_t_v), "scale must have 1 element");
  expect_value_error(call(codes, si_v, s_v, view(out_t, DType::kFloat8E4M3, {2, 4})),
                     "out_t must be float8_e4m3fn[4, 2]");
  expect_value_error(call(codes, si_v, s_v, view(x_f, DType::kBFloat16, {4, 2})),
                     "dtype must be float8_e4m3fn, float8_e5m2 or float16");
  TensorView strided = codes;
  strided.strides = {1, 2};
  expect_value_error(call(strided, si_v, s_v, out_t_v), "x must be contiguous");
  TensorView over_x = view(x, DType::kFloat8E4M3, {4, 2});
  expect_value_error(call(codes, si_v, s_v, over_x), "must not share memory");
  TensorView on_gpu = out_t_v;
  on_gpu.device = Device::kCUDA;
  on_gpu.device_index = 0;
  expect_value_error(call(codes, si_v, s_v, on_gpu), "must be on the same device");
}

}  // namespace
}  // namespace fp8amp
