// The MXFP8 GEMM on CUDA (host code; CUDA builds only): cuBLASLt's VEC32_UE8M0 scale mode on both
// operands, through gemm_tiles' scaled_matmul. Each operand's E8M0 codes are first copied into
// the 128 x 4 tiled layout cuBLASLt reads for block-scaled formats (MxScaleLayout), at the front
// of the workspace. cuBLASLt offers the mode on Blackwell (compute capability 10.0 and newer):
// any other GPU is refused before any work is queued. Never run: no Blackwell GPU was at hand.
#include <cublasLt.h>

#include <cstdint>

#include "fp8amp/gemm.h"
#include "gemm/cublaslt_util.h"
#include "gemm/gemm_kernels.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

using namespace cublaslt;

constexpr const char* kOp = "gemm_mx";
constexpr int kBlackwellCapability = 100;

}  // namespace

void gemm_mx(const GemmTilesArgs& g, const uint8_t* a_scales, const uint8_t* b_scales, Stream stream) {
  const DeviceScope scope(g.device_index);
  const DeviceState& device = device_state(g.device_index);
  FP8AMP_CHECK(device.compute_capability >= kBlackwellCapability, kNotImplemented, kOp,
               "mxfp8 needs a Blackwell GPU (sm_100+); this GPU is sm_", device.compute_capability,
               ": use recipe='blockwise' (fp8amp.ops.gemm_tiles)");
  const MxScaleLayout a_layout{g.m, g.k / g.block_k}, b_layout{g.n, g.k / g.block_k};
  const size_t needed = gemm_mx_scale_bytes(g.m, g.n, g.k);
  FP8AMP_CHECK_VALUE(g.workspace != nullptr && g.workspace_bytes >= needed, kOp, "options.workspace must hold at least ",
                     needed, " bytes (gemm_mx_scale_bytes) for the scales in cuBLASLt's layout, got ",
                     g.workspace_bytes);
  if (g.k == 0) {
    // The empty sum: out = bias or 0.
    gemm_empty_sum(g, /*accumulate=*/false, stream);
    return;
  }
  char* const base = static_cast<char*>(g.workspace);
  char* const a_copy = align_scale_copy(base);
  char* const b_copy = a_copy + a_layout.copy_bytes();
  char* const rest = b_copy + b_layout.copy_bytes();
  copy_mx_scales(a_scales, a_layout, reinterpret_cast<uint8_t*>(a_copy), stream);
  copy_mx_scales(b_scales, b_layout, reinterpret_cast<uint8_t*>(b_copy), stream);
  const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  const ScaleModes modes{mode, mode, a_copy, b_copy, "VEC32_UE8M0", "VEC32_UE8M0", kOp};
  scaled_matmul(g, modes, rest, g.workspace_bytes - static_cast<size_t>(rest - base), stream);
}

}  // namespace cuda
}  // namespace fp8amp
