// CPU reference of the scaling ops: the readable definition of correct for scaling_cuda.cu.
#include <vector>

#include "scaling/scaling_kernels.h"

namespace fp8amp {
namespace cpu {

void compute_scale(const float* amax, int64_t amax_stride, float* scale, float* scale_inv, int64_t n, float fmax,
                   int margin, bool pow2_scale) {
  for (int64_t i = 0; i < n; ++i) {
    const numerics::ScalePair pair =
        numerics::scale_from_amax(amax[i * amax_stride], fmax, margin, pow2_scale, {scale[i], scale_inv[i]});
    scale[i] = pair.scale;
    scale_inv[i] = pair.scale_inv;
  }
}

void update_delayed_scaling(const std::vector<DelayedScalingSlice>& states, float fmax, int margin, bool pow2_scale) {
  for (const DelayedScalingSlice& st : states) {
    for (int64_t i = 0; i < st.rows; ++i) {
      update_delayed_row(st.amax_history + i * st.history_len, st.history_len, st.scale + i, st.scale_inv + i,
                         st.counter + i, fmax, margin, pow2_scale);
    }
  }
}

}  // namespace cpu
}  // namespace fp8amp
