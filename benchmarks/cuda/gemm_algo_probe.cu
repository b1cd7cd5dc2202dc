// Is cuBLASLt's first heuristic choice the fastest FP8 kernel for the 1B GPT's GEMMs? For each of
// the forward, dgrad and wgrad problems of its Linears (M = 16384 tokens), asks the heuristic for
// up to 32 algorithms, times each (CUDA events, median of 20 after 5 warm-ups) and prints them
// against the first. A diagnostic, not a test; docs/benchmarks.md has its result. On the GPU machine:
//   nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/cuda/gemm_algo_probe.cu -lcublasLt -o build/gemm_algo_probe \
//     && build/gemm_algo_probe
// The call is fp8amp's (src/gemm/gemm_cuda.cpp): TN, out[M, N] = a[M, K] b[N, K]^T read column-major,
// per-tensor scales, fast accumulation for the forward, a bf16 bias where the Linear has one. Last,
// whether a scale pointer at a small byte offset is accepted.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

struct Problem {
  const char* name;
  int m, n, k;
  cudaDataType_t a, b, out;
  bool bias, fast_accum;
};

// Random finite FP8 codes (bit 6 clear: no NaN in E4M3 or E5M2, magnitudes below 2): GEMM clocks
// depend on the data's toggling, so constant inputs would time too fast.
__global__ void fill_codes(uint8_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = static_cast<uint8_t>(x & 0xBFu);
  }
}

float time_algo(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                cublasLtMatrixLayout_t lo, const cublasLtMatmulAlgo_t& algo, const void* a, const void* b, void* out,
                void* ws) {
  const float alpha = 1.0f, beta = 0.0f;
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < 25; ++i) {
    CK(cudaEventRecord(start));
    const cublasStatus_t st = cublasLtMatmul(h, desc, &alpha, b, la, a, lb, &beta, out, lo, out, lo, &algo, ws,
                                             kWorkspace, nullptr);
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    if (st != CUBLAS_STATUS_SUCCESS) {
      std::printf("    cublasLtMatmul: %s\n", cublasLtGetStatusString(st));
      return -1.0f;
    }
    float t = 0.0f;
    CK(cudaEventElapsedTime(&t, start, stop));
    if (i >= 5) ms.push_back(t);
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// fp8amp's cuBLASLt call for one problem: descriptor (scales, fast accumulation, bias epilogue),
// layouts and workspace preference; destroyed with it.
struct Call {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lo = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;

  Call(const Problem& p, const void* sa, const void* sb, const void* bias) {
    CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int8_t fast = p.fast_accum ? 1 : 0;
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
    if (p.bias) {
      const uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = CUDA_R_16BF;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    }
    // cuBLASLt's A is our b (K x N, ld K), its B our a (K x M, ld K), out N x M (ld N).
    CK(cublasLtMatrixLayoutCreate(&la, p.b, p.k, p.n, p.k));
    CK(cublasLtMatrixLayoutCreate(&lb, p.a, p.k, p.m, p.k));
    CK(cublasLtMatrixLayoutCreate(&lo, p.out, p.n, p.m, p.n));
    CK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t wsz = kWorkspace;
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz)));
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  ~Call() {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lo);
    cublasLtMatmulDescDestroy(desc);
  }
  // Up to n of the heuristic's algorithms into results; its status.
  cublasStatus_t heuristic(cublasLtHandle_t h, int n, cublasLtMatmulHeuristicResult_t* results, int* found) const {
    return cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lo, lo, pref, n, results, found);
  }
};

int main() {
  const Problem problems[] = {
      {"qkv fwd", 16384, 6144, 2048, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, false, true},
      {"proj fwd", 16384, 2048, 2048, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, false, true},
      {"fc1 fwd (bias)", 16384, 8192, 2048, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, true, true},
      {"fc2 fwd (bias)", 16384, 2048, 8192, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, true, true},
      {"fc1 dgrad", 16384, 2048, 8192, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_16BF, false, true},
      {"fc2 dgrad", 16384, 8192, 2048, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_16BF, false, true},
      {"fc1 wgrad", 8192, 2048, 16384, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, false, true},
  };
  cublasLtHandle_t h;
  CK(cublasLtCreate(&h));
  void *a, *b, *out, *ws, *bias;
  float* scales;
  CK(cudaMalloc(&a, size_t{16384} * 8192));
  CK(cudaMalloc(&b, size_t{16384} * 8192));
  CK(cudaMalloc(&out, size_t{16384} * 8192 * 4));
  CK(cudaMalloc(&ws, kWorkspace));
  CK(cudaMalloc(&bias, 8192 * 2));
  CK(cudaMalloc(&scales, 512));  // two scales, 256 bytes apart, as separate tensors would be
  fill_codes<<<1024, 256>>>(static_cast<uint8_t*>(a), size_t{16384} * 8192);
  fill_codes<<<1024, 256>>>(static_cast<uint8_t*>(b) , size_t{16384} * 8192);
  CK(cudaDeviceSynchronize());
  CK(cudaMemset(bias, 0, 8192 * 2));
  const float ones[2] = {1.0f, 1.0f};
  CK(cudaMemcpy(scales, ones, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(scales + 64, ones + 1, 4, cudaMemcpyHostToDevice));
  std::printf("| GEMM | M x N x K | heuristic #1 us | TFLOP/s | best us (its rank of found) | best TFLOP/s | "
              "best / #1 |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Problem& p : problems) {
    const Call call(p, scales, scales + 64, bias);
    cublasLtMatmulHeuristicResult_t results[32] = {};
    int found = 0;
    CK(call.heuristic(h, 32, results, &found));
    std::vector<float> us;
    for (int i = 0; i < found; ++i) {
      us.push_back(1e3f * time_algo(h, call.desc, call.la, call.lb, call.lo, results[i].algo, a, b, out, ws));
    }
    int best = 0;
    for (int i = 1; i < found; ++i) {
      if (us[i] > 0 && (us[best] <= 0 || us[i] < us[best])) best = i;
    }
    const double flop = 2.0 * p.m * p.n * p.k;
    std::printf("| %s | %d x %d x %d | %.1f | %.0f | %.1f (%d of %d) | %.0f | %.3f |\n", p.name, p.m, p.n, p.k, us[0],
                flop / us[0] / 1e6, us[best], best + 1, found, flop / us[best] / 1e6, us[best] / us[0]);
    std::printf("    all (us):");
    for (int i = 0; i < found; ++i) std::printf(" %.0f", us[i]);
    std::printf("\n");
  }

  // Which alignment cuBLASLt needs of the scale pointers: with the B scale 4 bytes after the A
  // scale, every algorithm above returned NOT_SUPPORTED (first run of this probe). The qkv forward
  // problem, the heuristic's first algorithm, one scale at a few byte offsets, the other aligned.
  const float alpha = 1.0f, beta = 0.0f;
  for (const bool moved_a : {true, false}) {
    std::printf("\n%s_SCALE_POINTER offset (bytes) -> cublasLtMatmul status:", moved_a ? "A" : "B");
    for (const int offset : {0, 4, 8, 12, 16, 32, 64}) {
      const char* base = reinterpret_cast<const char*>(moved_a ? scales + 32 : scales + 64);
      const void* moved = base + offset;
      CK(cudaMemcpy(const_cast<void*>(moved), ones, 4, cudaMemcpyHostToDevice));
      const Call call(problems[0], moved_a ? moved : scales, moved_a ? scales + 64 : moved, bias);
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t heuristic = call.heuristic(h, 1, &result, &found);
      const cublasStatus_t run = heuristic == CUBLAS_STATUS_SUCCESS && found > 0
                                     ? cublasLtMatmul(h, call.desc, &alpha, b, call.la, a, call.lb, &beta, out,
                                                      call.lo, out, call.lo, &result.algo, ws, kWorkspace, nullptr)
                                     : heuristic;
      CK(cudaDeviceSynchronize());
      std::printf(" %d -> %s;", offset, cublasLtGetStatusString(run));
    }
  }
  std::printf("\n");
  return 0;
}
