// What the Adam kernels see: raw pointers, validated by adam.cpp, and the element math shared by
// the CPU reference (adam_cpu.cpp) and the CUDA kernels (adam_cuda.cu). fp8amp/optim.h states the
// math; the functions here are its one implementation, so both backends agree bit for bit.
//
// Rounding is explicit: every operation goes through numerics.h's rn:: helpers (one IEEE
// rounding each, never contracted into an fma, on host and device alike).
#pragma once

#include <cstdint>
#include <vector>

#include "common/dispatch.h"
#include "common/fast_divide.h"
#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/optim.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// ------------------------------------------------------------------------------------------------
// Per-step constants (optim.h, "Per step, once").

struct AdamConstants {
  float decay;         // f32(1 - lr * wd), AdamW
  float weight_decay;  // f32(wd), Adam
  float w1;            // f32(1 - beta1)
  float w1m1;          // w1 - 1
  bool lerp_small;     // |w1| < 0.5: torch's lerp branch
  float beta2;         // f32(beta2)
  float w2;            // f32(1 - beta2)
  float neg_step;      // f32(-(lr / bc1))
  float inv_bc2_sqrt;  // f32(1 / sqrt(bc2))
  float eps;           // f32(eps)
  bool adamw;
  bool maximize;
  bool decays;         // weight_decay != 0
};

// base^e for e >= 0 by squaring: a fixed sequence of float64 products.
FP8AMP_HD double pow_int(double base, int64_t e) {
  double result = 1.0;
  while (e > 0) {
    if (e & 1) result = rn::mul(result, base);
    e >>= 1;
    if (e > 0) base = rn::mul(base, base);
  }
  return result;
}

// The step number t of a device counter holding the steps taken so far (optim.h).
FP8AMP_HD int64_t step_number(float steps_taken) {
  // Counts beyond 2^53 are not integers anyway; torch keeps them in float32 (exact to 2^24).
  if (!(steps_taken >= 0.0f)) return 1;
  if (steps_taken >= 9.0e15f) return static_cast<int64_t>(9.0e15);
  return static_cast<int64_t>(steps_taken) + 1;
}

FP8AMP_HD AdamConstants adam_constants(const AdamHyper& h, int64_t t) {
  AdamConstants c;
  c.decay = rn::to_float(rn::sub(1.0, rn::mul(h.lr, h.weight_decay)));
  c.weight_decay = rn::to_float(h.weight_decay);
  c.w1 = rn::to_float(rn::sub(1.0, h.beta1));
  c.w1m1 = rn::sub(c.w1, 1.0f);
  c.lerp_small = (c.w1 < 0.0f ? -c.w1 : c.w1) < 0.5f;
  c.beta2 = rn::to_float(h.beta2);
  c.w2 = rn::to_float(rn::sub(1.0, h.beta2));
  const double bc1 = rn::sub(1.0, pow_int(h.beta1, t));
  const double bc2 = rn::sub(1.0, pow_int(h.beta2, t));
  c.neg_step = rn::to_float(-rn::div(h.lr, bc1));
  c.inv_bc2_sqrt = rn::to_float(rn::div(1.0, rn::sqrt(bc2)));
  c.eps = rn::to_float(h.eps);
  c.adamw = h.adamw;
  c.maximize = h.maximize;
  c.decays = h.weight_decay != 0.0;
  return c;
}

// ------------------------------------------------------------------------------------------------
// Element math (optim.h, "Per element"). Inputs are the dequantized values.

struct AdamUpdate {
  float exp_avg;     // m'
  float exp_avg_sq;  // v'
  float param;       // p'
};

// The update up to the denominator, in two pieces so that the CUDA amax pass can bound |p'|
// without the IEEE sqrt and divisions (adam_bound.h) and evaluate adam_param only where needed.
struct AdamMoments {
  float param;       // p after AdamW's decay: the addend of p'
  float exp_avg;     // m'
  float exp_avg_sq;  // v'
  float step;        // neg_step * m': the numerator of the update
};

// What a stored v is multiplied by to give v * b2 (optim.h): its scale_inv (1 unscaled) times b2.
FP8AMP_HD float exp_avg_sq_factor(float exp_avg_sq_scale_inv, float b2) { return rn::mul(exp_avg_sq_scale_inv, b2); }

// v_b2: v * b2, the stored v times exp_avg_sq_factor.
FP8AMP_HD AdamMoments adam_moments(float p, float g, float m, float v_b2, const AdamConstants& c) {
  if (c.maximize) g = -g;
  if (c.decays) {
    if (c.adamw) {
      p = rn::mul(p, c.decay);
    } else {
      g = rn::fma(p, c.weight_decay, g);
    }
  }
  const float d1 = rn::sub(g, m);
  AdamMoments r;
  r.param = p;
  r.exp_avg = c.lerp_small ? rn::fma(c.w1, d1, m) : rn::fma(c.w1m1, d1, g);
  r.exp_avg_sq = rn::fma(rn::mul(c.w2, g), g, v_b2);
  r.step = rn::mul(c.neg_step, r.exp_avg);
  return r;
}

// p' = p + step / den, den = fma(sqrt(v'), inv_bc2_sqrt, eps).
FP8AMP_HD float adam_param(const AdamMoments& mo, const AdamConstants& c) {
  const float den = rn::fma(rn::sqrt(mo.exp_avg_sq), c.inv_bc2_sqrt, c.eps);
  return rn::add(mo.param, rn::div(mo.step, den));
}

FP8AMP_HD AdamUpdate adam_update(float p, float g, float m, float v_b2, const AdamConstants& c) {
  const AdamMoments mo = adam_moments(p, g, m, v_b2, c);
  return {mo.exp_avg, mo.exp_avg_sq, adam_param(mo, c)};
}

// ------------------------------------------------------------------------------------------------
// Stochastic rounding of a float16 master (optim.h, "Stochastic rounding of the master").

// The random stream of the call's tensor `index` at step t, for the pairs of elements j / 2 whose
// high 32 bits are `high`: a key and an offset that pair_random_bits hashes the pair with.
struct RoundingStream {
  uint32_t key, offset;
};
FP8AMP_HD RoundingStream rounding_stream(uint64_t seed, int64_t t, uint32_t index, uint32_t high) {
  using numerics::random_bits;
  uint32_t s = random_bits(random_bits(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32));
  s = random_bits(s ^ static_cast<uint32_t>(t));
  const uint32_t key = random_bits(random_bits(s ^ index) ^ high);
  return {key, random_bits(key ^ 0x9E3779B9u)};
}

// The random bits of the pair of elements holding `pair` (the low 32 bits of j / 2); an even j
// takes the low half, an odd one the high. Two hashes: with one, of pair ^ key, streams whose keys
// differ by d drew the same bits at pairs p and p ^ d, a whole tensor's bits shared whenever d
// was below its pair count; the offset added between them breaks that structure.
FP8AMP_HD uint32_t pair_random_bits(RoundingStream stream, uint32_t pair) {
  return numerics::random_bits(numerics::random_bits(pair ^ stream.key) + stream.offset);
}

// ------------------------------------------------------------------------------------------------
// One tensor's buffers. A scale_inv pointer is null iff its tensor is not in a scaled format (and
// the weight pointers iff there is no FP8 weight copy); a scaled tensor's scale pointer may be
// null too: its old scale is then 1 / scale_inv, and only scale_inv is written. An FP8 grad has
// one scale_inv, or one per 128 x 128 block of its [rows, 128 * grad_blocks_per_row] elements
// (grad_blocks_per_row != 0).
struct AdamTensorPtrs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* weight_fp8;  // float8_e4m3fn or nullptr
  const float* grad_scale_inv;
  float* param_scale;
  float* param_scale_inv;
  float* exp_avg_scale;
  float* exp_avg_scale_inv;
  float* exp_avg_sq_scale;
  float* exp_avg_sq_scale_inv;
  float* weight_scale;
  float* weight_scale_inv;
  float* step_count;  // this param's count of steps taken, or nullptr
  float* param_amax;  // the kept master amax (optim.h), or nullptr
  int64_t numel;
  uint32_t grad_blocks_per_row;  // 0: one grad scale_inv
};

// ------------------------------------------------------------------------------------------------
// Kept master amax (optim.h): pass 1 bounds |p'| without reading p.

// Whether pass 1 takes tensor t's kept amax instead of reading the master: not without a
// param_amax, nor for one that is NaN, inf or negative, nor with Adam's weight decay (which adds p
// to g, so m' and v' need it).
FP8AMP_HD bool uses_kept_amax(const AdamTensorPtrs& t, bool adamw, bool decays) {
  if (t.param_amax == nullptr || (decays && !adamw)) return false;
  const float a = *t.param_amax;
  return a >= 0.0f && a < numerics::bits_float(0x7F800000u);
}
// A_d, the bound on every |p_d| of tensor t from its kept amax; negative where pass 1 reads the master.
FP8AMP_HD float kept_param_bound(const AdamTensorPtrs& t, const AdamConstants& c) {
  if (!uses_kept_amax(t, c.adamw, c.decays)) return -1.0f;
  const float a = *t.param_amax;
  return c.decays ? rn::mul(a, c.decay < 0.0f ? -c.decay : c.decay) : a;
}

// The smallest m * 2^k >= x (k an integer) for the significand m of 448 (1.75) or of 65504
// (1.9990234375), for 2^-100 <= x <= 65504 * 2^112; x itself below (0 included), +inf above, NaN
// for NaN. Where x and its top lie in one interval between such values, the master's FP16 scale and
// its E4M3 copy's scale (from the FP16 max 65504 and the E4M3 max 448) come out as x would give
// them. Pass 1 with a kept amax folds this instead of each element's bound: only an element whose
// bound could pass the largest top so far needs its exact update, and Adam's updates, nearly
// equal for many elements, tie at the bound's precision but rarely straddle a top.
FP8AMP_HD float scale_grid_top(float x) {
  if (!(x >= 0x1p-100f)) return x;
  const uint32_t bits = numerics::float_bits(x);
  if (bits > 0x7F7FE000u) return numerics::bits_float(0x7F800000u);  // above 65504 * 2^112, inf
  const uint32_t exponent = bits & 0x7F800000u, mantissa = bits & 0x007FFFFFu;
  // 448's significand 1.75 (0x600000) below 65504's (0x7FE000): the top is the first one of this
  // binade at or above x, else 448's of the next binade.
  if (mantissa <= 0x600000u) return numerics::bits_float(exponent | 0x600000u);
  if (mantissa <= 0x7FE000u) return numerics::bits_float(exponent | 0x7FE000u);
  return numerics::bits_float((exponent + 0x00800000u) | 0x600000u);
}

// The moments whose adam_param is rn(A_d + |q|) >= |p'| (q = step / den as adam_param rounds it:
// den is >= 0 or NaN, so rn(|step| / den) = |q|), for pass 1 with a kept amax. m' and v' do not
// depend on p there, so p_d may be anything (the passes give 0).
FP8AMP_HD AdamMoments bound_moments(AdamMoments mo, float a_d) {
  mo.param = a_d;
  mo.step = mo.step < 0.0f ? -mo.step : mo.step;
  return mo;
}

// Block scales of a grad: its elements in runs of 128 (numbered run = e / 128, row by row; a run
// lies in one block), a row holding blocks_per_row runs. The block of `run`, which lies in `row`
// (= run / blocks_per_row, which the CUDA kernels compute with a FastDivisor).
constexpr int kGradBlock = 128;
FP8AMP_HD uint32_t grad_block_index(uint32_t run, uint32_t row, uint32_t blocks_per_row) {
  return (row / kGradBlock) * blocks_per_row + (run - row * blocks_per_row);
}

// The storage formats of one tensor; tensors of a call may mix them.
struct AdamFormats {
  DType param, grad, exp_avg, exp_avg_sq;
  bool grad_blocks;  // block scales of the grad
  bool operator==(const AdamFormats& o) const {
    return param == o.param && grad == o.grad && exp_avg == o.exp_avg && exp_avg_sq == o.exp_avg_sq &&
           grad_blocks == o.grad_blocks;
  }
};

// The call's other arguments.
struct AdamArgs {
  AdamHyper hyper;
  int64_t step;        // t when step_tensor is null
  float* step_tensor;  // steps taken so far, or null
  float* found_inf;    // [1]
  float* amax;         // [n, kAdamAmaxColumns]
};

// The step number t of this call: from the device counter when the call has one.
FP8AMP_HD int64_t call_step(const AdamArgs& args) {
  return args.step_tensor != nullptr ? step_number(*args.step_tensor) : args.step;
}

// The type sets the kernels are instantiated for (dispatch.h's visitor picks one).
using AdamGradTypes =
    TypeSet<float, numerics::bf16, numerics::fp16, numerics::fp8_e4m3, numerics::fp8_e5m2>;
using AdamParamTypes = TypeSet<float, numerics::fp16>;
using AdamExpAvgTypes = TypeSet<float, numerics::fp8_e4m3>;
using AdamExpAvgSqTypes = TypeSet<float, numerics::fp16>;

// Calls f(G{}, P{}, M{}, V{}) with the storage types of `formats` (grad, param, exp_avg, exp_avg_sq).
template <class F>
void visit_formats(const AdamFormats& formats, F&& f) {
  visit(AdamGradTypes{}, formats.grad, [&](auto g) {
    visit(AdamParamTypes{}, formats.param, [&](auto p) {
      visit(AdamExpAvgTypes{}, formats.exp_avg, [&](auto m) {
        visit(AdamExpAvgSqTypes{}, formats.exp_avg_sq, [&](auto v) { f(g, p, m, v); });
      });
    });
  });
}

// ------------------------------------------------------------------------------------------------
// New scales (optim.h, "New scales"): the same function for pass 2 and the commit.

struct AdamScales {
  numerics::ScalePair param, exp_avg, exp_avg_sq, weight;
};

FP8AMP_HD numerics::ScalePair new_scale(const float* scale, const float* scale_inv, float amax, float fmax,
                                        int margin) {
  if (scale_inv == nullptr) return {1.0f, 1.0f};
  const float old_scale = scale != nullptr ? *scale : rn::div(1.0f, *scale_inv);
  return numerics::scale_from_amax(amax, fmax, margin, true, {old_scale, *scale_inv});
}

// The largest magnitude of tensor t's master stored with `param` from values whose largest
// magnitude is `amax`: the stored form of `amax` (encode, decode and the power-of-two products are
// all monotonic).
FP8AMP_HD float stored_magnitude(const AdamTensorPtrs& t, float amax, numerics::ScalePair param) {
  if (t.param_scale_inv == nullptr) return amax;
  return rn::mul(numerics::to_float(numerics::quantize_to<numerics::fp16>(rn::mul(amax, param.scale))), param.scale_inv);
}

// amax_row: the tensor's kAdamAmaxColumns amaxes of this step.
FP8AMP_HD AdamScales adam_new_scales(const AdamTensorPtrs& t, const float* amax_row, int margin) {
  AdamScales s;
  s.param = new_scale(t.param_scale, t.param_scale_inv, amax_row[kAdamAmaxParam], numerics::FP16::max, margin);
  s.exp_avg = new_scale(t.exp_avg_scale, t.exp_avg_scale_inv, amax_row[kAdamAmaxExpAvg], numerics::E4M3::max,
                        margin);
  s.exp_avg_sq = new_scale(t.exp_avg_sq_scale, t.exp_avg_sq_scale_inv, amax_row[kAdamAmaxExpAvgSq],
                           numerics::FP16::max, margin);
  // The weight copy is quantized from the stored master.
  s.weight = new_scale(t.weight_scale, t.weight_scale_inv, stored_magnitude(t, amax_row[kAdamAmaxParam], s.param),
                       numerics::E4M3::max, margin);
  return s;
}

FP8AMP_HD void store_scale(float* scale, float* scale_inv, numerics::ScalePair pair) {
  if (scale_inv == nullptr) return;
  if (scale != nullptr) *scale = pair.scale;
  *scale_inv = pair.scale_inv;
}

// Writes the new pairs (the commit).
FP8AMP_HD void store_scales(const AdamTensorPtrs& t, const AdamScales& s) {
  store_scale(t.param_scale, t.param_scale_inv, s.param);
  store_scale(t.exp_avg_scale, t.exp_avg_scale_inv, s.exp_avg);
  store_scale(t.exp_avg_sq_scale, t.exp_avg_sq_scale_inv, s.exp_avg_sq);
  store_scale(t.weight_scale, t.weight_scale_inv, s.weight);
}

// Tensor `t`'s commit of a step that is not skipped: its new scale pairs, its kept master amax
// (the stored form of pass 2's exact |p'|), its step count + 1.
FP8AMP_HD void commit_tensor(const AdamTensorPtrs& t, const float* amax_row, int margin) {
  const AdamScales s = adam_new_scales(t, amax_row, margin);
  store_scales(t, s);
  if (t.param_amax != nullptr) *t.param_amax = stored_magnitude(t, amax_row[kAdamAmaxNewParam], s.param);
  if (t.step_count != nullptr) *t.step_count = rn::add(*t.step_count, 1.0f);
}

// A non-finite amax key (inf or NaN) in any column.
FP8AMP_HD bool is_nonfinite_key(uint32_t key) { return key >= 0x7F800000u; }

namespace cpu {
void adam_step(const std::vector<AdamTensorPtrs>& tensors, const std::vector<AdamFormats>& formats,
               const AdamArgs& args);
}  // namespace cpu

namespace cuda {
void adam_step(const std::vector<AdamTensorPtrs>& tensors, const std::vector<AdamFormats>& formats,
               const AdamArgs& args, Stream stream);
}  // namespace cuda

}  // namespace fp8amp
