// What the scaling kernels see, and the scale rules the quantizing kernels share: raw pointers
// and sizes, already validated (scaling.cpp, scaling_checks.h). Each function has a CPU reference
// (scaling_cpu.cpp) and a CUDA twin (scaling_cuda.cu) with the same signature; the CPU one defines
// correct. The FP8AMP_HD functions are the per-tensor math of both, and of the cast kernels'
// choice of scale (cast_kernels.h).
#pragma once

#include <cstdint>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// Scaling buffers of n tensors (see fp8amp::Scaling in scaling.h). Tensor i reads scale[i],
// folds its amax into amax[i * amax_stride], writes scale_inv[i].
struct ScalingPtrs {
  const float* scale;
  float* amax;
  int64_t amax_stride;
  float* scale_inv;
  const int32_t* warmup_counter;  // nullptr: always delayed (use scale as is)
  int warmup_steps;
  int margin;
  bool pow2_scale;
  // quantize_current (cast.h): current scaling on every call, from the amax of this call with the
  // fallback scale 1 (scale and warmup_counter are not read), and with nan_if_nonfinite a scale_inv
  // of NaN for an inf or NaN amax.
  bool current = false;
  bool nan_if_nonfinite = false;
};

FP8AMP_HD bool warming_up(const int32_t* warmup_counter, int64_t i, int warmup_steps) {
  return warmup_counter != nullptr && warmup_counter[i] < warmup_steps;
}

// Whether tensor i takes its scale from the amax of this call (the amax pass runs first).
FP8AMP_HD bool current_scaling(const ScalingPtrs& s, int64_t i) {
  return s.current || warming_up(s.warmup_counter, i, s.warmup_steps);
}

// The scale tensor i is quantized with, given the (already folded) amax of this step.
FP8AMP_HD numerics::ScalePair select_scale(const ScalingPtrs& s, int64_t i, float amax_now, float fmax) {
  if (s.current) return numerics::scale_from_amax(amax_now, fmax, s.margin, s.pow2_scale, {1.0f, 1.0f});
  const float scale = s.scale[i];
  const numerics::ScalePair given{scale, 1.0f / scale};
  if (!warming_up(s.warmup_counter, i, s.warmup_steps)) return given;
  return numerics::scale_from_amax(amax_now, fmax, s.margin, s.pow2_scale, given);
}

// torch's NaN (float("nan")), which ScaledTensor.from_tensor(nan_if_nonfinite=True) wrote before
// quantize_current did it in the kernel.
constexpr uint32_t kQuietNanBits = 0x7FC00000u;

// The scale_inv written for tensor i: that of its scale, or NaN (nan_if_nonfinite, amax not finite).
FP8AMP_HD float scale_inv_to_write(const ScalingPtrs& s, const numerics::ScalePair& pair, float amax_now) {
  return s.nan_if_nonfinite && !numerics::is_finite(amax_now) ? numerics::bits_float(kQuietNanBits) : pair.scale_inv;
}

// One delayed-scaling state of update_delayed_scaling (scaling.h): `rows` tensors, row i with its
// history amax_history[i * history_len ...] and scale[i], scale_inv[i], counter[i].
struct DelayedScalingSlice {
  float* amax_history;
  float* scale;
  float* scale_inv;
  int32_t* counter;
  int64_t rows;
  int64_t history_len;
};

// The update of one row, the same on the CPU and in a CUDA thread.
FP8AMP_HD void update_delayed_row(float* h, int64_t history_len, float* scale, float* scale_inv, int32_t* counter,
                                  float fmax, int margin, bool pow2_scale) {
  const bool bad = !numerics::is_finite(h[0]);
  const bool recorded = h[0] > 0.0f;
  if (bad) h[0] = 0.0f;
  float window_max = 0.0f;
  // std::max's rule: an older NaN entry never wins.
  for (int64_t j = 0; j < history_len; ++j) window_max = window_max < h[j] ? h[j] : window_max;
  const numerics::ScalePair pair =
      numerics::scale_from_amax(window_max, fmax, margin, pow2_scale, {*scale, *scale_inv});
  *scale = pair.scale;
  *scale_inv = pair.scale_inv;
  for (int64_t j = history_len - 1; j > 0; --j) h[j] = h[j - 1];
  h[0] = 0.0f;
  // The warm-up counts steps that recorded an amax: a tensor no training forward cast (an expert
  // routed no tokens, a layer skipped, run only in eval or without grad) would end it at scale 1.
  const int64_t next = static_cast<int64_t>(*counter) + (recorded ? 1 : 0);
  *counter = bad ? 0 : static_cast<int32_t>(next < history_len ? next : history_len);
}

namespace cpu {
void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2_scale);
void update_delayed_scaling(const std::vector<DelayedScalingSlice>& states, float fmax, int margin, bool pow2_scale);
}  // namespace cpu

namespace cuda {
void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2_scale, Stream stream);
void update_delayed_scaling(const std::vector<DelayedScalingSlice>& states, float fmax, int margin, bool pow2_scale,
                            Stream stream);
}  // namespace cuda

}  // namespace fp8amp
