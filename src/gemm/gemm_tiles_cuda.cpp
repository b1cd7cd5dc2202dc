// The tile-scaled FP8 GEMM on CUDA through cuBLASLt's scale modes (host code; CUDA builds only).
//
// Layout as in gemm_cuda.cpp: row-major out[M, N] = a · bᵀ is column-major outᵀ = b · aᵀ, so
// cuBLASLt's A is our b (TRANSA = T) and its B our a (TRANSB = N); m = N, n = M, k = K. Each
// operand's scales go to its side's scale pointer with its scale mode:
//   (1, 128)    CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
//   (128, 128)  CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
//   rowwise     CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
// read in the layouts cuBLASLt takes (CublasScaleLayout): where they already are, else from
// copies that one small kernel writes into the front of the caller's workspace; cuBLASLt gets the
// rest. cuBLAS 12.9+ offers these modes on Hopper only: other devices are refused before any
// work is queued. The algorithm comes from the cache the GEMM paths share (algo_tuner.h): the
// heuristic's first, or with autotuning (gemm.h) the fastest of its first candidates.
// scaled_matmul, the call with given scale modes and scale copies, also serves gemm_mx.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/cuda_check.h"
#include "gemm/algo_tuner.h"
#include "gemm/cublaslt_util.h"
#include "gemm/gemm_kernels.h"
#include "gemm/gemm_tiles_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

using namespace cublaslt;

constexpr const char* kOp = "gemm_tiles";
// The scale modes exist for FP8 on Hopper (compute capability 9.x) only.
constexpr int kHopperMajor = 9;

int32_t scale_mode(TileScaling s) {
  switch (s) {
    case TileScaling::kTile1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case TileScaling::kBlock128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case TileScaling::kRowwise: break;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
}

const char* scale_mode_name(TileScaling s) {
  switch (s) {
    case TileScaling::kTile1x128: return "VEC128_32F";
    case TileScaling::kBlock128x128: return "BLK128x128_32F";
    case TileScaling::kRowwise: break;
  }
  return "OUTER_VEC_32F";
}

// The heuristic's first `count` algorithms for the call; NotImplementedError where it has none.
std::vector<cublasLtMatmulAlgo_t> candidates(const GemmTilesArgs& g, const ScaleModes& modes, cublasLtHandle_t handle,
                                             cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a_layout,
                                             cublasLtMatrixLayout_t b_layout, cublasLtMatrixLayout_t out_layout,
                                             size_t workspace_bytes, int count) {
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  std::vector<cublasLtMatmulAlgo_t> algos =
      heuristic_algos(g, handle, desc, a_layout, b_layout, out_layout, workspace_bytes, count, &status);
  // NOT_SUPPORTED (and, for some scale-mode combinations, INVALID_VALUE) is cuBLASLt's way of
  // saying it has no kernel for this problem.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED && status != CUBLAS_STATUS_INVALID_VALUE) {
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  }
  FP8AMP_CHECK(!algos.empty(), kNotImplemented, modes.op,
               "cuBLASLt (", cublasLtGetVersion(), ") has no FP8 kernel with scale modes ", modes.a_name, " for a and ",
               modes.b_name, " for b at M = ",
               g.m, ", N = ", g.n, ", K = ", g.k, ", a ", dtype_name(g.a_dtype), ", b ", dtype_name(g.b_dtype), ", out ",
               dtype_name(g.out_dtype), g.bias != nullptr ? " with bias" : "", " on cuda:", g.device_index, " (",
               cublasLtGetStatusString(status), ")");
  return algos;
}

}  // namespace

void gemm_tiles(const GemmTilesArgs& g, Stream stream) {
  const DeviceScope scope(g.device_index);
  const DeviceState& device = device_state(g.device_index);
  // The scale copies at the front of the workspace, cuBLASLt's part after them.
  const CublasScaleLayout a_layout_s = cublas_scale_layout(g.a_scales.scaling, g.m, g.k);
  const CublasScaleLayout b_layout_s = cublas_scale_layout(g.b_scales.scaling, g.n, g.k);
  const size_t needed = kScaleCopyAlignment + scale_copy_bytes(a_layout_s) + scale_copy_bytes(b_layout_s);
  FP8AMP_CHECK_VALUE(g.workspace != nullptr && g.workspace_bytes >= needed, kOp, "options.workspace must hold at least ",
                     needed, " bytes (gemm_tiles_scale_bytes) for the scales in cuBLASLt's layout, got ",
                     g.workspace_bytes);
  char* const base = static_cast<char*>(g.workspace);
  char* const a_copy = align_scale_copy(base);
  char* const b_copy = a_copy + scale_copy_bytes(a_layout_s);
  char* const rest = b_copy + scale_copy_bytes(b_layout_s);
  FP8AMP_CHECK(device.compute_capability / 10 == kHopperMajor, kNotImplemented, kOp,
               "cuBLASLt offers its tile scale modes (VEC128_32F, BLK128x128_32F, OUTER_VEC_32F) for FP8 on Hopper "
               "(compute capability 9.x) only; cuda:", g.device_index, " has ", device.compute_capability / 10, ".",
               device.compute_capability % 10, ". Use per-tensor scaling (fp8amp.ops.gemm) on this GPU");
  if (g.k == 0) {
    // The empty sum, as gemm's K == 0: out = bias or 0, whatever the scales hold.
    gemm_empty_sum(g, /*accumulate=*/false, stream);
    return;
  }
  // cuBLASLt has no kernel for 1 x 128 scales of an operand whose rows are not a multiple of 4,
  // padded or not (measured: docs/tiles.md): refused here with the way out rather than with its
  // heuristic's "not supported" (N already is a multiple of 16).
  FP8AMP_CHECK(g.a_scales.scaling != TileScaling::kTile1x128 || g.m % 4 == 0, kNotImplemented, kOp,
               "cuBLASLt's (1, 128) scales of a need M (the rows of a) to be a multiple of 4 on CUDA, got M = ", g.m,
               "; pad the rows or use rowwise scaling for this GEMM");

  const size_t cublas_bytes = g.workspace_bytes - static_cast<size_t>(rest - base);
  // Scales already in cuBLASLt's layout (and aligned as the copies are) are read in place.
  const ScaleCopy wanted[] = {{g.a_scales.data, g.a_scales.cols, a_layout_s, reinterpret_cast<float*>(a_copy)},
                              {g.b_scales.data, g.b_scales.cols, b_layout_s, reinterpret_cast<float*>(b_copy)}};
  ScaleCopy copies[kMaxScaleCopies];
  const float* read[kMaxScaleCopies];
  int count = 0;
  for (int k = 0; k < kMaxScaleCopies; ++k) {
    const ScaleCopy& w = wanted[k];
    const bool in_place = w.layout.same_as(w.src_cols) && reinterpret_cast<uintptr_t>(w.src) % kScaleCopyAlignment == 0;
    read[k] = in_place ? w.src : w.dst;
    if (!in_place) copies[count++] = w;
  }
  copy_tile_scales(copies, count, stream);
  const ScaleModes modes{scale_mode(g.a_scales.scaling),      scale_mode(g.b_scales.scaling),
                         read[0],
                         read[1],
                         scale_mode_name(g.a_scales.scaling), scale_mode_name(g.b_scales.scaling),
                         kOp};
  scaled_matmul(g, modes, rest, cublas_bytes, stream);
}

void scaled_matmul(const GemmTilesArgs& g, const ScaleModes& modes, void* workspace, size_t workspace_bytes,
                   Stream stream) {
  const DeviceState& device = device_state(g.device_index);
  cublasLtMatmulDesc_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const MatmulDesc desc(raw);
  const int32_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, transa);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, transb);
  // cuBLASLt's A is our b and its B our a.
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_MODE, modes.b_mode);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_MODE, modes.a_mode);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, modes.b_scales);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, modes.a_scales);
  if (g.bias != nullptr) {
    const uint32_t bias_epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = cuda_type(g.bias_dtype);
    FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, bias_epilogue);
    FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
  }
  const Layout a_layout = layout(g.b_dtype, g.k, g.n, g.ldb);
  const Layout b_layout = layout(g.a_dtype, g.k, g.m, g.lda);
  const Layout out_layout = layout(g.out_dtype, g.n, g.m, g.ldo);

  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const float alpha = 1.0f, beta = 0.0f;
  const auto matmul = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(device.handle, desc.get(), &alpha, g.b, a_layout.get(), g.a, b_layout.get(), &beta, g.out,
                          out_layout.get(), g.out, out_layout.get(), &algo, workspace, workspace_bytes, s);
  };
  const auto find = [&](int count) {
    return candidates(g, modes, device.handle, desc.get(), a_layout.get(), b_layout.get(), out_layout.get(),
                      workspace_bytes, count);
  };
  const TunerKey key = tuner_key(g, GemmPath::kTiles, modes.a_mode, modes.b_mode, workspace_bytes, gemm_autotune());
  const cublasStatus_t status = run_tuned(key, s, find, matmul);
  FP8AMP_CHECK(status != CUBLAS_STATUS_NOT_SUPPORTED, kNotImplemented, modes.op,
               "cuBLASLt refused to run the algorithm its heuristic chose for scale modes ", modes.a_name, " x ",
               modes.b_name, " at M = ", g.m, ", N = ", g.n, ", K = ", g.k, " (NOT_SUPPORTED)");
  check_cublas(status, "cublasLtMatmul", __FILE__, __LINE__);
}

}  // namespace cuda
}  // namespace fp8amp
