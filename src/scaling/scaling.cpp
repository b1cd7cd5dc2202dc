// Public scaling ops and the scaling arguments' checks (scaling_checks.h): validate the views
// once, then hand raw pointers to the CPU reference or the CUDA kernels (scaling_kernels.h).
#include "fp8amp/scaling.h"

#include <string>
#include <utility>

#include "common/op_args.h"
#include "common/run_on.h"
#include "fp8amp/error.h"
#include "scaling/scaling_checks.h"
#include "scaling/scaling_kernels.h"

namespace fp8amp {

void check_recipe(const ScalingRecipe& recipe, const char* op) {
  FP8AMP_CHECK_VALUE(recipe.margin >= 0 && recipe.margin <= numerics::kMaxScaleExponent, op,
                     "margin must be in [0, ", numerics::kMaxScaleExponent, "], got ", recipe.margin);
}

void check_warmup_steps(int warmup_steps, const char* op) {
  FP8AMP_CHECK_VALUE(warmup_steps >= 0, op, "warmup_steps must be >= 0, got ", warmup_steps);
}

int64_t amax_stride(const TensorView& amax, int64_t n, const char* op) {
  if (amax.dim() == 2) {
    FP8AMP_CHECK_VALUE(amax.shape[0] == n && amax.shape[1] >= 1, op, "amax must be [", n,
                       "] or [", n, ", k>=1], got ", amax.describe());
    return amax.shape[1];
  }
  FP8AMP_CHECK_VALUE(amax.dim() <= 1, op, "amax must be [", n, "] or [", n, ", k], got ", amax.describe());
  if (n == 1) {
    check::numel_at_least(amax, 1, op, "amax");
    return 0;
  }
  check::numel_is(amax, n, op, "amax");
  return 1;
}

ScalingPtrs scaling_ptrs(const Scaling& s, int64_t n, const TensorView& x, const char* op) {
  check_recipe(s.recipe, op);
  check_float32(s.scale, x, op, "scale");
  check::numel_is(s.scale, n, op, "scale");
  check_float32(s.amax, x, op, "amax");
  check_float32(s.scale_inv, x, op, "scale_inv");
  check::numel_is(s.scale_inv, n, op, "scale_inv");
  const int32_t* warmup_counter = nullptr;
  if (s.warmup_counter != nullptr) {
    check::dtype_is(*s.warmup_counter, DType::kInt32, op, "warmup_counter");
    check::contiguous(*s.warmup_counter, op, "warmup_counter");
    check::same_device(*s.warmup_counter, x, op, "warmup_counter", "x");
    check::numel_is(*s.warmup_counter, n, op, "warmup_counter");
    check_warmup_steps(s.warmup_steps, op);
    warmup_counter = s.warmup_counter->ptr<const int32_t>();
  }
  return ScalingPtrs{s.scale.ptr<const float>(), s.amax.ptr<float>(), amax_stride(s.amax, n, op),
                     s.scale_inv.ptr<float>(), warmup_counter, s.warmup_steps, s.recipe.margin, s.recipe.pow2_scale};
}

float format_max(DType dtype) {
  check::scaled_format(dtype, "format_max", "dtype");
  return dtype_info(dtype).max_finite;
}

void compute_scale(const TensorView& amax_in, const TensorView& scale, const TensorView& scale_inv, float fmax,
                   const ScalingRecipe& recipe, Stream stream) {
  const char* op = "compute_scale";
  check::dtype_is(scale, DType::kFloat32, op, "scale");
  check::contiguous(scale, op, "scale");
  const int64_t n = scale.numel();
  check_float32(amax_in, scale, op, "amax");
  check_float32(scale_inv, scale, op, "scale_inv");
  check::numel_is(scale_inv, n, op, "scale_inv");
  const int64_t stride = amax_stride(amax_in, n, op);
  FP8AMP_CHECK_VALUE(fmax > 0.0f && numerics::is_finite(fmax), op, "fmax must be positive and finite, got ", fmax);
  check_recipe(recipe, op);
  check::disjoint_writes({{&scale, "scale"}, {&scale_inv, "scale_inv"}}, {{&amax_in, "amax"}}, op);
  float* sc = scale.ptr<float>();
  float* si = scale_inv.ptr<float>();
  const float* a = amax_in.ptr<const float>();
  run_on(
      scale, op, [&] { cpu::compute_scale(a, stride, sc, si, n, fmax, recipe.margin, recipe.pow2_scale); },
      [&] { cuda::compute_scale(a, stride, sc, si, n, fmax, recipe.margin, recipe.pow2_scale, stream); });
}

namespace {

// One state's checks (names: "amax_history" ... or "amax_histories[3]" ...), and its slice.
DelayedScalingSlice delayed_state(const TensorView& amax_history, const TensorView& scale, const TensorView& scale_inv,
                                  const TensorView& counter, const char* op, Arity arity, size_t i) {
  const std::string hist_name = element_name(arity, "amax_history", "amax_histories", i);
  const std::string scale_name = element_name(arity, "scale", "scales", i);
  const std::string scale_inv_name = element_name(arity, "scale_inv", "scale_invs", i);
  const std::string counter_name = element_name(arity, "counter", "counters", i);
  check::dtype_is(amax_history, DType::kFloat32, op, hist_name.c_str());
  check::contiguous(amax_history, op, hist_name.c_str());
  check::dim_is(amax_history, 2, op, hist_name.c_str());
  const int64_t n = amax_history.shape[0];
  const int64_t h = amax_history.shape[1];
  FP8AMP_CHECK_VALUE(h >= 1, op, hist_name, " must be [n, H] with H >= 1, got ", amax_history.describe());
  for (const auto& [t, arg] : {std::pair{&scale, scale_name.c_str()}, std::pair{&scale_inv, scale_inv_name.c_str()}}) {
    check::dtype_is(*t, DType::kFloat32, op, arg);
    check::contiguous(*t, op, arg);
    check::numel_is(*t, n, op, arg);
    check::same_device(*t, amax_history, op, arg, hist_name.c_str());
  }
  check::dtype_is(counter, DType::kInt32, op, counter_name.c_str());
  check::contiguous(counter, op, counter_name.c_str());
  check::numel_is(counter, n, op, counter_name.c_str());
  check::same_device(counter, amax_history, op, counter_name.c_str(), hist_name.c_str());
  return DelayedScalingSlice{amax_history.ptr<float>(), scale.ptr<float>(), scale_inv.ptr<float>(),
                             counter.ptr<int32_t>(), n, h};
}

void update_delayed_impl(const std::vector<DelayedScalingSlice>& states, const TensorView& device_of, float fmax,
                         const ScalingRecipe& recipe, Stream stream, const char* op) {
  FP8AMP_CHECK_VALUE(fmax > 0.0f && numerics::is_finite(fmax), op, "fmax must be positive and finite, got ", fmax);
  check_recipe(recipe, op);
  run_on(
      device_of, op, [&] { cpu::update_delayed_scaling(states, fmax, recipe.margin, recipe.pow2_scale); },
      [&] { cuda::update_delayed_scaling(states, fmax, recipe.margin, recipe.pow2_scale, stream); });
}

}  // namespace

void update_delayed_scaling(const TensorView& amax_history, const TensorView& scale, const TensorView& scale_inv,
                            const TensorView& counter, float fmax, const ScalingRecipe& recipe, Stream stream) {
  const char* op = "update_delayed_scaling";
  const DelayedScalingSlice state = delayed_state(amax_history, scale, scale_inv, counter, op, Arity::kSingle, 0);
  // Every tensor is written: two sharing memory would race on the GPU and give wrong scales on both.
  check::disjoint_writes(
      {{&amax_history, "amax_history"}, {&scale, "scale"}, {&scale_inv, "scale_inv"}, {&counter, "counter"}}, {}, op);
  update_delayed_impl({state}, amax_history, fmax, recipe, stream, op);
}

void multi_update_delayed_scaling(const std::vector<TensorView>& amax_histories, const std::vector<TensorView>& scales,
                                  const std::vector<TensorView>& scale_invs, const std::vector<TensorView>& counters,
                                  float fmax, const ScalingRecipe& recipe, Stream stream) {
  const char* op = "multi_update_delayed_scaling";
  const size_t n = amax_histories.size();
  FP8AMP_CHECK_VALUE(scales.size() == n && scale_invs.size() == n && counters.size() == n, op,
                     "amax_histories, scales, scale_invs and counters must hold as many tensors each, got ", n, ", ",
                     scales.size(), ", ", scale_invs.size(), " and ", counters.size());
  if (n == 0) return;
  std::vector<DelayedScalingSlice> states;
  states.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    states.push_back(delayed_state(amax_histories[i], scales[i], scale_invs[i], counters[i], op, Arity::kMulti, i));
    check::same_device(amax_histories[i], amax_histories[0], op,
                       element_name(Arity::kMulti, "", "amax_histories", i).c_str(), "amax_histories[0]");
  }
  // Every tensor is written: two sharing memory would race on the GPU.
  std::vector<const TensorView*> written;
  for (const auto* list : {&amax_histories, &scales, &scale_invs, &counters}) {
    for (const TensorView& t : *list) written.push_back(&t);
  }
  check::disjoint_writes(written, {}, {}, {}, op, [&](bool, size_t k) {
    static constexpr const char* kLists[] = {"amax_histories", "scales", "scale_invs", "counters"};
    return element_name(Arity::kMulti, "", kLists[k / n], k % n);
  });
  update_delayed_impl(states, amax_histories[0], fmax, recipe, stream, op);
}

}  // namespace fp8amp
