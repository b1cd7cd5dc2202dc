// torch.library registration of the FP8 GEMM (fp8amp/gemm.h): argument plumbing only.
//
//   gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias=None, fast_accum=False) -> Tensor
//       functional: returns out = (a * a_scale_inv) @ (b * b_scale_inv).T (+ bias), [M, N] of
//       out_dtype; what torch.compile traces most easily.
//   gemm_accumulate(a, b, a_scale_inv, b_scale_inv, out!, bias=None, fast_accum=False) -> ()
//       out += the same (e.g. weight gradients summed across micro-batches in FP32).
//   gemm_tiles(a, a_scale_inv, a_tile_rows, a_tile_cols, b, b_scale_inv, b_tile_rows, b_tile_cols,
//              out_dtype, bias=None) -> Tensor
//       the same product with one scale per tile of each operand (fp8amp/gemm.h, gemm_tiles).
//
// On CUDA, cuBLASLt's workspace comes from torch's caching allocator on the op's stream, so it
// is stream-ordered like any other tensor and CUDA-graph capture works.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "binding_utils.h"
#include "meta_kernel.h"
#include "fp8amp/gemm.h"

namespace fp8amp::torch_binding {
namespace {

constexpr const char* kOp = "gemm";

// Rows of a 2-D operand; other ranks are the core's to refuse, with its message. Symbolic, so the
// Meta kernel works on dynamic shapes.
c10::SymInt rows(const at::Tensor& t) { return t.dim() == 2 ? t.sym_size(0) : c10::SymInt(0); }

at::Tensor empty_out(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  return at::empty_symint({rows(a), rows(b)}, a.options().dtype(out_dtype));
}

void run_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv, const at::Tensor& b_scale_inv,
              const std::optional<at::Tensor>& bias, const at::Tensor& out, bool accumulate, bool fast_accum) {
  call(a, [&](Stream stream) {
    GemmOptions options;
    options.accumulate = accumulate;
    options.fast_accum = fast_accum;
    at::Tensor workspace;
    if (a.is_cuda()) {
      workspace = at::empty({static_cast<int64_t>(kGemmWorkspaceBytes)}, a.options().dtype(at::kByte));
      options.workspace = workspace.data_ptr();
      options.workspace_bytes = kGemmWorkspaceBytes;
    }
    const auto bias_view = optional_view(bias, kOp, "bias");
    fp8amp::gemm(view(a, kOp, "a"), view(b, kOp, "b"), view(a_scale_inv, kOp, "a_scale_inv"),
                 view(b_scale_inv, kOp, "b_scale_inv"), bias_view ? &*bias_view : nullptr, view(out, kOp, "out"),
                 options, stream);
  });
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                const at::Tensor& b_scale_inv, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                bool fast_accum) {
  at::Tensor out = empty_out(a, b, out_dtype);
  run_gemm(a, b, a_scale_inv, b_scale_inv, bias, out, /*accumulate=*/false, fast_accum);
  return out;
}

void gemm_accumulate(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                     const at::Tensor& b_scale_inv, const at::Tensor& out, const std::optional<at::Tensor>& bias,
                     bool fast_accum) {
  run_gemm(a, b, a_scale_inv, b_scale_inv, bias, out, /*accumulate=*/true, fast_accum);
}

at::Tensor gemm_tiles(const at::Tensor& a, const at::Tensor& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
                      const at::Tensor& b, const at::Tensor& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
                      at::ScalarType out_dtype, const std::optional<at::Tensor>& bias) {
  const char* op = "gemm_tiles";
  at::Tensor out = empty_out(a, b, out_dtype);
  call(a, [&](Stream stream) {
    GemmTilesOptions options;
    at::Tensor workspace;
    // The core refuses operands of another rank before it looks at the workspace.
    if (a.is_cuda() && a.dim() == 2 && b.dim() == 2) {
      const size_t bytes = kGemmWorkspaceBytes + fp8amp::gemm_tiles_scale_bytes(a.size(0), b.size(0), a.size(1),
                                                                               a_tile_rows, a_tile_cols, b_tile_rows,
                                                                               b_tile_cols);
      workspace = at::empty({static_cast<int64_t>(bytes)}, a.options().dtype(at::kByte));
      options.workspace = workspace.data_ptr();
      options.workspace_bytes = bytes;
    }
    const auto bias_view = optional_view(bias, op, "bias");
    fp8amp::gemm_tiles(view(a, op, "a"), view(a_scale_inv, op, "a_scale_inv"), a_tile_rows, a_tile_cols,
                       view(b, op, "b"), view(b_scale_inv, op, "b_scale_inv"), b_tile_rows, b_tile_cols,
                       bias_view ? &*bias_view : nullptr, view(out, op, "out"), options, stream);
  });
  return out;
}

// Meta kernels: shapes and dtypes only, for torch.compile's fake tensors.
at::Tensor gemm_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor&, const at::Tensor&,
                     at::ScalarType out_dtype, const std::optional<at::Tensor>&, bool) {
  return empty_out(a, b, out_dtype);
}

void gemm_accumulate_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const std::optional<at::Tensor>&, bool) {}

at::Tensor gemm_tiles_meta(const at::Tensor& a, const at::Tensor&, int64_t, int64_t, const at::Tensor& b,
                           const at::Tensor&, int64_t, int64_t, at::ScalarType out_dtype,
                           const std::optional<at::Tensor>&) {
  return empty_out(a, b, out_dtype);
}

constexpr char kGemm[] = "gemm";
constexpr char kGemmTiles[] = "gemm_tiles";
constexpr char kGemmAccumulate[] = "gemm_accumulate";

void set_gemm_autotune(bool enabled) { fp8amp::set_gemm_autotune(enabled); }

bool gemm_autotune() { return fp8amp::gemm_autotune(); }

std::vector<int64_t> gemm_autotune_stats() {
  const GemmAutotuneStats s = fp8amp::gemm_autotune_stats();
  return {s.tuning, s.tuned, s.changed};
}

}  // namespace
}  // namespace fp8amp::torch_binding

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  // Process-wide settings, no tensors: one kernel for every dispatch key.
  m.def("set_gemm_autotune(bool enabled) -> ()", fp8amp::torch_binding::set_gemm_autotune);
  m.def("gemm_autotune() -> bool", fp8amp::torch_binding::gemm_autotune);
  m.def("gemm_autotune_stats() -> int[]", fp8amp::torch_binding::gemm_autotune_stats);
  m.def(
      "gemm(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, ScalarType out_dtype, Tensor? bias=None, "
      "bool fast_accum=False) -> Tensor");
  m.def(
      "gemm_accumulate(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor(a!) out, "
      "Tensor? bias=None, bool fast_accum=False) -> ()");
  m.def(
      "gemm_tiles(Tensor a, Tensor a_scale_inv, int a_tile_rows, int a_tile_cols, Tensor b, Tensor b_scale_inv, "
      "int b_tile_rows, int b_tile_cols, ScalarType out_dtype, Tensor? bias=None) -> Tensor");
}

// The same functions serve CPU and CUDA: the core dispatches on the tensors' device.
TORCH_LIBRARY_IMPL(fp8amp, CPU, m) {
  m.impl("gemm", fp8amp::torch_binding::gemm);
  m.impl("gemm_accumulate", fp8amp::torch_binding::gemm_accumulate);
  m.impl("gemm_tiles", fp8amp::torch_binding::gemm_tiles);
}
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) {
  m.impl("gemm", fp8amp::torch_binding::gemm);
  m.impl("gemm_accumulate", fp8amp::torch_binding::gemm_accumulate);
  m.impl("gemm_tiles", fp8amp::torch_binding::gemm_tiles);
}
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("gemm", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kGemm, fp8amp::torch_binding::gemm_meta>::run);
  m.impl("gemm_accumulate", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kGemmAccumulate,
                                                             fp8amp::torch_binding::gemm_accumulate_meta>::run);
  m.impl("gemm_tiles",
         &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kGemmTiles, fp8amp::torch_binding::gemm_tiles_meta>::run);
}
TORCH_LIBRARY_IMPL(fp8amp, Autograd, m) {
  fp8amp::torch_binding::register_no_derivative(
      m, "gemm", "gemm_accumulate", "gemm_tiles");
}
