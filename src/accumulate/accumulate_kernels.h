// What the scaled_accumulate kernels see (accumulate.h): raw pointers and sizes, already
// validated by accumulate.cpp, and the element math and scale rule shared bit for bit by the CPU
// reference (accumulate_cpu.cpp) and the CUDA kernels (accumulate_cuda.cu); the CPU one defines
// correct.
#pragma once

#include <cstdint>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

struct AccumulatePtrs {
  void* dst;
  float* dst_scale_inv;
  const void* src;
  const float* src_scale_inv;  // nullptr: src holds high-precision values
  float alpha;
  float* amax;
  int64_t numel;
  int margin;
  bool pow2_scale;
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
FP8AMP_HD numerics::ScalePair new_scale(float amax, float fmax, int margin, bool pow2_scale) {
  if (!numerics::is_finite(amax)) {
    const float nan = numerics::bits_float(numerics::kCanonicalNanBits);
    return {nan, nan};
  }
  return numerics::scale_from_amax(amax, fmax, margin, pow2_scale, {1.0f, 1.0f});
}

}  // namespace accumulate

namespace cpu {
void scaled_accumulate(DType dst_dtype, DType src_dtype, const AccumulatePtrs& p);
}  // namespace cpu

namespace cuda {
void scaled_accumulate(DType dst_dtype, DType src_dtype, const AccumulatePtrs& p, Stream stream);
}  // namespace cuda

}  // namespace fp8amp
