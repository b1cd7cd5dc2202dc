// torch.library registration of the fused Adam/AdamW step (fp8amp/optim.h): argument plumbing only.
//
//   adam_step(params!, grads, exp_avgs!, exp_avg_sqs!, <scale lists>, step_counts!, param_amaxes!, *,
//             lr, beta1, beta2, eps, weight_decay, adamw, maximize, step=0, step_tensor!=None,
//             found_inf!=None, margin=0, stochastic_rounding=False, rounding_seed=0) -> amax [n, 5]
//
// Updates every listed tensor in place on its device with no host sync. Each scale list is either
// empty (no tensor of the call has that scale) or holds one entry per param: a float32 [1] tensor
// where the tensor's format is scaled, None where it is not (optim.h says which formats are); a
// scale list (not a scale_inv one) may also be None, or empty, where the format is scaled: the op
// then derives the old scale from the scale_inv. step_counts, empty or one entry per param (a
// float32 [1] count, or None), are incremented with step_tensor. param_amaxes, empty or one entry
// per param (float32 [1] or None): the kept master amaxes (optim.h, "Kept master amax").
// found_inf (float32 [1]): skip flag, in/out; None gives the op a zeroed one of its own.
// Returns the amax of the new values, float32 [n, 5]: |grad|, |exp_avg'|, exp_avg_sq', |param'| (or
// its bound), |param'| (optim.h's columns).
//
//   torch.classes.fp8amp.AdamPlan(params, exp_avgs, exp_avg_sqs, <the scale lists but grad_scale_invs>,
//                                 step_counts, param_amaxes)
//   plan.step(grads, grad_scale_invs, lr, beta1, beta2, eps, weight_decay, adamw, maximize, step,
//             step_tensor, found_inf, margin, stochastic_rounding, rounding_seed) -> amax [n, 5], or None
//
// The same step over buffers checked once (fp8amp/optim.h's AdamPlan), for a caller that repeats
// it: each step passes only its grads and numbers. The plan holds its tensors (they live as long
// as it does); a step finds none of them with other storage, shape or dtype than when the plan was
// made (a `.data` swap, a resize), or it does nothing and returns None: make a new plan.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
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

// The per-param optional lists of the schema but grad_scale_invs, in its order.
struct OptionalLists {
  const OptionalTensorList &param_scales, &param_scale_invs, &exp_avg_scales, &exp_avg_scale_invs,
      &exp_avg_sq_scales, &exp_avg_sq_scale_invs, &weights_fp8, &weight_scales, &weight_scale_invs, &step_counts,
      &param_amaxes;
};

// The views of tensor i's buffers but its grad.
AdamTensors buffers(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    const OptionalLists& s, size_t i) {
  const size_t n = params.size();
  AdamTensors t;
  t.param = view(params[i], kOp, ListItem("params", i).c_str());
  t.exp_avg = view(exp_avgs[i], kOp, ListItem("exp_avgs", i).c_str());
  t.exp_avg_sq = view(exp_avg_sqs[i], kOp, ListItem("exp_avg_sqs", i).c_str());
  t.param_scale = entry(s.param_scales, i, n, "param_scales");
  t.param_scale_inv = entry(s.param_scale_invs, i, n, "param_scale_invs");
  t.exp_avg_scale = entry(s.exp_avg_scales, i, n, "exp_avg_scales");
  t.exp_avg_scale_inv = entry(s.exp_avg_scale_invs, i, n, "exp_avg_scale_invs");
  t.exp_avg_sq_scale = entry(s.exp_avg_sq_scales, i, n, "exp_avg_sq_scales");
  t.exp_avg_sq_scale_inv = entry(s.exp_avg_sq_scale_invs, i, n, "exp_avg_sq_scale_invs");
  t.weight_fp8 = entry(s.weights_fp8, i, n, "weights_fp8");
  t.weight_scale = entry(s.weight_scales, i, n, "weight_scales");
  t.weight_scale_inv = entry(s.weight_scale_invs, i, n, "weight_scale_invs");
  t.step_count = entry(s.step_counts, i, n, "step_counts");
  t.param_amax = entry(s.param_amaxes, i, n, "param_amaxes");
  return t;
}

AdamHyper hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw, bool maximize,
                int64_t margin, bool stochastic_rounding, int64_t rounding_seed) {
  AdamHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adamw = adamw;
  h.maximize = maximize;
  h.margin = narrow_int(margin, kOp, "margin");
  h.stochastic_rounding = stochastic_rounding;
  h.rounding_seed = static_cast<uint64_t>(rounding_seed);  // (its bits: a negative seed is a seed too)
  return h;
}

at::Tensor adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     const OptionalTensorList& param_scales, const OptionalTensorList& param_scale_invs,
                     const OptionalTensorList& grad_scale_invs, const OptionalTensorList& exp_avg_scales,
                     const OptionalTensorList& exp_avg_scale_invs, const OptionalTensorList& exp_avg_sq_scales,
                     const OptionalTensorList& exp_avg_sq_scale_invs, const OptionalTensorList& weights_fp8,
                     const OptionalTensorList& weight_scales, const OptionalTensorList& weight_scale_invs,
                     const OptionalTensorList& step_counts, const OptionalTensorList& param_amaxes, double lr,
                     double beta1, double beta2, double eps,
                     double weight_decay, bool adamw, bool maximize, int64_t step,
                     const std::optional<at::Tensor>& step_tensor,
                     const std::optional<at::Tensor>& found_inf, int64_t margin, bool stochastic_rounding,
                     int64_t rounding_seed) {
  const size_t n = params.size();
  at::Tensor amax = amax_like(params);
  const at::Tensor found = found_inf ? *found_inf : at::zeros({1}, amax.options());
  const OptionalLists lists{param_scales,      param_scale_invs,      exp_avg_scales, exp_avg_scale_invs,
                            exp_avg_sq_scales, exp_avg_sq_scale_invs, weights_fp8,    weight_scales,
                            weight_scale_invs, step_counts,       param_amaxes};
  call(amax, [&](Stream stream) {
    check_length(grads.size(), n, "grads");
    check_length(exp_avgs.size(), n, "exp_avgs");
    check_length(exp_avg_sqs.size(), n, "exp_avg_sqs");
    std::vector<AdamTensors> tensors(n);
    for (size_t i = 0; i < n; ++i) {
      tensors[i] = buffers(params, exp_avgs, exp_avg_sqs, lists, i);
      tensors[i].grad = view(grads[i], kOp, ListItem("grads", i).c_str());
      tensors[i].grad_scale_inv = entry(grad_scale_invs, i, n, "grad_scale_invs");
    }
    const auto step_view = optional_view(step_tensor, kOp, "step_tensor");
    fp8amp::adam_step(tensors,
                      hyper(lr, beta1, beta2, eps, weight_decay, adamw, maximize, margin, stochastic_rounding,
                            rounding_seed),
                      step,
                      step_view ? &*step_view : nullptr, view(found, kOp, "found_inf"), view(amax, kOp, "amax"),
                      stream);
  });
  return amax;
}

// torch.classes.fp8amp.AdamPlan: the core's plan and the tensors it was made from.
class TorchAdamPlan : public torch::CustomClassHolder {
 public:
  TorchAdamPlan(std::vector<at::Tensor> params, std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                OptionalTensorList param_scales, OptionalTensorList param_scale_invs,
                OptionalTensorList exp_avg_scales, OptionalTensorList exp_avg_scale_invs,
                OptionalTensorList exp_avg_sq_scales, OptionalTensorList exp_avg_sq_scale_invs,
                OptionalTensorList weights_fp8, OptionalTensorList weight_scales, OptionalTensorList weight_scale_invs,
                OptionalTensorList step_counts, OptionalTensorList param_amaxes)
      : plan_(translating_errors([&] {
          const size_t n = params.size();
          check_length(exp_avgs.size(), n, "exp_avgs");
          check_length(exp_avg_sqs.size(), n, "exp_avg_sqs");
          const OptionalLists lists{param_scales,      param_scale_invs,      exp_avg_scales, exp_avg_scale_invs,
                                    exp_avg_sq_scales, exp_avg_sq_scale_invs, weights_fp8,    weight_scales,
                                    weight_scale_invs, step_counts,       param_amaxes};
          std::vector<AdamTensors> tensors(n);
          for (size_t i = 0; i < n; ++i) tensors[i] = buffers(params, exp_avgs, exp_avg_sqs, lists, i);
          return AdamPlan(tensors);
        })) {
    for (const auto* list : {&params, &exp_avgs, &exp_avg_sqs}) {
      for (const at::Tensor& t : *list) hold(t);
    }
    for (const OptionalTensorList* list : {&param_scales, &param_scale_invs, &exp_avg_scales, &exp_avg_scale_invs,
                                           &exp_avg_sq_scales, &exp_avg_sq_scale_invs, &weights_fp8, &weight_scales,
                                           &weight_scale_invs, &step_counts, &param_amaxes}) {
      for (const std::optional<at::Tensor>& t : *list) {
        if (t) hold(*t);
      }
    }
  }

  std::optional<at::Tensor> step(std::vector<at::Tensor> grads, OptionalTensorList grad_scale_invs, double lr,
                                 double beta1, double beta2, double eps, double weight_decay, bool adamw,
                                 bool maximize, int64_t step, std::optional<at::Tensor> step_tensor,
                                 std::optional<at::Tensor> found_inf, int64_t margin, bool stochastic_rounding,
                                 int64_t rounding_seed) {
    RECORD_FUNCTION("fp8amp::AdamPlan.step", std::vector<c10::IValue>());  // (a method: no dispatcher event)
    for (const Held& h : held_) {
      if (!h.unchanged()) return std::nullopt;
    }
    const size_t n = plan_.size();
    at::Tensor amax = at::empty({static_cast<int64_t>(n), int64_t{kAdamAmaxColumns}},
                                held_.front().tensor.options().dtype(at::kFloat));
    const at::Tensor found = found_inf ? *found_inf : at::zeros({1}, amax.options());
    call(amax, [&](Stream stream) {
      std::vector<TensorView> grad_views(grads.size());
      for (size_t i = 0; i < grads.size(); ++i) grad_views[i] = view(grads[i], kOp, ListItem("grads", i).c_str());
      std::vector<std::optional<TensorView>> scale_inv_views(grad_scale_invs.size());
      for (size_t i = 0; i < grad_scale_invs.size(); ++i) {
        scale_inv_views[i] = entry(grad_scale_invs, i, grad_scale_invs.size(), "grad_scale_invs");
      }
      const auto step_view = optional_view(step_tensor, kOp, "step_tensor");
      plan_.step(grad_views, scale_inv_views,
                 hyper(lr, beta1, beta2, eps, weight_decay, adamw, maximize, margin, stochastic_rounding,
                       rounding_seed),
                 step, step_view ? &*step_view : nullptr, view(found, kOp, "found_inf"), view(amax, kOp, "amax"),
                 stream);
    });
    return amax;
  }

 private:
  // A tensor of the plan, and its storage, dtype and sizes when the plan was made.
  struct Held {
    at::Tensor tensor;
    const void* data;
    at::ScalarType dtype;
    std::vector<int64_t> sizes;
    bool unchanged() const {
      return tensor.data_ptr() == data && tensor.scalar_type() == dtype && tensor.sizes().equals(sizes) &&
             tensor.is_contiguous();
    }
  };

  void hold(const at::Tensor& t) { held_.push_back({t, t.data_ptr(), t.scalar_type(), t.sizes().vec()}); }

  AdamPlan plan_;
  std::vector<Held> held_;
};

// Meta kernel: the amax output's shape only, for torch.compile's fake tensors.
at::Tensor adam_step_meta(at::TensorList params, at::TensorList, at::TensorList, at::TensorList,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&,
                          const OptionalTensorList&, const OptionalTensorList&, const OptionalTensorList&, double,
                          double, double, double, double, bool, bool, int64_t,
                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, bool,
                          int64_t) {
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
      "Tensor(l!)?[] weight_scale_invs, Tensor(m!)?[] step_counts, Tensor(p!)?[] param_amaxes, *, float lr, "
      "float beta1, float beta2, "
      "float eps, float weight_decay, bool adamw, bool maximize, int step=0, Tensor(n!)? step_tensor=None, "
      "Tensor(o!)? found_inf=None, int margin=0, bool stochastic_rounding=False, int rounding_seed=0) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  m.class_<fp8amp::torch_binding::TorchAdamPlan>("AdamPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       fp8amp::torch_binding::OptionalTensorList, fp8amp::torch_binding::OptionalTensorList,
                       fp8amp::torch_binding::OptionalTensorList, fp8amp::torch_binding::OptionalTensorList,
                       fp8amp::torch_binding::OptionalTensorList, fp8amp::torch_binding::OptionalTensorList,
                       fp8amp::torch_binding::OptionalTensorList, fp8amp::torch_binding::OptionalTensorList,
                       fp8amp::torch_binding::OptionalTensorList, fp8amp::torch_binding::OptionalTensorList,
                       fp8amp::torch_binding::OptionalTensorList>())
      .def("step", &fp8amp::torch_binding::TorchAdamPlan::step, "",
           {torch::arg("grads"), torch::arg("grad_scale_invs"), torch::arg("lr"), torch::arg("beta1"),
            torch::arg("beta2"), torch::arg("eps"), torch::arg("weight_decay"), torch::arg("adamw"),
            torch::arg("maximize"), torch::arg("step"), torch::arg("step_tensor"), torch::arg("found_inf"),
            torch::arg("margin"), torch::arg("stochastic_rounding") = false, torch::arg("rounding_seed") = 0});
}

// The same function serves CPU and CUDA: the core dispatches on the tensors' device.
TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { m.impl("adam_step", fp8amp::torch_binding::adam_step); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { m.impl("adam_step", fp8amp::torch_binding::adam_step); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("adam_step",
         &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kAdamStep, fp8amp::torch_binding::adam_step_meta>::run);
}
TORCH_LIBRARY_IMPL(fp8amp, Autograd, m) { fp8amp::torch_binding::register_no_derivative(m, "adam_step"); }
