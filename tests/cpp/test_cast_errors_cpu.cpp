// Clear errors for bad arguments to the cast ops on CPU: each names the argument (dtype, shape,
// device, layout, margin), multi_dequantize names the output by its index, outputs sharing memory
// with an input or another output are refused, and check::disjoint_writes matches the pairwise
// definition of overlap.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cast_test_util.h"
#include "expect_error.h"
#include "fp8amp/accumulate.h"
#include "fp8amp/cast.h"
#include "fp8amp/error.h"
#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"
#include "host_view.h"

namespace fp8amp {
namespace {

TEST(Errors, NameTheArgument) {
  std::vector<float> x{1.0f, 2.0f};
  std::vector<uint8_t> y(2);
  std::vector<int32_t> wrong(2);
  State st;
  expect_value_error([&] { quantize(view(wrong, DType::kInt32, {2}), view(y, DType::kFloat8E4M3, {2}), st.scaling(), nullptr); },
                     "x must be float32, bfloat16 or float16");
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kBFloat16, {2}), st.scaling(), nullptr); },
                     "dtype must be float8_e4m3fn, float8_e5m2 or float16");
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {1, 2}), st.scaling(), nullptr); },
                     "must have the same shape");
  Scaling bad = st.scaling();
  bad.scale.shape = {};
  bad.scale.dtype = DType::kInt32;
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {2}), bad, nullptr); },
                     "scale must be float32");
  TensorView strided = view(x, DType::kFloat32, {2});
  strided.strides = {2};
  expect_value_error([&] { quantize(strided, view(y, DType::kFloat8E4M3, {2}), st.scaling(), nullptr); },
                     "must be contiguous");
  for (int margin : {-2, 127}) {
    Scaling wide = st.scaling();
    wide.recipe.margin = margin;
    expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), view(y, DType::kFloat8E4M3, {2}), wide, nullptr); },
                       "margin must be in [0, 126]");
  }
  TensorView on_gpu = view(y, DType::kFloat8E4M3, {2});
  on_gpu.device = Device::kCUDA;
  on_gpu.device_index = 0;
  expect_value_error([&] { quantize(view(x, DType::kFloat32, {2}), on_gpu, st.scaling(), nullptr); },
                     "must be on the same device");
}

// The caller's outputs of multi_dequantize: count, dtype, shape, device and layout, each error
// naming the output by its index.
TEST(Errors, MultiDequantizeNamesTheOutput) {
  std::vector<uint8_t> x0(2), x1(3);
  std::vector<float> scale_inv{1.0f, 1.0f}, y0(2), y1(3);
  std::vector<uint16_t> half(3);
  const std::vector<TensorView> xs{view(x0, DType::kFloat8E4M3), view(x1, DType::kFloat8E4M3)};
  auto run = [&](std::vector<TensorView> outs) {
    multi_dequantize(xs, view(scale_inv, DType::kFloat32), outs, nullptr);
  };
  expect_value_error([&] { run({view(y0, DType::kFloat32)}); }, "outs must hold as many tensors as xs (2), got 1");
  expect_value_error([&] { run({}); }, "outs must hold as many tensors as xs");
  expect_value_error([&] { run({view(y0, DType::kFloat32), view(half, DType::kBFloat16)}); },
                     "outs must share one dtype: outs[0] is float32[2] on cpu, outs[1] is bfloat16[3] on cpu");
  expect_value_error([&] { run({view(x0, DType::kFloat8E4M3), view(x1, DType::kFloat8E4M3)}); },
                     "outs must be float32, bfloat16 or float16, got float8_e4m3fn[2] on cpu");
  expect_value_error([&] { run({view(y0, DType::kFloat32), view(y1, DType::kFloat32, {1, 3})}); },
                     "xs[1] and outs[1] must have the same shape, got float8_e4m3fn[3] on cpu and float32[1, 3] on cpu");
  TensorView on_gpu = view(y1, DType::kFloat32);
  on_gpu.device = Device::kCUDA;
  on_gpu.device_index = 0;
  expect_value_error([&] { run({view(y0, DType::kFloat32), on_gpu}); }, "xs[1] and outs[1] must be on the same device");
  std::vector<float> wide(6);
  expect_value_error([&] { run({view(y0, DType::kFloat32), view(wide, DType::kFloat32, {3}, {2})}); },
                     "outs[1] must be contiguous");
}

// Outputs that share memory with an input or another output are refused, naming both; inputs may
// share memory with each other (they are only read); scaled_accumulate's src may be dst itself.
TEST(Errors, OutputsMustNotShareMemory) {
  std::vector<float> buf(64, 1.0f), scale_inv{1.0f, 1.0f}, scale{1.0f}, amax(4, 0.0f), out_f(16);
  const auto at = [&](int64_t byte, DType dtype, int64_t n) {
    TensorView t;
    t.data = reinterpret_cast<uint8_t*>(buf.data()) + byte;
    t.dtype = dtype;
    t.shape = {n};
    return t;
  };
  Scaling s{view(scale, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1, 4}), view(scale_inv, DType::kFloat32, {1})};
  // quantize: out inside x's bytes.
  expect_value_error([&] { quantize(at(0, DType::kFloat32, 8), at(4, DType::kFloat8E4M3, 8), s, nullptr); },
                     "quantize: x and out must not share memory");
  // dequantize: out over the codes.
  expect_value_error([&] { dequantize(at(0, DType::kFloat8E4M3, 8), view(scale_inv, DType::kFloat32, {1}),
                                      at(6, DType::kFloat32, 8), nullptr); },
                     "dequantize: x and out must not share memory");
  // multi_dequantize: two outs overlapping each other; an out over another tensor's codes; xs sharing is fine.
  const TensorView codes0 = at(0, DType::kFloat8E4M3, 4), codes1 = at(2, DType::kFloat8E4M3, 4);
  const TensorView si2 = view(scale_inv, DType::kFloat32, {2});
  expect_value_error([&] { multi_dequantize({codes0, codes1}, si2, {at(64, DType::kFloat32, 4), at(72, DType::kFloat32, 4)}, nullptr); },
                     "multi_dequantize: outs[0] and outs[1] must not share memory");
  expect_value_error([&] { multi_dequantize({codes0, at(128, DType::kFloat8E4M3, 4)}, si2,
                                            {at(64, DType::kFloat32, 4), at(126, DType::kFloat32, 4)}, nullptr); },
                     "multi_dequantize: xs[1] and outs[1] must not share memory");
  multi_dequantize({codes0, codes1}, si2, {at(64, DType::kFloat32, 4), at(80, DType::kFloat32, 4)}, nullptr);
  // cast_transpose: out_t over out.
  TensorView out = at(0, DType::kFloat8E4M3, 16), out_t = at(8, DType::kFloat8E4M3, 16);
  out.shape = out_t.shape = {4, 4};
  expect_value_error([&] { cast_transpose(view(out_f, DType::kFloat32, {4, 4}), out, out_t, s, nullptr); },
                     "cast_transpose: out and out_t must not share memory");
  // scaled_accumulate: src part of dst is refused, src = dst accepted; amax must be its own.
  std::vector<float> acc_amax{0.0f}, dst_si{1.0f};
  const TensorView dst = at(0, DType::kFloat8E4M3, 8);
  const TensorView src_si = view(scale_inv, DType::kFloat32, {1});
  expect_value_error([&] { scaled_accumulate(dst, view(dst_si, DType::kFloat32), at(1, DType::kFloat8E4M3, 8), &src_si, 1.0f,
                                             view(acc_amax, DType::kFloat32), ScalingRecipe{}, nullptr); },
                     "scaled_accumulate: dst and src must not share memory");
  scaled_accumulate(dst, view(dst_si, DType::kFloat32), dst, &src_si, 1.0f, view(acc_amax, DType::kFloat32), ScalingRecipe{},
                    nullptr);
  expect_value_error([&] { scaled_accumulate(dst, view(dst_si, DType::kFloat32), at(64, DType::kFloat32, 8), nullptr, 1.0f,
                                             view(dst_si, DType::kFloat32), ScalingRecipe{}, nullptr); },
                     "scaled_accumulate: amax and dst_scale_inv must not share memory");
}

// check::disjoint_writes against the pairwise definition, over random layouts in one buffer.
TEST(Errors, DisjointWritesMatchesPairwiseOverlap) {
  std::mt19937 rng(3);
  std::vector<uint8_t> buf(4096);
  const auto names = [](bool written, size_t i) { return std::string(written ? "outs" : "xs") + "[" + std::to_string(i) + "]"; };
  int refused = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const auto random_views = [&](size_t n) {
      std::vector<TensorView> v(n);
      for (auto& t : v) {
        t.data = buf.data() + rng() % 4000;
        t.dtype = rng() % 2 ? DType::kFloat32 : DType::kFloat8E4M3;
        t.shape = {static_cast<int64_t>(rng() % 24)};  // empty views too
      }
      return v;
    };
    const std::vector<TensorView> outs = random_views(1 + rng() % 12), xs = random_views(rng() % 12);
    const auto range = [](const TensorView& t) {
      const auto b = reinterpret_cast<uintptr_t>(t.data);
      return std::make_pair(b, b + static_cast<uintptr_t>(t.numel()) * dtype_size(t.dtype));
    };
    const auto overlap = [&](const TensorView& a, const TensorView& b) {
      const auto [a0, a1] = range(a);
      const auto [b0, b1] = range(b);
      return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;  // empty views share no byte
    };
    bool expected = false;
    for (size_t i = 0; i < outs.size(); ++i) {
      for (size_t j = i + 1; j < outs.size(); ++j) expected = expected || overlap(outs[i], outs[j]);
      for (const TensorView& x : xs) expected = expected || overlap(outs[i], x);
    }
    std::vector<const TensorView*> written, read;
    for (const TensorView& t : outs) written.push_back(&t);
    for (const TensorView& t : xs) read.push_back(&t);
    bool threw = false;
    try {
      check::disjoint_writes(written, read, {}, {}, "op", names);
    } catch (const Error& e) {
      threw = e.kind() == ErrorKind::kValue;
    }
    ASSERT_EQ(threw, expected) << "trial " << trial;
    refused += threw;
  }
  EXPECT_GT(refused, 100);
  EXPECT_LT(refused, 2900);
}

}  // namespace
}  // namespace fp8amp
