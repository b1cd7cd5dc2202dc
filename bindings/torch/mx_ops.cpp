// torch.library registration of the MXFP8 ops (fp8amp/tiles.h and fp8amp/gemm.h, docs/tiles.md#mxfp8):
// blocks of 1 x 32 elements with uint8 E8M0 scales. Argument plumbing only, as in tile_ops.cpp;
// every op has CPU, CUDA and Meta (fake) kernels.
//
//   quantize_mx(x, dtype) -> (codes, scales)
//   cast_transpose_mx(x, dtype) -> (codes, scales, codes_t, scales_t)
//   dequantize_mx(x, scales, dtype) -> Tensor
//   gemm_mx(a, a_scales, b, b_scales, out_dtype, bias=None) -> Tensor
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

#include "binding_utils.h"
#include "fp8amp/gemm.h"
#include "fp8amp/tiles.h"
#include "meta_kernel.h"

namespace fp8amp::torch_binding {
namespace {

// The E8M0 scales of a [rows, cols] matrix: uint8 [rows, ceil(cols / 32)], symbolic for the Meta kernels.
at::Tensor empty_mx_scales(const at::Tensor& x, const c10::SymInt& rows, const c10::SymInt& cols) {
  return at::empty_symint({rows, (cols + kMxBlock - 1) / kMxBlock}, x.options().dtype(at::kByte));
}

at::Tensor empty_mx_scales(const at::Tensor& x) { return empty_mx_scales(x, matrix_rows(x.sym_sizes()), columns(x)); }

at::Tensor empty_transposed_mx_scales(const at::Tensor& x) {
  return empty_mx_scales(x, columns(x), matrix_rows(x.sym_sizes()));
}

std::tuple<at::Tensor, at::Tensor> quantize_mx(const at::Tensor& x, at::ScalarType dtype) {
  const char* op = "quantize_mx";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor scales = empty_mx_scales(x);
  call(x, [&](Stream stream) {
    fp8amp::quantize_mx(view(x, op, "x"), view(out, op, "dtype"), view(scales, op, "scales"), stream);
  });
  return {out, scales};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cast_transpose_mx(const at::Tensor& x,
                                                                             at::ScalarType dtype) {
  const char* op = "cast_transpose_mx";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor scales = empty_mx_scales(x);
  at::Tensor out_t = empty_transposed(x, dtype);
  at::Tensor scales_t = empty_transposed_mx_scales(x);
  call(x, [&](Stream stream) {
    fp8amp::cast_transpose_mx(view(x, op, "x"), view(out, op, "dtype"), view(scales, op, "scales"),
                              view(out_t, op, "dtype"), view(scales_t, op, "scales_t"), stream);
  });
  return {out, scales, out_t, scales_t};
}

at::Tensor dequantize_mx(const at::Tensor& x, const at::Tensor& scales, at::ScalarType dtype) {
  const char* op = "dequantize_mx";
  at::Tensor out = empty_as(x, dtype);
  call(x, [&](Stream stream) {
    fp8amp::dequantize_mx(view(x, op, "x"), view(scales, op, "scales"), view(out, op, "dtype"), stream);
  });
  return out;
}

c10::SymInt rows(const at::Tensor& t) { return t.dim() == 2 ? t.sym_size(0) : c10::SymInt(0); }

at::Tensor gemm_mx(const at::Tensor& a, const at::Tensor& a_scales, const at::Tensor& b, const at::Tensor& b_scales,
                   at::ScalarType out_dtype, const std::optional<at::Tensor>& bias) {
  const char* op = "gemm_mx";
  at::Tensor out = at::empty_symint({rows(a), rows(b)}, a.options().dtype(out_dtype));
  call(a, [&](Stream stream) {
    GemmTilesOptions options;
    at::Tensor workspace;
    // The core refuses operands of another rank before it looks at the workspace.
    if (a.is_cuda() && a.dim() == 2 && b.dim() == 2) {
      const size_t bytes = kGemmWorkspaceBytes + fp8amp::gemm_mx_scale_bytes(a.size(0), b.size(0), a.size(1));
      workspace = at::empty({static_cast<int64_t>(bytes)}, a.options().dtype(at::kByte));
      options.workspace = workspace.data_ptr();
      options.workspace_bytes = bytes;
    }
    const auto bias_view = optional_view(bias, op, "bias");
    fp8amp::gemm_mx(view(a, op, "a"), view(a_scales, op, "a_scales"), view(b, op, "b"), view(b_scales, op, "b_scales"),
                    bias_view ? &*bias_view : nullptr, view(out, op, "out"), options, stream);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_mx_meta(const at::Tensor& x, at::ScalarType dtype) {
  return {empty_as(x, dtype), empty_mx_scales(x)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cast_transpose_mx_meta(const at::Tensor& x,
                                                                                  at::ScalarType dtype) {
  return {empty_as(x, dtype), empty_mx_scales(x), empty_transposed(x, dtype), empty_transposed_mx_scales(x)};
}

at::Tensor dequantize_mx_meta(const at::Tensor& x, const at::Tensor&, at::ScalarType dtype) {
  return empty_as(x, dtype);
}

at::Tensor gemm_mx_meta(const at::Tensor& a, const at::Tensor&, const at::Tensor& b, const at::Tensor&,
                        at::ScalarType out_dtype, const std::optional<at::Tensor>&) {
  return at::empty_symint({rows(a), rows(b)}, a.options().dtype(out_dtype));
}

constexpr char kQuantizeMx[] = "quantize_mx";
constexpr char kCastTransposeMx[] = "cast_transpose_mx";
constexpr char kDequantizeMx[] = "dequantize_mx";
constexpr char kGemmMx[] = "gemm_mx";

}  // namespace
}  // namespace fp8amp::torch_binding

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  m.def("quantize_mx(Tensor x, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("cast_transpose_mx(Tensor x, ScalarType dtype) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dequantize_mx(Tensor x, Tensor scales, ScalarType dtype) -> Tensor");
  m.def("gemm_mx(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, ScalarType out_dtype, Tensor? bias=None) -> Tensor");
}

#define FP8AMP_REGISTER_MX_KERNELS(m)                                    \
  m.impl("quantize_mx", fp8amp::torch_binding::quantize_mx);             \
  m.impl("cast_transpose_mx", fp8amp::torch_binding::cast_transpose_mx); \
  m.impl("dequantize_mx", fp8amp::torch_binding::dequantize_mx);         \
  m.impl("gemm_mx", fp8amp::torch_binding::gemm_mx)

TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { FP8AMP_REGISTER_MX_KERNELS(m); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { FP8AMP_REGISTER_MX_KERNELS(m); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  using namespace fp8amp::torch_binding;
  m.impl("quantize_mx", &MetaKernel<kQuantizeMx, quantize_mx_meta>::run);
  m.impl("cast_transpose_mx", &MetaKernel<kCastTransposeMx, cast_transpose_mx_meta>::run);
  m.impl("dequantize_mx", &MetaKernel<kDequantizeMx, dequantize_mx_meta>::run);
  m.impl("gemm_mx", &MetaKernel<kGemmMx, gemm_mx_meta>::run);
}
TORCH_LIBRARY_IMPL(fp8amp, Autograd, m) {
  fp8amp::torch_binding::register_no_derivative(
      m, "quantize_mx", "cast_transpose_mx", "dequantize_mx", "gemm_mx");
}
