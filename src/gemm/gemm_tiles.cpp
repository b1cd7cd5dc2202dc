// Public tile-scaled GEMM op (gemm.h, gemm_tiles): validates the views once, with cuBLASLt's FP8
// and scale-mode rules on every device, then hands raw pointers to the CPU reference or the
// cuBLASLt path (gemm_tiles_kernels.h).
#include <cstdint>

#include "common/run_on.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"
#include "gemm/gemm_checks.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {

namespace {

constexpr const char* kOp = "gemm_tiles";

// The scaling of an operand tiled tile_rows x tile_cols along a contraction of k.
TileScaling tile_scaling(int64_t tile_rows, int64_t tile_cols, int64_t k, const char* arg) {
  if (tile_rows == 1 && tile_cols == kTileBlock) return TileScaling::kTile1x128;
  if (tile_rows == kTileBlock && tile_cols == kTileBlock) return TileScaling::kBlock128x128;
  if (tile_rows == 1 && tile_cols >= k && tile_cols >= 1) return TileScaling::kRowwise;
  detail::throw_error(ErrorKind::kValue, kOp, arg, " must be (1, 128), (128, 128) or rowwise (1, c) with c >= K = ",
                      k, ", got (", tile_rows, ", ", tile_cols, ")");
}

const char* scaling_name(TileScaling s) {
  switch (s) {
    case TileScaling::kTile1x128: return "(1, 128)";
    case TileScaling::kBlock128x128: return "(128, 128)";
    case TileScaling::kRowwise: break;
  }
  return "rowwise";
}

// The pairs cuBLASLt has scale modes for (gemm.h). With K <= 128 a rowwise operand is also one
// 1 x 128 tile per row (the same [rows, 1] scales), and is taken as such beside a tiled one.
void resolve_pair(TileScaling& a, TileScaling& b, int64_t k) {
  using S = TileScaling;
  if (k <= kTileBlock && (a == S::kRowwise) != (b == S::kRowwise)) (a == S::kRowwise ? a : b) = S::kTile1x128;
  const bool rowwise = a == S::kRowwise && b == S::kRowwise;
  const bool tiled = a != S::kRowwise && b != S::kRowwise && !(a == S::kBlock128x128 && b == S::kBlock128x128);
  FP8AMP_CHECK_VALUE(rowwise || tiled, kOp, "a_tile ", scaling_name(a), " with b_tile ", scaling_name(b),
                     " is not a pair cuBLASLt can multiply; accepted: (1, 128) x (128, 128), (1, 128) x (1, 128), "
                     "(128, 128) x (1, 128), rowwise x rowwise");
}

// scale_inv float32 [ceil(rows / tile_rows), ceil(k / tile_cols)], contiguous, on a's device.
TileScales check_scales(const TensorView& s, const TensorView& a, int64_t rows, int64_t k, int64_t tile_rows,
                        int64_t tile_cols, TileScaling scaling, const char* arg, const char* operand) {
  const int64_t grid_rows = (rows + tile_rows - 1) / tile_rows, grid_cols = (k + tile_cols - 1) / tile_cols;
  check::dtype_is(s, DType::kFloat32, kOp, arg);
  FP8AMP_CHECK_VALUE(s.dim() == 2 && s.shape[0] == grid_rows && s.shape[1] == grid_cols, kOp, arg,
                     " must be float32 [", grid_rows, ", ", grid_cols, "] (one per ", tile_rows, " x ", tile_cols,
                     " tile of ", operand, ", as quantize_tiles writes it), got ", s.describe());
  check::contiguous(s, kOp, arg);
  check::same_device(s, a, kOp, arg, "a");
  return TileScales{s.ptr<const float>(), scaling, grid_cols};
}

}  // namespace

size_t gemm_tiles_scale_bytes(int64_t m, int64_t n, int64_t k, int64_t a_tile_rows, int64_t a_tile_cols,
                              int64_t b_tile_rows, int64_t b_tile_cols) {
  TileScaling a = tile_scaling(a_tile_rows, a_tile_cols, k, "a_tile");
  TileScaling b = tile_scaling(b_tile_rows, b_tile_cols, k, "b_tile");
  resolve_pair(a, b, k);
  // Slack for aligning the first copy inside a workspace that is not 256-byte aligned.
  return kScaleCopyAlignment + scale_copy_bytes(cublas_scale_layout(a, m, k)) +
         scale_copy_bytes(cublas_scale_layout(b, n, k));
}

void gemm_tiles(const TensorView& a, const TensorView& a_scale_inv, int64_t a_tile_rows, int64_t a_tile_cols,
                const TensorView& b, const TensorView& b_scale_inv, int64_t b_tile_rows, int64_t b_tile_cols,
                const TensorView* bias, const TensorView& out, const GemmTilesOptions& options, Stream stream) {
  const gemm_checks::Operands ops = gemm_checks::check_operands(a, b, kOp);
  TileScaling a_scaling = tile_scaling(a_tile_rows, a_tile_cols, ops.k, "a_tile");
  TileScaling b_scaling = tile_scaling(b_tile_rows, b_tile_cols, ops.k, "b_tile");
  resolve_pair(a_scaling, b_scaling, ops.k);
  const TileScales a_scales = check_scales(a_scale_inv, a, ops.m, ops.k, a_tile_rows, a_tile_cols, a_scaling,
                                           "a_scale_inv", "a [M, K]");
  const TileScales b_scales = check_scales(b_scale_inv, a, ops.n, ops.k, b_tile_rows, b_tile_cols, b_scaling,
                                           "b_scale_inv", "b [N, K]");
  const int64_t ldo = gemm_checks::check_out(out, a, ops.m, ops.n, kOp);
  if (bias != nullptr) gemm_checks::check_bias(*bias, a, out.dtype, ops.n, kOp);
  FP8AMP_CHECK_VALUE(options.workspace != nullptr || options.workspace_bytes == 0, kOp,
                     "options.workspace is null but options.workspace_bytes is ", options.workspace_bytes);
  check::disjoint_writes({{&out, "out"}},
                         {{&a, "a"}, {&b, "b"}, {&a_scale_inv, "a_scale_inv"}, {&b_scale_inv, "b_scale_inv"},
                          {bias, "bias"}},
                         kOp);

  if (ops.m == 0 || ops.n == 0) return;  // nothing to write
  GemmTilesArgs g{};
  gemm_checks::fill_problem(g, ops, a, b, bias, out, ldo, options.workspace, options.workspace_bytes);
  g.a_scales = a_scales;
  g.b_scales = b_scales;
  g.block_k = a_scaling == TileScaling::kRowwise ? ops.k : kTileBlock;
  run_on(
      a, kOp, [&] { cpu::gemm_tiles(g); }, [&] { cuda::gemm_tiles(g, stream); });
}

}  // namespace fp8amp
