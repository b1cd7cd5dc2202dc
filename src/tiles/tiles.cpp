// Public tile ops: validate the views once, then hand raw pointers to the CPU reference or the
// CUDA kernels (tiles_kernels.h).
#include "fp8amp/tiles.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/op_args.h"
#include "common/run_on.h"
#include "fp8amp/error.h"
#include "scaling/scaling_checks.h"
#include "tiles/tiles_kernels.h"

namespace fp8amp {

namespace {

// x (named `arg`) viewed as a contiguous [rows, cols] matrix, cut into tile_rows x tile_cols tiles.
TileShape matrix_tiles(const TensorView& x, int64_t tile_rows, int64_t tile_cols, const char* op, const char* arg) {
  check::contiguous(x, op, arg);
  FP8AMP_CHECK_VALUE(x.dim() >= 1, op, arg, " must have at least 1 dimension, got ", x.describe());
  check_tile_sizes(tile_rows, tile_cols, op);
  return TileShape{matrix_rows(x.shape), x.shape.back(), tile_rows, tile_cols};
}

// scale_inv (named `arg`): float32 (uint8 for MXFP8's E8M0 codes) [grid_rows, grid_cols] of t,
// contiguous, on x's device.
void check_tile_scales(const TensorView& scale_inv, const TensorView& x, const TileShape& t, const char* op,
                       const char* arg, DType dtype = DType::kFloat32) {
  if (dtype == DType::kFloat32) {
    check_float32(scale_inv, x, op, arg);
  } else {
    check::dtype_is(scale_inv, dtype, op, arg);
    check::contiguous(scale_inv, op, arg);
    check::same_device(scale_inv, x, op, arg, "x");
  }
  FP8AMP_CHECK_VALUE(scale_inv.dim() == 2 && scale_inv.shape[0] == t.grid_rows() && scale_inv.shape[1] == t.grid_cols(),
                     op, arg, " must be ", dtype_name(dtype), " [", t.grid_rows(), ", ", t.grid_cols(), "] (one per ",
                     t.tile_rows, " x ", t.tile_cols, " tile of a [", t.rows, ", ", t.cols, "] matrix), got ",
                     scale_inv.describe());
}

// The transposed copy out_t of a cast: `dtype` [cols, rows] of x viewed as t, contiguous, on x's device.
void check_transposed(const TensorView& x, const TensorView& out_t, DType dtype, const TileShape& t, const char* op) {
  FP8AMP_CHECK_VALUE(out_t.dtype == dtype && out_t.dim() == 2 && out_t.shape[0] == t.cols && out_t.shape[1] == t.rows,
                     op, "out_t must be ", dtype_name(dtype), "[", t.cols, ", ", t.rows, "], got ", out_t.describe());
  check::contiguous(out_t, op, "out_t");
  check::same_device(x, out_t, op, "x", "out_t");
}

// out (named `out_name`) of x's shape, contiguous, on x's device.
void check_like(const TensorView& x, const TensorView& out, const char* op, const char* x_name, const char* out_name) {
  check::same_shape(x, out, op, x_name, out_name);
  check::contiguous(out, op, out_name);
  check::same_device(x, out, op, x_name, out_name);
}

// The checks quantize_tiles and dequantize_tiles share: x and out a [rows, cols] pair of one
// shape, the tile sizes, and scale_inv float32 with one element per tile. Returns the tiling.
TileShape check_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv, int64_t tile_rows,
                      int64_t tile_cols, const char* op, const char* out_name) {
  const TileShape t = matrix_tiles(x, tile_rows, tile_cols, op, "x");
  check_like(x, out, op, "x", out_name);
  check_tile_scales(scale_inv, x, t, op, "scale_inv");
  check::no_overlap(x, out, op, "x", out_name);
  check::no_overlap(x, scale_inv, op, "x", "scale_inv");
  check::no_overlap(out, scale_inv, op, out_name, "scale_inv");
  return t;
}

// How messages name the transpose's tile sizes (tile_rows_t, tile_cols_t): the Python tile_t pair.
constexpr char kTransposedTile[] = "tile_t's ";

void check_fp8(DType dtype, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(is_fp8(dtype), op, arg, " must be float8_e4m3fn or float8_e5m2, got ", dtype_name(dtype));
}

}  // namespace

void check_tile_sizes(int64_t tile_rows, int64_t tile_cols, const char* op, const char* owner) {
  FP8AMP_CHECK_VALUE(tile_rows >= 1 && tile_cols >= 1, op, owner, "tile_rows and tile_cols must be positive, got ",
                     tile_rows, " and ", tile_cols);
}

void quantize_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv, int64_t tile_rows,
                    int64_t tile_cols, const ScalingRecipe& recipe, Stream stream) {
  const char* op = "quantize_tiles";
  check::high_precision(x, op, "x");
  check_fp8(out.dtype, op, "dtype");
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
  check_fp8(x.dtype, op, "x");
  check::high_precision(out, op, "dtype");
  const TileShape t = check_tiles(x, out, scale_inv, tile_rows, tile_cols, op, "out");
  const float* si = scale_inv.ptr<const float>();
  run_on(
      x, op, [&] { cpu::dequantize_tiles(x.dtype, out.dtype, x.data, si, out.data, t); },
      [&] { cuda::dequantize_tiles(x.dtype, out.dtype, x.data, si, out.data, t, stream); });
}

void cast_transpose_tiles(const TensorView& x, const TensorView& out, const TensorView& scale_inv,
                          const TensorView& out_t, const TensorView& scale_inv_t, int64_t tile_rows, int64_t tile_cols,
                          int64_t tile_rows_t, int64_t tile_cols_t, const ScalingRecipe& recipe, Stream stream) {
  const char* op = "cast_transpose_tiles";
  check::high_precision(x, op, "x");
  check_fp8(out.dtype, op, "dtype");
  check_recipe(recipe, op);
  const TileShape t = matrix_tiles(x, tile_rows, tile_cols, op, "x");
  check_tile_sizes(tile_rows_t, tile_cols_t, op, kTransposedTile);
  const TileShape t_t{t.cols, t.rows, tile_rows_t, tile_cols_t};
  check_like(x, out, op, "x", "out");
  check_transposed(x, out_t, out.dtype, t, op);
  check_tile_scales(scale_inv, x, t, op, "scale_inv");
  check_tile_scales(scale_inv_t, x, t_t, op, "scale_inv_t");
  check::disjoint_writes({{&out, "out"}, {&scale_inv, "scale_inv"}, {&out_t, "out_t"}, {&scale_inv_t, "scale_inv_t"}},
                         {{&x, "x"}}, op);
  const CastTransposeTiles p{x.data, out.data, scale_inv.ptr<float>(), out_t.data, scale_inv_t.ptr<float>(), t, t_t};
  run_on(
      x, op, [&] { cpu::cast_transpose_tiles(x.dtype, out.dtype, p, recipe); },
      [&] { cuda::cast_transpose_tiles(x.dtype, out.dtype, p, recipe, stream); });
}

void scaled_accumulate_tiles(const TensorView& acc, const TensorView& acc_scale_inv, const TensorView& update,
                             const TensorView& out, const TensorView& scale_inv, int64_t tile_rows, int64_t tile_cols,
                             const ScalingRecipe& recipe, Stream stream) {
  const char* op = "scaled_accumulate_tiles";
  check_fp8(acc.dtype, op, "acc");
  check::high_precision(update, op, "update");
  FP8AMP_CHECK_VALUE(out.dtype == acc.dtype, op, "out must be ", dtype_name(acc.dtype), " (acc's format), got ",
                     out.describe());
  check_recipe(recipe, op);
  const TileShape t = matrix_tiles(acc, tile_rows, tile_cols, op, "acc");
  check_tile_scales(acc_scale_inv, acc, t, op, "acc_scale_inv");
  check_like(acc, update, op, "acc", "update");
  check_like(acc, out, op, "acc", "out");
  check_tile_scales(scale_inv, acc, t, op, "scale_inv");
  check::disjoint_writes({{&out, "out"}, {&scale_inv, "scale_inv"}},
                         {{&acc, "acc"}, {&acc_scale_inv, "acc_scale_inv"}, {&update, "update"}}, op);
  const AccumulateTiles p{acc.data, acc_scale_inv.ptr<const float>(), update.data, out.data, scale_inv.ptr<float>(), t};
  run_on(
      acc, op, [&] { cpu::scaled_accumulate_tiles(acc.dtype, update.dtype, p, recipe); },
      [&] { cuda::scaled_accumulate_tiles(acc.dtype, update.dtype, p, recipe, stream); });
}

namespace {

// MXFP8's casts: x (fp32/bf16/fp16) into out (E4M3/E5M2) with scales, and, when out_t is given,
// its transpose into out_t with scales_t, each by 1 x 32 blocks along its own rows.
void cast_mx(const TensorView& x, const TensorView& out, const TensorView& scales, const TensorView* out_t,
             const TensorView* scales_t, const char* op, Stream stream) {
  check::high_precision(x, op, "x");
  check_fp8(out.dtype, op, "dtype");
  const TileShape t = matrix_tiles(x, 1, kMxBlock, op, "x");
  const TileShape t_t = mx_blocks(t.cols, t.rows);
  check_like(x, out, op, "x", "out");
  check_tile_scales(scales, x, t, op, "scales", DType::kUInt8);
  if (out_t != nullptr) {
    check_transposed(x, *out_t, out.dtype, t, op);
    check_tile_scales(*scales_t, x, t_t, op, "scales_t", DType::kUInt8);
  }
  check::disjoint_writes({{&out, "out"}, {&scales, "scales"}, {out_t, "out_t"}, {scales_t, "scales_t"}}, {{&x, "x"}},
                         op);
  const CastTransposeMx p{x.data,
                          out.data,
                          scales.ptr<uint8_t>(),
                          out_t != nullptr ? out_t->data : nullptr,
                          scales_t != nullptr ? scales_t->ptr<uint8_t>() : nullptr,
                          t,
                          t_t};
  run_on(
      x, op, [&] { cpu::quantize_mx(x.dtype, out.dtype, p); },
      [&] { cuda::quantize_mx(x.dtype, out.dtype, p, stream); });
}

}  // namespace

void quantize_mx(const TensorView& x, const TensorView& out, const TensorView& scales, Stream stream) {
  cast_mx(x, out, scales, nullptr, nullptr, "quantize_mx", stream);
}

void cast_transpose_mx(const TensorView& x, const TensorView& out, const TensorView& scales, const TensorView& out_t,
                       const TensorView& scales_t, Stream stream) {
  cast_mx(x, out, scales, &out_t, &scales_t, "cast_transpose_mx", stream);
}

void dequantize_mx(const TensorView& x, const TensorView& scales, const TensorView& out, Stream stream) {
  const char* op = "dequantize_mx";
  check_fp8(x.dtype, op, "x");
  check::high_precision(out, op, "dtype");
  const TileShape t = matrix_tiles(x, 1, kMxBlock, op, "x");
  check_like(x, out, op, "x", "out");
  check_tile_scales(scales, x, t, op, "scales", DType::kUInt8);
  check::disjoint_writes({{&out, "out"}}, {{&x, "x"}, {&scales, "scales"}}, op);
  const uint8_t* s = scales.ptr<const uint8_t>();
  run_on(
      x, op, [&] { cpu::dequantize_mx(x.dtype, out.dtype, x.data, s, out.data, t); },
      [&] { cuda::dequantize_mx(x.dtype, out.dtype, x.data, s, out.data, t, stream); });
}

namespace {

constexpr int64_t kNormMaxDim = int64_t{1} << 32;  // rows and cols: the CUDA kernel's 32-bit divisions

// The tensors of multi_norm_tiles, checked: xs of one FP8 or FP16 dtype, contiguous, on one device,
// each with its scale_invs (one float32 per tile), viewed as matrices.
std::vector<NormTensor> norm_tensors(const std::vector<TensorView>& xs, const std::vector<TensorView>& scale_invs,
                                     int64_t tile_rows, int64_t tile_cols, const char* op) {
  FP8AMP_CHECK_VALUE(!xs.empty(), op, "xs must hold at least one tensor");
  FP8AMP_CHECK_VALUE(scale_invs.size() == xs.size(), op, "scale_invs must hold as many tensors as xs (", xs.size(),
                     "), got ", scale_invs.size());
  check::scaled_format(xs[0].dtype, op, "xs");
  check_tile_sizes(tile_rows, tile_cols, op);
  std::vector<NormTensor> tensors;
  tensors.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const TensorView& x = xs[i];
    const ListItem x_name("xs", i), s_name("scale_invs", i);
    FP8AMP_CHECK_VALUE(x.dtype == xs[0].dtype, op, "xs must share one dtype: xs[0] is ", xs[0].describe(), ", ",
                       x_name.c_str(), " is ", x.describe());
    check::same_device(x, xs[0], op, x_name.c_str(), "xs[0]");
    check::contiguous(x, op, x_name.c_str());
    FP8AMP_CHECK_VALUE(x.dim() >= 1, op, x_name.c_str(), " must have at least 1 dimension, got ", x.describe());
    const int64_t rows = matrix_rows(x.shape), cols = x.shape.back();
    FP8AMP_CHECK_VALUE(rows < kNormMaxDim && cols < kNormMaxDim, op, x_name.c_str(),
                       " viewed as [rows, cols] must have fewer than 2^32 of each, got ", x.describe());
    // Tiles larger than the matrix tile it as the matrix itself does (and keep the sums below from
    // overflowing).
    const TileShape t{rows, cols, std::min(tile_rows, std::max<int64_t>(rows, 1)),
                      std::min(tile_cols, std::max<int64_t>(cols, 1))};
    const TensorView& scale_inv = scale_invs[i];
    check::dtype_is(scale_inv, DType::kFloat32, op, s_name.c_str());
    check::contiguous(scale_inv, op, s_name.c_str());
    check::same_device(scale_inv, x, op, s_name.c_str(), x_name.c_str());
    // (A tensor of no elements has norm 0: its scale_inv, if any, is not read.)
    const int64_t tiles = t.grid_rows() * t.grid_cols();
    FP8AMP_CHECK_VALUE(x.numel() == 0 || scale_inv.numel() == tiles, op, s_name.c_str(), " must hold ", tiles,
                       " float32 (one per ", t.tile_rows, " x ", t.tile_cols, " tile of a [", t.rows, ", ", t.cols,
                       "] matrix, ", t.grid_rows(), " x ", t.grid_cols(), "), got ", scale_inv.describe());
    tensors.push_back(NormTensor{x.data, scale_inv.ptr<const float>(), t});
  }
  return tensors;
}

}  // namespace

int64_t multi_norm_tiles_workspace(const std::vector<TensorView>& xs) {
  int64_t items = 0;
  for (const TensorView& x : xs) items += norm_items(matrix_rows(x.shape), x.dim() >= 1 ? x.shape.back() : 1).count;
  return items * static_cast<int64_t>(sizeof(double));
}

void multi_norm_tiles(const std::vector<TensorView>& xs, const std::vector<TensorView>& scale_invs, int64_t tile_rows,
                      int64_t tile_cols, const TensorView& out, const TensorView& workspace, Stream stream) {
  const char* op = "multi_norm_tiles";
  const std::vector<NormTensor> tensors = norm_tensors(xs, scale_invs, tile_rows, tile_cols, op);
  check_float32(out, xs[0], op, "out");
  check::numel_is(out, static_cast<int64_t>(xs.size()), op, "out");
  check::dtype_is(workspace, DType::kUInt8, op, "workspace");
  check::contiguous(workspace, op, "workspace");
  check::same_device(workspace, xs[0], op, "workspace", "xs[0]");
  check::numel_at_least(workspace, multi_norm_tiles_workspace(xs), op, "workspace");
  FP8AMP_CHECK_VALUE(reinterpret_cast<uintptr_t>(workspace.data) % alignof(double) == 0, op,
                     "workspace must be 8-byte aligned");
  std::vector<const TensorView*> read;
  for (const auto* list : {&xs, &scale_invs}) {
    for (const TensorView& t : *list) read.push_back(&t);
  }
  check::disjoint_writes({}, read, {{&out, "out"}, {&workspace, "workspace"}}, {}, op, [&](bool, size_t i) {
    return std::string(i < xs.size() ? ListItem("xs", i).c_str() : ListItem("scale_invs", i - xs.size()).c_str());
  });
  float* o = out.ptr<float>();
  run_on(
      xs[0], op, [&] { cpu::multi_norm_tiles(xs[0].dtype, tensors, o); },
      [&] { cuda::multi_norm_tiles(xs[0].dtype, tensors, o, static_cast<double*>(workspace.data), stream); });
}

}  // namespace fp8amp
