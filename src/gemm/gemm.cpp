// Public GEMM op: validates the views once, with cuBLASLt's FP8 rules on every device, then hands
// raw pointers to the CPU reference or the cuBLASLt path (gemm_kernels.h).
#include "fp8amp/gemm.h"

#include <atomic>
#include <cstdint>

#include "common/run_on.h"
#include "fp8amp/error.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {

namespace {

constexpr const char* kOp = "gemm";
// cuBLASLt's FP8 kernels need K, N and every leading dimension in multiples of 16 elements and
// 16-byte aligned operands, output and bias (cuBLAS docs, cublasLtMatmul: FP8 requirements), and,
// as measured, scales.
constexpr int64_t kMultiple = 16;
constexpr uintptr_t kAlignment = 16;

// cuBLASLt's FP8 kernels read operands, output, bias and scales at 16-byte aligned addresses.
void check_aligned(const TensorView& t, const char* arg) {
  FP8AMP_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data) % kAlignment == 0, kOp, arg, " must start at a ",
                     kAlignment, "-byte aligned address for cuBLASLt FP8 (", t.describe(),
                     " is a view at an odd offset); call .clone() first");
}

// The row stride of a 2-D view, checked to be row-major (inner stride 1, ld >= cols) the way
// cuBLASLt FP8 needs it.
int64_t leading_dim(const TensorView& t, const char* arg) {
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const bool strided = !t.strides.empty();
  // torch gives size-1 and empty dims arbitrary strides; they address nothing.
  const int64_t ld = strided && rows > 1 ? t.strides[0] : cols;
  if (rows > 0 && cols > 0) {
    FP8AMP_CHECK_VALUE(!strided || cols == 1 || t.strides[1] == 1, kOp, arg,
                       " must be row-major (last stride 1), got strides [", t.strides[0], ", ", t.strides[1],
                       "] for ", t.describe(), "; call .contiguous() first");
    FP8AMP_CHECK_VALUE(ld >= cols, kOp, arg, " rows must not overlap: row stride ", ld, " < ", cols,
                       " columns for ", t.describe());
    FP8AMP_CHECK_VALUE(ld % kMultiple == 0, kOp, arg, " row stride (leading dimension) must be a multiple of ",
                       kMultiple, " for cuBLASLt FP8, got ", ld, " for ", t.describe());
    check_aligned(t, arg);
  }
  return ld;
}

void check_fp8(const TensorView& t, const char* arg) {
  FP8AMP_CHECK_VALUE(is_fp8(t.dtype), kOp, arg, " must be float8_e4m3fn or float8_e5m2, got ", t.describe());
}

void check_scale_inv(const TensorView& s, const TensorView& a, const char* arg) {
  check::dtype_is(s, DType::kFloat32, kOp, arg);
  check::numel_is(s, 1, kOp, arg);
  check::same_device(s, a, kOp, arg, "a");
  // cuBLASLt (13.0, H200) refuses every FP8 algorithm (NOT_SUPPORTED) for a scale 4, 8 or 12 bytes
  // past a 16-byte boundary, such as s[1] of a larger tensor (benchmarks/cuda/gemm_algo_probe.cu).
  check_aligned(s, arg);
}

// cuBLASLt's FP8 bias type: the output's 16-bit type, and bfloat16 for a float32 output.
DType bias_dtype_for(DType out) { return out == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16; }

}  // namespace

void gemm(const TensorView& a, const TensorView& b, const TensorView& a_scale_inv, const TensorView& b_scale_inv,
          const TensorView* bias, const TensorView& out, const GemmOptions& options, Stream stream) {
  check_fp8(a, "a");
  check_fp8(b, "b");
  FP8AMP_CHECK_VALUE(!(a.dtype == DType::kFloat8E5M2 && b.dtype == DType::kFloat8E5M2), kOp,
                     "a and b are both float8_e5m2, which cuBLASLt cannot multiply; accepted: "
                     "e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3");
  check::dim_is(a, 2, kOp, "a");
  check::dim_is(b, 2, kOp, "b");
  const int64_t m = a.shape[0], n = b.shape[0], k = a.shape[1];
  FP8AMP_CHECK_VALUE(b.shape[1] == k, kOp, "a [M, K] and b [N, K] must share K, got ", a.describe(), " and ",
                     b.describe());
  FP8AMP_CHECK_VALUE(k % kMultiple == 0, kOp, "K (the columns of a and b) must be a multiple of ", kMultiple,
                     " for cuBLASLt FP8, got K = ", k, " (a ", a.describe(),
                     "); keep this layer in high precision or pad K");
  FP8AMP_CHECK_VALUE(n % kMultiple == 0, kOp, "N (the rows of b) must be a multiple of ", kMultiple,
                     " for cuBLASLt FP8, got N = ", n, " (b ", b.describe(),
                     "); keep this layer in high precision or pad N");
  const int64_t lda = leading_dim(a, "a");
  const int64_t ldb = leading_dim(b, "b");
  check::same_device(b, a, kOp, "b", "a");
  check_scale_inv(a_scale_inv, a, "a_scale_inv");
  check_scale_inv(b_scale_inv, a, "b_scale_inv");

  check::high_precision(out, kOp, "out");
  check::same_device(out, a, kOp, "out", "a");
  FP8AMP_CHECK_VALUE(out.dim() == 2 && out.shape[0] == m && out.shape[1] == n, kOp, "out must be [M, N] = [", m,
                     ", ", n, "], got ", out.describe());
  const int64_t ldo = leading_dim(out, "out");

  if (bias != nullptr) {
    const DType want = bias_dtype_for(out.dtype);
    FP8AMP_CHECK_VALUE(bias->dtype == want, kOp, "bias must be ", dtype_name(want), " for a ",
                       dtype_name(out.dtype), " out (cuBLASLt's FP8 bias type), got ", bias->describe());
    FP8AMP_CHECK_VALUE(bias->dim() == 1 && bias->shape[0] == n, kOp, "bias must be [N] = [", n, "], got ",
                       bias->describe());
    check::contiguous(*bias, kOp, "bias");
    check::same_device(*bias, a, kOp, "bias", "a");
    // cuBLASLt's heuristic refuses (INVALID_VALUE) a bias that is less aligned, seen on an H200.
    check_aligned(*bias, "bias");
  }
  FP8AMP_CHECK_VALUE(options.workspace != nullptr || options.workspace_bytes == 0, kOp,
                     "options.workspace is null but options.workspace_bytes is ",
                     options.workspace_bytes);

  // With accumulate, out is read and rewritten tile by tile: an operand inside it would be read
  // after being overwritten (on the GPU, by another block at any time).
  check::disjoint_writes({{&out, "out"}},
                         {{&a, "a"}, {&b, "b"}, {&a_scale_inv, "a_scale_inv"}, {&b_scale_inv, "b_scale_inv"},
                          {bias, "bias"}},
                         kOp);

  if (m == 0 || n == 0) return;  // nothing to write
  GemmArgs g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a.data;
  g.a_dtype = a.dtype;
  g.lda = lda;
  g.b = b.data;
  g.b_dtype = b.dtype;
  g.ldb = ldb;
  g.a_scale_inv = a_scale_inv.ptr<const float>();
  g.b_scale_inv = b_scale_inv.ptr<const float>();
  g.bias = bias != nullptr ? bias->data : nullptr;
  g.bias_dtype = bias_dtype_for(out.dtype);
  g.out = out.data;
  g.out_dtype = out.dtype;
  g.ldo = ldo;
  g.accumulate = options.accumulate;
  g.fast_accum = options.fast_accum;
  g.workspace = options.workspace;
  g.workspace_bytes = options.workspace_bytes;
  g.device_index = a.device_index;
  run_on(
      a, kOp, [&] { cpu::gemm(g); }, [&] { cuda::gemm(g, stream); });
}

namespace {
std::atomic<bool> autotune_enabled{false};
}  // namespace

void set_gemm_autotune(bool enabled) { autotune_enabled.store(enabled); }

bool gemm_autotune() { return autotune_enabled.load(); }

GemmAutotuneStats gemm_autotune_stats() {
#ifdef FP8AMP_WITH_CUDA
  return cuda::autotune_stats();
#else
  return {};
#endif
}

}  // namespace fp8amp
