// Public Adam op: validate the views once, then hand raw pointers to the CPU reference or the
// CUDA kernels (adam_kernels.h).
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/op_args.h"
#include "common/run_on.h"
#include "fp8amp/error.h"
#include "fp8amp/optim.h"
#include "optim/adam_kernels.h"

namespace fp8amp {

namespace {

constexpr const char* kOp = "adam_step";


bool one_of(DType d, std::initializer_list<DType> accepted) {
  for (DType a : accepted) {
    if (d == a) return true;
  }
  return false;
}

// A buffer of tensor i: its dtype among `accepted` (spelled out in `accepted_names`), contiguous,
// the shape of the param and on its device.
void check_buffer(const TensorView& t, const TensorView& param, const char* name,
                  std::initializer_list<DType> accepted, const char* accepted_names) {
  FP8AMP_CHECK_VALUE(one_of(t.dtype, accepted), kOp, name, " must be ", accepted_names, ", got ", t.describe());
  check::contiguous(t, kOp, name);
  check::same_shape(t, param, kOp, name, "its param");
  check::same_device(t, param, kOp, name, "its param");
}

// A float32 scalar on `like`'s device.
void check_scalar(const TensorView& t, const TensorView& like, const char* name, const char* like_name) {
  check::dtype_is(t, DType::kFloat32, kOp, name);
  check::numel_is(t, 1, kOp, name);
  check::same_device(t, like, kOp, name, like_name);
}

// A scale_inv must be given iff `needed` (its tensor is in a scaled format, described by `why`); a
// scale may be None when needed too: the op then derives the old one from the scale_inv.
enum class ScaleArg { kScaleInv, kScale };

template <class Ptr>
Ptr scale_ptr(const std::optional<TensorView>& t, bool needed, const TensorView& param, const char* list, size_t i,
              const char* why, ScaleArg arg = ScaleArg::kScaleInv) {
  const ListItem item_name(list, i);
  const char* name = item_name.c_str();
  if (!needed) {
    FP8AMP_CHECK_VALUE(!t.has_value(), kOp, name, " must be None: ", why);
    return nullptr;
  }
  if (!t.has_value()) {
    FP8AMP_CHECK_VALUE(arg == ScaleArg::kScale, kOp, name, " is required: ", why);
    return nullptr;
  }
  check_scalar(*t, param, name, "its param");
  return t->template ptr<std::remove_pointer_t<Ptr>>();
}

// An FP8 grad's scale_inv: one scale, or the [ceil(rows / 128), cols / 128] block scales of a 2-D
// grad whose cols are a multiple of 128 (the blockwise recipe's weight gradients); sets
// *blocks_per_row (0 for one scale).
const float* grad_scale_inv_ptr(const std::optional<TensorView>& t, bool needed, const TensorView& param, size_t i,
                                const char* why, uint32_t* blocks_per_row) {
  *blocks_per_row = 0;
  if (!needed || !t.has_value() || t->numel() == 1) {
    return scale_ptr<const float*>(t, needed, param, "grad_scale_invs", i, why);
  }
  const ListItem item_name("grad_scale_invs", i);
  const char* name = item_name.c_str();
  const bool blocks_fit = param.dim() == 2 && param.shape[1] % kGradBlock == 0 &&
                          param.numel() / kGradBlock <= int64_t{UINT32_MAX};
  FP8AMP_CHECK_VALUE(blocks_fit, kOp, name, " must have one element, or be the 128 x 128 block scales of a 2-D grad "
                     "whose columns are a multiple of 128 (and at most 128 * (2^32 - 1) elements); the param is ",
                     param.describe(), ", the scale_inv ", t->describe());
  const int64_t grid_rows = (param.shape[0] + kGradBlock - 1) / kGradBlock;
  const int64_t grid_cols = param.shape[1] / kGradBlock;
  check::dtype_is(*t, DType::kFloat32, kOp, name);
  check::contiguous(*t, kOp, name);
  check::same_device(*t, param, kOp, name, "its param");
  FP8AMP_CHECK_VALUE(t->dim() == 2 && t->shape[0] == grid_rows && t->shape[1] == grid_cols, kOp, name,
                     " must have one element or be the block scales [", grid_rows, ", ", grid_cols,
                     "] of its param ", param.describe(), ", got ", t->describe());
  *blocks_per_row = static_cast<uint32_t>(grid_cols);
  return t->ptr<float>();
}

void check_hyper(const AdamHyper& h) {
  const auto finite_at_least_0 = [](double x) { return std::isfinite(x) && x >= 0.0; };
  FP8AMP_CHECK_VALUE(finite_at_least_0(h.lr), kOp, "lr must be finite and >= 0, got ", h.lr);
  FP8AMP_CHECK_VALUE(finite_at_least_0(h.eps), kOp, "eps must be finite and >= 0, got ", h.eps);
  FP8AMP_CHECK_VALUE(finite_at_least_0(h.weight_decay), kOp, "weight_decay must be finite and >= 0, got ",
                     h.weight_decay);
  FP8AMP_CHECK_VALUE(h.beta1 >= 0.0 && h.beta1 < 1.0, kOp, "beta1 must be in [0, 1), got ", h.beta1);
  FP8AMP_CHECK_VALUE(h.beta2 >= 0.0 && h.beta2 < 1.0, kOp, "beta2 must be in [0, 1), got ", h.beta2);
  FP8AMP_CHECK_VALUE(h.margin >= 0 && h.margin <= numerics::kMaxScaleExponent, kOp, "margin must be in [0, ",
                     numerics::kMaxScaleExponent, "], got ", h.margin);
}

// Tensor i's buffers but its grad, checked; set_grad adds the grad's pointers and format.
AdamTensorPtrs buffer_ptrs(const AdamTensors& t, const TensorView& first, size_t i, AdamFormats* formats) {
  const TensorView& p = t.param;
  const ListItem item_name("params", i);
  const char* pname = item_name.c_str();
  FP8AMP_CHECK_VALUE(one_of(p.dtype, {DType::kFloat32, DType::kFloat16}), kOp, pname,
                     " must be float32, or float16 with a scale (the FP16 master), got ", p.describe());
  check::contiguous(p, kOp, pname);
  check::same_device(p, first, kOp, pname, "params[0]");
  check_buffer(t.exp_avg, p, ListItem("exp_avgs", i).c_str(), {DType::kFloat32, DType::kFloat8E4M3},
               "float32 or float8_e4m3fn");
  check_buffer(t.exp_avg_sq, p, ListItem("exp_avg_sqs", i).c_str(), {DType::kFloat32, DType::kFloat16}, "float32 or float16");
  if (t.weight_fp8) {
    check_buffer(*t.weight_fp8, p, ListItem("weights_fp8", i).c_str(), {DType::kFloat8E4M3}, "float8_e4m3fn");
  }

  AdamTensorPtrs r{};
  r.param = p.data;
  r.exp_avg = t.exp_avg.data;
  r.exp_avg_sq = t.exp_avg_sq.data;
  r.weight_fp8 = t.weight_fp8 ? t.weight_fp8->data : nullptr;
  r.numel = p.numel();

  const bool fp16_param = p.dtype == DType::kFloat16;
  const bool fp8_m = t.exp_avg.dtype == DType::kFloat8E4M3;
  const bool fp16_v = t.exp_avg_sq.dtype == DType::kFloat16;
  const bool weight = t.weight_fp8.has_value();
  const char* param_why = fp16_param ? "its param is float16" : "its param is float32";
  const char* m_why = fp8_m ? "its exp_avg is float8_e4m3fn" : "its exp_avg is float32";
  const char* v_why = fp16_v ? "its exp_avg_sq is float16" : "its exp_avg_sq is float32";
  const char* w_why = weight ? "weights_fp8[i] is given" : "weights_fp8[i] is None";
  r.param_scale = scale_ptr<float*>(t.param_scale, fp16_param, p, "param_scales", i, param_why, ScaleArg::kScale);
  r.param_scale_inv = scale_ptr<float*>(t.param_scale_inv, fp16_param, p, "param_scale_invs", i, param_why);
  r.exp_avg_scale = scale_ptr<float*>(t.exp_avg_scale, fp8_m, p, "exp_avg_scales", i, m_why, ScaleArg::kScale);
  r.exp_avg_scale_inv = scale_ptr<float*>(t.exp_avg_scale_inv, fp8_m, p, "exp_avg_scale_invs", i, m_why);
  r.exp_avg_sq_scale =
      scale_ptr<float*>(t.exp_avg_sq_scale, fp16_v, p, "exp_avg_sq_scales", i, v_why, ScaleArg::kScale);
  r.exp_avg_sq_scale_inv = scale_ptr<float*>(t.exp_avg_sq_scale_inv, fp16_v, p, "exp_avg_sq_scale_invs", i, v_why);
  r.weight_scale = scale_ptr<float*>(t.weight_scale, weight, p, "weight_scales", i, w_why, ScaleArg::kScale);
  r.weight_scale_inv = scale_ptr<float*>(t.weight_scale_inv, weight, p, "weight_scale_invs", i, w_why);
  if (t.step_count) {
    check_scalar(*t.step_count, p, ListItem("step_counts", i).c_str(), "its param");
    r.step_count = t.step_count->ptr<float>();
  }
  if (t.param_amax) {
    check_scalar(*t.param_amax, p, ListItem("param_amaxes", i).c_str(), "its param");
    r.param_amax = t.param_amax->ptr<float>();
  }
  *formats = AdamFormats{p.dtype, DType::kFloat32, t.exp_avg.dtype, t.exp_avg_sq.dtype, false};
  return r;
}

// This step's grad of tensor i (of `param`): checked, its pointers into *r, its format into *formats.
void set_grad(const TensorView& grad, const std::optional<TensorView>& grad_scale_inv, const TensorView& param,
              size_t i, AdamTensorPtrs* r, AdamFormats* formats) {
  check_buffer(grad, param, ListItem("grads", i).c_str(),
               {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2},
               "float32, bfloat16, float16, float8_e4m3fn or float8_e5m2");
  const bool fp8_grad = is_fp8(grad.dtype);
  r->grad = grad.data;
  r->grad_scale_inv = grad_scale_inv_ptr(grad_scale_inv, fp8_grad, param, i,
                                         fp8_grad ? "its grad is float8" : "its grad is not float8",
                                         &r->grad_blocks_per_row);
  formats->grad = grad.dtype;
  formats->grad_blocks = r->grad_blocks_per_row != 0;
}

// Every buffer but the grads and their scales is rewritten in place, element by element, and read
// again in pass 2 (optim.h, "How"): two sharing memory, or a grad inside one of them, would give
// wrong values on the CPU and a race on the GPU. The grads may share memory with each other.
// These are the plan's written buffers, checked against each other once; each step checks its
// grads and its own outputs against them.
check::WrittenViews written_buffers(const std::vector<AdamTensors>& tensors) {
  std::vector<TensorView> written;
  std::vector<std::pair<const char*, size_t>> written_at;  // (list, i), as the torch op names them
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamTensors& t = tensors[i];
    const auto add = [&](const TensorView& view, const char* list) {
      written.push_back(view);
      written_at.push_back({list, i});
    };
    const auto add_optional = [&](const std::optional<TensorView>& view, const char* list) {
      if (view) add(*view, list);
    };
    add(t.param, "params");
    add(t.exp_avg, "exp_avgs");
    add(t.exp_avg_sq, "exp_avg_sqs");
    add_optional(t.param_scale, "param_scales");
    add_optional(t.param_scale_inv, "param_scale_invs");
    add_optional(t.exp_avg_scale, "exp_avg_scales");
    add_optional(t.exp_avg_scale_inv, "exp_avg_scale_invs");
    add_optional(t.exp_avg_sq_scale, "exp_avg_sq_scales");
    add_optional(t.exp_avg_sq_scale_inv, "exp_avg_sq_scale_invs");
    add_optional(t.weight_fp8, "weights_fp8");
    add_optional(t.weight_scale, "weight_scales");
    add_optional(t.weight_scale_inv, "weight_scale_invs");
    add_optional(t.step_count, "step_counts");
    add_optional(t.param_amax, "param_amaxes");
  }
  return check::WrittenViews(std::move(written), kOp, [written_at = std::move(written_at)](size_t k) {
    return std::string(ListItem(written_at[k].first, written_at[k].second).c_str());
  });
}

}  // namespace

struct AdamPlan::Checked {
  std::vector<TensorView> params;
  std::vector<AdamTensorPtrs> ptrs;  // the grads' pointers left null
  std::vector<AdamFormats> formats;  // the grads' formats left float32
  check::WrittenViews written;
};

AdamPlan::AdamPlan(const std::vector<AdamTensors>& tensors) {
  FP8AMP_CHECK_VALUE(!tensors.empty(), kOp, "params must hold at least one tensor");
  const TensorView& first = tensors[0].param;
  const size_t n = tensors.size();
  std::vector<TensorView> params(n);
  std::vector<AdamTensorPtrs> ptrs(n);
  std::vector<AdamFormats> formats(n);
  for (size_t i = 0; i < n; ++i) {
    params[i] = tensors[i].param;
    ptrs[i] = buffer_ptrs(tensors[i], first, i, &formats[i]);
  }
  checked_ = std::make_unique<const Checked>(
      Checked{std::move(params), std::move(ptrs), std::move(formats), written_buffers(tensors)});
}

AdamPlan::AdamPlan(AdamPlan&&) noexcept = default;
AdamPlan& AdamPlan::operator=(AdamPlan&&) noexcept = default;
AdamPlan::~AdamPlan() = default;

size_t AdamPlan::size() const { return checked_->params.size(); }

void AdamPlan::step(const std::vector<TensorView>& grads, const std::vector<std::optional<TensorView>>& grad_scale_invs,
                    const AdamHyper& hyper, int64_t step, const TensorView* step_tensor, const TensorView& found_inf,
                    const TensorView& amax, Stream stream) const {
  const Checked& c = *checked_;
  const size_t n = c.params.size();
  const TensorView& first = c.params[0];
  check_hyper(hyper);
  FP8AMP_CHECK_VALUE(grads.size() == n, kOp, "grads must hold one tensor per param (", n, "), got ", grads.size());
  FP8AMP_CHECK_VALUE(grad_scale_invs.empty() || grad_scale_invs.size() == n, kOp,
                     "grad_scale_invs must be empty or hold one entry per param (", n, "), got ",
                     grad_scale_invs.size());
  std::vector<AdamTensorPtrs> ptrs = c.ptrs;
  std::vector<AdamFormats> formats = c.formats;
  static const std::optional<TensorView> kNone;
  for (size_t i = 0; i < n; ++i) {
    set_grad(grads[i], grad_scale_invs.empty() ? kNone : grad_scale_invs[i], c.params[i], i, &ptrs[i], &formats[i]);
  }

  AdamArgs args{hyper, step, nullptr, nullptr, nullptr};
  if (step_tensor != nullptr) {
    FP8AMP_CHECK_VALUE(step == 0, kOp, "step must be 0 when step_tensor is given (t comes from it), got ", step);
    check_scalar(*step_tensor, first, "step_tensor", "params[0]");
    args.step_tensor = step_tensor->ptr<float>();
  } else {
    FP8AMP_CHECK_VALUE(step >= 1, kOp, "step must be >= 1 (the number of this step), or give step_tensor; got ",
                       step);
  }
  check_scalar(found_inf, first, "found_inf", "params[0]");
  args.found_inf = found_inf.ptr<float>();
  check::dtype_is(amax, DType::kFloat32, kOp, "amax");
  check::contiguous(amax, kOp, "amax");
  FP8AMP_CHECK_VALUE(amax.dim() == 2 && amax.shape[0] == static_cast<int64_t>(n) &&
                         amax.shape[1] == kAdamAmaxColumns,
                     kOp, "amax must be [", n, ", ", static_cast<int>(kAdamAmaxColumns), "], got ", amax.describe());
  check::same_device(amax, first, kOp, "amax", "params[0]");
  args.amax = amax.ptr<float>();

  // This step's outputs against each other and the plan's buffers, then what it reads against both.
  std::vector<TensorView> outputs;
  std::vector<const char*> output_names;
  if (step_tensor != nullptr) {
    outputs.push_back(*step_tensor);
    output_names.push_back("step_tensor");
  }
  outputs.insert(outputs.end(), {found_inf, amax});
  output_names.insert(output_names.end(), {"found_inf", "amax"});
  for (size_t k = 0; k < outputs.size(); ++k) {
    c.written.refuse_overlap(outputs[k], [&] { return std::string(output_names[k]); });
  }
  const check::WrittenViews step_outputs(std::move(outputs), kOp,
                                         [&](size_t k) { return std::string(output_names[k]); });
  for (size_t i = 0; i < n; ++i) {
    const auto grad_name = [&] { return std::string(ListItem("grads", i).c_str()); };
    c.written.refuse_overlap(grads[i], grad_name);
    step_outputs.refuse_overlap(grads[i], grad_name);
    if (!grad_scale_invs.empty() && grad_scale_invs[i]) {
      const auto scale_name = [&] { return std::string(ListItem("grad_scale_invs", i).c_str()); };
      c.written.refuse_overlap(*grad_scale_invs[i], scale_name);
      step_outputs.refuse_overlap(*grad_scale_invs[i], scale_name);
    }
  }

  run_on(
      first, kOp, [&] { cpu::adam_step(ptrs, formats, args); },
      [&] { cuda::adam_step(ptrs, formats, args, stream); });
}

void adam_step(const std::vector<AdamTensors>& tensors, const AdamHyper& hyper, int64_t step,
               const TensorView* step_tensor, const TensorView& found_inf, const TensorView& amax, Stream stream) {
  const AdamPlan plan(tensors);
  std::vector<TensorView> grads;
  std::vector<std::optional<TensorView>> grad_scale_invs;
  grads.reserve(tensors.size());
  grad_scale_invs.reserve(tensors.size());
  for (const AdamTensors& t : tensors) {
    grads.push_back(t.grad);
    grad_scale_invs.push_back(t.grad_scale_inv);
  }
  plan.step(grads, grad_scale_invs, hyper, step, step_tensor, found_inf, amax, stream);
}

}  // namespace fp8amp
