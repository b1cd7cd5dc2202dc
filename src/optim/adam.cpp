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

AdamTensorPtrs tensor_ptrs(const AdamTensors& t, const TensorView& first, size_t i, AdamFormats* formats) {
  const TensorView& p = t.param;
  const ListItem item_name("params", i);
  const char* pname = item_name.c_str();
  FP8AMP_CHECK_VALUE(one_of(p.dtype, {DType::kFloat32, DType::kFloat16}), kOp, pname,
                     " must be float32, or float16 with a scale (the FP16 master), got ", p.describe());
  check::contiguous(p, kOp, pname);
  check::same_device(p, first, kOp, pname, "params[0]");
  check_buffer(t.grad, p, ListItem("grads", i).c_str(),
               {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2},
               "float32, bfloat16, float16, float8_e4m3fn or float8_e5m2");
  check_buffer(t.exp_avg, p, ListItem("exp_avgs", i).c_str(), {DType::kFloat32, DType::kFloat8E4M3},
               "float32 or float8_e4m3fn");
  check_buffer(t.exp_avg_sq, p, ListItem("exp_avg_sqs", i).c_str(), {DType::kFloat32, DType::kFloat16}, "float32 or float16");
  if (t.weight_fp8) {
    check_buffer(*t.weight_fp8, p, ListItem("weights_fp8", i).c_str(), {DType::kFloat8E4M3}, "float8_e4m3fn");
  }

  AdamTensorPtrs r{};
  r.param = p.data;
  r.grad = t.grad.data;
  r.exp_avg = t.exp_avg.data;
  r.exp_avg_sq = t.exp_avg_sq.data;
  r.weight_fp8 = t.weight_fp8 ? t.weight_fp8->data : nullptr;
  r.numel = p.numel();

  const bool fp16_param = p.dtype == DType::kFloat16;
  const bool fp8_grad = is_fp8(t.grad.dtype);
  const bool fp8_m = t.exp_avg.dtype == DType::kFloat8E4M3;
  const bool fp16_v = t.exp_avg_sq.dtype == DType::kFloat16;
  const bool weight = t.weight_fp8.has_value();
  const char* param_why = fp16_param ? "its param is float16" : "its param is float32";
  const char* grad_why = fp8_grad ? "its grad is float8" : "its grad is not float8";
  const char* m_why = fp8_m ? "its exp_avg is float8_e4m3fn" : "its exp_avg is float32";
  const char* v_why = fp16_v ? "its exp_avg_sq is float16" : "its exp_avg_sq is float32";
  const char* w_why = weight ? "weights_fp8[i] is given" : "weights_fp8[i] is None";
  r.param_scale = scale_ptr<float*>(t.param_scale, fp16_param, p, "param_scales", i, param_why, ScaleArg::kScale);
  r.param_scale_inv = scale_ptr<float*>(t.param_scale_inv, fp16_param, p, "param_scale_invs", i, param_why);
  r.grad_scale_inv = grad_scale_inv_ptr(t.grad_scale_inv, fp8_grad, p, i, grad_why, &r.grad_blocks_per_row);
  r.exp_avg_scale = scale_ptr<float*>(t.exp_avg_scale, fp8_m, p, "exp_avg_scales", i, m_why, ScaleArg::kScale);
  r.exp_avg_scale_inv = scale_ptr<float*>(t.exp_avg_scale_inv, fp8_m, p, "exp_avg_scale_invs", i, m_why);
  r.exp_avg_sq_scale =
      scale_ptr<float*>(t.exp_avg_sq_scale, fp16_v, p, "exp_avg_sq_scales", i, v_why, ScaleArg::kScale);
  r.exp_avg_sq_scale_inv = scale_ptr<float*>(t.exp_avg_sq_scale_inv, fp16_v, p, "exp_avg_sq_scale_invs", i, v_why);
  r.weight_scale = scale_ptr<float*>(t.weight_scale, weight, p, "weight_scales", i, w_why, ScaleArg::kScale);
  r.weight_scale_inv = scale_ptr<float*>(t.weight_scale_inv, weight, p, "weight_scale_invs", i, w_why);
  *formats = AdamFormats{p.dtype, t.grad.dtype, t.exp_avg.dtype, t.exp_avg_sq.dtype, r.grad_blocks_per_row != 0};
  return r;
}

// Every buffer but the grads and their scales is rewritten in place, element by element, and read
// again in pass 2 (optim.h, "How"): two sharing memory, or a grad inside one of them, would give
// wrong values on the CPU and a race on the GPU. The grads may share memory with each other.
void check_disjoint(const std::vector<AdamTensors>& tensors, const TensorView* step_tensor, const TensorView& found_inf,
                    const TensorView& amax) {
  std::vector<const TensorView*> written, read;
  std::vector<std::pair<const char*, size_t>> written_at, read_at;  // (list, i), as the torch op names them
  const auto add = [](std::vector<const TensorView*>* views, std::vector<std::pair<const char*, size_t>>* at,
                      const TensorView* t, const char* list, size_t i) {
    if (t == nullptr) return;
    views->push_back(t);
    at->push_back({list, i});
  };
  const auto opt = [](const std::optional<TensorView>& t) { return t ? &*t : nullptr; };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamTensors& t = tensors[i];
    for (const auto& [view, list] : {std::pair{&t.param, "params"}, {&t.exp_avg, "exp_avgs"},
                                     {&t.exp_avg_sq, "exp_avg_sqs"}, {opt(t.param_scale), "param_scales"},
                                     {opt(t.param_scale_inv), "param_scale_invs"},
                                     {opt(t.exp_avg_scale), "exp_avg_scales"},
                                     {opt(t.exp_avg_scale_inv), "exp_avg_scale_invs"},
                                     {opt(t.exp_avg_sq_scale), "exp_avg_sq_scales"},
                                     {opt(t.exp_avg_sq_scale_inv), "exp_avg_sq_scale_invs"},
                                     {opt(t.weight_fp8), "weights_fp8"}, {opt(t.weight_scale), "weight_scales"},
                                     {opt(t.weight_scale_inv), "weight_scale_invs"}}) {
      add(&written, &written_at, view, list, i);
    }
    add(&read, &read_at, &t.grad, "grads", i);
    add(&read, &read_at, opt(t.grad_scale_inv), "grad_scale_invs", i);
  }
  check::disjoint_writes(written, read, {{step_tensor, "step_tensor"}, {&found_inf, "found_inf"}, {&amax, "amax"}}, {},
                         kOp, [&](bool is_written, size_t k) {
                           const auto& [list, i] = (is_written ? written_at : read_at)[k];
                           return std::string(ListItem(list, i).c_str());
                         });
}

}  // namespace

void adam_step(const std::vector<AdamTensors>& tensors, const AdamHyper& hyper, int64_t step,
               const TensorView* step_tensor, const TensorView& found_inf, const TensorView& amax, Stream stream) {
  FP8AMP_CHECK_VALUE(!tensors.empty(), kOp, "params must hold at least one tensor");
  check_hyper(hyper);
  const TensorView& first = tensors[0].param;
  const size_t n = tensors.size();
  std::vector<AdamTensorPtrs> ptrs(n);
  std::vector<AdamFormats> formats(n);
  for (size_t i = 0; i < n; ++i) ptrs[i] = tensor_ptrs(tensors[i], first, i, &formats[i]);

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
  check_disjoint(tensors, step_tensor, found_inf, amax);

  run_on(
      first, kOp, [&] { cpu::adam_step(ptrs, formats, args); },
      [&] { cuda::adam_step(ptrs, formats, args, stream); });
}

}  // namespace fp8amp
