// torch.library registration of the fused Adam/AdamW step (fp8amp/optim.h): argument plumbing only.
//
//   adam_step(params!, grads, exp_avgs!, exp_avg_sqs!, <scale lists>, *, lr, beta1, beta2, eps,
//             weight_decay, adamw, maximize, step=0, step_tensor!=None, found_inf!=None, margin=0)
//       -> amax [n, 4]
//
// Updates every listed tensor in place on its device with no host sync. Each scale list is either
// empty (no tensor of the call has that scale) or holds one entry per param: a float32 [1] tensor
// where the tensor's format is scaled, None where it is not (optim.h says which formats are); a
// scale list (not a scale_inv one) may also be None, or empty, where the format is scaled: the op
// then derives the old scale from the scale_inv.
// found_inf (float32 [1]): skip flag, in/out; None gives the op a zeroed one of its own.
// Returns the amax of the new values, float32 [n, 4]: |grad|, |exp_avg'|, exp_avg_sq', |param'|.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "binding_utils.h"
#include "meta_kernel.h"
#include "fp8amp/optim.h"

namespace fp8amp::torch_binding {
namespace {

constexpr const char* kOp = "adam_step";

using OptionalTensorList = c10::List<std::optional<at::Tensor>>;

void check_length(size_t size, size_t n, const char* list) {
  FP8AMP_CHECK_VALUE(size == n, kOp, list, " must hold one tensor per param (", n, "), got ", size);
}

// Entry i of a per-param list of optional tensors; an empty list is None for every param.
std::optional<TensorView> entry(const OptionalTensorList& list, size_t i, size_t n, const char* name) {
  if (list.empty()) return std::nullopt;
  FP8AMP_CHECK_VALUE(list.size() == n, kOp, name, " must be empty or hold one entry per param (", n, "), got ",
                     list.size());
  const std::optional<at::Tensor> t = list.get(i);
  if (!t.has_value()) return std::nullopt;
  return view(*t, kOp, ListItem(name, i).c_str());
}

at::Tensor amax_like(at::TensorList params) {
  const at::TensorOptions options =
      params.empty() ? at::TensorOptions() : params[0].options();
  return at::empty({static_cast<int64_t>(params.size()), int64_t{kAdamAmaxColumns}}, options.dtype(at::kFloat));
}

at::Tensor adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     const OptionalTensorList& param_scales, const OptionalTensorList& param_scale_invs,
                     const OptionalTensorList& grad_scale_invs, const OptionalTensorList& exp_avg_scales,
                     const OptionalTensorList& exp_avg_scale_invs, const OptionalTensorList& exp_avg_sq_scales,
                     const OptionalTensorList& exp_avg_sq_scale_invs, const OptionalTensorList& weights_fp8,
                     const OptionalTensorList& weight_scales, const OptionalTensorList& weight_scale_invs,
                     double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                     bool maximize, int64_t step, const std::optional<at::Tensor>& step_tensor,
                     const std::optional<at::Tensor>& found_inf, int64_t margin) {
  const size_t n = params.size();
  at::Tensor amax = amax_like(params);
  const at::Tensor found = found_inf ? *found_inf : at::zeros({1}, amax.options());
  call(amax, [&](Stream stream) {
    check_length(grads.size(), n, "grads");
    check_length(exp_avgs.size(), n, "exp_avgs");
    check_length(exp_avg_sqs.size(), n, "exp_avg_sqs");
    std::vector<AdamTensors> tensors(n);
    for (size_t i = 0; i < n; ++i) {
      AdamTensors& t = tensors[i];
      t.param = view(params[i], kOp, ListItem("params", i).c_str());
      t.grad = view(grads[i], kOp, ListItem("grads", i).c_str());
      t.exp_avg = view(exp_avgs[i], kOp, ListItem("exp_avgs", i).c_str());
      t.exp_avg_sq = view(exp_avg_sqs[i], kOp, ListItem("exp_avg_sqs", i).c_str());
      t.param_scale = entry(param_scales, i, n, "param_scales");
      t.param_scale_inv = entry(param_scale_invs, i, n, "param_scale_invs");
      t.grad_scale_inv = entry(grad_scale_invs, i, n, "grad_scale_invs");
      t.exp_avg_scale = entry(exp_avg_scales, i, n, "exp_avg_scales");
      t.exp_avg_scale_inv = entry(exp_avg_scale_invs, i, n, "exp_avg_scale_invs");
      t.exp_avg_sq_scale = entry(exp_avg_sq_scales, i, n, "exp_avg_sq_scales");
      t.exp_avg_sq_scale_inv = entry(exp_avg_sq_scale_invs, i, n, "exp_avg_sq_scale_invs");
      t.weight_fp8 = entry(weights_fp8, i, n, "weights_fp8");
      t.weight_scale = entry(weight_scales, i, n, "weight_scales");
      t.weight_scale_inv = entry(weight_scale_invs, i, n, "weight_scale_invs");
    }
    AdamHyper hyper;
    hyper.lr = lr;
    hyper.beta1 = beta1;
    hyper.beta2 = beta2;
    hyper.eps = eps;
    hyper.weight_decay = weight_decay;
    hyper.adamw = adamw;
    hyper.maximize = maximize;
    hyper.margin = narrow_int(margin, kOp, "margin");
    const auto step_view = optional_view(step_tensor, kOp, "step_tensor");
    fp8amp::adam_step(tensors, hyper, step, step_view ? &*step_view : nullptr, view(found, kOp, "found_inf"),
                      view(amax, kOp, "amax"), stream);
  });
  return amax;
}

// Meta kernel: the amax output's shape only, for torch.compile's fake tensors.
at::Tensor adam_step_meta(at::TensorList params, at::TensorList, at::TensorList, at::TensorList,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&,
                          const OptionalTensorList&, double, double, double, double, double, bool, bool, int64_t,
                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t) {
  return amax_like(params);
}

constexpr char kAdamStep[] = "adam_step";

}  // namespace
}  // namespace fp8amp::torch_binding

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)?[] param_scales, Tensor(e!)?[] param_scale_invs, Tensor?[] grad_scale_invs, "
      "Tensor(f!)?[] exp_avg_scales, Tensor(g!)?[] exp_avg_scale_invs, Tensor(h!)?[] exp_avg_sq_scales, "
      "Tensor(i!)?[] exp_avg_sq_scale_invs, Tensor(j!)?[] weights_fp8, Tensor(k!)?[] weight_scales, "
      "Tensor(l!)?[] weight_scale_invs, *, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw, bool maximize, int step=0, Tensor(m!)? step_tensor=None, Tensor(n!)? found_inf=None, "
      "int margin=0) -> Tensor");
}

// The same function serves CPU and CUDA: the core dispatches on the tensors' device.
TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { m.impl("adam_step", fp8amp::torch_binding::adam_step); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { m.impl("adam_step", fp8amp::torch_binding::adam_step); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("adam_step",
         &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kAdamStep, fp8amp::torch_binding::adam_step_meta>::run);
}
