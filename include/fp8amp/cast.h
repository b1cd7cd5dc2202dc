// Cast op family: quantize, dequantize, cast+transpose, amax (docs/numerics.md#numerics); their Scaling argument
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

// out = encode(x * scale) in out.dtype (E4M3, E5M2, or FP16 with saturation of finite values; an
// infinity is coded as NaN, docs/numerics.md#non-finite-values); x fp32/bf16/fp16.
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

// The transpose of a scaled FP16 tensor re-quantized into another scale: x FP16 codes viewed as
// [rows, cols] (its last dim is cols), whose real values are x * scale_inv; out_t [cols, rows] in
// out_t.dtype (E4M3, E5M2 or FP16) holds encode(x * (scale_inv[0] * scale[0])), the product of the
// two float32 [1] scales rounded once to float32 (exact when both are powers of two, as a
// MasterWeight's are). Nothing else is written: no codes in x's layout, no amax, no scale_inv
// (the caller already has 1 / scale). Fp8Linear's backward makes its weight's transpose with it.
void cast_transpose_rescaled(const TensorView& x, const TensorView& scale_inv, const TensorView& scale,
                             const TensorView& out_t, Stream stream);

// cast_transpose, and in the same pass the column sums of x (the bias gradient, when x is a
// layer's output gradient): dbias float32 [cols], dbias[c] = the sum over rows of x[r, c], in
// float32 and in a fixed order (cast_kernels.h, "Column sums"), the same on the CPU and the GPU,
// so the two agree bit for bit. workspace: float32, contiguous, at least
// cast_transpose_dbias_workspace(rows, cols) elements (partial sums; its contents are scratch).
void cast_transpose_dbias(const TensorView& x, const TensorView& out, const TensorView& out_t,
                          const TensorView& dbias, const TensorView& workspace, const Scaling& scaling,
                          Stream stream);
int64_t cast_transpose_dbias_workspace(int64_t rows, int64_t cols);

// amax[0] = max(amax[0], max |x|). With a warmup_counter, nothing is done unless
// warmup_counter[0] < warmup_steps (the pass current scaling needs before its quantize). x may be
// any layout with row runs (tensor.h): contiguous, a permutation of that, or rows at one stride.
void amax(const TensorView& x, const TensorView& amax, const TensorView* warmup_counter,
          int warmup_steps, Stream stream);

// The multi-tensor versions: tensor i uses row i of the scaling tensors. One launch (or a few,
// for very many tensors) covers them all. outs[i] (the caller's, one dtype, contiguous, xs[i]'s
// shape and device) may be a view into a larger buffer; errors name the tensor by its index.
// multi_amax also reads FP8 codes (float8_e4m3fn, float8_e5m2): the amax of the codes' own values,
// NaN for a NaN code, which times a power-of-two scale_inv is the amax of the dequantized tensor.
void multi_amax(const std::vector<TensorView>& xs, const TensorView& amax, Stream stream);
void multi_quantize(const std::vector<TensorView>& xs, const std::vector<TensorView>& outs,
                    const Scaling& scaling, Stream stream);
void multi_dequantize(const std::vector<TensorView>& xs, const TensorView& scale_inv,
                      const std::vector<TensorView>& outs, Stream stream);

}  // namespace fp8amp
