// CPU reference of the tile-scaled FP8 GEMM (gemm.h, gemm_tiles): the readable definition of
// correct for the cuBLASLt path.
//
// Per output element: each K-block's product sum is exact in double (as in gemm_cpu.cpp: at most
// 128 products of 4 x 4 significant bits), times the block's a and b scale_inv (their product is
// exact in double), and the blocks are added in order of k, in double. The epilogue
// (gemm_kernels.h) adds nothing but the bias and rounds once to out's dtype, through float32.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "common/dispatch.h"
#include "gemm/gemm_kernels.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {
namespace cpu {

namespace {

// Columns of out per pass: the decoded columns of b ([K, kColumns] doubles), their scales and the
// row of accumulators stay in cache; the inner loop runs over contiguous memory (order i, k, j).
constexpr int64_t kColumns = 256;

template <class Out>
void gemm_tiles_into(const GemmTilesArgs& g, Out* out) {
  const std::array<double, 256> a_value = fp8_decode_table(g.a_dtype);
  const std::array<double, 256> b_value = fp8_decode_table(g.b_dtype);
  const auto* a = static_cast<const uint8_t*>(g.a);
  const auto* b = static_cast<const uint8_t*>(g.b);
  const int64_t block = std::max<int64_t>(g.block_k, 1);
  const int64_t blocks = (g.k + block - 1) / block;  // 0 for K == 0: the empty sum

  std::vector<double> bias(g.bias != nullptr ? g.n : 0);
  if (g.bias != nullptr) {
    visit(BiasTypes{}, g.bias_dtype, [&](auto type) {
      using Bias = decltype(type);
      for (int64_t j = 0; j < g.n; ++j) bias[j] = numerics::to_float(static_cast<const Bias*>(g.bias)[j]);
    });
  }

  std::vector<double> b_block(g.k * kColumns), b_scale(blocks * kColumns), partial(kColumns), acc(kColumns);
  for (int64_t j0 = 0; j0 < g.n; j0 += kColumns) {
    const int64_t cols = std::min(kColumns, g.n - j0);
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t k = 0; k < g.k; ++k) b_block[k * cols + j] = b_value[b[(j0 + j) * g.ldb + k]];
      for (int64_t kb = 0; kb < blocks; ++kb) b_scale[kb * cols + j] = g.b_scales.at(j0 + j, kb);
    }
    for (int64_t i = 0; i < g.m; ++i) {
      std::fill(acc.begin(), acc.begin() + cols, 0.0);
      for (int64_t kb = 0; kb < blocks; ++kb) {
        std::fill(partial.begin(), partial.begin() + cols, 0.0);
        for (int64_t k = kb * block; k < std::min(g.k, (kb + 1) * block); ++k) {
          const double av = a_value[a[i * g.lda + k]];
          const double* bk = &b_block[k * cols];
          for (int64_t j = 0; j < cols; ++j) partial[j] += av * bk[j];
        }
        const double sa = g.a_scales.at(i, kb);
        const double* sb = &b_scale[kb * cols];
        for (int64_t j = 0; j < cols; ++j) acc[j] += partial[j] * (sa * sb[j]);
      }
      Out* row = out + i * g.ldo + j0;
      for (int64_t j = 0; j < cols; ++j) {
        double v = acc[j];
        if (g.bias != nullptr) v += bias[j0 + j];
        row[j] = epilogue<Out>(v, nullptr);
      }
    }
  }
}

}  // namespace

void gemm_tiles(const GemmTilesArgs& g) {
  visit(HighPrecisionTypes{}, g.out_dtype, [&](auto type) {
    using Out = decltype(type);
    gemm_tiles_into(g, static_cast<Out*>(g.out));
  });
}

}  // namespace cpu
}  // namespace fp8amp
