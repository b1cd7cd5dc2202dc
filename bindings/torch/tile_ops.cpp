// torch.library registration of the tile ops (fp8amp/tiles.h, docs/tiles.md): fine-grained
// scaling with one scale per tile_rows x tile_cols tile. Argument plumbing only, as in ops.cpp;
// every op has CPU, CUDA and Meta (fake) kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "binding_utils.h"
#include "fp8amp/error.h"
#include "fp8amp/tiles.h"
#include "meta_kernel.h"

namespace fp8amp::torch_binding {
namespace {

// The scale_inv of tiles of a [rows, cols] matrix, [ceil(rows / tile_rows), ceil(cols / tile_cols)],
// symbolic for the Meta kernels; the tile sizes are the core's to check first (a zero would divide
// by zero here).
at::Tensor empty_tile_scales(const at::Tensor& x, const c10::SymInt& rows, const c10::SymInt& cols, int64_t tile_rows,
                             int64_t tile_cols, const char* op, const char* owner = "") {
  call(x, [&](Stream) { fp8amp::check_tile_sizes(tile_rows, tile_cols, op, owner); });
  return at::empty_symint({(rows + tile_rows - 1) / tile_rows, (cols + tile_cols - 1) / tile_cols},
                          x.options().dtype(at::kFloat));
}

// The scale_inv of x's tiles.
at::Tensor empty_tile_scales(const at::Tensor& x, int64_t tile_rows, int64_t tile_cols, const char* op) {
  return empty_tile_scales(x, matrix_rows(x.sym_sizes()), columns(x), tile_rows, tile_cols, op);
}

// The scale_inv of the tiles of x's transpose.
at::Tensor empty_transposed_tile_scales(const at::Tensor& x, int64_t tile_rows_t, int64_t tile_cols_t, const char* op) {
  return empty_tile_scales(x, columns(x), matrix_rows(x.sym_sizes()), tile_rows_t, tile_cols_t, op, "tile_t's ");
}

std::tuple<at::Tensor, at::Tensor> quantize_tiles(const at::Tensor& x, at::ScalarType dtype, int64_t tile_rows,
                                                  int64_t tile_cols, int64_t margin, bool pow2_scale) {
  const char* op = "quantize_tiles";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor scale_inv = empty_tile_scales(x, tile_rows, tile_cols, op);
  call(x, [&](Stream stream) {
    fp8amp::quantize_tiles(view(x, op, "x"), view(out, op, "dtype"), view(scale_inv, op, "scale_inv"), tile_rows,
                           tile_cols, ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale}, stream);
  });
  return {out, scale_inv};
}

at::Tensor dequantize_tiles(const at::Tensor& x, const at::Tensor& scale_inv, int64_t tile_rows, int64_t tile_cols,
                            at::ScalarType dtype) {
  const char* op = "dequantize_tiles";
  at::Tensor out = empty_as(x, dtype);
  call(x, [&](Stream stream) {
    fp8amp::dequantize_tiles(view(x, op, "x"), view(scale_inv, op, "scale_inv"), view(out, op, "dtype"), tile_rows,
                             tile_cols, stream);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cast_transpose_tiles(
    const at::Tensor& x, at::ScalarType dtype, int64_t tile_rows, int64_t tile_cols, int64_t tile_rows_t,
    int64_t tile_cols_t, int64_t margin, bool pow2_scale) {
  const char* op = "cast_transpose_tiles";
  at::Tensor out = empty_as(x, dtype);
  at::Tensor scale_inv = empty_tile_scales(x, tile_rows, tile_cols, op);
  at::Tensor out_t = empty_transposed(x, dtype);
  at::Tensor scale_inv_t = empty_transposed_tile_scales(x, tile_rows_t, tile_cols_t, op);
  call(x, [&](Stream stream) {
    fp8amp::cast_transpose_tiles(view(x, op, "x"), view(out, op, "dtype"), view(scale_inv, op, "scale_inv"),
                                 view(out_t, op, "dtype"), view(scale_inv_t, op, "scale_inv_t"), tile_rows, tile_cols,
                                 tile_rows_t, tile_cols_t, ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale},
                                 stream);
  });
  return {out, scale_inv, out_t, scale_inv_t};
}

std::tuple<at::Tensor, at::Tensor> scaled_accumulate_tiles(const at::Tensor& acc, const at::Tensor& acc_scale_inv,
                                                           const at::Tensor& update, int64_t tile_rows,
                                                           int64_t tile_cols, int64_t margin, bool pow2_scale) {
  const char* op = "scaled_accumulate_tiles";
  at::Tensor out = empty_as(acc, acc.scalar_type());
  at::Tensor scale_inv = empty_tile_scales(acc, tile_rows, tile_cols, op);
  call(acc, [&](Stream stream) {
    fp8amp::scaled_accumulate_tiles(view(acc, op, "acc"), view(acc_scale_inv, op, "acc_scale_inv"),
                                    view(update, op, "update"), view(out, op, "out"), view(scale_inv, op, "scale_inv"),
                                    tile_rows, tile_cols, ScalingRecipe{narrow_int(margin, op, "margin"), pow2_scale},
                                    stream);
  });
  return {out, scale_inv};
}

// The norms' output: float32 [len(xs)] on xs' device. An empty xs has no device: then a CPU
// tensor, for the core to refuse the list.
at::Tensor empty_norms(at::TensorList xs) {
  const at::Tensor first = xs.empty() ? at::empty({0}) : xs[0];
  return at::empty({static_cast<int64_t>(xs.size())}, first.options().dtype(at::kFloat));
}

at::Tensor multi_norm_tiles(at::TensorList xs, at::TensorList scale_invs, int64_t tile_rows, int64_t tile_cols) {
  const char* op = "multi_norm_tiles";
  at::Tensor out = empty_norms(xs);
  call(out, [&](Stream stream) {
    const std::vector<TensorView> x_views = views(xs, op, "xs");
    at::Tensor workspace = at::empty({fp8amp::multi_norm_tiles_workspace(x_views)}, out.options().dtype(at::kByte));
    fp8amp::multi_norm_tiles(x_views, views(scale_invs, op, "scale_invs"), tile_rows, tile_cols, view(out, op, "out"),
                             view(workspace, op, "workspace"), stream);
  });
  return out;
}

at::Tensor multi_norm_tiles_meta(at::TensorList xs, at::TensorList, int64_t, int64_t) { return empty_norms(xs); }

std::tuple<at::Tensor, at::Tensor> quantize_tiles_meta(const at::Tensor& x, at::ScalarType dtype, int64_t tile_rows,
                                                       int64_t tile_cols, int64_t, bool) {
  return {empty_as(x, dtype), empty_tile_scales(x, tile_rows, tile_cols, "quantize_tiles")};
}

at::Tensor dequantize_tiles_meta(const at::Tensor& x, const at::Tensor&, int64_t, int64_t, at::ScalarType dtype) {
  return empty_as(x, dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cast_transpose_tiles_meta(
    const at::Tensor& x, at::ScalarType dtype, int64_t tile_rows, int64_t tile_cols, int64_t tile_rows_t,
    int64_t tile_cols_t, int64_t, bool) {
  const char* op = "cast_transpose_tiles";
  return {empty_as(x, dtype), empty_tile_scales(x, tile_rows, tile_cols, op), empty_transposed(x, dtype),
          empty_transposed_tile_scales(x, tile_rows_t, tile_cols_t, op)};
}

std::tuple<at::Tensor, at::Tensor> scaled_accumulate_tiles_meta(const at::Tensor& acc, const at::Tensor&,
                                                                const at::Tensor&, int64_t tile_rows,
                                                                int64_t tile_cols, int64_t, bool) {
  return {empty_as(acc, acc.scalar_type()), empty_tile_scales(acc, tile_rows, tile_cols, "scaled_accumulate_tiles")};
}

constexpr char kQuantizeTiles[] = "quantize_tiles";
constexpr char kDequantizeTiles[] = "dequantize_tiles";
constexpr char kCastTransposeTiles[] = "cast_transpose_tiles";
constexpr char kScaledAccumulateTiles[] = "scaled_accumulate_tiles";
constexpr char kMultiNormTiles[] = "multi_norm_tiles";

}  // namespace
}  // namespace fp8amp::torch_binding

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  m.def(
      "quantize_tiles(Tensor x, ScalarType dtype, int tile_rows, int tile_cols, int margin=0, bool pow2_scale=True) "
      "-> (Tensor, Tensor)");
  m.def("dequantize_tiles(Tensor x, Tensor scale_inv, int tile_rows, int tile_cols, ScalarType dtype) -> Tensor");
  m.def(
      "cast_transpose_tiles(Tensor x, ScalarType dtype, int tile_rows, int tile_cols, int tile_rows_t, "
      "int tile_cols_t, int margin=0, bool pow2_scale=True) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "scaled_accumulate_tiles(Tensor acc, Tensor acc_scale_inv, Tensor update, int tile_rows, int tile_cols, "
      "int margin=0, bool pow2_scale=True) -> (Tensor, Tensor)");
  m.def("multi_norm_tiles(Tensor[] xs, Tensor[] scale_invs, int tile_rows, int tile_cols) -> Tensor");
}

#define FP8AMP_REGISTER_TILE_KERNELS(m)                                        \
  m.impl("quantize_tiles", fp8amp::torch_binding::quantize_tiles);             \
  m.impl("dequantize_tiles", fp8amp::torch_binding::dequantize_tiles);         \
  m.impl("cast_transpose_tiles", fp8amp::torch_binding::cast_transpose_tiles); \
  m.impl("scaled_accumulate_tiles", fp8amp::torch_binding::scaled_accumulate_tiles); \
  m.impl("multi_norm_tiles", fp8amp::torch_binding::multi_norm_tiles)

TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { FP8AMP_REGISTER_TILE_KERNELS(m); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { FP8AMP_REGISTER_TILE_KERNELS(m); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("quantize_tiles", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kQuantizeTiles,
                                                            fp8amp::torch_binding::quantize_tiles_meta>::run);
  m.impl("dequantize_tiles", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kDequantizeTiles,
                                                              fp8amp::torch_binding::dequantize_tiles_meta>::run);
  m.impl("cast_transpose_tiles",
         &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCastTransposeTiles,
                                            fp8amp::torch_binding::cast_transpose_tiles_meta>::run);
  m.impl("scaled_accumulate_tiles",
         &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kScaledAccumulateTiles,
                                            fp8amp::torch_binding::scaled_accumulate_tiles_meta>::run);
  m.impl("multi_norm_tiles", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kMultiNormTiles,
                                                              fp8amp::torch_binding::multi_norm_tiles_meta>::run);
}
TORCH_LIBRARY_IMPL(fp8amp, Autograd, m) {
  fp8amp::torch_binding::register_no_derivative(
      m, "quantize_tiles", "cast_transpose_tiles", "dequantize_tiles", "scaled_accumulate_tiles", "multi_norm_tiles");
}
