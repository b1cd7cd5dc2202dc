// The comm ops (comm.h) on CUDA against the CPU reference, bit for bit: every input and output
// dtype, many tensors or pieces (more than one launch's batch), sizes with tails, misaligned
// starts, NaN and non-finite amaxes, shared and per-row scales. Every buffer, guard bytes around it
// included, must end up byte-identical. Skips cleanly on a machine without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "cuda_test_util.h"
#include "fp8amp/comm.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

constexpr DType kHigh[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
constexpr DType kFp8[] = {DType::kFloat8E4M3, DType::kFloat8E5M2};

// v as the bits of `dtype`.
uint32_t value_bits(DType dtype, float v) {
  if (dtype == DType::kFloat32) return numerics::float_bits(v);
  if (dtype == DType::kBFloat16) return numerics::float_to_bf16(v);
  return numerics::float_to_fp16(v);
}

TEST(CommCuda, QuantizeMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (DType in : kHigh) {
    for (DType fmt : kFp8) {
      for (bool non_finite : {false, true}) {
        std::vector<int64_t> sizes;
        for (int i = 0; i < 150; ++i) sizes.push_back(i % 5 == 0 ? 0 : (i * 37) % 700 + 1);
        sizes.push_back(70001);
        int64_t total = 0;
        std::vector<std::unique_ptr<MirroredTensor>> xs;
        MirroredTensor amax(DType::kFloat32, {static_cast<int64_t>(sizes.size())});
        for (size_t i = 0; i < sizes.size(); ++i) {
          xs.push_back(std::make_unique<MirroredTensor>(in, std::vector<int64_t>{sizes[i]}, static_cast<int64_t>(i % 3)));
          const float magnitude = std::pow(10.0f, static_cast<float>(static_cast<int>(i % 7) - 4));
          for (int64_t j = 0; j < sizes[i]; ++j) xs[i]->set_bits(j, value_bits(in, normal(rng) * magnitude));
          amax.set_float(static_cast<int64_t>(i), 4.0f * magnitude);
          total += sizes[i];
        }
        if (non_finite) amax.set_float(3, std::nanf(""));
        MirroredTensor out(fmt, {total + 13}, 1);
        MirroredTensor scale_inv(DType::kFloat32, {static_cast<int64_t>(sizes.size())});
        std::vector<MirroredTensor*> all{&amax, &out, &scale_inv};
        for (auto& x : xs) all.push_back(x.get());
        expect_cuda_matches_cpu(all, [&](Device d) {
          std::vector<TensorView> views;
          for (auto& x : xs) views.push_back(x->view(d));
          comm_quantize(views, amax.view(d), numerics::format_max<numerics::fp8_e4m3>() / 3, out.view(d),
                        scale_inv.view(d), nullptr);
        }, std::string(dtype_name(in)) + " -> " + dtype_name(fmt) + (non_finite ? ", a NaN amax" : ""));
      }
    }
  }
}

TEST(CommCuda, SumShardsMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  for (DType fmt : kFp8) {
    for (DType out_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                            DType::kFloat8E5M2}) {
      for (int64_t rows : {1, 2, 3, 5}) {
        for (bool per_row : {false, true}) {
          const int64_t cols = rows == 2 ? (int64_t{1} << 18) : 100003;
          // Narrow pieces (up to 1,500 columns), or wide ones that span several blocks of the kernel.
          const int64_t widest = rows == 5 ? 40000 : 1500;
          std::vector<int64_t> bounds{1};
          while (bounds.back() < cols - widest - 5000) {
            bounds.push_back(bounds.back() + static_cast<int64_t>(rng() % widest));
          }
          bounds.push_back(cols - 2);
          const int64_t pieces = static_cast<int64_t>(bounds.size()) - 1;
          MirroredTensor codes(fmt, {rows, cols});
          // Mostly finite codes; a non-finite one in about one piece in two.
          for (int64_t i = 0; i < rows * cols; ++i) {
            uint32_t c = rng() % 256;
            const bool non_finite = fmt == DType::kFloat8E4M3 ? (c & 0x7F) == 0x7F : (c & 0x7C) == 0x7C;
            if (non_finite && i % 1499 != 0) c &= 0xBF;
            codes.set_bits(i, c);
          }
          MirroredTensor scale_inv(DType::kFloat32, {per_row ? rows * pieces : pieces});
          for (int64_t i = 0; i < scale_inv.numel(); ++i) {
            scale_inv.set_float(i, numerics::pow2(static_cast<int>(rng() % 20) - 14));
          }
          MirroredTensor out(out_dtype, {bounds.back() - bounds.front()}, 1);
          MirroredTensor out_scale_inv(DType::kFloat32, {pieces});
          MirroredTensor out_amax(DType::kFloat32, {pieces});
          const bool requantize = is_fp8(out_dtype);
          std::vector<MirroredTensor*> all{&codes, &scale_inv, &out};
          if (requantize) all.insert(all.end(), {&out_scale_inv, &out_amax});
          expect_cuda_matches_cpu(all, [&](Device d) {
            const TensorView osi = out_scale_inv.view(d), oa = out_amax.view(d);
            comm_sum_shards(codes.view(d), scale_inv.view(d), bounds, static_cast<float>(rows), out.view(d),
                            requantize ? &osi : nullptr, requantize ? &oa : nullptr, nullptr);
          }, std::string(dtype_name(fmt)) + " -> " + dtype_name(out_dtype) + ", rows " + std::to_string(rows) +
                                      (per_row ? ", per-row scales" : ""));
        }
      }
    }
  }
}

}  // namespace
}  // namespace fp8amp
