// What the comm kernels see (comm.h): raw pointers and sizes, already validated by comm.cpp, and
// the element math that the CPU reference (comm_cpu.cpp) and the CUDA kernels (comm_cuda.cu) share
// bit for bit; the CPU one defines correct.
#pragma once

#include <cstdint>
#include <vector>

#include "accumulate/accumulate_kernels.h"
#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// comm_quantize: tensor i is numel[i] elements at in[i], its codes at out + offset[i].
struct BucketSlice {
  const void* in;
  int64_t offset;
  int64_t numel;
};

struct BucketPtrs {
  const float* amax;  // [T]
  float fmax;
  void* out;
  int64_t out_numel;  // the tail after the last tensor is zeroed
  float* scale_inv;   // [T]
};

// comm_sum_shards. Piece p = columns [bounds[p], bounds[p + 1]) of every row.
struct ShardPtrs {
  const void* codes;  // [rows, cols]
  int64_t rows;
  int64_t cols;
  const float* scale_inv;  // row j, piece p at j * scale_inv_row_stride + p
  int64_t scale_inv_row_stride;
  float divisor;
  void* out;  // column c at out[c - bounds[0]]
  float* out_scale_inv;  // requantized output only (else nullptr)
  float* out_amax;
};

namespace comm {

// The scale tensor i is quantized with: the pow2 rule, 1 for an amax of 0 or a non-finite one.
FP8AMP_HD numerics::ScalePair bucket_scale(float amax, float fmax) {
  return numerics::scale_from_amax(amax, fmax, 0, true, {1.0f, 1.0f});
}

// The scale_inv written for a tensor of the bucket: NaN when any amax of the bucket is non-finite.
FP8AMP_HD float bucket_scale_inv(float amax, float fmax, bool bucket_non_finite) {
  return bucket_non_finite ? numerics::bits_float(0x7FC00000u) : bucket_scale(amax, fmax).scale_inv;
}

// d_j = fl(decode(code) * s_j), accumulated in rank order: the running sum after row j.
FP8AMP_HD float add_copy(float sum, float code_value, float scale_inv, bool first) {
  const float d = rn::mul(code_value, scale_inv);
  return first ? d : rn::add(sum, d);
}

// v / divisor, a NaN as the GPU's float operations return it (the host's keep an operand's payload),
// so that a float32 output holds the same bits on both.
FP8AMP_HD float mean_of_sum(float sum, float divisor) {
  const float v = rn::div(sum, divisor);
  return numerics::is_nan(v) ? numerics::bits_float(numerics::kCanonicalNanBits) : v;
}

}  // namespace comm

namespace cpu {
void comm_quantize(DType in_dtype, DType out_dtype, const std::vector<BucketSlice>& tensors, const BucketPtrs& p);
void comm_sum_shards(DType code_dtype, DType out_dtype, const std::vector<int64_t>& bounds, const ShardPtrs& p);
}  // namespace cpu

namespace cuda {
void comm_quantize(DType in_dtype, DType out_dtype, const std::vector<BucketSlice>& tensors, const BucketPtrs& p,
                   Stream stream);
void comm_sum_shards(DType code_dtype, DType out_dtype, const std::vector<int64_t>& bounds, const ShardPtrs& p,
                     Stream stream);
}  // namespace cuda

}  // namespace fp8amp
