// Cast op family: quantize, dequantize, cast+transpose, amax (DESIGN §3); their Scaling argument
// and the scale updates are in scaling.h. Every op runs on the device of its tensors (CPU
// reference or CUDA kernel) and never syncs with the host. Scales, amaxes and counters are device
// tensors, never host scalars. An output never shares memory with an input or another output
// (ValueError naming both): there is no in-place form of a cast, and on the GPU the overlap would
// be a race.
#pragma once

#include <vector>

#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// out = encode(x * scale) in out.dtype (E4M3, E5M2, or FP16 with saturation); x fp32/bf16/fp16.
void quantize(const TensorView& x, const TensorView& out, const Scaling& scaling, Stream stream);

// Current scaling in one call (ScaledTensor.from_tensor, FP8 weight gradients), bit for bit
// amax() into a zero, compute_scale() from the pair (1, 1), then quantize() with that scale:
// amax (float32 [1], written, not folded) = max |x| (NaN above everything; 0 when x is empty);
// scale = the pow2 rule from amax with `margin`, or 1 for an amax of 0, inf or NaN;
// out = encode(x * scale) in out.dtype; scale_inv (float32 [1]) = 1 / scale, or NaN (0x7FC00000)
// when nan_if_nonfinite and the amax is inf or NaN (an E4M3 code cannot hold the overflow).
void quantize_current(const TensorView& x, const TensorView& out, const TensorView& scale_inv,
                      const TensorView& amax, int margin, bool nan_if_nonfinite, Stream stream);

// out = decode(x) * scale_inv in out.dtype (fp32/bf16/fp16, IEEE rounding); x E4M3/E5M2/FP16;
// scale_inv float32 [1].
void dequantize(const TensorView& x, const TensorView& scale_inv, const TensorView& out, Stream stream);

// x viewed as [rows, cols] (its last dim is cols): out [rows, cols] and out_t [cols, rows] hold
// the same quantized values, amax as in quantize; one pass over x.
void cast_transpose(const TensorView& x, const TensorView& out, const TensorView& out_t,
                    const Scaling& scaling, Stream stream);

// cast_transpose, and in the same pass the column sums of x (the bias gradient, when x is a
// layer's output gradient): dbias float32 [cols], dbias[c] = the sum over rows of x[r, c], in
// float32 and in a fixed order (cast_kernels.h, "Column sums"), the same on the CPU and the GPU,
// so the two agree bit for bit. workspace: float32, contiguous, at least
// cast_transpose_dbias_workspace(rows, cols) elements (partial sums; its contents are scratch).
void cast_transpose_dbias(const TensorView& x, const TensorView& out, const TensorView& out_t,
                          const TensorView& dbias, const TensorView& workspace, const Scaling& scaling,
                          Stream stream);
int64_t cast_transpose_dbias_workspace(int64_t rows, int64_t cols);

// amax[0] = max(amax[0], max |x|). With a warmup counter, nothing is done unless
// counter[0] < warmup_steps (the pass current scaling needs before its quantize). x may be any
// layout with row runs (tensor.h): contiguous, a permutation of that, or rows at one stride.
void amax(const TensorView& x, const TensorView& amax, const TensorView* warmup_counter,
          int warmup_steps, Stream stream);

// The multi-tensor versions: tensor i uses row i of the scaling tensors. One launch (or a few,
// for very many tensors) covers them all. outs[i] (the caller's, one dtype, contiguous, xs[i]'s
// shape and device) may be a view into a larger buffer; errors name the tensor by its index.
void multi_amax(const std::vector<TensorView>& xs, const TensorView& amax, Stream stream);
void multi_quantize(const std::vector<TensorView>& xs, const std::vector<TensorView>& outs,
                    const Scaling& scaling, Stream stream);
void multi_dequantize(const std::vector<TensorView>& xs, const TensorView& scale_inv,
                      const std::vector<TensorView>& outs, Stream stream);

// ------------------------------------------------------------------------------------------------
// scaled_accumulate: dequantize-add-requantize, for accumulating FP8 weight gradients across
// micro-batches (DESIGN §5) in one fused op.
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
// - recipe:        the scale rule (margin in [0, 126]; pow2 by default) with fmax = dst's format max.
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
                       const ScaleRecipe& recipe, Stream stream);

}  // namespace fp8amp
