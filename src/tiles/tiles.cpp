// Public tile ops: validate the views once, then hand raw pointers to the CPU reference or the
// CUDA kernels (tiles_kernels.h).
#include "fp8amp/tiles.h"

#include "common/op_args.h"
#include "common/run_on.h"
#include "fp8amp/error.h"
#include "scaling/scaling_checks.h"
#include "tiles/tiles_kernels.h"

namespace fp8amp {

namespace {

// The checks both ops share: x and out a [rows, cols] pair of one shape, the tile sizes, and
// scale_inv float32 with one element per tile. Returns the tiling.
TileShape check_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv, int64_t tile_rows,
                      int64_t tile_cols, const char* op, const char* out_name) {
  check::contiguous(x, op, "x");
  FP8AMP_CHECK_VALUE(x.dim() >= 1, op, "x must have at least 1 dimension, got ", x.describe());
  check::same_shape(x, out, op, "x", out_name);
  check::contiguous(out, op, out_name);
  check::same_device(x, out, op, "x", out_name);
  check_tile_sizes(tile_rows, tile_cols, op);
  const int64_t cols = x.shape.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < x.shape.size(); ++d) rows *= x.shape[d];
  const TileShape t{rows, cols, tile_rows, tile_cols};
  check_float32(scale_inv, x, op, "scale_inv");
  FP8AMP_CHECK_VALUE(scale_inv.dim() == 2 && scale_inv.shape[0] == t.grid_rows() && scale_inv.shape[1] == t.grid_cols(),
                     op, "scale_inv must be float32 [", t.grid_rows(), ", ", t.grid_cols(), "] (one per ", tile_rows,
                     " x ", tile_cols, " tile of a [", rows, ", ", cols, "] matrix), got ", scale_inv.describe());
  check::no_overlap(x, out, op, "x", out_name);
  check::no_overlap(x, scale_inv, op, "x", "scale_inv");
  check::no_overlap(out, scale_inv, op, out_name, "scale_inv");
  return t;
}

}  // namespace

void check_tile_sizes(int64_t tile_rows, int64_t tile_cols, const char* op) {
  FP8AMP_CHECK_VALUE(tile_rows >= 1 && tile_cols >= 1, op, "tile_rows and tile_cols must be positive, got ",
                     tile_rows, " and ", tile_cols);
}

void quantize_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv, int64_t tile_rows,
                    int64_t tile_cols, const ScalingRecipe& recipe, Stream stream) {
  const char* op = "quantize_tiles";
  check::high_precision(x, op, "x");
  FP8AMP_CHECK_VALUE(is_fp8(out.dtype), op, "dtype must be float8_e4m3fn or float8_e5m2, got ", dtype_name(out.dtype));
  check_recipe(recipe, op);
  const TileShape t = check_tiles(x, out, scale_inv, tile_rows, tile_cols, op, "out");
  float* si = scale_inv.ptr<float>();
  run_on(
      x, op, [&] { cpu::quantize_tiles(x.dtype, out.dtype, x.data, out.data, si, t, recipe); },
      [&] { cuda::quantize_tiles(x.dtype, out.dtype, x.data, out.data, si, t, recipe, stream); });
}

void dequantize_tiles(const TensorView& x, const TensorView& scale_inv, const TensorView& out, int64_t tile_rows,
                      int64_t tile_cols, Stream stream) {
  const char* op = "dequantize_tiles";
  FP8AMP_CHECK_VALUE(is_fp8(x.dtype), op, "x must be float8_e4m3fn or float8_e5m2, got ", dtype_name(x.dtype));
  check::high_precision(out, op, "dtype");
  const TileShape t = check_tiles(x, out, scale_inv, tile_rows, tile_cols, op, "out");
  const float* si = scale_inv.ptr<const float>();
  run_on(
      x, op, [&] { cpu::dequantize_tiles(x.dtype, out.dtype, x.data, si, out.data, t); },
      [&] { cuda::dequantize_tiles(x.dtype, out.dtype, x.data, si, out.data, t, stream); });
}

}  // namespace fp8amp
