// Cheap bounds on |p'|, the magnitude of the new master value, for the CUDA amax pass (pass 1 of
// optim.h's "How, without a host sync").
//
// Pass 1 needs |p'| only for the amax of the master, and only its maximum. So it bounds every |p'|
// with approximate instructions (no IEEE sqrt, no IEEE division) and evaluates p' exactly
// (adam_param, the reference's own operations) only for elements whose upper bound does not prove
// them below a value the maximum is known to reach. The amax row therefore stays bit-identical to
// the CPU reference's; only the work changes. Everything here is __host__ __device__ so that a CPU
// test can run the same bounds with emulated approximate instructions (test_adam_bound.cpp).
//
// ------------------------------------------------------------------------------------------------
// The bounds. Notation: rn(.) one IEEE float32 rounding to nearest even, u = 2^-24, and
// (adam_kernels.h) p_d = mo.param, a = mo.step = rn(neg_step * m'), v' = mo.exp_avg_sq,
// c^ = inv_bc2_sqrt = f32(1 / sqrt(bc2)) in [1, 2^26.5] (bc2 = 1 - beta2^t in [2^-53, 1], beta2 < 1
// being a double), eps = f32(eps) >= 0; exactly, den = rn(fma(sqrt_rn(v'), c^, eps)),
// q = rn(a / den), p' = rn(p_d + q). Computed here:
//   z  = v', or the NaN 0x7FC00000 where v' has its sign bit set (the reference's sqrt of a
//        negative v' is NaN, and the ftz instruction would flush a negative subnormal to -0; a v'
//        of -0, which Adam's update cannot produce, is merely never skipped)
//   d~ = fma(approx_sqrt(z), c^, eps)  (the reference's den with the approximate square root)
//   t  = rn(a * approx_rcp(d~))
//   w  = fma(|t|, R, 2^-149)          (a bound on |q|)
//   upper = rn(|p_d| + w),  lower = rn(|p_d| - w).
// Assumptions on the approximate instructions (the CUDA ones are sqrt.approx.ftz.f32 and
// rcp.approx.ftz.f32, documented to about 1 ulp, i.e. ~2^-23; we assume 2^-16, 128 times that):
//   approx_sqrt(x) = sqrt(x)(1 + s), |s| <= 2^-16, for normal x > 0; +0 for +0 and for positive
//     subnormals (flushed); +inf for +inf; NaN for NaN.
//   approx_rcp(x) = (1 / x)(1 + r), |r| <= 2^-16, for normal 0 < x <= 2^126 (a normal result);
//     +inf for +0 and positive subnormals; +0 for +inf; NaN for NaN.
// R (AdamBoundConstants::rel) is 1 + E rounded up to a float, E = 2^-12 + 8 kappa, kappa =
// 2^-62 c^ / eps (0 when eps = 0); when eps > 2^100 or E would exceed 2^-4, R = +inf, which makes
// every upper bound non-finite: no skipping.
//
// Lemma 0 (|q| <= w). If t and R are finite and d~ is +inf or normal, then |q| <= w.
//  (1) d~ = +inf: approx_sqrt(z) is +inf (finite s~ c^ + eps < 2^64.01 * 2^27 + 2^100 < 2^126),
//      so v' = +inf, den = +inf, q = +-0 <= w.
//  (2) d~ normal (so d~ < 2^126 by the same sum: approx_rcp is in its accurate range), and v' >= 0
//      (z is not NaN). With D = sqrt(v') c^ + eps, both sums of non-negative terms,
//      |d~/den - 1| <= rho where
//        v' = 0:            d~ = den = eps, rho = 0;
//        v' >= 2^-126:      den in D[(1-u)^2, (1+u)^2] (the rounded sqrt, the fma's one
//                           rounding), d~ in D(1 +- 2^-16)(1 +- u), rho = 2^-16 + 4u;
//        0 < v' < 2^-126:   approx_sqrt flushes: d~ = eps (> 0, d~ being normal), while
//                           eps <= den <= (eps + 2^-63 c^ (1 + u))(1 + u): rho = kappa + u.
//      With r~ = approx_rcp(d~) = (1 + r)/d~: a/den = a r~ F, F = (d~/den)/(1 + r) in 1 +- phi,
//      phi <= (rho + 2^-16)(1 + 2^-15). If t is normal, |a/den - t| <= |t| phi' with
//      phi' = (phi + u)(1 + 2^-23) <= (rho + 2^-16 + u)(1 + 2^-14) <= E / 4, and w >= rn(|t| R) >=
//      |t|(1 + E)(1 - u) >= |t|(1 + phi') >= |a/den|. If t is subnormal or zero, t = a r~ + b with
//      |b| <= 2^-150 and |a/den| <= |t|(1 + phi) + 2^-150 (1 + phi). For t = 0, w = 2^-149 exactly,
//      above that. For |t| >= 2^-149, |t| R + 2^-149 < 2^-125, where floats are 2^-149 apart, so
//      w >= |t| R + 2^-150, and |t|(R - 1 - phi) >= 2^-149 (3E / 4) >= 2^-150 phi gives w >=
//      |a/den| again. So |a/den| <= w (reals), and |q| = rn(|a/den|) <= w (w is a float).
// Lemma 1. If upper is finite, then p' is finite and |p'| <= upper.
//  upper finite needs finite p_d and w, hence finite t and R (R >= 1), hence a finite and
//  approx_rcp(d~) finite unless a = 0 (inf * 0 would make t NaN): so d~ is +inf or normal
//  (approx_rcp of 0 or a subnormal is inf, of NaN NaN), and z is not NaN: v' >= 0. Lemma 0 gives
//  |q| <= w, so |p_d + q| <= |p_d| + w, and |p'| = rn(|p_d + q|) <= rn(|p_d| + w) = upper
//  (rounding is monotonic); p' is finite as upper is.
// Lemma 2. If p' is finite, lower <= |p'| or lower is NaN. p' finite means p_d and q finite. A NaN
//  w (NaN t, or 0 * inf) makes lower NaN; an infinite w (R = +inf, an overflowing t, or a d~ of 0
//  or a subnormal with a != 0) makes it -inf. Otherwise t and R are finite and d~ is +inf or
//  normal (as in Lemma 1), so |q| <= w (Lemma 0), |p_d + q| >= |p_d| - w, and lower <= |p'|.
//
// The skip rule (adam_cuda.cu's pass 1). An element k is skipped iff an upper bound of it is < T:
// its own upper_k, or that of a group holding it (param_bounds below: if finite, it bounds upper_k);
// false for a NaN bound or T, and an infinite bound is below no T. By Lemma 1 |p'_k| < T with p'_k
// finite. T is the largest of
//   - nextup(M) (key + 1), M a value of the amax row of this tensor in this call, or a lane's
//     running maximum of the exact |p'| it folded, or 0: every such M is the |p'| of an element
//     that is evaluated exactly (or 0, below any amax), so |p'_k| <= M changes no maximum;
//   - a lower bound: lower_j of some element j of the tensor, or of a group (at most lower_j of
//     its element j of largest |p_d|): |p'_k| < lower_j <= |p'_j| (Lemma 2; if p'_j is not finite
//     its key is the largest anyway), so k is not a maximizer.
// An element whose p' is inf or NaN has no finite upper bound (Lemma 1), so it is always
// evaluated: found_inf and the NaN/inf keys come out as in the reference. A NaN-valued T (key + 1
// of an inf or NaN) compares false: no skipping.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/numerics.h"
#include "optim/adam_kernels.h"

namespace fp8amp {

struct AdamBoundConstants {
  float rel;  // R >= 1 + E, +inf to disable skipping
};

FP8AMP_HD AdamBoundConstants adam_bound_constants(const AdamConstants& c) {
  AdamBoundConstants b;
  // kappa: the relative error of d~ where approx_sqrt flushes a subnormal v' (rho above).
  const double kappa = c.eps > 0.0f ? 0x1p-62 * c.inv_bc2_sqrt / c.eps : 0.0;
  const double e = 0x1p-12 + 8.0 * kappa;
  if (c.eps <= 0x1p100f && e <= 0x1p-4) {
    const double rel = 1.0 + e;
    b.rel = static_cast<float>(rel);
    if (b.rel < rel) b.rel = numerics::bits_float(numerics::float_bits(b.rel) + 1u);  // round up
  } else {
    b.rel = numerics::bits_float(0x7F800000u);
  }
  return b;
}

// t of one element (above). Approx: sqrt(x) and rcp(x) with the properties assumed above (on the
// device, the ftz approximate instructions; in the CPU test, an adversarial emulation of them).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Approx>
FP8AMP_HD float update_ratio(const AdamMoments& mo, const AdamConstants& c, const Approx& approx) {
  // One unsigned min: every negative v' (sign bit set) becomes the NaN 0x7FC00000.
  const uint32_t v_bits = numerics::float_bits(mo.exp_avg_sq);
  const float z = numerics::bits_float(v_bits < 0x7FC00000u ? v_bits : 0x7FC00000u);
  const float den = rn::fma(approx.sqrt(z), c.inv_bc2_sqrt, c.eps);
  return rn::mul(mo.step, approx.rcp(den));
}

// w from |t|. Monotonic in |t| (an fma with R >= 1), so that for a group of elements the w of their
// largest |t| (max_nan: NaN if any is NaN) serves as their largest w, W below: it is at least every
// element's w when R is finite; when R = +inf it is +inf or NaN, like every w, and makes the
// group's upper bound non-finite and its lower bound NaN or -inf, which the skip rule treats alike.
FP8AMP_HD float ratio_bound(float t_magnitude, const AdamBoundConstants& b) {
  return rn::fma(t_magnitude, b.rel, 0x1p-149f);
}

// w, the bound on |q| (Lemma 0).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Approx>
FP8AMP_HD float update_bound(const AdamMoments& mo, const AdamConstants& c, const AdamBoundConstants& b,
                             const Approx& approx) {
  return ratio_bound(fabsf(update_ratio(mo, c, approx)), b);
}

// lower <= |p'| <= upper under the conditions of Lemmas 1 and 2.
struct ParamBounds {
  float lower, upper;
};

// The bounds of one element from |p_d| and w; or of a group of elements from P, the largest of
// their |p_d|, and W, the largest of their w or ratio_bound of their largest |t| (both NaN if any
// is NaN): every upper bound in the group is at most rn(P + W), and rn(P - W) is at most the lower
// bound of the element with |p_d| = P (its w <= W), so that Lemmas 1 and 2 hold for the group's
// pair too.
FP8AMP_HD ParamBounds param_bounds(float p_magnitude, float w) {
  return {rn::sub(p_magnitude, w), rn::add(p_magnitude, w)};
}

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

}  // namespace fp8amp
