// The CUDA multi-tensor cast ops (multi_quantize, multi_amax, also of FP8 codes, multi_dequantize) against the CPU
// reference, bit for bit, through the public API (cast.h): 300 tensors of varied sizes, each with
// its own row of the scaling buffers; every tensor, guard elements included, must end up
// byte-identical. Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
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
    // The amax of codes: random bits hold NaN codes (and E5M2 infinities) in most tensors, so every
    // other tensor keeps only codes whose bit 6 is clear (finite in both formats).
    auto finite_or_not = make_tensors(sizes, [&](size_t i, int64_t size) {
      auto t = std::make_unique<MirroredTensor>(in, std::vector<int64_t>{size}, static_cast<int64_t>(i % 2));
      for (int64_t j = 0; j < size; ++j) t->set_bits(j, static_cast<uint32_t>(rng()) & (i % 2 == 0 ? 0xBFu : 0xFFu));
      return t;
    });
    MirroredTensor a(DType::kFloat32, {n});
    for (int64_t i = 0; i < n; ++i) a.set_float(i, i % 7 == 0 ? 3.0f : 0.0f);
    expect_cuda_matches_cpu(pointers(finite_or_not) + std::vector<MirroredTensor*>{&a},
                            [&](Device d) { multi_amax(views(finite_or_not, d), a.view(d), nullptr); },
                            std::string(dtype_name(in)) + " multi_amax of codes");
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

}  // namespace
}  // namespace fp8amp
