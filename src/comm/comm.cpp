// Public comm ops: validate the views once, then hand raw pointers to the CPU reference or the
// CUDA kernels (comm_kernels.h).
#include "fp8amp/comm.h"

#include <cmath>
#include <string>

#include "comm/comm_kernels.h"
#include "common/op_args.h"
#include "common/run_on.h"
#include "fp8amp/error.h"

namespace fp8amp {

void comm_quantize(const std::vector<TensorView>& xs, const TensorView& amax_in, float fmax, const TensorView& out,
                   const TensorView& scale_inv, Stream stream) {
  const char* op = "comm_quantize";
  FP8AMP_CHECK_VALUE(!xs.empty(), op, "xs must hold at least one tensor");
  FP8AMP_CHECK_VALUE(std::isfinite(fmax) && fmax > 0.0f, op, "fmax must be positive and finite, got ", fmax);
  FP8AMP_CHECK_VALUE(is_fp8(out.dtype), op, "out must be float8_e4m3fn or float8_e5m2, got ", out.describe());
  check::contiguous(out, op, "out");
  const int64_t count = static_cast<int64_t>(xs.size());
  std::vector<BucketSlice> slices;
  slices.reserve(xs.size());
  std::vector<const TensorView*> x_views;
  int64_t offset = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::string name = element_name(Arity::kMulti, "x", "xs", i);
    FP8AMP_CHECK_VALUE(xs[i].dtype == xs[0].dtype, op, "xs must share one dtype: xs[0] is ", xs[0].describe(), ", ",
                       name, " is ", xs[i].describe());
    check::high_precision(xs[i], op, name.c_str());
    check::contiguous(xs[i], op, name.c_str());
    check::same_device(xs[i], out, op, name.c_str(), "out");
    slices.push_back(BucketSlice{xs[i].data, offset, xs[i].numel()});
    offset += xs[i].numel();
    x_views.push_back(&xs[i]);
  }
  FP8AMP_CHECK_VALUE(out.numel() >= offset, op, "out must hold at least the ", offset,
                     " elements of xs together, got ", out.describe());
  check_float32(amax_in, out, op, "amax");
  check::numel_is(amax_in, count, op, "amax");
  check_float32(scale_inv, out, op, "scale_inv");
  check::numel_is(scale_inv, count, op, "scale_inv");
  check::disjoint_writes({}, x_views, {{&out, "out"}, {&scale_inv, "scale_inv"}}, {{&amax_in, "amax"}}, op,
                         [](bool, size_t i) { return element_name(Arity::kMulti, "x", "xs", i); });
  const BucketPtrs p{amax_in.ptr<const float>(), fmax, out.data, out.numel(), scale_inv.ptr<float>()};
  run_on(
      out, op, [&] { cpu::comm_quantize(xs[0].dtype, out.dtype, slices, p); },
      [&] { cuda::comm_quantize(xs[0].dtype, out.dtype, slices, p, stream); });
}

void comm_sum_shards(const TensorView& codes, const TensorView& scale_inv, const std::vector<int64_t>& bounds,
                     float divisor, const TensorView& out, const TensorView* out_scale_inv,
                     const TensorView* out_amax, Stream stream) {
  const char* op = "comm_sum_shards";
  FP8AMP_CHECK_VALUE(is_fp8(codes.dtype), op, "codes must be float8_e4m3fn or float8_e5m2, got ", codes.describe());
  check::dim_is(codes, 2, op, "codes");
  check::contiguous(codes, op, "codes");
  const int64_t rows = codes.shape[0], cols = codes.shape[1];
  FP8AMP_CHECK_VALUE(rows >= 1, op, "codes must have at least one row (one received copy), got ", codes.describe());
  FP8AMP_CHECK_VALUE(bounds.size() >= 2, op, "bounds must hold at least 2 offsets (one piece), got ", bounds.size());
  const int64_t pieces = static_cast<int64_t>(bounds.size()) - 1;
  for (size_t k = 0; k < bounds.size(); ++k) {
    FP8AMP_CHECK_VALUE(bounds[k] >= 0 && bounds[k] <= cols && (k == 0 || bounds[k] >= bounds[k - 1]), op,
                       "bounds must be non-decreasing offsets in [0, ", cols, "] (the columns of codes), got bounds[",
                       k, "] = ", bounds[k], k > 0 ? " after " : "", k > 0 ? std::to_string(bounds[k - 1]) : "");
  }
  FP8AMP_CHECK_VALUE(std::isfinite(divisor) && divisor > 0.0f, op, "divisor must be positive and finite, got ",
                     divisor);
  check_float32(scale_inv, codes, op, "scale_inv");
  FP8AMP_CHECK_VALUE(scale_inv.numel() == pieces || scale_inv.numel() == rows * pieces, op,
                     "scale_inv must hold one value per piece (", pieces, ") or per row and piece (", rows * pieces,
                     "), got ", scale_inv.describe());
  check::contiguous(out, op, "out");
  check::same_device(out, codes, op, "out", "codes");
  check::numel_is(out, bounds.back() - bounds.front(), op, "out");
  const bool requantize = is_fp8(out.dtype);
  FP8AMP_CHECK_VALUE(requantize || is_high_precision(out.dtype), op,
                     "out must be float32, bfloat16 or float16 (the sum) or float8_e4m3fn or float8_e5m2 (the sum "
                     "requantized), got ", out.describe());
  FP8AMP_CHECK_VALUE(requantize == (out_scale_inv != nullptr) && requantize == (out_amax != nullptr), op,
                     requantize ? "out_scale_inv and out_amax are required when out is FP8 (the sum requantized)"
                                : "out_scale_inv and out_amax apply only to an FP8 out (the sum requantized)");
  if (requantize) {
    check_float32(*out_scale_inv, codes, op, "out_scale_inv");
    check::numel_is(*out_scale_inv, pieces, op, "out_scale_inv");
    check_float32(*out_amax, codes, op, "out_amax");
    check::numel_is(*out_amax, pieces, op, "out_amax");
  }
  check::disjoint_writes({{&out, "out"}, {out_scale_inv, "out_scale_inv"}, {out_amax, "out_amax"}},
                         {{&codes, "codes"}, {&scale_inv, "scale_inv"}}, op);
  const ShardPtrs p{codes.data, rows, cols, scale_inv.ptr<const float>(),
                    scale_inv.numel() == pieces ? 0 : pieces, divisor, out.data,
                    requantize ? out_scale_inv->ptr<float>() : nullptr, requantize ? out_amax->ptr<float>() : nullptr};
  run_on(
      codes, op, [&] { cpu::comm_sum_shards(codes.dtype, out.dtype, bounds, p); },
      [&] { cuda::comm_sum_shards(codes.dtype, out.dtype, bounds, p, stream); });
}

}  // namespace fp8amp
