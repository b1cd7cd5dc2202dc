// What the cast kernels see: raw pointers, sizes and scaling buffers, already validated by
// cast.cpp. Each function has a CPU reference (cast_cpu.cpp) and a CUDA twin (cast_cuda.cu)
// with the same signature; the CPU one defines correct.
#pragma once

#include <cstdint>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// Scaling buffers of n tensors (see fp8amp::Scaling in cast.h). Tensor i reads scale[i],
// folds its amax into amax[i * amax_stride], writes scale_inv[i].
struct ScalingPtrs {
  const float* scale;
  float* amax;
  int64_t amax_stride;
  float* scale_inv;
  const int32_t* warmup_counter;  // nullptr: always delayed (use scale as is)
  int warmup_steps;
  int margin;
  bool pow2;
  // quantize_current (cast.h): current scaling on every call, from the amax of this call with the
  // fallback scale 1 (scale and warmup_counter are not read), and with nan_if_nonfinite a scale_inv
  // of NaN for an inf or NaN amax.
  bool current = false;
  bool nan_if_nonfinite = false;
};

FP8AMP_HD bool warming_up(const int32_t* counter, int64_t i, int warmup_steps) {
  return counter != nullptr && counter[i] < warmup_steps;
}

// Whether tensor i takes its scale from the amax of this call (the amax pass runs first).
FP8AMP_HD bool current_scaling(const ScalingPtrs& s, int64_t i) {
  return s.current || warming_up(s.warmup_counter, i, s.warmup_steps);
}

// The scale tensor i is quantized with, given the (already folded) amax of this step.
FP8AMP_HD numerics::ScalePair select_scale(const ScalingPtrs& s, int64_t i, float amax_now, float fmax) {
  if (s.current) return numerics::scale_from_amax(amax_now, fmax, s.margin, s.pow2, {1.0f, 1.0f});
  const float scale = s.scale[i];
  const numerics::ScalePair given{scale, 1.0f / scale};
  if (!warming_up(s.warmup_counter, i, s.warmup_steps)) return given;
  return numerics::scale_from_amax(amax_now, fmax, s.margin, s.pow2, given);
}

// torch's NaN (float("nan")), which ScaledTensor.from_tensor(nan_if_nonfinite=True) wrote before
// quantize_current did it in the kernel.
constexpr uint32_t kQuietNanBits = 0x7FC00000u;

// The scale_inv written for tensor i: that of its scale, or NaN (nan_if_nonfinite, amax not finite).
FP8AMP_HD float scale_inv_to_write(const ScalingPtrs& s, const numerics::ScalePair& pair, float amax_now) {
  return s.nan_if_nonfinite && !numerics::is_finite(amax_now) ? numerics::bits_float(kQuietNanBits) : pair.scale_inv;
}

// One tensor of a multi-tensor op.
struct TensorSlice {
  const void* in;
  void* out;
  int64_t numel;
};

// One delayed-scaling state of update_delayed_scaling (cast.h): `rows` tensors, row i with its
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
                                  float fmax, int margin, bool pow2) {
  const bool bad = !numerics::is_finite(h[0]);
  if (bad) h[0] = 0.0f;
  float window_max = 0.0f;
  // std::max's rule: an older NaN entry never wins.
  for (int64_t j = 0; j < history_len; ++j) window_max = window_max < h[j] ? h[j] : window_max;
  const numerics::ScalePair pair = numerics::scale_from_amax(window_max, fmax, margin, pow2, {*scale, *scale_inv});
  *scale = pair.scale;
  *scale_inv = pair.scale_inv;
  for (int64_t j = history_len - 1; j > 0; --j) h[j] = h[j - 1];
  h[0] = 0.0f;
  const int64_t next = static_cast<int64_t>(*counter) + 1;
  *counter = bad ? 0 : static_cast<int32_t>(next < history_len ? next : history_len);
}

// Column sums (cast_transpose_dbias): the order of the float32 additions, which the CUDA kernel's
// thread layout sets and the CPU reference repeats. x's rows are cut into bands of
// kBandRows = kSumTiles * kSumTileRows rows; within a band, row group g (g in [0, kSumTileRows /
// kSumGroupRows)) holds rows k * kSumTileRows + g * kSumGroupRows + i, k in [0, kSumTiles), i in
// [0, kSumGroupRows). Every sum starts from +0 and adds in order:
//   group[g] = sum over k, then i, of x[r, c]   (rows past the end skipped: adding +0 is exact)
//   band[b]  = sum over g of group[g]            (stored in the workspace, [bands, cols])
//   dbias[c] = sum over b of band[b]
// A NaN sum is stored as the canonical NaN (numerics::kCanonicalNanBits), which is what the GPU's
// adds return.
constexpr int64_t kSumTileRows = 128;
constexpr int64_t kSumTiles = 2;
constexpr int64_t kSumGroupRows = 4;
constexpr int64_t kBandRows = kSumTiles * kSumTileRows;

FP8AMP_HD int64_t column_sum_bands(int64_t rows) { return (rows + kBandRows - 1) / kBandRows; }

namespace cpu {
// x: the runs of tensor.h's row_runs.
void amax(DType dtype, const void* x, const RowRuns& runs, float* amax, const int32_t* warmup_counter,
          int warmup_steps);
void quantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const ScalingPtrs& s);
// quantize of one tensor with s.current: zeroes amax[0] first (an output here, not a fold).
void quantize_current(DType in_dtype, DType out_dtype, const TensorSlice& tensor, const ScalingPtrs& s);
void dequantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const float* scale_inv);
// dbias (nullptr: none) and workspace: the column sums, see above.
void cast_transpose(DType in_dtype, DType out_dtype, const void* x, void* out, void* out_t, int64_t rows,
                    int64_t cols, const ScalingPtrs& s, float* dbias, float* workspace);
void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride);
void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2);
void update_delayed_scaling(const std::vector<DelayedScalingSlice>& states, float fmax, int margin, bool pow2);
}  // namespace cpu

namespace cuda {
void amax(DType dtype, const void* x, const RowRuns& runs, float* amax, const int32_t* warmup_counter,
          int warmup_steps, Stream stream);
void quantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const ScalingPtrs& s,
              Stream stream);
void quantize_current(DType in_dtype, DType out_dtype, const TensorSlice& tensor, const ScalingPtrs& s,
                      Stream stream);
void dequantize(DType in_dtype, DType out_dtype, const std::vector<TensorSlice>& tensors, const float* scale_inv,
                Stream stream);
void cast_transpose(DType in_dtype, DType out_dtype, const void* x, void* out, void* out_t, int64_t rows,
                    int64_t cols, const ScalingPtrs& s, float* dbias, float* workspace, Stream stream);
void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride,
                Stream stream);
void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2, Stream stream);
void update_delayed_scaling(const std::vector<DelayedScalingSlice>& states, float fmax, int margin, bool pow2,
                            Stream stream);
}  // namespace cuda

// ------------------------------------------------------------------------------------------------
// scaled_accumulate (cast.h): the element math and scale rule shared bit for bit by the CPU
// reference (accumulate_cpu.cpp) and the CUDA kernels (accumulate_cuda.cu).

struct AccumulatePtrs {
  void* dst;
  float* dst_scale_inv;
  const void* src;
  const float* src_scale_inv;  // nullptr: src holds high-precision values
  float alpha;
  float* amax;
  int64_t numel;
  int margin;
  bool pow2;
};

namespace accumulate {

// s = fl(fl(decode(d) * dst_scale_inv) + fl(alpha * v)), v = decode(x) [* src_scale_inv]: one
// IEEE rounding per operation (numerics.h's rn::), never an fma.
template <bool kScaledSrc, class Dst, class Src>
FP8AMP_HD float sum(Dst d, Src x, float dst_scale_inv, float src_scale_inv, float alpha) {
  float v = numerics::to_float(x);
  if constexpr (kScaledSrc) v = rn::mul(v, src_scale_inv);
  return rn::add(rn::mul(numerics::to_float(d), dst_scale_inv), rn::mul(alpha, v));
}

// The new (scale, scale_inv) from the amax of the sums: the recipe's rule; 1 for amax 0; NaN for
// a non-finite amax.
FP8AMP_HD numerics::ScalePair new_scale(float amax, float fmax, int margin, bool pow2) {
  if (!numerics::is_finite(amax)) {
    const float nan = numerics::bits_float(numerics::kCanonicalNanBits);
    return {nan, nan};
  }
  return numerics::scale_from_amax(amax, fmax, margin, pow2, {1.0f, 1.0f});
}

}  // namespace accumulate

namespace cpu {
void scaled_accumulate(DType dst_dtype, DType src_dtype, const AccumulatePtrs& p);
}  // namespace cpu

namespace cuda {
void scaled_accumulate(DType dst_dtype, DType src_dtype, const AccumulatePtrs& p, Stream stream);
}  // namespace cuda

}  // namespace fp8amp
