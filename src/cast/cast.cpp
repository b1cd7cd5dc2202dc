// Public cast ops: validate the views once, then hand raw pointers to the CPU reference or the
// CUDA kernels (cast_kernels.h).
#include "fp8amp/cast.h"

#include <initializer_list>
#include <optional>
#include <string>

#include "cast/cast_kernels.h"
#include "common/dispatch.h"
#include "common/op_args.h"
#include "common/run_on.h"
#include "fp8amp/error.h"
#include "scaling/scaling_checks.h"

namespace fp8amp {

namespace {

// Checks a list of inputs and outputs pairwise and returns them as slices.
std::vector<TensorSlice> slices(const std::vector<TensorView>& xs, const std::vector<TensorView>& outs,
                                Arity arity, const char* op) {
  FP8AMP_CHECK_VALUE(!xs.empty(), op, "xs must hold at least one tensor");
  FP8AMP_CHECK_VALUE(outs.empty() || outs.size() == xs.size(), op, "outs must hold as many tensors as xs (",
                     xs.size(), "), got ", outs.size());
  std::vector<TensorSlice> result;
  result.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const TensorView& x = xs[i];
    const std::string x_name = element_name(arity, "x", "xs", i);
    FP8AMP_CHECK_VALUE(x.dtype == xs[0].dtype, op, "xs must share one dtype: xs[0] is ", xs[0].describe(), ", ",
                       x_name, " is ", x.describe());
    check::same_device(x, xs[0], op, x_name.c_str(), "xs[0]");
    check::contiguous(x, op, x_name.c_str());
    void* out = nullptr;
    if (!outs.empty()) {
      const std::string out_name = element_name(arity, "out", "outs", i);
      FP8AMP_CHECK_VALUE(outs[i].dtype == outs[0].dtype, op, "outs must share one dtype: outs[0] is ",
                         outs[0].describe(), ", ", out_name, " is ", outs[i].describe());
      check::same_shape(x, outs[i], op, x_name.c_str(), out_name.c_str());
      check::same_device(x, outs[i], op, x_name.c_str(), out_name.c_str());
      check::contiguous(outs[i], op, out_name.c_str());
      out = outs[i].data;
    }
    result.push_back(TensorSlice{x.data, out, x.numel()});
  }
  return result;
}

// No output or written scaling buffer (amax, scale_inv) may share memory with another one or with
// an input: on the GPU that would be a race, and codes are narrower or wider than the values (no
// in-place form exists). The outs and xs are named "outs[3]" / "xs[3]", or "out" / "x"; the
// scaling buffers by their names. After the format checks.
void check_disjoint(const std::vector<TensorView>& xs, const std::vector<TensorView>& outs,
                    std::initializer_list<check::NamedView> written, std::initializer_list<check::NamedView> read,
                    Arity arity, const char* op) {
  std::vector<const TensorView*> out_views, x_views;
  for (const TensorView& t : outs) out_views.push_back(&t);
  for (const TensorView& t : xs) x_views.push_back(&t);
  check::disjoint_writes(out_views, x_views, written, read, op, [&](bool is_out, size_t i) {
    return is_out ? element_name(arity, "out", "outs", i) : element_name(arity, "x", "xs", i);
  });
}

void quantize_impl(const std::vector<TensorView>& xs, const std::vector<TensorView>& outs, const Scaling& scaling,
                   Stream stream, Arity arity, const char* op) {
  const std::vector<TensorSlice> t = slices(xs, outs, arity, op);
  FP8AMP_CHECK_VALUE(!outs.empty(), op, "outs must hold as many tensors as xs");
  const bool multi = arity == Arity::kMulti;
  check::high_precision(xs[0], op, multi ? "xs" : "x");
  check::scaled_format(outs[0].dtype, op, multi ? "outs" : "dtype");
  const ScalingPtrs s = scaling_ptrs(scaling, static_cast<int64_t>(xs.size()), xs[0], op);
  check_disjoint(xs, outs, {{&scaling.amax, "amax"}, {&scaling.scale_inv, "scale_inv"}},
                 {{&scaling.scale, "scale"}, {scaling.warmup_counter, "warmup_counter"}}, arity, op);
  run_on(
      xs[0], op, [&] { cpu::quantize(xs[0].dtype, outs[0].dtype, t, s); },
      [&] { cuda::quantize(xs[0].dtype, outs[0].dtype, t, s, stream); });
}

void dequantize_impl(const std::vector<TensorView>& xs, const TensorView& scale_inv,
                     const std::vector<TensorView>& outs, Stream stream, Arity arity, const char* op) {
  const std::vector<TensorSlice> t = slices(xs, outs, arity, op);
  FP8AMP_CHECK_VALUE(!outs.empty(), op, "outs must hold as many tensors as xs");
  const bool multi = arity == Arity::kMulti;
  check::scaled_format(xs[0].dtype, op, multi ? "xs" : "x");
  check::high_precision(outs[0], op, multi ? "outs" : "dtype");
  check_float32(scale_inv, xs[0], op, "scale_inv");
  check::numel_is(scale_inv, static_cast<int64_t>(xs.size()), op, "scale_inv");
  check_disjoint(xs, outs, {}, {{&scale_inv, "scale_inv"}}, arity, op);
  const float* si = scale_inv.ptr<const float>();
  run_on(
      xs[0], op, [&] { cpu::dequantize(xs[0].dtype, outs[0].dtype, t, si); },
      [&] { cuda::dequantize(xs[0].dtype, outs[0].dtype, t, si, stream); });
}

}  // namespace

void quantize(const TensorView& x, const TensorView& out, const Scaling& scaling, Stream stream) {
  quantize_impl({x}, {out}, scaling, stream, Arity::kSingle, "quantize");
}

void quantize_current(const TensorView& x, const TensorView& out, const TensorView& scale_inv,
                      const TensorView& amax_out, int margin, bool nan_if_nonfinite, Stream stream) {
  const char* op = "quantize_current";
  const std::vector<TensorSlice> t = slices({x}, {out}, Arity::kSingle, op);
  check::high_precision(x, op, "x");
  check::scaled_format(out.dtype, op, "dtype");
  check_recipe(ScalingRecipe{margin, true}, op);
  check_float32(scale_inv, x, op, "scale_inv");
  check::numel_is(scale_inv, 1, op, "scale_inv");
  check_float32(amax_out, x, op, "amax");
  check::numel_is(amax_out, 1, op, "amax");
  check::disjoint_writes({{&out, "out"}, {&scale_inv, "scale_inv"}, {&amax_out, "amax"}}, {{&x, "x"}}, op);
  ScalingPtrs s{nullptr, amax_out.ptr<float>(), 0, scale_inv.ptr<float>(), nullptr, 0, margin, true};
  s.current = true;
  s.nan_if_nonfinite = nan_if_nonfinite;
  run_on(
      x, op, [&] { cpu::quantize_current(x.dtype, out.dtype, t[0], s); },
      [&] { cuda::quantize_current(x.dtype, out.dtype, t[0], s, stream); });
}

void multi_quantize(const std::vector<TensorView>& xs, const std::vector<TensorView>& outs, const Scaling& scaling,
                    Stream stream) {
  quantize_impl(xs, outs, scaling, stream, Arity::kMulti, "multi_quantize");
}

void dequantize(const TensorView& x, const TensorView& scale_inv, const TensorView& out, Stream stream) {
  dequantize_impl({x}, scale_inv, {out}, stream, Arity::kSingle, "dequantize");
}

void multi_dequantize(const std::vector<TensorView>& xs, const TensorView& scale_inv,
                      const std::vector<TensorView>& outs, Stream stream) {
  dequantize_impl(xs, scale_inv, outs, stream, Arity::kMulti, "multi_dequantize");
}

namespace {

// x viewed as [rows, cols]: the checks cast_transpose and cast_transpose_dbias share.
struct Matrix {
  int64_t rows;
  int64_t cols;
};

// x (its dtype checked by the caller) and the transpose out_t of its matrix, in a scaled format.
Matrix check_transposed(const TensorView& x, const TensorView& out_t, const char* op) {
  check::contiguous(x, op, "x");
  FP8AMP_CHECK_VALUE(x.dim() >= 1, op, "x must have at least 1 dimension, got ", x.describe());
  check::scaled_format(out_t.dtype, op, "dtype");
  const int64_t cols = x.shape.back();
  const int64_t rows = matrix_rows(x.shape);
  FP8AMP_CHECK_VALUE(out_t.dim() == 2 && out_t.shape[0] == cols && out_t.shape[1] == rows, op, "out_t must be ",
                     dtype_name(out_t.dtype), "[", cols, ", ", rows, "], got ", out_t.describe());
  check::contiguous(out_t, op, "out_t");
  check::same_device(x, out_t, op, "x", "out_t");
  return {rows, cols};
}

Matrix check_cast_transpose(const TensorView& x, const TensorView& out, const TensorView& out_t, const char* op) {
  check::high_precision(x, op, "x");
  check::scaled_format(out.dtype, op, "dtype");
  check::same_shape(x, out, op, "x", "out");
  check::contiguous(out, op, "out");
  check::same_device(x, out, op, "x", "out");
  FP8AMP_CHECK_VALUE(out_t.dtype == out.dtype, op, "out_t must be ", dtype_name(out.dtype), " as out, got ",
                     out_t.describe());
  return check_transposed(x, out_t, op);
}

}  // namespace

void cast_transpose(const TensorView& x, const TensorView& out, const TensorView& out_t, const Scaling& scaling,
                    Stream stream) {
  const char* op = "cast_transpose";
  const auto [rows, cols] = check_cast_transpose(x, out, out_t, op);
  const ScalingPtrs s = scaling_ptrs(scaling, 1, x, op);
  check::disjoint_writes({{&out, "out"}, {&out_t, "out_t"}, {&scaling.amax, "amax"}, {&scaling.scale_inv, "scale_inv"}},
                         {{&x, "x"}, {&scaling.scale, "scale"}, {scaling.warmup_counter, "warmup_counter"}}, op);
  run_on(
      x, op,
      [&] { cpu::cast_transpose(x.dtype, out.dtype, x.data, out.data, out_t.data, rows, cols, s, nullptr, nullptr); },
      [&] {
        cuda::cast_transpose(x.dtype, out.dtype, x.data, out.data, out_t.data, rows, cols, s, nullptr, nullptr,
                             stream);
      });
}

void cast_transpose_rescaled(const TensorView& x, const TensorView& scale_inv, const TensorView& scale,
                             const TensorView& out_t, Stream stream) {
  const char* op = "cast_transpose_rescaled";
  FP8AMP_CHECK_VALUE(x.dtype == DType::kFloat16, op, "x must hold float16 codes (a scaled FP16 tensor), got ",
                     x.describe());
  const auto [rows, cols] = check_transposed(x, out_t, op);
  check_float32(scale_inv, x, op, "scale_inv");
  check::numel_is(scale_inv, 1, op, "scale_inv");
  check_float32(scale, x, op, "scale");
  check::numel_is(scale, 1, op, "scale");
  check::disjoint_writes({{&out_t, "out_t"}}, {{&x, "x"}, {&scale_inv, "scale_inv"}, {&scale, "scale"}}, op);
  const auto* codes = x.ptr<const numerics::fp16>();
  const RescalePtrs rescale{scale_inv.ptr<const float>(), scale.ptr<const float>()};
  run_on(
      x, op, [&] { cpu::cast_transpose_rescaled(out_t.dtype, codes, out_t.data, rows, cols, rescale); },
      [&] { cuda::cast_transpose_rescaled(out_t.dtype, codes, out_t.data, rows, cols, rescale, stream); });
}

int64_t cast_transpose_dbias_workspace(int64_t rows, int64_t cols) { return column_sum_bands(rows) * cols; }

void cast_transpose_dbias(const TensorView& x, const TensorView& out, const TensorView& out_t,
                          const TensorView& dbias, const TensorView& workspace, const Scaling& scaling,
                          Stream stream) {
  const char* op = "cast_transpose_dbias";
  const auto [rows, cols] = check_cast_transpose(x, out, out_t, op);
  check_float32(dbias, x, op, "dbias");
  check::numel_is(dbias, cols, op, "dbias");
  check_float32(workspace, x, op, "workspace");
  check::numel_at_least(workspace, cast_transpose_dbias_workspace(rows, cols), op, "workspace");
  const ScalingPtrs s = scaling_ptrs(scaling, 1, x, op);
  check::disjoint_writes({{&out, "out"}, {&out_t, "out_t"}, {&dbias, "dbias"}, {&workspace, "workspace"},
                          {&scaling.amax, "amax"}, {&scaling.scale_inv, "scale_inv"}},
                         {{&x, "x"}, {&scaling.scale, "scale"}, {scaling.warmup_counter, "warmup_counter"}}, op);
  float* sums = dbias.ptr<float>();
  float* bands = workspace.ptr<float>();
  run_on(
      x, op, [&] { cpu::cast_transpose(x.dtype, out.dtype, x.data, out.data, out_t.data, rows, cols, s, sums, bands); },
      [&] {
        cuda::cast_transpose(x.dtype, out.dtype, x.data, out.data, out_t.data, rows, cols, s, sums, bands, stream);
      });
}

void amax(const TensorView& x, const TensorView& amax_out, const TensorView* warmup_counter, int warmup_steps,
          Stream stream) {
  const char* op = "amax";
  check::high_precision(x, op, "x");
  const std::optional<RowRuns> runs = row_runs(x);
  FP8AMP_CHECK_VALUE(runs.has_value(), op, "x must be contiguous, a permutation of a contiguous tensor, or rows of "
                     "equal length at one stride (e.g. a slice of a matrix's columns), got strides that are not (",
                     x.describe(), "); call .contiguous() first");
  check_float32(amax_out, x, op, "amax");
  check::numel_at_least(amax_out, 1, op, "amax");
  const int32_t* warmup_counter_data = nullptr;
  if (warmup_counter != nullptr) {
    check::dtype_is(*warmup_counter, DType::kInt32, op, "warmup_counter");
    check::same_device(*warmup_counter, x, op, "warmup_counter", "x");
    check::numel_is(*warmup_counter, 1, op, "warmup_counter");
    check_warmup_steps(warmup_steps, op);
    warmup_counter_data = warmup_counter->ptr<const int32_t>();
  }
  check::disjoint_writes({{&amax_out, "amax"}}, {{&x, "x"}, {warmup_counter, "warmup_counter"}}, op);
  float* a = amax_out.ptr<float>();
  run_on(
      x, op, [&] { cpu::amax(x.dtype, x.data, *runs, a, warmup_counter_data, warmup_steps); },
      [&] { cuda::amax(x.dtype, x.data, *runs, a, warmup_counter_data, warmup_steps, stream); });
}

void multi_amax(const std::vector<TensorView>& xs, const TensorView& amax_out, Stream stream) {
  const char* op = "multi_amax";
  const std::vector<TensorSlice> t = slices(xs, {}, Arity::kMulti, op);
  FP8AMP_CHECK_VALUE(is_high_precision(xs[0].dtype) || is_fp8(xs[0].dtype), op,
                     "xs must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got ", xs[0].describe());
  check_float32(amax_out, xs[0], op, "amax");
  const int64_t stride = amax_stride(amax_out, static_cast<int64_t>(xs.size()), op);
  check_disjoint(xs, {}, {{&amax_out, "amax"}}, {}, Arity::kMulti, op);
  float* a = amax_out.ptr<float>();
  run_on(
      xs[0], op, [&] { cpu::multi_amax(xs[0].dtype, t, a, stride); },
      [&] { cuda::multi_amax(xs[0].dtype, t, a, stride, stream); });
}

}  // namespace fp8amp
