// Does cuBLASLt compute CUBLASLT_MATMUL_DESC_AMAX_D_POINTER for FP8 x FP8 -> float32 / bf16 D (the
// weight-gradient GEMM's output), and at what cost? A diagnostic, not a test; docs/benchmarks.md
// ("GPT training") has its result. Build and run on the GPU machine:
//   nvcc -std=c++17 -arch=sm_90a benchmarks/cuda/amax_d_probe.cu -lcublasLt -o build/amax_d_probe && build/amax_d_probe
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdio>
#include <vector>
#include <cmath>
#include <random>
#include "probe_check.h"

float run(cublasLtHandle_t h, cudaDataType_t dt, int m, int n, int k, bool amax, float* amax_out, bool timed) {
  void *a, *b, *d, *ws; float *sa, *sb, *am;
  size_t dsz = dt == CUDA_R_32F ? 4 : 2;
  cudaMalloc(&a, (size_t)m * k); cudaMalloc(&b, (size_t)n * k); cudaMalloc(&d, (size_t)m * n * dsz);
  cudaMalloc(&ws, kWorkspace); cudaMalloc(&sa, 4); cudaMalloc(&sb, 4); cudaMalloc(&am, 4);
  std::vector<__nv_fp8_e4m3> ha((size_t)m * k), hb((size_t)n * k);
  std::mt19937 rng(1); std::normal_distribution<float> nd(0, 1);
  for (auto& v : ha) v = __nv_fp8_e4m3(nd(rng)); for (auto& v : hb) v = __nv_fp8_e4m3(nd(rng));
  cudaMemcpy(a, ha.data(), ha.size(), cudaMemcpyHostToDevice); cudaMemcpy(b, hb.data(), hb.size(), cudaMemcpyHostToDevice);
  float one = 1.0f, zero = 0.0f; cudaMemcpy(sa, &one, 4, cudaMemcpyHostToDevice); cudaMemcpy(sb, &one, 4, cudaMemcpyHostToDevice);
  cudaMemcpy(am, &zero, 4, cudaMemcpyHostToDevice);
  cublasLtMatmulDesc_t desc; CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, 4));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, 4));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(void*)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(void*)));
  if (amax) CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &am, sizeof(void*)));
  cublasLtMatrixLayout_t la, lb, lc, ld;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, m, k)); CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, n, k));
  CK(cublasLtMatrixLayoutCreate(&lc, dt, m, n, m)); CK(cublasLtMatrixLayoutCreate(&ld, dt, m, n, m));
  cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
  size_t wsz = kWorkspace; CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz)));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  float ms = -1;  // -1: cuBLASLt refused
  auto st = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, ld, pref, 1, &res, &found);
  auto call = [&] { return cublasLtMatmul(h, desc, &one, a, la, b, lb, &zero, d, lc, d, ld, &res.algo, ws, wsz, 0); };
  if (st != 0 || !found) {
    printf("  heuristic status %d found %d\n", (int)st, found);
  } else if ((st = call()) != 0) {
    printf("  matmul status %d\n", (int)st);
  } else {
    ms = 0;
    if (timed) {
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0); cudaEventCreate(&e1);
      for (int i = 0; i < 5; ++i) call();
      cudaEventRecord(e0); for (int i = 0; i < 20; ++i) call(); cudaEventRecord(e1); cudaEventSynchronize(e1);
      cudaEventElapsedTime(&ms, e0, e1); ms /= 20;
      cudaEventDestroy(e0); cudaEventDestroy(e1);
    }
    cudaMemcpy(amax_out, am, 4, cudaMemcpyDeviceToHost);
    std::vector<unsigned char> hd((size_t)m * n * dsz);  // the amax of D as stored, for comparison
    cudaMemcpy(hd.data(), d, hd.size(), cudaMemcpyDeviceToHost);
    float ref = 0;
    for (size_t i = 0; i < (size_t)m * n; ++i) {
      float v = dt == CUDA_R_32F ? ((float*)hd.data())[i] : __bfloat162float(((__nv_bfloat16*)hd.data())[i]);
      ref = fmaxf(ref, fabsf(v));
    }
    printf("  stored-D amax %g\n", ref);
  }
  cublasLtMatmulPreferenceDestroy(pref); cublasLtMatmulDescDestroy(desc);
  for (auto l : {la, lb, lc, ld}) cublasLtMatrixLayoutDestroy(l);
  cudaFree(a); cudaFree(b); cudaFree(d); cudaFree(ws); cudaFree(sa); cudaFree(sb); cudaFree(am);
  return ms;
}

int main() {
  cublasLtHandle_t h; cublasLtCreate(&h);
  struct { cudaDataType_t t; const char* name; } types[] = {{CUDA_R_32F, "fp32"}, {CUDA_R_16BF, "bf16"}};
  for (auto t : types) {
    float am = -1;
    printf("%s D, AMAX_D set:\n", t.name);
    run(h, t.t, 512, 256, 1024, true, &am, false);
    printf("  AMAX_D = %g\n", am);
  }
  // the 1B GPT's fc1 weight gradient: [8192, 2048] from K = 16384 tokens
  for (auto t : types) {
    float am;
    float with = run(h, t.t, 8192, 2048, 16384, true, &am, true);
    float without = run(h, t.t, 8192, 2048, 16384, false, &am, true);
    printf("%s 8192x2048x16384: with AMAX_D %.1f us, without %.1f us\n", t.name, with * 1e3, without * 1e3);
  }
  return 0;
}
