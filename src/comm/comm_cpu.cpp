// CPU reference of the comm op family (comm.h): the readable definition of correct for
// comm_cuda.cu.
#include <algorithm>
#include <cstring>

#include "comm/comm_kernels.h"
#include "common/dispatch.h"

namespace fp8amp {
namespace cpu {

void comm_quantize(DType in_dtype, DType out_dtype, const std::vector<BucketSlice>& tensors, const BucketPtrs& p) {
  bool non_finite = false;
  for (size_t i = 0; i < tensors.size(); ++i) non_finite = non_finite || !numerics::is_finite(p.amax[i]);
  int64_t end = 0;
  visit(HighPrecisionTypes{}, in_dtype, [&](auto in) {
    visit(Fp8Types{}, out_dtype, [&](auto o) {
      using In = decltype(in);
      using Out = decltype(o);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const In* x = static_cast<const In*>(tensors[i].in);
        Out* y = static_cast<Out*>(p.out) + tensors[i].offset;
        const float scale = comm::bucket_scale(p.amax[i], p.fmax).scale;
        for (int64_t j = 0; j < tensors[i].numel; ++j) {
          y[j] = numerics::quantize_to<Out>(rn::mul(numerics::to_float(x[j]), scale));
        }
        p.scale_inv[i] = comm::bucket_scale_inv(p.amax[i], p.fmax, non_finite);
        end = std::max(end, tensors[i].offset + tensors[i].numel);
      }
    });
  });
  std::memset(static_cast<uint8_t*>(p.out) + end, 0, static_cast<size_t>(p.out_numel - end));
}

namespace {

template <class Code, class Out>
void sum_shards(const std::vector<int64_t>& bounds, const ShardPtrs& p) {
  const Code* codes = static_cast<const Code*>(p.codes);
  Out* out = static_cast<Out*>(p.out);
  const auto value = [&](int64_t piece, int64_t c) {
    float v = 0.0f;
    for (int64_t j = 0; j < p.rows; ++j) {
      v = comm::add_copy(v, numerics::to_float(codes[j * p.cols + c]), p.scale_inv[j * p.scale_inv_row_stride + piece],
                         j == 0);
    }
    return comm::mean_of_sum(v, p.divisor);
  };
  for (size_t piece = 0; piece + 1 < bounds.size(); ++piece) {
    const int64_t begin = bounds[piece], end = bounds[piece + 1];
    const int64_t i = static_cast<int64_t>(piece);
    if constexpr (numerics::kIsFp8<Out>) {
      uint32_t key = 0;
      for (int64_t c = begin; c < end; ++c) key = std::max(key, numerics::amax_key(value(i, c)));
      const float amax = numerics::amax_from_key(key);
      const numerics::ScalePair pair = accumulate::new_scale(amax, numerics::format_max<Out>(), 0, true);
      for (int64_t c = begin; c < end; ++c) out[c - bounds[0]] = numerics::quantize_to<Out>(rn::mul(value(i, c), pair.scale));
      p.out_amax[i] = amax;
      p.out_scale_inv[i] = pair.scale_inv;
    } else {
      for (int64_t c = begin; c < end; ++c) out[c - bounds[0]] = numerics::round_to<Out>(value(i, c));
    }
  }
}

}  // namespace

void comm_sum_shards(DType code_dtype, DType out_dtype, const std::vector<int64_t>& bounds, const ShardPtrs& p) {
  visit(Fp8Types{}, code_dtype, [&](auto c) {
    using Code = decltype(c);
    if (is_high_precision(out_dtype)) {
      visit(HighPrecisionTypes{}, out_dtype, [&](auto o) { sum_shards<Code, decltype(o)>(bounds, p); });
    } else {
      visit(Fp8Types{}, out_dtype, [&](auto o) { sum_shards<Code, decltype(o)>(bounds, p); });
    }
  });
}

}  // namespace cpu
}  // namespace fp8amp
