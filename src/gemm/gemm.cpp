// Public GEMM op: validates the views once, with cuBLASLt's FP8 rules on every device, then hands
// raw pointers to the CPU reference or the cuBLASLt path (gemm_kernels.h).
#include "fp8amp/gemm.h"

#include <atomic>
#include <cstdint>

#include "common/run_on.h"
#include "fp8amp/error.h"
#include "gemm/gemm_checks.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {

namespace {

constexpr const char* kOp = "gemm";

void check_scale_inv(const TensorView& s, const TensorView& a, const char* arg) {
  check::dtype_is(s, DType::kFloat32, kOp, arg);
  check::numel_is(s, 1, kOp, arg);
  check::same_device(s, a, kOp, arg, "a");
  // cuBLASLt (13.0, H200) refuses every FP8 algorithm (NOT_SUPPORTED) for a scale 4, 8 or 12 bytes
  // past a 16-byte boundary, such as s[1] of a larger tensor (benchmarks/cuda/gemm_algo_probe.cu).
  gemm_checks::check_aligned(s, kOp, arg);
}

}  // namespace

void gemm(const TensorView& a, const TensorView& b, const TensorView& a_scale_inv, const TensorView& b_scale_inv,
          const TensorView* bias, const TensorView& out, const GemmOptions& options, Stream stream) {
  const gemm_checks::Operands ops = gemm_checks::check_operands(a, b, kOp);
  check_scale_inv(a_scale_inv, a, "a_scale_inv");
  check_scale_inv(b_scale_inv, a, "b_scale_inv");
  const int64_t ldo = gemm_checks::check_out(out, a, ops.m, ops.n, kOp);
  if (bias != nullptr) gemm_checks::check_bias(*bias, a, out.dtype, ops.n, kOp);
  FP8AMP_CHECK_VALUE(options.workspace != nullptr || options.workspace_bytes == 0, kOp,
                     "options.workspace is null but options.workspace_bytes is ",
                     options.workspace_bytes);

  // With accumulate, out is read and rewritten tile by tile: an operand inside it would be read
  // after being overwritten (on the GPU, by another block at any time).
  check::disjoint_writes({{&out, "out"}},
                         {{&a, "a"}, {&b, "b"}, {&a_scale_inv, "a_scale_inv"}, {&b_scale_inv, "b_scale_inv"},
                          {bias, "bias"}},
                         kOp);

  if (ops.m == 0 || ops.n == 0) return;  // nothing to write
  GemmArgs g{};
  gemm_checks::fill_problem(g, ops, a, b, bias, out, ldo, options.workspace, options.workspace_bytes);
  g.a_scale_inv = a_scale_inv.ptr<const float>();
  g.b_scale_inv = b_scale_inv.ptr<const float>();
  g.accumulate = options.accumulate;
  g.fast_accum = options.fast_accum;
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
