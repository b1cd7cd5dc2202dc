// CPU reference of the Adam step: the readable definition of correct for adam_cuda.cu. It runs
// the same steps as the CUDA path (optim.h): amax pass, skip decision, store pass, commit. Every
// write of a pass goes to the tensors of that pass alone, and the commit comes last, so the order
// of the tensors does not matter (param_amax, read by pass 1, is written by the commit).

#include <algorithm>
#include <type_traits>

#include "common/dispatch.h"
#include "optim/adam_kernels.h"

namespace fp8amp {
namespace cpu {

namespace {

using numerics::amax_from_key;
using numerics::amax_key;
using numerics::to_float;

// code * scale_inv for a scaled format, the value itself otherwise.
template <class T>
float dequantize(T x, const float* scale_inv) {
  const float f = to_float(x);
  return scale_inv != nullptr ? rn::mul(f, *scale_inv) : f;
}

// v * b2 of element j of tensor t (optim.h): the stored v times exp_avg_sq_factor.
template <class V>
float decayed_exp_avg_sq(const AdamTensorPtrs& t, int64_t j, const AdamConstants& c) {
  const float scale_inv = t.exp_avg_sq_scale_inv != nullptr ? *t.exp_avg_sq_scale_inv : 1.0f;
  return rn::mul(to_float(static_cast<const V*>(t.exp_avg_sq)[j]), exp_avg_sq_factor(scale_inv, c.beta2));
}

// The stored form of x: itself in float32, else quantize(x * scale) (saturating, RNE).
template <class T>
T store(float x, float scale) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return numerics::quantize_to<T>(rn::mul(x, scale));
  }
}

// Element j's new master value p stored with stochastic rounding (optim.h), from its tensor's
// random stream: a float16 master's; other params store as store() does.
template <class P>
P store_stochastic(float p, float scale, RoundingStream stream, int64_t j) {
  if constexpr (std::is_same_v<P, numerics::fp16>) {
    const uint32_t bits = pair_random_bits(stream, static_cast<uint32_t>(static_cast<uint64_t>(j) / 2));
    return numerics::quantize_fp16_stochastic(rn::mul(p, scale), j % 2 == 0 ? bits : bits >> 16);
  } else {
    return store<P>(p, scale);
  }
}

// The scale_inv of grad element j: the grad's one, or that of j's block.
const float* grad_scale_inv(const AdamTensorPtrs& t, int64_t j) {
  if (t.grad_blocks_per_row == 0) return t.grad_scale_inv;
  const auto run = static_cast<uint32_t>(j / kGradBlock);
  return t.grad_scale_inv + grad_block_index(run, run / t.grad_blocks_per_row, t.grad_blocks_per_row);
}

// Element j of tensor t: the dequantized grad and the update.
template <class G, class P, class M, class V>
AdamUpdate element(const AdamTensorPtrs& t, int64_t j, const AdamConstants& c, float* grad) {
  *grad = dequantize(static_cast<const G*>(t.grad)[j], grad_scale_inv(t, j));
  return adam_update(dequantize(static_cast<const P*>(t.param)[j], t.param_scale_inv), *grad,
                     dequantize(static_cast<const M*>(t.exp_avg)[j], t.exp_avg_scale_inv),
                     decayed_exp_avg_sq<V>(t, j, c), c);
}

// Pass 1: the amaxes of tensor t's new values, into its row; with a kept master amax
// (kept_param_bound), the master left unread and the param column the scale grid's top of the
// bound on |p'| (scale_grid_top).
template <class G, class P, class M, class V>
void amax_pass(const AdamTensorPtrs& t, const AdamConstants& c, float* row) {
  const float a_d = kept_param_bound(t, c);
  // An FP8 grad with one scale_inv: its column is the largest |code| times |scale_inv| (optim.h).
  const bool grad_from_codes = numerics::kIsFp8<G> && t.grad_blocks_per_row == 0;
  uint32_t keys[kAdamAmaxColumns] = {};
  for (int64_t j = 0; j < t.numel; ++j) {
    const G code = static_cast<const G*>(t.grad)[j];
    const float g = dequantize(code, grad_scale_inv(t, j));
    const float p = a_d >= 0.0f ? 0.0f : dequantize(static_cast<const P*>(t.param)[j], t.param_scale_inv);
    AdamMoments mo = adam_moments(p, g, dequantize(static_cast<const M*>(t.exp_avg)[j], t.exp_avg_scale_inv),
                                  decayed_exp_avg_sq<V>(t, j, c), c);
    if (a_d >= 0.0f) mo = bound_moments(mo, a_d);
    keys[kAdamAmaxGrad] = std::max(keys[kAdamAmaxGrad], amax_key(grad_from_codes ? to_float(code) : g));
    keys[kAdamAmaxExpAvg] = std::max(keys[kAdamAmaxExpAvg], amax_key(mo.exp_avg));
    keys[kAdamAmaxExpAvgSq] = std::max(keys[kAdamAmaxExpAvgSq], amax_key(mo.exp_avg_sq));
    const float param = adam_param(mo, c);
    keys[kAdamAmaxParam] = std::max(keys[kAdamAmaxParam], amax_key(a_d >= 0.0f ? scale_grid_top(param) : param));
  }
  for (int col = 0; col < kAdamAmaxColumns; ++col) row[col] = amax_from_key(keys[col]);
  if (grad_from_codes) row[kAdamAmaxGrad] = rn::mul(row[kAdamAmaxGrad], std::fabs(*t.grad_scale_inv));
}

// Pass 2: recompute and store tensor t (the call's tensor `index`) with its new scales; the exact
// |p'| into row's new_param, or with stochastic rounding (a float16 master) the largest stored magnitude.
template <class G, class P, class M, class V>
void store_pass(const AdamTensorPtrs& t, const AdamConstants& c, const AdamScales& s, const AdamArgs& args,
                int64_t step, uint32_t index, float* row) {
  const bool stochastic = std::is_same_v<P, numerics::fp16> && args.hyper.stochastic_rounding;
  RoundingStream stream{};
  uint32_t new_param_key = 0;
  for (int64_t j = 0; j < t.numel; ++j) {
    float g;
    const AdamUpdate u = element<G, P, M, V>(t, j, c, &g);
    static_cast<M*>(t.exp_avg)[j] = store<M>(u.exp_avg, s.exp_avg.scale);
    static_cast<V*>(t.exp_avg_sq)[j] = store<V>(u.exp_avg_sq, s.exp_avg_sq.scale);
    const auto pair = static_cast<uint64_t>(j) / 2;
    if (stochastic && static_cast<uint32_t>(pair) == 0) {  // j = 0, and where the high bits of j / 2 change
      stream = rounding_stream(args.hyper.rounding_seed, step, index, static_cast<uint32_t>(pair >> 32));
    }
    const P p = stochastic ? store_stochastic<P>(u.param, s.param.scale, stream, j)
                           : store<P>(u.param, s.param.scale);
    static_cast<P*>(t.param)[j] = p;
    const float stored = std::is_same_v<P, float> ? u.param : rn::mul(to_float(p), s.param.scale_inv);
    new_param_key = std::max(new_param_key, amax_key(stochastic ? stored : u.param));
    if (t.weight_fp8 != nullptr) {
      static_cast<numerics::fp8_e4m3*>(t.weight_fp8)[j] = store<numerics::fp8_e4m3>(stored, s.weight.scale);
    }
  }
  row[kAdamAmaxNewParam] = amax_from_key(new_param_key);
}

}  // namespace

void adam_step(const std::vector<AdamTensorPtrs>& tensors, const std::vector<AdamFormats>& formats,
               const AdamArgs& args) {
  const int64_t t = call_step(args);
  const AdamConstants c = adam_constants(args.hyper, t);
  const size_t n = tensors.size();

  // Pass 1 and the skip decision.
  bool nonfinite = false;
  for (size_t i = 0; i < n; ++i) {
    float* row = args.amax + i * kAdamAmaxColumns;
    visit_formats(formats[i], [&](auto g, auto p, auto m, auto v) {
      amax_pass<decltype(g), decltype(p), decltype(m), decltype(v)>(tensors[i], c, row);
    });
    for (int col = 0; col < kAdamAmaxColumns; ++col) nonfinite = nonfinite || is_nonfinite_key(amax_key(row[col]));
  }
  if (nonfinite) *args.found_inf = 1.0f;
  if (*args.found_inf != 0.0f) return;

  // Pass 2, with the old scales still in place.
  for (size_t i = 0; i < n; ++i) {
    float* row = args.amax + i * kAdamAmaxColumns;
    const AdamScales s = adam_new_scales(tensors[i], row, args.hyper.margin);
    visit_formats(formats[i], [&](auto g, auto p, auto m, auto v) {
      store_pass<decltype(g), decltype(p), decltype(m), decltype(v)>(tensors[i], c, s, args, t,
                                                                      static_cast<uint32_t>(i), row);
    });
  }

  // Commit.
  for (size_t i = 0; i < n; ++i) commit_tensor(tensors[i], args.amax + i * kAdamAmaxColumns, args.hyper.margin);
  if (args.step_tensor != nullptr) *args.step_tensor = rn::add(*args.step_tensor, 1.0f);
}

}  // namespace cpu
}  // namespace fp8amp
