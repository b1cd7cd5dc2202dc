// Scaling op family: how scales are made from amaxes (compute_scale, the delayed-scaling update)
// and the scaling arguments that the quantizing ops (cast.h, accumulate.h) take. Every op runs on
// the device of its tensors and never syncs with the host: scales, amaxes and counters are device
// tensors, never host scalars.
#pragma once

#include <vector>

#include "fp8amp/tensor.h"

namespace fp8amp {

// How a new scale is made from an amax. fmax comes from the target dtype.
struct ScalingRecipe {
  int margin = 0;
  bool pow2_scale = true;  // 2^(floor(log2(fmax / amax)) - margin); false: TE's fmax / amax / 2^margin
};

// The scaling of one quantize (or of n tensors in the multi-tensor ops):
// - scale:      float32 [n]; the scale to use (stored = real * scale).
// - amax:       float32 [n] or [n, k] (an amax history): element [i, 0] receives max(itself, amax
//               of tensor i) in the same pass that reads the tensor. NaN propagates.
// - scale_inv:  float32 [n], written: 1 / the scale actually used.
// - warmup_counter (optional, int32 [n]) and warmup_steps: while warmup_counter[i] < warmup_steps
//   the tensor is quantized with current scaling: the scale comes from amax[i, 0] (after this
//   tensor's own amax is folded in) by `recipe`, falling back to scale[i] if that amax is 0 or
//   non-finite. Otherwise scale[i] is used as is (delayed scaling).
struct Scaling {
  TensorView scale;
  TensorView amax;
  TensorView scale_inv;
  const TensorView* warmup_counter = nullptr;
  int warmup_steps = 0;
  ScalingRecipe recipe;
};

// scale[i], scale_inv[i] = rule(amax[i, 0]); amax 0 or non-finite keeps the previous pair.
void compute_scale(const TensorView& amax, const TensorView& scale, const TensorView& scale_inv,
                   float fmax, const ScalingRecipe& recipe, Stream stream);

// Delayed scaling, after an optimizer step, for n tensors with amax histories [n, H]:
//   a non-finite amax[i, 0] is zeroed and resets counter[i] to 0, else counter[i] += 1 (capped at H)
//   if amax[i, 0] > 0 (an amax of 0, nothing recorded this step, leaves the warm-up where it is);
//   scale[i] = rule(max_j amax[i, j]) (previous kept if that max is 0);
//   the history rolls: amax[i, j] = amax[i, j - 1], amax[i, 0] = 0.
// All four are written: no two may share memory (a ValueError names both), here and in
// compute_scale (scale, scale_inv written; amax read).
void update_delayed_scaling(const TensorView& amax_history, const TensorView& scale,
                            const TensorView& scale_inv, const TensorView& counter, float fmax,
                            const ScalingRecipe& recipe, Stream stream);

// update_delayed_scaling of many states with one fmax and recipe in one launch (a few for very
// many): state i is amax_histories[i] [n_i, H_i], scales[i], scale_invs[i], counters[i] [n_i].
// All on one device; no two of the tensors may share memory.
void multi_update_delayed_scaling(const std::vector<TensorView>& amax_histories, const std::vector<TensorView>& scales,
                                  const std::vector<TensorView>& scale_invs, const std::vector<TensorView>& counters,
                                  float fmax, const ScalingRecipe& recipe, Stream stream);

// Largest finite magnitude of a scaled format (E4M3 448, E5M2 57344, FP16 65504): the fmax of the
// ops above for a tensor quantized into that format.
float format_max(DType dtype);

}  // namespace fp8amp
