// Public scaled_accumulate: validate the views once, then hand raw pointers to the CPU reference
// or the CUDA kernels (accumulate_kernels.h).
#include "fp8amp/accumulate.h"

#include <utility>

#include "accumulate/accumulate_kernels.h"
#include "common/run_on.h"
#include "fp8amp/error.h"
#include "scaling/scaling_checks.h"

namespace fp8amp {

namespace {

// A float32 [1] buffer on dst's device.
void check_scalar_buffer(const TensorView& t, const TensorView& dst, const char* op, const char* arg) {
  check::dtype_is(t, DType::kFloat32, op, arg);
  check::numel_is(t, 1, op, arg);
  check::same_device(t, dst, op, arg, "dst");
}

}  // namespace

void scaled_accumulate(const TensorView& dst, const TensorView& dst_scale_inv, const TensorView& src,
                       const TensorView* src_scale_inv, float alpha, const TensorView& amax_out,
                       const ScalingRecipe& recipe, Stream stream) {
  const char* op = "scaled_accumulate";
  FP8AMP_CHECK_VALUE(is_scaled_format(dst.dtype), op, "dst must be float8_e4m3fn, float8_e5m2 or float16, got ",
                     dst.describe());
  check::contiguous(dst, op, "dst");
  check_scalar_buffer(dst_scale_inv, dst, op, "dst_scale_inv");
  if (src_scale_inv == nullptr) {
    FP8AMP_CHECK_VALUE(is_high_precision(src.dtype), op,
                       "src must be float32, bfloat16 or float16 when src_scale_inv is None (a scaled src, "
                       "float8_e4m3fn, float8_e5m2 or float16, comes with src_scale_inv), got ",
                       src.describe());
  } else {
    FP8AMP_CHECK_VALUE(is_scaled_format(src.dtype), op,
                       "src must be float8_e4m3fn, float8_e5m2 or float16 when src_scale_inv is given (a "
                       "high-precision src, float32 or bfloat16, takes src_scale_inv=None), got ",
                       src.describe());
    check_scalar_buffer(*src_scale_inv, dst, op, "src_scale_inv");
  }
  check::same_device(src, dst, op, "src", "dst");
  check::contiguous(src, op, "src");
  FP8AMP_CHECK_VALUE(src.numel() == dst.numel(), op, "src must have as many elements as dst (", dst.numel(),
                     "), got ", src.describe());
  check_scalar_buffer(amax_out, dst, op, "amax");
  check_recipe(recipe, op);
  // dst is rewritten in place, element by element: src may be dst itself (same memory, same
  // format), never part of it; the scalars must be their own memory (amax is zeroed first and
  // dst_scale_inv rewritten last; src_scale_inv may be dst_scale_inv, read before that).
  if (!(src.data == dst.data && src.dtype == dst.dtype)) check::no_overlap(dst, src, op, "dst", "src");
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&dst, "dst"}, {&src, "src"}}) {
    check::no_overlap(*t, dst_scale_inv, op, name, "dst_scale_inv");
    check::no_overlap(*t, amax_out, op, name, "amax");
    if (src_scale_inv != nullptr) check::no_overlap(*t, *src_scale_inv, op, name, "src_scale_inv");
  }
  check::no_overlap(amax_out, dst_scale_inv, op, "amax", "dst_scale_inv");
  if (src_scale_inv != nullptr) check::no_overlap(amax_out, *src_scale_inv, op, "amax", "src_scale_inv");
  const AccumulatePtrs p{dst.data,     dst_scale_inv.ptr<float>(),
                         src.data,     src_scale_inv != nullptr ? src_scale_inv->ptr<const float>() : nullptr,
                         alpha,        amax_out.ptr<float>(),
                         dst.numel(),  recipe.margin,
                         recipe.pow2_scale};
  run_on(
      dst, op, [&] { cpu::scaled_accumulate(dst.dtype, src.dtype, p); },
      [&] { cuda::scaled_accumulate(dst.dtype, src.dtype, p, stream); });
}

}  // namespace fp8amp
