// The FP8 GEMMs' shared argument checks (gemm_checks.h).
#include "gemm/gemm_checks.h"

#include "fp8amp/error.h"

namespace fp8amp {
namespace gemm_checks {

void check_aligned(const TensorView& t, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data) % kAlignment == 0, op, arg, " must start at a ",
                     kAlignment, "-byte aligned address for cuBLASLt FP8 (", t.describe(),
                     " is a view at an odd offset); call .clone() first");
}

int64_t leading_dim(const TensorView& t, const char* op, const char* arg) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const bool strided = !t.strides.empty();
  // torch gives size-1 and empty dims arbitrary strides; they address nothing.
  const int64_t ld = strided && rows > 1 ? t.strides[0] : cols;
  if (rows > 0 && cols > 0) {
    FP8AMP_CHECK_VALUE(!strided || cols == 1 || t.strides[1] == 1, op, arg,
                       " must be row-major (last stride 1), got strides [", t.strides[0], ", ", t.strides[1],
                       "] for ", t.describe(), "; call .contiguous() first");
    FP8AMP_CHECK_VALUE(ld >= cols, op, arg, " rows must not overlap: row stride ", ld, " < ", cols,
                       " columns for ", t.describe());
    FP8AMP_CHECK_VALUE(ld % kMultiple == 0, op, arg, " row stride (leading dimension) must be a multiple of ",
                       kMultiple, " for cuBLASLt FP8, got ", ld, " for ", t.describe());
    check_aligned(t, op, arg);
  }
  return ld;
}

namespace {
void check_fp8(const TensorView& t, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(is_fp8(t.dtype), op, arg, " must be float8_e4m3fn or float8_e5m2, got ", t.describe());
}
}  // namespace

Operands check_operands(const TensorView& a, const TensorView& b, const char* op) {
  check_fp8(a, op, "a");
  check_fp8(b, op, "b");
  FP8AMP_CHECK_VALUE(!(a.dtype == DType::kFloat8E5M2 && b.dtype == DType::kFloat8E5M2), op,
                     "a and b are both float8_e5m2, which cuBLASLt cannot multiply; accepted: "
                     "e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3");
  check::dim_is(a, 2, op, "a");
  check::dim_is(b, 2, op, "b");
  const int64_t m = a.shape[0], n = b.shape[0], k = a.shape[1];
  FP8AMP_CHECK_VALUE(b.shape[1] == k, op, "a [M, K] and b [N, K] must share K, got ", a.describe(), " and ",
                     b.describe());
  FP8AMP_CHECK_VALUE(k % kMultiple == 0, op, "K (the columns of a and b) must be a multiple of ", kMultiple,
                     " for cuBLASLt FP8, got K = ", k, " (a ", a.describe(),
                     "); keep this layer in high precision or pad K");
  FP8AMP_CHECK_VALUE(n % kMultiple == 0, op, "N (the rows of b) must be a multiple of ", kMultiple,
                     " for cuBLASLt FP8, got N = ", n, " (b ", b.describe(),
                     "); keep this layer in high precision or pad N");
  const int64_t lda = leading_dim(a, op, "a");
  const int64_t ldb = leading_dim(b, op, "b");
  check::same_device(b, a, op, "b", "a");
  return {m, n, k, lda, ldb};
}

int64_t check_out(const TensorView& out, const TensorView& a, int64_t m, int64_t n, const char* op) {
  check::high_precision(out, op, "out");
  check::same_device(out, a, op, "out", "a");
  FP8AMP_CHECK_VALUE(out.dim() == 2 && out.shape[0] == m && out.shape[1] == n, op, "out must be [M, N] = [", m,
                     ", ", n, "], got ", out.describe());
  return leading_dim(out, op, "out");
}

DType bias_dtype_for(DType out) { return out == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16; }

void check_bias(const TensorView& bias, const TensorView& a, DType out, int64_t n, const char* op) {
  const DType want = bias_dtype_for(out);
  FP8AMP_CHECK_VALUE(bias.dtype == want, op, "bias must be ", dtype_name(want), " for a ", dtype_name(out),
                     " out (cuBLASLt's FP8 bias type), got ", bias.describe());
  FP8AMP_CHECK_VALUE(bias.dim() == 1 && bias.shape[0] == n, op, "bias must be [N] = [", n, "], got ",
                     bias.describe());
  check::contiguous(bias, op, "bias");
  check::same_device(bias, a, op, "bias", "a");
  // cuBLASLt's heuristic refuses (INVALID_VALUE) a bias that is less aligned, seen on an H200.
  check_aligned(bias, op, "bias");
}

void fill_problem(GemmProblem& g, const Operands& ops, const TensorView& a, const TensorView& b,
                  const TensorView* bias, const TensorView& out, int64_t ldo, void* workspace,
                  size_t workspace_bytes) {
  g.m = ops.m;
  g.n = ops.n;
  g.k = ops.k;
  g.a = a.data;
  g.a_dtype = a.dtype;
  g.lda = ops.lda;
  g.b = b.data;
  g.b_dtype = b.dtype;
  g.ldb = ops.ldb;
  g.bias = bias != nullptr ? bias->data : nullptr;
  g.bias_dtype = bias_dtype_for(out.dtype);
  g.out = out.data;
  g.out_dtype = out.dtype;
  g.ldo = ldo;
  g.workspace = workspace;
  g.workspace_bytes = workspace_bytes;
  g.device_index = a.device_index;
}

}  // namespace gemm_checks
}  // namespace fp8amp
