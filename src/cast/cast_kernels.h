// What the cast kernels see: raw pointers, sizes and scaling buffers (ScalingPtrs, in
// scaling_kernels.h), already validated by cast.cpp. Each function has a CPU reference
// (cast_cpu.cpp) and a CUDA twin (cast_cuda.cu) with the same signature; the CPU one defines
// correct.
#pragma once

#include <cstdint>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"
#include "scaling/scaling_kernels.h"

namespace fp8amp {

// One tensor of a multi-tensor op.
struct TensorSlice {
  const void* in;
  void* out;
  int64_t numel;
};

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

// The scale of cast_transpose_rescaled: x's scale_inv times the output's scale, one float32
// multiply (what torch's mul of the two gave before the op took both), the same on both devices.
struct RescalePtrs {
  const float* scale_inv;
  const float* scale;
};

FP8AMP_HD float rescaled_scale(const RescalePtrs& r) { return rn::mul(r.scale_inv[0], r.scale[0]); }

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
// x: FP16 codes [rows, cols]; out_t [cols, rows] in out_dtype.
void cast_transpose_rescaled(DType out_dtype, const numerics::fp16* x, void* out_t, int64_t rows, int64_t cols,
                             const RescalePtrs& rescale);
void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride);
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
void cast_transpose_rescaled(DType out_dtype, const numerics::fp16* x, void* out_t, int64_t rows, int64_t cols,
                             const RescalePtrs& rescale, Stream stream);
void multi_amax(DType dtype, const std::vector<TensorSlice>& tensors, float* amax, int64_t amax_stride,
                Stream stream);
}  // namespace cuda

}  // namespace fp8amp
