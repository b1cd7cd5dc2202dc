// torch.library registration of the core's ops: argument plumbing only. Tensors become
// TensorViews, outputs are allocated, core errors become Python ValueError / TypeError /
// NotImplementedError / RuntimeError. Every op has CPU, CUDA and Meta (fake) kernels. The tile ops
// are in tile_ops.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "binding_utils.h"
#include "meta_kernel.h"
#include "fp8amp/accumulate.h"
#include "fp8amp/cast.h"
#include "fp8amp/error.h"
#include "fp8amp/scaling.h"

namespace fp8amp::torch_binding {
namespace {

Scaling scaling(const at::Tensor& scale, const at::Tensor& amax, const at::Tensor& scale_inv,
                const std::optional<TensorView>& warmup_counter, int64_t warmup_steps, int64_t margin,
                bool pow2_scale, const char* op) {
  Scaling s{view(scale, op, "scale"), view(amax, op, "amax"), view(scale_inv, op, "scale_inv")};
  s.warmup_counter = warmup_counter ? &*warmup_counter : nullptr;
  s.warmup_steps = narrow_int(warmup_steps, op, "warmup_steps");
  s.recipe = ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale};
  return s;
}

at::Tensor scale_inv_like(const at::Tensor& scale) { return at::empty_symint({scale.sym_numel()}, scale.options()); }

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& amax,
                                            at::ScalarType dtype, const std::optional<at::Tensor>& warmup_counter,
                                            int64_t warmup_steps, int64_t margin, bool pow2_scale) {
  at::Tensor out = empty_as(x, dtype);
  at::Tensor scale_inv = scale_inv_like(scale);
  call(x, [&](Stream stream) {
    const auto counter_view = optional_view(warmup_counter, "quantize", "warmup_counter");
    fp8amp::quantize(view(x, "quantize", "x"), view(out, "quantize", "dtype"),
                     scaling(scale, amax, scale_inv, counter_view, warmup_steps, margin, pow2_scale, "quantize"),
                     stream);
  });
  return {out, scale_inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_current(const at::Tensor& x, at::ScalarType dtype,
                                                                int64_t margin, bool nan_if_nonfinite) {
  const char* op = "quantize_current";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  at::Tensor amax_out = at::empty({1}, x.options().dtype(at::kFloat));
  call(x, [&](Stream stream) {
    fp8amp::quantize_current(view(x, op, "x"), view(out, op, "dtype"), view(scale_inv, op, "scale_inv"),
                             view(amax_out, op, "amax"), narrow_int(margin, op, "margin"), nan_if_nonfinite, stream);
  });
  return {out, scale_inv, amax_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_transpose(const at::Tensor& x, const at::Tensor& scale,
                                                              const at::Tensor& amax, at::ScalarType dtype,
                                                              const std::optional<at::Tensor>& warmup_counter,
                                                              int64_t warmup_steps, int64_t margin, bool pow2_scale) {
  const char* op = "cast_transpose";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor out_t = empty_transposed(x, dtype);
  at::Tensor scale_inv = scale_inv_like(scale);
  call(x, [&](Stream stream) {
    const auto counter_view = optional_view(warmup_counter, op, "warmup_counter");
    fp8amp::cast_transpose(view(x, op, "x"), view(out, op, "dtype"), view(out_t, op, "dtype"),
                           scaling(scale, amax, scale_inv, counter_view, warmup_steps, margin, pow2_scale, op), stream);
  });
  return {out, out_t, scale_inv};
}

at::Tensor cast_transpose_rescaled(const at::Tensor& x, const at::Tensor& scale_inv, const at::Tensor& scale,
                                   at::ScalarType dtype) {
  const char* op = "cast_transpose_rescaled";
  at::Tensor out_t = empty_transposed(x, dtype);
  call(x, [&](Stream stream) {
    fp8amp::cast_transpose_rescaled(view(x, op, "x"), view(scale_inv, op, "scale_inv"), view(scale, op, "scale"),
                                    view(out_t, op, "dtype"), stream);
  });
  return out_t;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cast_transpose_dbias(
    const at::Tensor& x, const at::Tensor& scale, const at::Tensor& amax, at::ScalarType dtype,
    const std::optional<at::Tensor>& warmup_counter, int64_t warmup_steps, int64_t margin, bool pow2_scale) {
  const char* op = "cast_transpose_dbias";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor out_t = empty_transposed(x, dtype);
  at::Tensor scale_inv = scale_inv_like(scale);
  at::Tensor dbias = at::empty_symint({columns(x)}, x.options().dtype(at::kFloat));
  at::Tensor workspace = at::empty(
      {fp8amp::cast_transpose_dbias_workspace(matrix_rows(x.sym_sizes()).expect_int(), columns(x).expect_int())},
      x.options().dtype(at::kFloat));
  call(x, [&](Stream stream) {
    const auto counter_view = optional_view(warmup_counter, op, "warmup_counter");
    fp8amp::cast_transpose_dbias(view(x, op, "x"), view(out, op, "dtype"), view(out_t, op, "dtype"),
                                 view(dbias, op, "dbias"), view(workspace, op, "workspace"),
                                 scaling(scale, amax, scale_inv, counter_view, warmup_steps, margin, pow2_scale, op),
                                 stream);
  });
  return {out, out_t, scale_inv, dbias};
}

at::Tensor dequantize(const at::Tensor& x, const at::Tensor& scale_inv, at::ScalarType dtype) {
  at::Tensor out = empty_as(x, dtype);
  call(x, [&](Stream stream) {
    fp8amp::dequantize(view(x, "dequantize", "x"), view(scale_inv, "dequantize", "scale_inv"),
                       view(out, "dequantize", "dtype"), stream);
  });
  return out;
}

void amax(const at::Tensor& x, const at::Tensor& amax_out, const std::optional<at::Tensor>& warmup_counter,
          int64_t warmup_steps) {
  call(x, [&](Stream stream) {
    const auto counter_view = optional_view(warmup_counter, "amax", "warmup_counter");
    fp8amp::amax(view(x, "amax", "x"), view(amax_out, "amax", "amax"), counter_view ? &*counter_view : nullptr,
                 narrow_int(warmup_steps, "amax", "warmup_steps"), stream);
  });
}

// amax's value as a new tensor: a compiled graph reads it as an op output, where torch 2.11's
// Inductor let a fused kernel read a buffer before the op that mutates it had run.
at::Tensor amax_of(const at::Tensor& x) {
  at::Tensor out = at::zeros({1}, x.options().dtype(at::kFloat));
  amax(x, out, std::nullopt, 0);
  return out;
}

// Multi-tensor ops need at least one tensor to know their device; the core names the error.
const at::Tensor& first_or(at::TensorList xs, const at::Tensor& fallback) { return xs.empty() ? fallback : xs[0]; }

void multi_amax(at::TensorList xs, const at::Tensor& amax_out) {
  call(first_or(xs, amax_out), [&](Stream stream) {
    fp8amp::multi_amax(views(xs, "multi_amax", "xs"), view(amax_out, "multi_amax", "amax"), stream);
  });
}

// The outputs are the caller's (a mutated Tensor[]), since torch's functionalization cannot
// handle an op that both mutates amax and returns a list.
at::Tensor multi_quantize(at::TensorList xs, at::TensorList outs, const at::Tensor& scale, const at::Tensor& amax,
                          const std::optional<at::Tensor>& warmup_counter, int64_t warmup_steps, int64_t margin,
                          bool pow2_scale) {
  const char* op = "multi_quantize";
  at::Tensor scale_inv = scale_inv_like(scale);
  call(first_or(xs, scale), [&](Stream stream) {
    const auto counter_view = optional_view(warmup_counter, op, "warmup_counter");
    fp8amp::multi_quantize(views(xs, op, "xs"), views(outs, op, "outs"),
                           scaling(scale, amax, scale_inv, counter_view, warmup_steps, margin, pow2_scale, op), stream);
  });
  return scale_inv;
}

// The outputs are the caller's, as multi_quantize's: written in place, they may be views into one
// larger buffer, which saves concatenating separate outputs (fp8amp.distributed dequantizes
// straight into its result).
void multi_dequantize(at::TensorList xs, const at::Tensor& scale_inv, at::TensorList outs) {
  const char* op = "multi_dequantize";
  call(first_or(xs, scale_inv), [&](Stream stream) {
    fp8amp::multi_dequantize(views(xs, op, "xs"), view(scale_inv, op, "scale_inv"), views(outs, op, "outs"),
                             stream);
  });
}

void compute_scale(const at::Tensor& amax_in, const at::Tensor& scale, const at::Tensor& scale_inv, double fmax,
                   int64_t margin, bool pow2_scale) {
  const char* op = "compute_scale";
  call(scale, [&](Stream stream) {
    fp8amp::compute_scale(view(amax_in, op, "amax"), view(scale, op, "scale"), view(scale_inv, op, "scale_inv"),
                          static_cast<float>(fmax), ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale},
                          stream);
  });
}

void update_delayed_scaling(const at::Tensor& amax_history, const at::Tensor& scale, const at::Tensor& scale_inv,
                            const at::Tensor& counter, double fmax, int64_t margin, bool pow2_scale) {
  const char* op = "update_delayed_scaling";
  call(amax_history, [&](Stream stream) {
    fp8amp::update_delayed_scaling(view(amax_history, op, "amax_history"), view(scale, op, "scale"),
                                   view(scale_inv, op, "scale_inv"), view(counter, op, "counter"),
                                   static_cast<float>(fmax),
                                   ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale}, stream);
  });
}

void multi_update_delayed_scaling(at::TensorList amax_histories, at::TensorList scales, at::TensorList scale_invs,
                                  at::TensorList counters, double fmax, int64_t margin, bool pow2_scale) {
  const char* op = "multi_update_delayed_scaling";
  // The device is that of the first tensor of any list (the core checks the lists' lengths).
  const at::Tensor* first = nullptr;
  for (const at::TensorList& list : {amax_histories, scales, scale_invs, counters}) {
    if (!list.empty()) {
      first = &list[0];
      break;
    }
  }
  if (first == nullptr) return;
  call(*first, [&](Stream stream) {
    fp8amp::multi_update_delayed_scaling(views(amax_histories, op, "amax_histories"), views(scales, op, "scales"),
                                         views(scale_invs, op, "scale_invs"), views(counters, op, "counters"),
                                         static_cast<float>(fmax),
                                         ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale}, stream);
  });
}

// Meta kernels: shapes and dtypes only (registered through MetaKernel, which checks devices).
constexpr char kQuantize[] = "quantize";
constexpr char kQuantizeCurrent[] = "quantize_current";
constexpr char kCastTranspose[] = "cast_transpose";
constexpr char kCastTransposeDbias[] = "cast_transpose_dbias";
constexpr char kCastTransposeRescaled[] = "cast_transpose_rescaled";
constexpr char kDequantize[] = "dequantize";
constexpr char kAmax[] = "amax";
constexpr char kAmaxOf[] = "amax_of";
constexpr char kMultiAmax[] = "multi_amax";
constexpr char kMultiQuantize[] = "multi_quantize";
constexpr char kMultiDequantize[] = "multi_dequantize";
constexpr char kComputeScale[] = "compute_scale";
constexpr char kUpdateDelayedScaling[] = "update_delayed_scaling";
constexpr char kMultiUpdateDelayedScaling[] = "multi_update_delayed_scaling";

std::tuple<at::Tensor, at::Tensor> quantize_meta(const at::Tensor& x, const at::Tensor& scale, const at::Tensor&,
                                                 at::ScalarType dtype, const std::optional<at::Tensor>&, int64_t,
                                                 int64_t, bool) {
  return {empty_as(x, dtype), scale_inv_like(scale)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_current_meta(const at::Tensor& x, at::ScalarType dtype, int64_t,
                                                                     bool) {
  const auto one_float = x.options().dtype(at::kFloat);
  return {empty_as(x, dtype), at::empty({1}, one_float), at::empty({1}, one_float)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_transpose_meta(const at::Tensor& x, const at::Tensor& scale,
                                                                   const at::Tensor&, at::ScalarType dtype,
                                                                   const std::optional<at::Tensor>&, int64_t,
                                                                   int64_t, bool) {
  return {empty_as(x, dtype), empty_transposed(x, dtype), scale_inv_like(scale)};
}

at::Tensor cast_transpose_rescaled_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                        at::ScalarType dtype) {
  return empty_transposed(x, dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cast_transpose_dbias_meta(
    const at::Tensor& x, const at::Tensor& scale, const at::Tensor&, at::ScalarType dtype,
    const std::optional<at::Tensor>&, int64_t, int64_t, bool) {
  return {empty_as(x, dtype), empty_transposed(x, dtype), scale_inv_like(scale),
          at::empty_symint({columns(x)}, x.options().dtype(at::kFloat))};
}

at::Tensor dequantize_meta(const at::Tensor& x, const at::Tensor&, at::ScalarType dtype) { return empty_as(x, dtype); }

void amax_meta(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t) {}
at::Tensor amax_of_meta(const at::Tensor& x) { return at::empty({1}, x.options().dtype(at::kFloat)); }
void multi_amax_meta(at::TensorList, const at::Tensor&) {}

at::Tensor multi_quantize_meta(at::TensorList, at::TensorList, const at::Tensor& scale, const at::Tensor&,
                               const std::optional<at::Tensor>&, int64_t, int64_t, bool) {
  return scale_inv_like(scale);
}

void multi_dequantize_meta(at::TensorList, const at::Tensor&, at::TensorList) {}

void compute_scale_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, bool) {}
void update_delayed_scaling_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                 int64_t, bool) {}

void multi_update_delayed_scaling_meta(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double, int64_t,
                                       bool) {}

}  // namespace
}  // namespace fp8amp::torch_binding

// The scaling arguments shared by the quantizing ops (see fp8amp::Scaling).
#define FP8AMP_SCALING_ARGS "Tensor? warmup_counter=None, int warmup_steps=0, int margin=0, bool pow2_scale=True"

TORCH_LIBRARY(fp8amp, m) {
  m.def("quantize(Tensor x, Tensor scale, Tensor(a!) amax, ScalarType dtype, " FP8AMP_SCALING_ARGS
        ") -> (Tensor, Tensor)");
  m.def("quantize_current(Tensor x, ScalarType dtype, int margin=0, bool nan_if_nonfinite=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("cast_transpose(Tensor x, Tensor scale, Tensor(a!) amax, ScalarType dtype, " FP8AMP_SCALING_ARGS
        ") -> (Tensor, Tensor, Tensor)");
  m.def("cast_transpose_dbias(Tensor x, Tensor scale, Tensor(a!) amax, ScalarType dtype, " FP8AMP_SCALING_ARGS
        ") -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("cast_transpose_rescaled(Tensor x, Tensor scale_inv, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("dequantize(Tensor x, Tensor scale_inv, ScalarType dtype) -> Tensor");
  // A compiled graph passes x with the strides it was traced with: the Python wrapper decides from
  // them whether x is read in place (row runs) or copied.
  m.def("amax(Tensor x, Tensor(a!) amax, Tensor? warmup_counter=None, int warmup_steps=0) -> ()",
        {at::Tag::needs_exact_strides});
  m.def("amax_of(Tensor x) -> Tensor", {at::Tag::needs_exact_strides});
  m.def("multi_amax(Tensor[] xs, Tensor(a!) amax) -> ()");
  m.def("multi_quantize(Tensor[] xs, Tensor(b!)[] outs, Tensor scale, Tensor(a!) amax, " FP8AMP_SCALING_ARGS
        ") -> Tensor");
  m.def("multi_dequantize(Tensor[] xs, Tensor scale_inv, Tensor(a!)[] outs) -> ()");
  m.def(
      "compute_scale(Tensor amax, Tensor(a!) scale, Tensor(b!) scale_inv, float fmax, int margin=0, "
      "bool pow2_scale=True) -> ()");
  m.def(
      "update_delayed_scaling(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv, "
      "Tensor(d!) counter, float fmax, int margin=0, bool pow2_scale=True) -> ()");
  m.def(
      "multi_update_delayed_scaling(Tensor(a!)[] amax_histories, Tensor(b!)[] scales, Tensor(c!)[] scale_invs, "
      "Tensor(d!)[] counters, float fmax, int margin=0, bool pow2_scale=True) -> ()");
}

#define FP8AMP_REGISTER_KERNELS(m, suffix)                                \
  m.impl("quantize", fp8amp::torch_binding::quantize##suffix);             \
  m.impl("quantize_current", fp8amp::torch_binding::quantize_current##suffix); \
  m.impl("cast_transpose", fp8amp::torch_binding::cast_transpose##suffix); \
  m.impl("cast_transpose_dbias", fp8amp::torch_binding::cast_transpose_dbias##suffix); \
  m.impl("cast_transpose_rescaled", fp8amp::torch_binding::cast_transpose_rescaled##suffix); \
  m.impl("dequantize", fp8amp::torch_binding::dequantize##suffix);         \
  m.impl("amax", fp8amp::torch_binding::amax##suffix);                     \
  m.impl("amax_of", fp8amp::torch_binding::amax_of##suffix);               \
  m.impl("multi_amax", fp8amp::torch_binding::multi_amax##suffix);         \
  m.impl("multi_quantize", fp8amp::torch_binding::multi_quantize##suffix); \
  m.impl("multi_dequantize", fp8amp::torch_binding::multi_dequantize##suffix); \
  m.impl("compute_scale", fp8amp::torch_binding::compute_scale##suffix);   \
  m.impl("update_delayed_scaling", fp8amp::torch_binding::update_delayed_scaling##suffix); \
  m.impl("multi_update_delayed_scaling", fp8amp::torch_binding::multi_update_delayed_scaling##suffix)

// The same functions serve CPU and CUDA: the core dispatches on the tensors' device.
TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { FP8AMP_REGISTER_KERNELS(m, ); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { FP8AMP_REGISTER_KERNELS(m, ); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("quantize", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kQuantize, fp8amp::torch_binding::quantize_meta>::run);
  m.impl("quantize_current", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kQuantizeCurrent, fp8amp::torch_binding::quantize_current_meta>::run);
  m.impl("cast_transpose", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCastTranspose, fp8amp::torch_binding::cast_transpose_meta>::run);
  m.impl("cast_transpose_dbias", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCastTransposeDbias, fp8amp::torch_binding::cast_transpose_dbias_meta>::run);
  m.impl("cast_transpose_rescaled", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCastTransposeRescaled, fp8amp::torch_binding::cast_transpose_rescaled_meta>::run);
  m.impl("dequantize", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kDequantize, fp8amp::torch_binding::dequantize_meta>::run);
  m.impl("amax", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kAmax, fp8amp::torch_binding::amax_meta>::run);
  m.impl("amax_of", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kAmaxOf, fp8amp::torch_binding::amax_of_meta>::run);
  m.impl("multi_amax", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kMultiAmax, fp8amp::torch_binding::multi_amax_meta>::run);
  m.impl("multi_quantize", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kMultiQuantize, fp8amp::torch_binding::multi_quantize_meta>::run);
  m.impl("multi_dequantize", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kMultiDequantize, fp8amp::torch_binding::multi_dequantize_meta>::run);
  m.impl("compute_scale", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kComputeScale, fp8amp::torch_binding::compute_scale_meta>::run);
  m.impl("update_delayed_scaling", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kUpdateDelayedScaling, fp8amp::torch_binding::update_delayed_scaling_meta>::run);
  m.impl("multi_update_delayed_scaling", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kMultiUpdateDelayedScaling, fp8amp::torch_binding::multi_update_delayed_scaling_meta>::run);
}

// ------------------------------------------------------------------------------------------------
// scaled_accumulate (fp8amp/accumulate.h): dst, dst_scale_inv and amax are written in place.

namespace fp8amp::torch_binding {
namespace {

void scaled_accumulate(const at::Tensor& dst, const at::Tensor& dst_scale_inv, const at::Tensor& src,
                       const std::optional<at::Tensor>& src_scale_inv, double alpha, const at::Tensor& amax_out,
                       int64_t margin, bool pow2_scale) {
  const char* op = "scaled_accumulate";
  call(dst, [&](Stream stream) {
    const auto src_si = optional_view(src_scale_inv, op, "src_scale_inv");
    fp8amp::scaled_accumulate(view(dst, op, "dst"), view(dst_scale_inv, op, "dst_scale_inv"), view(src, op, "src"),
                              src_si ? &*src_si : nullptr, static_cast<float>(alpha), view(amax_out, op, "amax"),
                              ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale}, stream);
  });
}

void scaled_accumulate_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            double, const at::Tensor&, int64_t, bool) {}
constexpr char kScaledAccumulate[] = "scaled_accumulate";

}  // namespace
}  // namespace fp8amp::torch_binding

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  m.def(
      "scaled_accumulate(Tensor(a!) dst, Tensor(b!) dst_scale_inv, Tensor src, Tensor? src_scale_inv, "
      "float alpha, Tensor(c!) amax, int margin=0, bool pow2_scale=True) -> ()");
}

TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { m.impl("scaled_accumulate", fp8amp::torch_binding::scaled_accumulate); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { m.impl("scaled_accumulate", fp8amp::torch_binding::scaled_accumulate); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("scaled_accumulate", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kScaledAccumulate,
                                                               fp8amp::torch_binding::scaled_accumulate_meta>::run);
}
TORCH_LIBRARY_IMPL(fp8amp, Autograd, m) {
  fp8amp::torch_binding::register_no_derivative(
      m, "quantize", "quantize_current", "cast_transpose", "cast_transpose_dbias", "cast_transpose_rescaled",
      "dequantize", "amax", "amax_of", "multi_amax", "multi_quantize", "multi_dequantize", "compute_scale",
      "update_delayed_scaling", "multi_update_delayed_scaling", "scaled_accumulate");
}
