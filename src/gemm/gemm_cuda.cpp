// FP8 GEMM on CUDA through cuBLASLt (host code; compiled only with CUDA).
//
// Layout. cuBLASLt is column-major and, on Ada and Hopper, runs FP8 only as "TN": op(A) = Aᵀ,
// op(B) = B, both operands K-major. Our row-major out[M, N] = a[M, K] · b[N, K]ᵀ is, read
// column-major, outᵀ[N, M] = b · aᵀ, so the call is
//   A := b, stored as a column-major K x N matrix with ld = ldb, TRANSA = T  (op(A) is N x K)
//   B := a, stored as a column-major K x M matrix with ld = lda, TRANSB = N  (op(B) is K x M)
//   C = D := out, a column-major N x M matrix with ld = ldo;  m = N, n = M, k = K,
// the per-tensor scales go to A_SCALE = b_scale_inv and B_SCALE = a_scale_inv, and the bias
// (one value per row of D, i.e. per column of out) goes to the BIAS epilogue.
//
// Caches, for the life of the process:
// - per device, behind one mutex: its compute capability and one cublasLt handle (created on
//   first use with that device current; never destroyed, because a static destructor can run
//   after the CUDA runtime has shut down). A handle is not tied to a stream, so one per device
//   serves every stream and thread.
// - the algorithm per problem (device, shape, leading dims, dtypes, flags, pointer alignments,
//   workspace size, autotuning on or off), in the cache the GEMM paths share (algo_tuner.h): the
//   heuristic's first choice, or with autotuning (gemm.h) the fastest of its first candidates,
//   timed on the problem's own calls. Descriptors hold the call's pointers (scales, bias), so they
//   are built per call: host work of a few microseconds.
// The workspace is the caller's (GemmOptions): the core allocates no device memory.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <vector>

#include "common/cuda_check.h"
#include "gemm/algo_tuner.h"
#include "gemm/cublaslt_util.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

using namespace cublaslt;

constexpr const char* kOp = "gemm";

// Everything the heuristic's answer depends on, and (last) whether the algorithm is autotuned.
TunerKey gemm_key(const GemmArgs& g) {
  return tuner_key(g, GemmPath::kPerTensor, g.accumulate, g.fast_accum, g.workspace_bytes, gemm_autotune());
}

// The heuristic's first `count` algorithms for the call; NotImplementedError where it has none.
std::vector<cublasLtMatmulAlgo_t> candidates(const GemmArgs& g, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                             cublasLtMatrixLayout_t a_layout, cublasLtMatrixLayout_t b_layout,
                                             cublasLtMatrixLayout_t out_layout, int count) {
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  std::vector<cublasLtMatmulAlgo_t> algos =
      heuristic_algos(g, handle, desc, a_layout, b_layout, out_layout, g.workspace_bytes, count, &status);
  // NOT_SUPPORTED is cuBLASLt's way of saying "no kernel for this problem".
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  }
  FP8AMP_CHECK(!algos.empty(), kNotImplemented, kOp,
               "cuBLASLt has no FP8 kernel for M = ", g.m, ", N = ", g.n, ", K = ", g.k, ", a ",
               dtype_name(g.a_dtype), ", b ", dtype_name(g.b_dtype), ", out ", dtype_name(g.out_dtype),
               g.bias != nullptr ? " with bias" : "", " on cuda:", g.device_index, " (", g.workspace_bytes,
               " bytes of workspace)");
  return algos;
}

}  // namespace

void gemm(const GemmArgs& g, Stream stream) {
  const DeviceScope scope(g.device_index);
  const DeviceState& device = device_state(g.device_index);
  FP8AMP_CHECK(device.compute_capability >= kMinComputeCapability, kNotImplemented, kOp,
               "FP8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); cuda:",
               g.device_index, " has ", device.compute_capability / 10, ".", device.compute_capability % 10);
  if (g.k == 0) {
    gemm_empty_sum(g, g.accumulate, stream);
    return;
  }

  cublasLtMatmulDesc_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const MatmulDesc desc(raw);
  const int32_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, transa);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, transb);
  const int8_t fast_accum = g.fast_accum ? 1 : 0;
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(g.b_scale_inv));
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(g.a_scale_inv));
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
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // In place (C = D, same layout) is how cuBLASLt accumulates; with beta = 0 C is not read.
  const auto matmul = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(device.handle, desc.get(), &alpha, g.b, a_layout.get(), g.a, b_layout.get(), &beta, g.out,
                          out_layout.get(), g.out, out_layout.get(), &algo, g.workspace, g.workspace_bytes, s);
  };
  const auto find = [&](int count) {
    return candidates(g, device.handle, desc.get(), a_layout.get(), b_layout.get(), out_layout.get(), count);
  };
  FP8AMP_CUBLAS_CHECK(run_tuned(gemm_key(g), s, find, matmul));
}

}  // namespace cuda
}  // namespace fp8amp
