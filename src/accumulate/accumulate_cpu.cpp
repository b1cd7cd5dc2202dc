// CPU reference of scaled_accumulate (accumulate.h): the readable definition of correct for
// accumulate_cuda.cu. Two passes, as on the device: the sums and their amax, then the new scale
// and the sums again, quantized with it.
#include <algorithm>

#include "accumulate/accumulate_kernels.h"
#include "common/dispatch.h"

namespace fp8amp {
namespace cpu {

namespace {

template <class Dst, class Src, bool kScaledSrc>
void accumulate(const AccumulatePtrs& p) {
  Dst* dst = static_cast<Dst*>(p.dst);
  const Src* src = static_cast<const Src*>(p.src);
  const float dst_scale_inv = p.dst_scale_inv[0];
  const float src_scale_inv = kScaledSrc ? p.src_scale_inv[0] : 1.0f;
  const auto sum = [&](int64_t i) {
    return accumulate::sum<kScaledSrc>(dst[i], src[i], dst_scale_inv, src_scale_inv, p.alpha);
  };

  uint32_t key = 0;
  for (int64_t i = 0; i < p.numel; ++i) key = std::max(key, numerics::amax_key(sum(i)));
  const float amax = numerics::amax_from_key(key);
  const numerics::ScalePair pair = accumulate::new_scale(amax, numerics::format_max<Dst>(), p.margin, p.pow2_scale);

  // dst[i] is read (by sum(i)) before it is written, so src may be dst itself.
  for (int64_t i = 0; i < p.numel; ++i) dst[i] = numerics::quantize_to<Dst>(rn::mul(sum(i), pair.scale));
  p.amax[0] = amax;
  p.dst_scale_inv[0] = pair.scale_inv;
}

}  // namespace

void scaled_accumulate(DType dst_dtype, DType src_dtype, const AccumulatePtrs& p) {
  visit(ScaledFormatTypes{}, dst_dtype, [&](auto d) {
    using Dst = decltype(d);
    if (p.src_scale_inv != nullptr) {
      visit(ScaledFormatTypes{}, src_dtype, [&](auto s) { accumulate<Dst, decltype(s), true>(p); });
    } else {
      visit(HighPrecisionTypes{}, src_dtype, [&](auto s) { accumulate<Dst, decltype(s), false>(p); });
    }
  });
}

}  // namespace cpu
}  // namespace fp8amp
