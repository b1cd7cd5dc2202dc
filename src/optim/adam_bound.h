// A cheap bracket of the new master value p' for the CUDA amax pass (pass 1 of optim.h's
// "How, without a host sync").
//
// Pass 1 needs |p'| only for the amax of the master, and only its maximum. So it brackets every
// p' with approximate instructions (no IEEE sqrt, no IEEE division) and evaluates p' exactly
// (adam_param, the reference's own operations) only for elements whose bracket does not prove
// them below a value the maximum is known to reach. The amax row therefore stays bit-identical to
// the CPU reference's; only the work changes. Everything here is __host__ __device__ so that a CPU
// test can run the same bracket with emulated approximate instructions (test_adam_bound.cpp).
//
// ------------------------------------------------------------------------------------------------
// The bracket. Notation: rn(.) one IEEE float32 rounding to nearest even, u = 2^-24, and
// (adam_kernels.h) p_d = mo.param, a = mo.step = rn(neg_step * m'), v' = mo.exp_avg_sq,
// c^ = inv_bc2_sqrt = f32(1 / sqrt(bc2)) in [1, 2^26.5] (bc2 = 1 - beta2^t in [2^-53, 1], beta2 < 1
// being a double), eps = f32(eps) >= 0; exactly, den = rn(fma(sqrt_rn(v'), c^, eps)),
// q = rn(a / den), p' = rn(p_d + q). Computed here:
//   z  = v' < 0 ? NaN : v'          (the reference's sqrt of a negative v' is NaN; the ftz
//                                    instruction would flush a negative subnormal to -0)
//   d~ = fma(approx_sqrt(z), c^, eps)  (the reference's den with the approximate square root)
//   t  = rn(a * approx_rcp(d~))
//   w  = fma(|t|, E, min(|a|, 2^-126))
//   lo = rn(p_d + rn(t - w)),  hi = rn(p_d + rn(t + w)).
// Assumptions on the approximate instructions (the CUDA ones are sqrt.approx.ftz.f32 and
// rcp.approx.ftz.f32, documented to about 1 ulp, i.e. ~2^-23; we assume 2^-16, 128 times that):
//   approx_sqrt(x) = sqrt(x)(1 + s), |s| <= 2^-16, for normal x > 0; +0 for +0 and for positive
//     subnormals (flushed); +inf for +inf; NaN for NaN.
//   approx_rcp(x) = (1 / x)(1 + r), |r| <= 2^-16, for normal 0 < x <= 2^126 (a normal result);
//     +inf for +0 and positive subnormals; +0 for +inf; NaN for NaN.
// E (AdamBoundConstants::rel) = 2^-12 + 8 kappa, kappa = 2^-62 c^ / eps (0 when eps = 0); when
// eps > 2^100 or E would exceed 2^-4, E = +inf, which makes every bracket non-finite: no skipping.
//
// Lemma 1. If lo and hi are both finite, then p' is finite and lo <= p' <= hi.
//  (1) Finite lo, hi need finite p_d, rn(t - w), rn(t + w), hence finite t and w (w >= 0), hence
//      finite E (|t| * inf is inf, 0 * inf NaN), a finite, approx_rcp(d~) finite, so d~ is +inf
//      or normal (never NaN, 0 or subnormal, whose reciprocal is inf), and then z, v' are not NaN:
//      v' >= 0.
//  (2) d~ = +inf: approx_sqrt(v') is +inf (finite s~ c^ + eps < 2^64.01 * 2^27 + 2^100 < 2^126),
//      so v' = +inf, den = +inf, q = +-0; t = a * 0 = +-0, so rn(t - w) <= 0 <= rn(t + w).
//  (3) d~ normal (so d~ < 2^126 by the same sum: approx_rcp is in its accurate range). With
//      D = sqrt(v') c^ + eps, both sums of non-negative terms, |d~/den - 1| <= rho where
//        v' = 0:            d~ = den = eps, rho = 0;
//        v' >= 2^-126:      den in D[(1-u)^2, (1+u)^2] (the rounded sqrt, the fma's one
//                           rounding), d~ in D(1 +- 2^-16)(1 +- u), rho = 2^-16 + 4u;
//        0 < v' < 2^-126:   approx_sqrt flushes: d~ = eps (> 0, d~ being normal), while
//                           eps <= den <= (eps + 2^-63 c^ (1 + u))(1 + u): rho = kappa + u.
//      With r~ = approx_rcp(d~) = (1 + r)/d~: a/den = a r~ F, F = (d~/den)/(1 + r) in 1 +- phi,
//      phi <= (rho + 2^-16)(1 + 2^-15). If t is normal, |a/den - t| <= |t| phi' with
//      phi' = (phi + u)(1 + 2^-23) <= (rho + 2^-16 + u)(1 + 2^-14) <= E / 4. If t is subnormal or
//      zero, t = a r~ + b with |b| <= 2^-150 and |a/den - t| <= |t| phi + 2^-150 (1 + phi). Then
//      w >= that radius: a = 0 gives t = +-0 = q exactly and w = 0; a normal t gives
//      w >= rn(|t| E) >= |t| E (1 - u) (or >= |t| E + 2^-150 in the subnormal range of w) >= |t| phi';
//      a subnormal t has w >= |t| E + min(|a|, 2^-126) - 2^-150 with min(|a|, 2^-126) >= 2^-148,
//      or |a| = 2^-149 and then w = 2^-149 (t = 0) or |t| >= 2^-149 and |t|(E - phi') >= 2^-150 phi.
//      So t - w <= a/den <= t + w (reals), and rounding is monotonic: rn(t - w) <= q <= rn(t + w).
//  (4) p_d and q finite: p_d + rn(t - w) <= p_d + q <= p_d + rn(t + w), so lo <= p' <= hi, and p'
//      is finite because lo and hi are.
// Lemma 2. If p' is finite, lower_magnitude = fmaxf(lo, -hi) <= |p'| or is NaN. p' finite means
//  p_d, q, a finite and den in (0, +inf], so v' >= 0 or +inf. E = +inf, a d~ of 0 or subnormal, or an
//  overflowing t makes one of lo, hi NaN and the other infinite the right way (lo = -inf or
//  hi = +inf), or both NaN: fmaxf then gives -inf or NaN. Otherwise t and w are finite and (2)-(3)
//  hold, so lo <= p' <= hi in the extended reals (rn is monotonic there too), and
//  max(lo, -hi) <= |p'|.
//
// The skip rule (adam_cuda.cu's pass 1). An element k is skipped iff upper_magnitude(bracket_k) =
// max(hi, -lo) < T (NaN-propagating max; NaN compares false), which needs finite lo and hi (if hi
// = +inf or lo = -inf nothing is below it; lo = +inf or hi = -inf can only come with the other
// infinite too, as lo <= hi when t and w are finite), so by Lemma 1 |p'_k| < T with p'_k finite. T is the largest of
//   - nextup(M) (key + 1), M a value of the amax row of this tensor in this call, or a lane's
//     running maximum of the exact |p'| it folded, or 0: every such M is the |p'| of an element
//     that is evaluated exactly (or 0, below any amax), so |p'_k| <= M changes no maximum;
//   - lower_magnitude of some element j of the tensor: |p'_k| < lower_magnitude_j <= |p'_j| (Lemma
//     2; if p'_j is not finite its key is the largest anyway), so k is not a maximizer.
// An element whose p' is inf or NaN has no finite bracket (Lemma 1), so it is always evaluated:
// found_inf and the NaN/inf keys come out as in the reference. A NaN-valued T (key + 1 of an inf
// or NaN) compares false: no skipping.
#pragma once

#include <cmath>

#include "common/numerics.h"
#include "optim/adam_kernels.h"

namespace fp8amp {

struct AdamBoundConstants {
  float rel;           // E: the relative radius of the bracket, +inf to disable skipping
};

FP8AMP_HD AdamBoundConstants adam_bound_constants(const AdamConstants& c) {
  AdamBoundConstants b;
  // kappa: the relative error of d~ where approx_sqrt flushes a subnormal v' (rho above).
  const double kappa = c.eps > 0.0f ? 0x1p-62 * c.inv_bc2_sqrt / c.eps : 0.0;
  const double rel = 0x1p-12 + 8.0 * kappa;
  const bool usable = c.eps <= 0x1p100f && rel <= 0x1p-4;
  b.rel = usable ? static_cast<float>(rel) : numerics::bits_float(0x7F800000u);
  return b;
}

// lo <= p' <= hi whenever both are finite (Lemma 1).
struct ParamBracket {
  float lo, hi;
};

// Approx: sqrt(x) and rcp(x) with the properties assumed above (on the device, the ftz
// approximate instructions; in the CPU test, an adversarial emulation of them).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Approx>
FP8AMP_HD ParamBracket param_bracket(const AdamMoments& mo, const AdamConstants& c, const AdamBoundConstants& b,
                                     const Approx& approx) {
  const float z = mo.exp_avg_sq < 0.0f ? numerics::bits_float(numerics::kCanonicalNanBits) : mo.exp_avg_sq;
  const float den = rn::fma(approx.sqrt(z), c.inv_bc2_sqrt, c.eps);
  const float t = rn::mul(mo.step, approx.rcp(den));
  const float radius = rn::fma(fabsf(t), b.rel, fminf(fabsf(mo.step), 0x1p-126f));
  return {rn::add(mo.param, rn::sub(t, radius)), rn::add(mo.param, rn::add(t, radius))};
}

// A lower bound of |p'| when p' is finite, or NaN (Lemma 2). fmaxf ignores a NaN operand.
FP8AMP_HD float lower_magnitude(ParamBracket br) { return fmaxf(br.lo, -br.hi); }

// max(x, y), NaN if either is NaN (IEEE maximum; max.NaN.f32 on the device).
FP8AMP_HD float max_nan(float x, float y) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
#else
  return numerics::is_nan(x) || numerics::is_nan(y) ? numerics::bits_float(numerics::kCanonicalNanBits) : fmaxf(x, y);
#endif
}

// max(hi, -lo): the bracket proves |p'| < T iff this is < T (false for a NaN T or a NaN bound, and
// an infinite bound is < no T), which needs finite lo and hi.
FP8AMP_HD float upper_magnitude(ParamBracket br) { return max_nan(br.hi, -br.lo); }

}  // namespace fp8amp
