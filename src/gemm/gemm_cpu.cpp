// CPU reference of the FP8 GEMM: the readable definition of correct for the cuBLASLt path.
//
// Every product of two decoded FP8 values is exact in double (at most 4 x 4 significant bits),
// and so are their sums as long as they span fewer than 53 bits: always for E4M3 x E4M3
// (products lie in [2^-18, 2^18)) up to K ~ 2^17, nearly always for E5M2. So the sum is the
// exact dot product; it is scaled and the bias added in double, and the epilogue
// (gemm_kernels.h) rounds it to out's dtype (through float32) and adds the old out if asked.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "common/dispatch.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cpu {

std::array<double, 256> fp8_decode_table(DType dtype) {
  std::array<double, 256> table{};
  visit(Fp8Types{}, dtype, [&](auto fmt) {
    using T = decltype(fmt);
    for (int code = 0; code < 256; ++code) table[code] = numerics::to_float(T{static_cast<uint8_t>(code)});
  });
  return table;
}

namespace {

// Columns of out computed per pass: the decoded block of b ([K, kColumns] doubles) and the row of
// accumulators stay in cache, and the inner loop runs over contiguous memory (order i, k, j).
constexpr int64_t kColumns = 256;

template <class Out>
void gemm_into(const GemmArgs& g, Out* out) {
  const std::array<double, 256> a_value = fp8_decode_table(g.a_dtype);
  const std::array<double, 256> b_value = fp8_decode_table(g.b_dtype);
  const auto* a = static_cast<const uint8_t*>(g.a);
  const auto* b = static_cast<const uint8_t*>(g.b);
  const double scale = static_cast<double>(*g.a_scale_inv) * static_cast<double>(*g.b_scale_inv);

  std::vector<double> bias(g.bias != nullptr ? g.n : 0);
  if (g.bias != nullptr) {
    visit(BiasTypes{}, g.bias_dtype, [&](auto type) {
      using Bias = decltype(type);
      for (int64_t j = 0; j < g.n; ++j) bias[j] = numerics::to_float(static_cast<const Bias*>(g.bias)[j]);
    });
  }

  std::vector<double> b_block(g.k * kColumns), acc(kColumns);
  for (int64_t j0 = 0; j0 < g.n; j0 += kColumns) {
    const int64_t cols = std::min(kColumns, g.n - j0);
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t k = 0; k < g.k; ++k) b_block[k * cols + j] = b_value[b[(j0 + j) * g.ldb + k]];
    }
    for (int64_t i = 0; i < g.m; ++i) {
      std::fill(acc.begin(), acc.begin() + cols, 0.0);
      for (int64_t k = 0; k < g.k; ++k) {
        const double av = a_value[a[i * g.lda + k]];
        const double* bk = &b_block[k * cols];
        for (int64_t j = 0; j < cols; ++j) acc[j] += av * bk[j];
      }
      Out* row = out + i * g.ldo + j0;
      for (int64_t j = 0; j < cols; ++j) {
        // K == 0 is the empty sum: exactly 0, whatever the scales hold.
        double v = g.k > 0 ? acc[j] * scale : 0.0;
        if (g.bias != nullptr) v += bias[j0 + j];
        row[j] = epilogue<Out>(v, g.accumulate ? &row[j] : nullptr);
      }
    }
  }
}

}  // namespace

void gemm(const GemmArgs& g) {
  visit(HighPrecisionTypes{}, g.out_dtype, [&](auto type) {
    using Out = decltype(type);
    gemm_into(g, static_cast<Out*>(g.out));
  });
}

}  // namespace cpu
}  // namespace fp8amp
