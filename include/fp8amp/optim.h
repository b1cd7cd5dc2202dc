// Optimizer op family (docs/o1_o2.md#optimizer): the fused multi-tensor Adam / AdamW step of the O1/O2
// optimizers, with FP32 or low-precision (scaled) master weights and moments.
//
// One call updates a list of parameter tensors with one set of hyperparameters (a param group).
// It never syncs with the host: lr and the hyperparameters are host numbers (a scheduler may
// change them every call), the step count is a host number or a device counter, and every new
// scale comes from an amax computed on the device in the same call.
//
// ------------------------------------------------------------------------------------------------
// Element math. Everything is IEEE float32 with round-to-nearest-even, each operation rounded
// once; fma(a, b, c) is a * b + c rounded once. It is the operation order of
// torch.optim.Adam/AdamW (foreach=False, CPU), whose vectorized kernels use the same fmas, so the
// all-FP32 path (O1) gives m' and v' bit-identical to torch's, with one exception: the denominator
// multiplies sqrt(v') by 1/sqrt(bc2) in one fma where torch divides by sqrt(bc2) and then adds eps
// (an IEEE division an element less, measurably faster on the GPU; den differs by at most ~2 ulp,
// the update by ~2^-22 relative, inside what torch's own vectorized sqrt, not correctly rounded,
// already differs by).
//
// Per step, once, in float64 (each operation rounded once), then rounded to float32 (f32(.)):
//   t          = the step number, >= 1 (see adam_step's `step` / `step_tensor`)
//   bc1        = 1 - pow_int(beta1, t)           bc2 = 1 - pow_int(beta2, t)
//                pow_int: exponentiation by squaring (a defined sequence of float64 products; it
//                may differ from libm's pow in the last float64 bit, which survives the rounding
//                to float32 below with probability ~1e-8)
//   decay      = f32(1 - lr * weight_decay)      (AdamW)     wd = f32(weight_decay)   (Adam)
//   w1         = f32(1 - beta1)                  w1m1 = w1 - 1 (float32)   small = |w1| < 0.5
//   b2         = f32(beta2)                      w2 = f32(1 - beta2)
//   neg_step   = f32(-(lr / bc1))                inv_bc2_sqrt = f32(1 / sqrt(bc2))   eps32 = f32(eps)
//
// Per element (g, p, m, v: the stored values dequantized, x = code * scale_inv, see below):
//   if maximize:               g = -g
//   if weight_decay != 0:      AdamW: p = p * decay                       torch: param.mul_(1 - lr*wd)
//                              Adam:  g = fma(p, wd, g)                   torch: grad.add(param, alpha=wd)
//   d1 = g - m
//   m' = small ? fma(w1, d1, m) : fma(w1m1, d1, g)                        torch: exp_avg.lerp_(grad, 1-beta1)
//   v' = fma(w2 * g, g, v * b2)                                           torch: exp_avg_sq.mul_(beta2)
//                                                                                .addcmul_(grad, grad, 1-beta2)
//        where v * b2 of a float16 v is code * f32(exp_avg_sq_scale_inv * b2), one product: the
//        same value as (code * scale_inv) * b2 for a power-of-two scale_inv (fp8amp's scales) whose
//        products stay normal, and one multiply an element less in the passes
//   den = fma(sqrt(v'), inv_bc2_sqrt, eps32)                              torch: (v.sqrt() / bc2_sqrt).add_(eps)
//   p' = p + (neg_step * m') / den                                        torch: param.addcdiv_(m, den, -step_size)
// (= docs/o1_o2.md#optimizer's m' = β1·m + (1−β1)·g, v' = β2·v + (1−β2)·g², p' = p·(1 − lr·wd) − lr/bc1 · m' /
// (sqrt(v')/sqrt(bc2) + eps), in the order torch rounds it but for den.) sqrt is the correctly rounded IEEE
// square root; the division is IEEE. The update uses the full-precision m' and v', not their
// stored (rounded) forms, as MS-AMP does.
//
// Dequantization (the inputs): float32/bf16/fp16 grads convert exactly; an FP8 grad is
// code * grad_scale_inv, with one scale_inv or one per 128 x 128 block; a float16 master is code *
// param_scale_inv; an FP8 m is code * exp_avg_scale_inv (one float32 product each); v enters only
// as v * b2 (above).
//
// ------------------------------------------------------------------------------------------------
// New scales (docs/numerics.md#numerics). Each low-precision output gets a power-of-two scale from the amax of its
// NEW values: scale = 2^(floor(log2(fmax / amax)) - margin) (numerics::scale_from_amax, fmax 448
// for E4M3 m, 65504 for float16 v and master), an amax of 0 keeping the previous pair. Stored =
// quantize(x' * scale) with saturation and round-to-nearest-even, as quantize() does.
// The FP8 weight copy is quantized from the master AS STORED (its dequantized value; for a
// float32 master that is p' itself), so it equals what re-casting the stored master gives; its
// amax is derived exactly from the fp32 amax of p' (rounding is monotonic: the largest stored
// magnitude is the rounded largest magnitude), no extra pass.
//
// Stochastic rounding of the master (AdamHyper::stochastic_rounding; docs/numerics.md#stochastic-rounding).
// A float16 master's p' * scale is then stored by numerics::quantize_fp16_stochastic, rounded up in
// magnitude with probability (distance to its truncation) / (FP16 spacing), to nearest below FP16's
// normal range, so that updates below half an FP16 unit move the master by their size on average.
// Element j of the call's tensor i takes 13 bits of
//   s = random_bits(random_bits(random_bits(random_bits(random_bits(lo32(seed)) ^ hi32(seed)) ^ lo32(t))
//                   ^ i) ^ hi32(j / 2)),
//   bits = random_bits(random_bits(lo32(j / 2) ^ s) + random_bits(s ^ 0x9E3779B9)),
//   r = j even ? bits : bits >> 16
// (seed: rounding_seed; t: the step number), so a run repeats bit for bit on CPU and CUDA, and two
// steps, tensors or pairs of elements draw different bits. Rounding up can pass amax(p') * scale by
// one FP16 unit, never 65504 (a float16 value), so nothing saturates; pass 2 then folds the stored
// magnitudes instead of |p'|, which keeps param_amax the largest stored magnitude. The moments and
// the E4M3 copy round to nearest as always.
//
// How, without a host sync (the CUDA path; the CPU reference runs the same steps in order):
//   1. zero `amax` (a memset);
//   2. pass 1, one launch per up to 128 tensors: compute g, m', v', p' and fold |g|, |m'|, |v'|,
//      |p'| into amax[i, 0..3]; nothing is stored. A block that meets a non-finite value sets
//      found_inf = 1. An FP8 grad with one scale_inv folds its codes: its |g| column is
//      max |code| * |scale_inv|, which is the largest |g| for every finite scale_inv (rounding is
//      monotonic) and inf, not NaN, where an infinite one meets a zero code (the step is skipped);
//   3. pass 2 (same batching): if found_inf != 0 nothing happens; else each block derives the new
//      scales from amax[i] and the old scales, recomputes the same values, stores m, v, p and
//      the FP8 weight copy, and folds |p'| into amax[i, new_param];
//   4. commit, one thread per tensor: if found_inf == 0, write the new scale/scale_inv pairs (pass
//      2 still needed the old ones) and param_amax, and increment the tensor's step_count and
//      step_tensor.
// A pass launch takes tensors of one dtype combination (a call may mix them), up to 128 (the
// kernel parameters, up to 32,764 bytes, hold their pointers); an empty tensor takes no block.
// Launches per call: 1 memset + 2 x sum over combinations of ceil(tensors / 128) + ceil(n / 128)
// commits. Pass 1 reads p, g, m, v (g, m, v only with a kept master amax, below); pass 2 reads
// them again and writes p, m, v and the weight copy: at O2 (FP16 master, FP8 grad and m, FP16 v,
// FP8 copy) 4 + 6 + 6 = 16 bytes per element with a kept amax (18 without), against 28 for a
// fused FP32 AdamW (read 16, write 12).
//
// ------------------------------------------------------------------------------------------------
// Kept master amax (param_amax, optional per tensor). The master's scale needs amax(p') before
// pass 2 stores p', and reading the master in pass 1 for it is a third of pass 1's bytes at O2.
// With A = the largest magnitude of the master's real values as stored (kept from the last step),
// pass 1 instead bounds it without reading the master, exactly as the reference evaluates it:
//   A_d = rn(A * |decay|) (AdamW with weight decay; A otherwise) >= every |p_d| (rounding is monotonic),
//   q   = (neg_step * m') / den, rounded as in p' above,
//   B   = max over elements of rn(A_d + |q|)  >=  max |rn(p_d + q)| = amax(p'),
//   amax[i, param] = the smallest 1.75 * 2^k or 65504 * 2^k >= B (adam_kernels.h's scale_grid_top),
// which gives the master and its E4M3 copy the scales B gives (those change only at such values:
// the E4M3 max 448 and the FP16 max 65504 times powers of two), so that only elements whose bound
// could pass the top need their exact q (Adam's updates tie at the bound's precision for many
// elements, but rarely straddle a top). The scales are never above those amax(p') gives (nothing
// saturates), and differ from them only where a top lies between amax(p') and B: as the largest
// |p_d| moves by at most Q = max |q|, B / amax(p') <= (A_d + Q) / (A_d - Q), under 2 while
// Q < A_d / 3, so they are then one power of two below at most. Pass 2 folds the exact |p'| (with
// stochastic rounding the stored magnitudes) into amax[i, new_param]; the commit writes its stored
// form to param_amax for the next step. The bound is used when param_amax holds
// a finite value >= 0 on entry and the element math does not read p before den (AdamW, or Adam
// without weight decay); otherwise (NaN: unknown) pass 1 reads the master and the scales come from
// amax(p'), as without param_amax. Whoever else writes the master must set param_amax to its new
// amax, or to NaN: a stale, smaller A would saturate it (fp8amp.MasterWeight does: its kept amax).
// No two written tensors or scales of a call may share memory, nor a grad with a written one (each
// tensor's scales are its own; grads may share memory with each other): a ValueError names both.
//
// ------------------------------------------------------------------------------------------------
// Non-finite values. A step never stores a non-finite m, v or master:
//   - found_inf (float32 [1], in/out) nonzero on entry (GradScaler's flag, or an earlier call's):
//     the call is a no-op on the device (amax is still written).
//   - any non-finite value among the dequantized grads, m', v' or p' of ANY tensor of the call
//     (an inf/NaN grad, a g² that overflows float32, ...): found_inf is set to 1 and the call is a
//     no-op. So one bad tensor skips the whole param group, as GradScaler skips the whole step.
//     eps = 0 makes an element with m' = v' = 0 a 0/0: torch writes NaN there, this op skips.
// "No-op" means every param, state, scale, weight copy, step count and step_tensor is left
// bit-identical.
// Calls are independent: a param group stepped by an earlier call is not undone when a later
// call (another group) finds a bad value; pass one found_inf to all calls of a step so the rest
// skip. (Making a whole multi-group step atomic needs the groups in one call: a later extension.)
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "fp8amp/tensor.h"

namespace fp8amp {

// The buffers of one parameter tensor. All contiguous, same shape (the scales: float32 with one
// element, but for a grad's block scales), on one device (every tensor of the call on the same device). A scale_inv is given
// iff its tensor is in a scaled format; its scale may be left out (std::nullopt) even then: the op
// takes the old scale as 1 / scale_inv (exact for the power-of-two scales) and writes only the
// scale_inv, which saves a caller that keeps no scale a tensor per param and per step:
//   param:       float32, or float16 with param_scale + param_scale_inv (FP16 master, docs/o1_o2.md#optimization-levels)
//   grad:        float32, bfloat16 or float16; or float8_e4m3fn / float8_e5m2 with grad_scale_inv:
//                one element, or for a 2-D grad [rows, cols] with cols a multiple of 128 (and at
//                most 128 * (2^32 - 1) elements) the block scales [ceil(rows / 128), cols / 128],
//                row-major, element (r, c) read with scale_inv[r / 128, c / 128]
//   exp_avg:     float32, or float8_e4m3fn with exp_avg_scale + exp_avg_scale_inv
//   exp_avg_sq:  float32, or float16 with exp_avg_sq_scale + exp_avg_sq_scale_inv
//   weight_fp8:  optional float8_e4m3fn output, the copy of the new master for the forward GEMMs,
//                with weight_scale + weight_scale_inv (all three or none)
//   step_count:  optional float32 [1], the param's count of steps taken (torch keeps one a param,
//                state["step"]), incremented by a step that is not skipped, as step_tensor is: a
//                caller with many counts advances them in this call instead of one op of its own
//   param_amax:  optional float32 [1], in/out: the kept master amax ("Kept master amax" above),
//                written by a step that is not skipped
// param, exp_avg, exp_avg_sq, weight_fp8, step_count, param_amax and every scale but
// grad_scale_inv are updated in place.
struct AdamTensors {
  TensorView param;
  TensorView grad;
  TensorView exp_avg;
  TensorView exp_avg_sq;
  std::optional<TensorView> param_scale, param_scale_inv;
  std::optional<TensorView> grad_scale_inv;
  std::optional<TensorView> exp_avg_scale, exp_avg_scale_inv;
  std::optional<TensorView> exp_avg_sq_scale, exp_avg_sq_scale_inv;
  std::optional<TensorView> weight_fp8, weight_scale, weight_scale_inv;
  std::optional<TensorView> step_count;
  std::optional<TensorView> param_amax;
};

// Hyperparameters of one param group, as torch.optim.Adam / AdamW take them (host numbers).
// Checked as torch checks them: lr >= 0, eps >= 0, 0 <= beta < 1, weight_decay >= 0, all finite.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;      // decoupled weight decay (AdamW); false: L2 added to the grad (Adam)
  bool maximize = false;
  int margin = 0;         // of the new power-of-two scales, in [0, 126]
  bool stochastic_rounding = false;  // float16 masters rounded stochastically ("Stochastic rounding")
  uint64_t rounding_seed = 0;        // its random stream's seed
};

// Columns of the amax output: amax[i, c] for tensor i.
enum AdamAmaxColumn : int {
  kAdamAmaxGrad = 0,       // |dequantized grad| (before maximize and weight decay)
  kAdamAmaxExpAvg = 1,     // |m'|
  kAdamAmaxExpAvgSq = 2,   // v'
  kAdamAmaxParam = 3,      // |p'|, the new master in float32 before it is stored; with a kept master
                           // amax, the scale grid's top of a bound of it, which the new scales come from
  kAdamAmaxNewParam = 4,   // |p'| exactly, folded by pass 2 (0 on a skipped step)
  kAdamAmaxColumns = 5,
};

// One Adam/AdamW step over tensors[0..n) (n >= 1), in the element math above.
//
// The step number t: exactly one of
//   step >= 1 with step_tensor == nullptr: t = step, a host count the caller keeps (it advances
//       even when the device skips; prefer step_tensor when skips are possible);
//   step == 0 with step_tensor: float32 [1] on the tensors' device holding the number of steps
//       taken so far (torch's state["step"]); t = its value + 1 (a negative or NaN value counts
//       as 0), and it is incremented on the device unless the step is skipped.
// found_inf: float32 [1], in/out, see "Non-finite values".
// amax:      float32 [n, kAdamAmaxColumns], contiguous, written (the columns above; on a skipped
//            step too, for diagnosis).
void adam_step(const std::vector<AdamTensors>& tensors, const AdamHyper& hyper, int64_t step,
               const TensorView* step_tensor, const TensorView& found_inf, const TensorView& amax, Stream stream);

// The same step for a caller that repeats it over the same buffers (an optimizer's steady state):
// the plan checks every buffer but the grads once, when it is made, and each step() brings only
// that step's grads and numbers. Both are the one op above: adam_step(tensors, ...) is
// AdamPlan(tensors).step(their grads, ...), so the results are the same bit for bit.
//
// Made from the tensors of a call (their grad and grad_scale_inv are not used, and may be empty
// views); checks them as adam_step does, with the same messages. The plan keeps the views, not the
// tensors: the caller keeps the buffers alive and unchanged (no other storage, shape or dtype)
// while it steps the plan, and makes a new plan otherwise.
class AdamPlan {
 public:
  explicit AdamPlan(const std::vector<AdamTensors>& tensors);
  AdamPlan(AdamPlan&&) noexcept;
  AdamPlan& operator=(AdamPlan&&) noexcept;
  ~AdamPlan();
  size_t size() const;
  // adam_step with grads[i] and grad_scale_invs[i] as tensor i's grad and grad_scale_inv
  // (grad_scale_invs: empty, no grad is float8, or one entry per tensor), checked as adam_step
  // checks them.
  void step(const std::vector<TensorView>& grads, const std::vector<std::optional<TensorView>>& grad_scale_invs,
            const AdamHyper& hyper, int64_t step, const TensorView* step_tensor, const TensorView& found_inf,
            const TensorView& amax, Stream stream) const;

 private:
  struct Checked;  // the checked buffers, as the kernels take them (adam.cpp)
  std::unique_ptr<const Checked> checked_;
};

}  // namespace fp8amp
