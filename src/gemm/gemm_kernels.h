// What the GEMM backends see: raw pointers, sizes and leading dimensions, already validated by
// gemm.cpp. The CPU reference (gemm_cpu.cpp) defines correct; the CUDA path (gemm_cuda.cpp,
// cuBLASLt) has the same signature plus a stream.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/gemm.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// What every FP8 GEMM of the core multiplies, whatever its scales: the operands, the output and
// the bias, their dtypes and leading dimensions, the workspace and the device.
struct GemmProblem {
  int64_t m, n, k;
  const void* a;
  DType a_dtype;
  int64_t lda;
  const void* b;
  DType b_dtype;
  int64_t ldb;
  const void* bias;  // nullptr: no bias
  DType bias_dtype;  // meaningful only with a bias
  void* out;
  DType out_dtype;
  int64_t ldo;
  void* workspace;
  size_t workspace_bytes;
  int device_index;
};

// out[M, N] (row stride ldo) = a[M, K] (row stride lda) · b[N, K]ᵀ (row stride ldb)
//                              * a_scale_inv[0] * b_scale_inv[0] (+ out) (+ bias[N]).
struct GemmArgs : GemmProblem {
  const float* a_scale_inv;
  const float* b_scale_inv;
  bool accumulate;
  bool fast_accum;
};

// The epilogue of one output element, shared by the CPU reference and the K == 0 kernel. `v` is
// the scaled product sum plus the bias, exact or nearly (double). It is rounded to Out; when
// accumulating, that result is added to the old value and rounded again. The two roundings are
// what cuBLASLt's FP8 kernels do with a 16-bit out and beta = 1: measured on an H200 (cuBLAS 13),
// D = round(round(alpha·AB + bias) + C) matched every element where the product sum was exact.
template <class Out>
FP8AMP_HD Out epilogue(double v, const Out* old) {
  const Out result = numerics::round_to<Out>(static_cast<float>(v));
  if (old == nullptr) return result;
  const double sum = static_cast<double>(numerics::to_float(result)) + numerics::to_float(*old);
  return numerics::round_to<Out>(static_cast<float>(sum));
}

namespace cpu {
void gemm(const GemmArgs& g);
// The value of every code of an FP8 dtype: decoding through a table keeps the inner loops of the
// references a plain multiply-add.
std::array<double, 256> fp8_decode_table(DType dtype);
}  // namespace cpu

namespace cuda {
void gemm(const GemmArgs& g, Stream stream);
GemmAutotuneStats autotune_stats();
// K == 0, which cuBLASLt has no kernel for: out = (accumulate ? out : 0) + bias (gemm_empty_cuda.cu).
void gemm_empty_sum(const GemmProblem& g, bool accumulate, Stream stream);
}  // namespace cuda

}  // namespace fp8amp
