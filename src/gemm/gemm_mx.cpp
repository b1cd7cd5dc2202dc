// Public MXFP8 GEMM op (gemm.h, gemm_mx): validates the views with cuBLASLt's FP8 rules on every
// device, then runs the CPU reference (gemm_tiles' with 32-wide K-blocks, on the E8M0 codes'
// values) or the cuBLASLt path (gemm_mx_cuda.cpp).
#include <cstdint>
#include <vector>

#include "common/run_on.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"
#include "gemm/gemm_checks.h"
#include "gemm/gemm_tiles_kernels.h"
#include "tiles/tiles_kernels.h"

namespace fp8amp {

namespace {

constexpr const char* kOp = "gemm_mx";

// scales: uint8 [rows, k / 32], contiguous, on a's device.
void check_mx_scales(const TensorView& s, const TensorView& a, int64_t rows, int64_t k, const char* arg,
                     const char* operand) {
  check::dtype_is(s, DType::kUInt8, kOp, arg);
  FP8AMP_CHECK_VALUE(s.dim() == 2 && s.shape[0] == rows && s.shape[1] == k / kMxBlock, kOp, arg, " must be uint8 [",
                     rows, ", ", k / kMxBlock, "] (one E8M0 code per 1 x 32 block of ", operand,
                     ", as quantize_mx writes them), got ", s.describe());
  check::contiguous(s, kOp, arg);
  check::same_device(s, a, kOp, arg, "a");
}

// The float32 scale_inv of each E8M0 code, for the CPU reference.
std::vector<float> scale_values(const TensorView& s) {
  const auto* codes = s.ptr<const uint8_t>();
  std::vector<float> values(static_cast<size_t>(s.numel()));
  for (size_t i = 0; i < values.size(); ++i) values[i] = e8m0_scale_inv(codes[i]);
  return values;
}

}  // namespace

size_t gemm_mx_scale_bytes(int64_t m, int64_t n, int64_t k) {
  // Slack for aligning the first copy inside a workspace that is not 256-byte aligned.
  return kScaleCopyAlignment + MxScaleLayout{m, k / kMxBlock}.copy_bytes() + MxScaleLayout{n, k / kMxBlock}.copy_bytes();
}

void gemm_mx(const TensorView& a, const TensorView& a_scales, const TensorView& b, const TensorView& b_scales,
             const TensorView* bias, const TensorView& out, const GemmTilesOptions& options, Stream stream) {
  const gemm_checks::Operands ops = gemm_checks::check_operands(a, b, kOp);
  FP8AMP_CHECK_VALUE(ops.k % kMxBlock == 0, kOp, "K (the columns of a and b) must be a multiple of ", kMxBlock,
                     " (whole MX blocks), got ", ops.k);
  check_mx_scales(a_scales, a, ops.m, ops.k, "a_scales", "a [M, K]");
  check_mx_scales(b_scales, a, ops.n, ops.k, "b_scales", "b [N, K]");
  const int64_t ldo = gemm_checks::check_out(out, a, ops.m, ops.n, kOp);
  if (bias != nullptr) gemm_checks::check_bias(*bias, a, out.dtype, ops.n, kOp);
  FP8AMP_CHECK_VALUE(options.workspace != nullptr || options.workspace_bytes == 0, kOp,
                     "options.workspace is null but options.workspace_bytes is ", options.workspace_bytes);
  check::disjoint_writes({{&out, "out"}},
                         {{&a, "a"}, {&b, "b"}, {&a_scales, "a_scales"}, {&b_scales, "b_scales"}, {bias, "bias"}}, kOp);

  if (ops.m == 0 || ops.n == 0) return;  // nothing to write
  GemmTilesArgs g{};
  gemm_checks::fill_problem(g, ops, a, b, bias, out, ldo, options.workspace, options.workspace_bytes);
  g.block_k = kMxBlock;
  const int64_t k_blocks = ops.k / kMxBlock;
  run_on(
      a, kOp,
      [&] {
        const std::vector<float> a_values = scale_values(a_scales), b_values = scale_values(b_scales);
        // One scale per row and K-block, as (1, 128) tiles have; g.block_k makes the blocks 32 wide.
        g.a_scales = TileScales{a_values.data(), TileScaling::kTile1x128, k_blocks};
        g.b_scales = TileScales{b_values.data(), TileScaling::kTile1x128, k_blocks};
        cpu::gemm_tiles(g);
      },
      [&] { cuda::gemm_mx(g, a_scales.ptr<const uint8_t>(), b_scales.ptr<const uint8_t>(), stream); });
}

}  // namespace fp8amp
