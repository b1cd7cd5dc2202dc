// Accumulate op family: scaled_accumulate, a scaled tensor's fused dequantize-add-requantize.
#pragma once

#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// scaled_accumulate: dequantize-add-requantize, for accumulating FP8 weight gradients across
// micro-batches (docs/architecture.md#fp8linear-dataflow) in one fused op.
//
// Arguments (all on one device; the op never syncs with the host):
// - dst:           the scaled accumulator: codes float8_e4m3fn, float8_e5m2 or float16,
//                  contiguous; read and rewritten in place.
// - dst_scale_inv: float32 [1]; read (real = code * dst_scale_inv), then rewritten.
// - src:           contiguous, dst's numel (any shape). Without src_scale_inv (nullptr) it holds
//                  high-precision values: float32, bfloat16 or float16. With src_scale_inv
//                  (float32 [1]) it is a scaled tensor: codes float8_e4m3fn, float8_e5m2 or
//                  float16, real = code * src_scale_inv. src may be dst itself (the same
//                  memory) but must not partly overlap it, nor any of the scalar buffers.
// - alpha:         the factor of src (1 to accumulate, 0.5 to average two, ...).
// - amax:          float32 [1], output: overwritten (not max-folded) with max |s| below.
// - recipe:        the scale rule (margin in [0, 126]; pow2_scale by default) with fmax = dst's format max.
//
// Per element i, in float32, each operation rounded once to nearest even (no fma contraction;
// decode() is exact, NaN codes decode to NaN):
//   a    = fl(decode(dst[i]) * dst_scale_inv)
//   v    = decode(src[i])                        (the value itself for float32/bfloat16/float16)
//   v    = fl(v * src_scale_inv)                 (scaled src only)
//   s[i] = fl(a + fl(alpha * v))
// amax = max_i |s[i]|, with NaN above everything (numerics::amax_key; one NaN makes it NaN);
// 0 for an empty tensor. The new pair (scale, scale_inv) is:
//   - amax finite and > 0: numerics::scale_from_amax(amax, fmax, recipe) (pow2: 2^(floor(log2(
//     fl(fmax / amax))) - margin), exponent clamped to [-126, 126]; TE: fmax / amax / 2^margin);
//   - amax == 0 (all sums zero, or no element): scale = scale_inv = 1;
//   - amax inf or NaN (some s[i] is non-finite): scale = scale_inv = NaN.
// Then dst[i] = quantize(fl(s[i] * scale)) exactly as quantize() encodes (round to nearest even,
// saturating to +-fmax, NaN -> the NaN code) and dst_scale_inv[0] = scale_inv.
// Consequences: a non-finite sum anywhere turns the whole accumulator into NaN (every code the
// NaN code and scale_inv NaN), so GradScaler's and the optimizer's non-finite checks see it (an
// E4M3 code cannot hold inf, and saturating would hide the overflow); a NaN dst_scale_inv on
// entry therefore stays NaN (for a non-empty dst). With amax 0 every code is a zero (-0 where
// the sum is -0, i.e. both terms are -0).
void scaled_accumulate(const TensorView& dst, const TensorView& dst_scale_inv, const TensorView& src,
                       const TensorView* src_scale_inv, float alpha, const TensorView& amax,
                       const ScalingRecipe& recipe, Stream stream);

}  // namespace fp8amp
