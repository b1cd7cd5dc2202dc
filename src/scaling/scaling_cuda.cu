// CUDA twin of scaling_cpu.cpp: one thread per tensor (per row of a delayed-scaling state), the
// CPU loop body as is.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/cuda_check.h"
#include "common/cuda_utils.cuh"
#include "scaling/scaling_kernels.h"

namespace fp8amp {
namespace cuda {
namespace {

constexpr int kScaleThreads = 128;

__global__ void compute_scale_kernel(const float* amax, int64_t amax_stride, float* scale, float* scale_inv,
                                     int64_t n, float fmax, int margin, bool pow2_scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const numerics::ScalePair pair =
      numerics::scale_from_amax(amax[i * amax_stride], fmax, margin, pow2_scale, {scale[i], scale_inv[i]});
  scale[i] = pair.scale;
  scale_inv[i] = pair.scale_inv;
}

// Up to kMaxStatesPerLaunch states a launch, by value (under the 4 KB of kernel parameters);
// thread g updates row g of the rows of all of them, in order.
constexpr int kMaxStatesPerLaunch = 64;

struct DelayedScalingBatch {
  DelayedScalingSlice states[kMaxStatesPerLaunch];
  int64_t row_begin[kMaxStatesPerLaunch + 1];
  int32_t count;
};
static_assert(sizeof(DelayedScalingBatch) + 16 <= 4096, "kernel parameters are limited to 4 KB");

__global__ void update_delayed_scaling_kernel(const DelayedScalingBatch batch, float fmax, int margin,
                                              bool pow2_scale) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= batch.row_begin[batch.count]) return;
  int k = 0;
  while (g >= batch.row_begin[k + 1]) ++k;
  const DelayedScalingSlice& st = batch.states[k];
  const int64_t i = g - batch.row_begin[k];
  update_delayed_row(st.amax_history + i * st.history_len, st.history_len, st.scale + i, st.scale_inv + i,
                     st.counter + i, fmax, margin, pow2_scale);
}

}  // namespace

void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2_scale, Stream stream) {
  if (n == 0) return;
  compute_scale_kernel<<<grid_size(ceil_div(n, kScaleThreads), "cast"), kScaleThreads, 0, cuda_stream(stream)>>>(
      amax, amax_stride, scale, scale_inv, n, fmax, margin, pow2_scale);
  FP8AMP_CUDA_CHECK_LAUNCH();
}

void update_delayed_scaling(const std::vector<DelayedScalingSlice>& states, float fmax, int margin, bool pow2_scale,
                            Stream stream) {
  for (size_t first = 0; first < states.size(); first += kMaxStatesPerLaunch) {
    DelayedScalingBatch batch{};
    batch.count = static_cast<int32_t>(std::min<size_t>(kMaxStatesPerLaunch, states.size() - first));
    for (int k = 0; k < batch.count; ++k) {
      batch.states[k] = states[first + k];
      batch.row_begin[k + 1] = batch.row_begin[k] + batch.states[k].rows;
    }
    const int64_t rows = batch.row_begin[batch.count];
    if (rows == 0) continue;
    update_delayed_scaling_kernel<<<grid_size(ceil_div(rows, kScaleThreads), "cast"), kScaleThreads, 0,
                                    cuda_stream(stream)>>>(batch, fmax, margin, pow2_scale);
    FP8AMP_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace cuda
}  // namespace fp8amp
