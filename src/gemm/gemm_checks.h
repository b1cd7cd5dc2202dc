// The argument checks the FP8 GEMMs share (gemm.cpp, gemm_tiles.cpp, gemm_mx.cpp): cuBLASLt's FP8
// rules, enforced on every device so the CPU refuses what the GPU would. `op` names the op in
// messages. Also the checked views as their backends see them (GemmProblem).
#pragma once

#include <cstdint>

#include "fp8amp/tensor.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace gemm_checks {

// cuBLASLt's FP8 kernels need K, N and every leading dimension in multiples of 16 elements and
// 16-byte aligned operands, output and bias (cuBLAS docs, cublasLtMatmul: FP8 requirements), and,
// as measured, scales.
constexpr int64_t kMultiple = 16;
constexpr uintptr_t kAlignment = 16;

// The problem of out[M, N] = a[M, K] · b[N, K]ᵀ, with the row strides of a and b.
struct Operands {
  int64_t m, n, k, lda, ldb;
};

void check_aligned(const TensorView& t, const char* op, const char* arg);

// The row stride of a 2-D view, checked to be row-major (inner stride 1, ld >= cols) the way
// cuBLASLt FP8 needs it.
int64_t leading_dim(const TensorView& t, const char* op, const char* arg);

// a [M, K] and b [N, K]: FP8 (not both E5M2), row-major, on one device, K and N multiples of 16.
Operands check_operands(const TensorView& a, const TensorView& b, const char* op);

// out [M, N] of a high-precision dtype, row-major, on a's device; returns its row stride.
int64_t check_out(const TensorView& out, const TensorView& a, int64_t m, int64_t n, const char* op);

// cuBLASLt's FP8 bias type: the output's 16-bit type, and bfloat16 for a float32 output.
DType bias_dtype_for(DType out);

// bias [N], contiguous, 16-byte aligned, of bias_dtype_for(out), on a's device.
void check_bias(const TensorView& bias, const TensorView& a, DType out, int64_t n, const char* op);

// Fills the fields every GEMM backend takes (GemmProblem, the base of GemmArgs and GemmTilesArgs)
// from views the checks above passed: ops from check_operands, ldo from check_out.
void fill_problem(GemmProblem& g, const Operands& ops, const TensorView& a, const TensorView& b,
                  const TensorView* bias, const TensorView& out, int64_t ldo, void* workspace,
                  size_t workspace_bytes);

}  // namespace gemm_checks
}  // namespace fp8amp
