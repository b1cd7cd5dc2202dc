// scaled_accumulate (accumulate.h) on CUDA against the CPU reference, bit for bit: every dst/src dtype
// combination, sizes with tails, misaligned pointers, grid-stride wrap-around, the non-finite and
// zero rules and src aliasing dst. Every buffer, guard bytes around it included, must end up
// byte-identical. Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/numerics.h"
#include "cuda_test_util.h"
#include "fp8amp/accumulate.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

using numerics::bits_float;
using numerics::float_bits;

// One accumulation: dst (+ its scale_inv), src (+ scale_inv when scaled), amax.
struct Case {
  Case(DType dst, DType src, bool scaled, int64_t n) : dst_dtype(dst), src_dtype(src), scaled_src(scaled), numel(n) {}
  DType dst_dtype, src_dtype;
  bool scaled_src;
  int64_t numel;
  int64_t dst_offset = 0, src_offset = 0;
  float alpha = 1.0f;
  ScalingRecipe recipe;
  float dst_scale_inv = 0.25f, src_scale_inv = 3.0f;
  uint32_t seed = 1;
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << dtype_name(c.dst_dtype) << " += " << c.alpha << " * " << dtype_name(c.src_dtype)
    << (c.scaled_src ? " (scaled)" : "") << ", numel " << c.numel << ", offsets " << c.dst_offset << "/"
    << c.src_offset << ", scale_invs " << c.dst_scale_inv << "/" << c.src_scale_inv << ", margin "
    << c.recipe.margin << ", pow2_scale " << c.recipe.pow2_scale;
  return s.str();
}

// A random finite code of a scaled format (NaN and infinity codes excluded).
uint32_t random_finite_code(DType dtype, std::mt19937& rng) {
  while (true) {
    const uint32_t code = static_cast<uint32_t>(rng()) & (dtype_size(dtype) == 1 ? 0xFFu : 0xFFFFu);
    float v = 0.0f;
    switch (dtype) {
      case DType::kFloat8E4M3: v = numerics::decode<numerics::E4M3>(code); break;
      case DType::kFloat8E5M2: v = numerics::decode<numerics::E5M2>(code); break;
      default: v = numerics::decode<numerics::FP16>(code); break;
    }
    if (numerics::is_finite(v)) return code;
  }
}

// A random finite value of a high-precision dtype, over many binades, as its bits.
uint32_t random_value_bits(DType dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-20, 12), sign(0, 1), zero(0, 63);
  const float v = zero(rng) == 0 ? (sign(rng) ? -0.0f : 0.0f)
                                 : std::ldexp(mantissa(rng), exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
  if (dtype == DType::kFloat32) return float_bits(v);
  return dtype == DType::kBFloat16 ? numerics::float_to_bf16(v) : numerics::float_to_fp16(v);
}

// Fills the buffers of `c` and runs the op on CPU and CUDA; `tweak` may change the host data
// before the upload. Every buffer must be byte-identical afterwards.
void check(const Case& c, const std::function<void(MirroredTensor& dst, MirroredTensor& src)>& tweak = {}) {
  std::mt19937 rng(c.seed);
  MirroredTensor dst(c.dst_dtype, {c.numel}, c.dst_offset), src(c.src_dtype, {c.numel}, c.src_offset);
  MirroredTensor dst_si(DType::kFloat32, {1}), src_si(DType::kFloat32, {1}), amax(DType::kFloat32, {1});
  for (int64_t i = 0; i < c.numel; ++i) {
    dst.set_bits(i, random_finite_code(c.dst_dtype, rng));
    src.set_bits(i, c.scaled_src ? random_finite_code(c.src_dtype, rng) : random_value_bits(c.src_dtype, rng));
  }
  dst_si.set_float(0, c.dst_scale_inv);
  src_si.set_float(0, c.src_scale_inv);
  amax.set_float(0, -77.0f);  // overwritten, not folded
  if (tweak) tweak(dst, src);
  expect_cuda_matches_cpu(
      {&dst, &src, &dst_si, &src_si, &amax},
      [&](Device d) {
        const TensorView ssi = src_si.view(d);
        scaled_accumulate(dst.view(d), dst_si.view(d), src.view(d), c.scaled_src ? &ssi : nullptr, c.alpha,
                          amax.view(d), c.recipe, nullptr);
      },
      describe(c));
}

const DType kScaled[] = {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kFloat16};
const DType kHighPrecision[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Every dtype combination: (src dtype, scaled?).
std::vector<std::pair<DType, bool>> sources() {
  std::vector<std::pair<DType, bool>> r;
  for (DType s : kHighPrecision) r.push_back({s, false});
  for (DType s : kScaled) r.push_back({s, true});
  return r;
}

TEST(AccumulateCuda, EveryDtypeTailsAndMisalignedPointers) {
  REQUIRE_GPU();
  const int64_t sizes[] = {1, 7, 31, 4097, 65537, (int64_t{1} << 20) + 3};
  const std::pair<int64_t, int64_t> offsets[] = {{0, 0}, {1, 0}, {0, 1}, {3, 5}};
  uint32_t seed = 0;
  for (DType dst : kScaled) {
    for (auto [src, scaled] : sources()) {
      for (int64_t n : sizes) {
        for (auto [dst_offset, src_offset] : offsets) {
          Case c(dst, src, scaled, n);
          c.dst_offset = dst_offset;
          c.src_offset = src_offset;
          c.seed = ++seed;
          c.alpha = seed % 3 == 0 ? 1.0f : (seed % 3 == 1 ? 0.5f : -1.3f);
          c.recipe = seed % 2 ? ScalingRecipe{0, true} : ScalingRecipe{2, false};
          c.dst_scale_inv = seed % 5 == 0 ? 0.3f : std::ldexp(1.0f, static_cast<int>(seed % 13) - 6);
          c.src_scale_inv = seed % 7 == 0 ? 1.7f : std::ldexp(1.0f, static_cast<int>(seed % 11) - 5);
          check(c);
        }
      }
    }
  }
}

TEST(AccumulateCuda, GridStrideWrapsAround) {
  REQUIRE_GPU();
  // Far more packs than one sweep of the grid (at most 8 blocks of 256 threads per SM).
  check(Case(DType::kFloat8E4M3, DType::kFloat8E4M3, true, (int64_t{9} << 20) + 5));
  Case c(DType::kFloat8E4M3, DType::kFloat32, false, (int64_t{5} << 20) + 1);
  c.alpha = 0.5f;
  check(c);
  Case d(DType::kFloat16, DType::kBFloat16, false, (int64_t{5} << 20) + 2);
  d.dst_offset = d.src_offset = 1;  // misaligned: element by element, many sweeps
  d.alpha = -1.0f;
  d.recipe = ScalingRecipe{1, true};
  check(d);
}

TEST(AccumulateCuda, EmptyTensor) {
  REQUIRE_GPU();
  for (DType dst : kScaled) {
    for (auto [src, scaled] : sources()) {
      Case c(dst, src, scaled, 0);
      c.dst_scale_inv = bits_float(0x7FC00000u);  // no element: scale_inv 1 all the same
      check(c);
    }
  }
}

TEST(AccumulateCuda, NonFiniteSums) {
  REQUIRE_GPU();
  const int64_t n = 100003;
  for (DType dst : kScaled) {
    for (auto [src, scaled] : sources()) {
      const uint32_t inf_bits = src == DType::kFloat32 ? 0x7F800000u
                                : src == DType::kBFloat16 ? 0x7F80u
                                : src == DType::kFloat16 ? 0x7C00u
                                : src == DType::kFloat8E5M2 ? 0x7Cu
                                : 0x7Fu;  // E4M3 has no inf: its NaN
      // An infinity (or NaN) in src, in the middle and in the tail.
      for (int64_t at : {int64_t{5000}, n - 1}) {
        check(Case(dst, src, scaled, n), [&](MirroredTensor&, MirroredTensor& s) { s.set_bits(at, inf_bits); });
      }
      // A NaN code in dst; a NaN and an infinite dst_scale_inv on entry; alpha 0 and huge.
      const uint32_t dst_nan = dtype_size(dst) == 1 ? 0x7Fu : 0x7FFFu;
      check(Case(dst, src, scaled, n), [&](MirroredTensor& d, MirroredTensor&) { d.set_bits(77, dst_nan); });
      Case c(dst, src, scaled, n);
      c.dst_scale_inv = bits_float(0xFFC00001u);
      check(c);
      c.dst_scale_inv = INFINITY;
      check(c);
      c.dst_scale_inv = 1.0f;
      c.alpha = 0.0f;
      check(c, [&](MirroredTensor&, MirroredTensor& s) { s.set_bits(3, inf_bits); });
      c.alpha = 3e38f;  // finite terms whose products overflow
      check(c);
    }
  }
}

TEST(AccumulateCuda, ZeroSumsAndExtremeAmaxes) {
  REQUIRE_GPU();
  const int64_t n = 4099;
  for (DType dst : kScaled) {
    for (auto [src, scaled] : sources()) {
      // All zero (signed zeros mixed): amax 0, scale_inv 1.
      check(Case(dst, src, scaled, n), [](MirroredTensor& d, MirroredTensor& s) {
        for (int64_t i = 0; i < d.numel(); ++i) {
          d.set_bits(i, i % 3 == 0 ? (dtype_size(d.dtype()) == 1 ? 0x80u : 0x8000u) : 0u);
          s.set_bits(i, i % 2 == 0 ? (s.dtype() == DType::kFloat32   ? 0x80000000u
                                      : dtype_size(s.dtype()) == 2 ? 0x8000u
                                                                   : 0x80u)
                                   : 0u);
        }
      });
      // Tiny and huge scale_invs: scale exponents at the clamp, subnormal sums, TE's rule.
      for (float si : {0x1p-140f, 0x1p-120f, 0x1p+100f}) {
        for (bool pow2_scale : {true, false}) {
          Case c(dst, src, scaled, n);
          c.dst_scale_inv = si;
          c.src_scale_inv = si;
          c.alpha = si > 1.0f ? 1.0f : 0x1p-30f;
          c.recipe = ScalingRecipe{pow2_scale ? 0 : 3, pow2_scale};
          check(c);
        }
      }
    }
  }
}

TEST(AccumulateCuda, SrcIsDst) {
  REQUIRE_GPU();
  for (DType dtype : kScaled) {
    for (int64_t n : {int64_t{1}, int64_t{4097}, (int64_t{1} << 20) + 7}) {
      std::mt19937 rng(static_cast<uint32_t>(n));
      MirroredTensor dst(dtype, {n}), si(DType::kFloat32, {1}), amax(DType::kFloat32, {1});
      for (int64_t i = 0; i < n; ++i) dst.set_bits(i, random_finite_code(dtype, rng));
      si.set_float(0, 0.125f);
      amax.set_float(0, 0.0f);
      expect_cuda_matches_cpu(
          {&dst, &si, &amax},
          [&](Device d) {
            const TensorView s = si.view(d);
            scaled_accumulate(dst.view(d), s, dst.view(d), &s, -0.75f, amax.view(d), ScalingRecipe{}, nullptr);
          },
          std::string(dtype_name(dtype)) + " numel " + std::to_string(n));
    }
  }
}

TEST(AccumulateCuda, MicroBatchSequence) {
  REQUIRE_GPU();
  // Eight accumulations into one E4M3 gradient, each from a fresh bf16 micro-batch gradient,
  // then a scaled E4M3 one: state carries over from step to step on both sides.
  const int64_t n = 300007;
  MirroredTensor dst(DType::kFloat8E4M3, {n}), si(DType::kFloat32, {1}), amax(DType::kFloat32, {1});
  MirroredTensor src(DType::kBFloat16, {n}), src8(DType::kFloat8E4M3, {n}), src_si(DType::kFloat32, {1});
  for (int64_t i = 0; i < n; ++i) dst.set_bits(i, 0);
  si.set_float(0, 1.0f);
  src_si.set_float(0, 0x1p-9f);
  std::mt19937 rng(99);
  for (int step = 0; step < 9; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (int64_t i = 0; i < n; ++i) {
      src.set_bits(i, random_value_bits(DType::kBFloat16, rng));
      src8.set_bits(i, random_finite_code(DType::kFloat8E4M3, rng));
    }
    for (MirroredTensor* b : {&src, &src8, &src_si}) b->upload();
    if (step == 0) {
      for (MirroredTensor* b : {&dst, &si, &amax}) b->upload();
    }
    for (Device d : {Device::kCPU, Device::kCUDA}) {
      const TensorView ssi = src_si.view(d);
      if (step < 8) {
        scaled_accumulate(dst.view(d), si.view(d), src.view(d), nullptr, 0.125f, amax.view(d), ScalingRecipe{}, nullptr);
      } else {
        scaled_accumulate(dst.view(d), si.view(d), src8.view(d), &ssi, 1.0f, amax.view(d), ScalingRecipe{}, nullptr);
      }
    }
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (MirroredTensor* b : {&dst, &si, &amax}) ASSERT_TRUE(b->same_on_both());
    EXPECT_TRUE(std::isfinite(si.get_float(0)));
  }
}

}  // namespace
}  // namespace fp8amp
