// Which scale layouts does cuBLASLt read for its tile scale modes on Hopper? fp8amp's gemm_tiles
// (src/gemm/gemm_tiles_cuda.cpp) copies 1 x 128 scales as runs of the rows padded to a multiple of
// 4 floats and 128 x 128 scales with their K-blocks padded to 4, and refuses (1, 128) scales of a
// with M % 4 != 0. This probe runs the raw cuBLASLt call with each candidate layout, for M and
// K / 128 that are and are not multiples of 4, and prints the heuristic's answer and the largest
// error against a host reference (float64 of the decoded codes times the scales); a wrong layout
// shows errors of the order of the result. A diagnostic, not a test; on the GPU machine:
//   nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/cuda/gemm_tiles_layout_probe.cu -lcublasLt \
//     -o build/gemm_tiles_layout_probe && build/gemm_tiles_layout_probe
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "probe_check.h"

constexpr int kBlock = 128;

float decode(uint8_t c) { return static_cast<float>(*reinterpret_cast<const __nv_fp8_e4m3*>(&c)); }
int ceil_div(int a, int b) { return (a + b - 1) / b; }
int round4(int v) { return (v + 3) / 4 * 4; }

// One operand: rows x K codes and a scale per (row or 128-row block, K-block).
struct Operand {
  int rows, k;
  bool blocks;  // 128 x 128 (else 1 x 128)
  std::vector<uint8_t> codes;
  std::vector<float> scale;  // row-major [row tiles, K-blocks], as quantize_tiles writes it
  Operand(int rows_, int k_, bool blocks_, std::mt19937& rng) : rows(rows_), k(k_), blocks(blocks_) {
    std::uniform_int_distribution<int> code(0, 255), exponent(-4, 4);
    codes.resize(static_cast<size_t>(rows) * k);
    for (auto& c : codes) c = static_cast<uint8_t>(code(rng) & 0xB7);  // finite, below 1
    scale.resize(static_cast<size_t>(ceil_div(rows, blocks ? kBlock : 1)) * ceil_div(k, kBlock));
    for (auto& s : scale) s = std::ldexp(1.0f, exponent(rng));
  }
  float s(int r, int kb) const { return scale[(r / (blocks ? kBlock : 1)) * ceil_div(k, kBlock) + kb]; }
  // The scales laid out for cuBLASLt: 1 x 128 as K-block runs of the rows (ld = rows, or padded to
  // 4), 128 x 128 as row-block runs of the K-blocks (ld = K-blocks, or padded to 4).
  std::vector<float> layout(bool pad) const {
    const int kb = ceil_div(k, kBlock);
    if (!blocks) {
      const int ld = pad ? round4(rows) : rows;
      std::vector<float> out(static_cast<size_t>(kb) * ld, 0.0f);
      for (int b = 0; b < kb; ++b)
        for (int r = 0; r < rows; ++r) out[static_cast<size_t>(b) * ld + r] = s(r, b);
      return out;
    }
    const int rb = ceil_div(rows, kBlock), ld = pad ? round4(kb) : kb;
    std::vector<float> out(static_cast<size_t>(rb) * ld, 0.0f);
    for (int r = 0; r < rb; ++r)
      for (int b = 0; b < kb; ++b) out[static_cast<size_t>(r) * ld + b] = scale[static_cast<size_t>(r) * kb + b];
    return out;
  }
};

template <class T>
T* to_device(const std::vector<T>& v) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// out[M, N] = a[M, K] b[N, K]^T in float32, as fp8amp calls it (cuBLASLt's A is b, its B is a).
void probe(cublasLtHandle_t h, void* ws, int m, int n, int k, bool a_blocks, bool b_blocks, bool pad) {
  std::mt19937 rng(static_cast<uint32_t>(m * 31 + n * 7 + k));
  const Operand a(m, k, a_blocks, rng), b(n, k, b_blocks, rng);
  std::vector<double> ref(static_cast<size_t>(m) * n, 0.0);
  double ref_max = 0.0;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int kb = 0; kb < ceil_div(k, kBlock); ++kb) {
        double dot = 0.0;
        for (int c = kb * kBlock; c < std::min(k, (kb + 1) * kBlock); ++c)
          dot += double(decode(a.codes[static_cast<size_t>(i) * k + c])) * decode(b.codes[static_cast<size_t>(j) * k + c]);
        sum += dot * a.s(i, kb) * b.s(j, kb);
      }
      ref[static_cast<size_t>(i) * n + j] = sum;
      ref_max = std::max(ref_max, std::fabs(sum));
    }
  }
  uint8_t *da = to_device(a.codes), *db = to_device(b.codes);
  float *sa = to_device(a.layout(pad)), *sb = to_device(b.layout(pad)), *out = nullptr;
  CK(cudaMalloc(&out, static_cast<size_t>(m) * n * sizeof(float)));

  cublasLtMatmulDesc_t desc;
  CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const int32_t mode_a = b_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t mode_b = a_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const void *pa = sb, *pb = sa;
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa)));
  CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb)));
  cublasLtMatrixLayout_t la, lb, lo;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k));
  CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k));
  CK(cublasLtMatrixLayoutCreate(&lo, CUDA_R_32F, n, m, n));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t bytes = kWorkspace;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lo, lo, pref, 1, &result, &count);
  std::printf("  M %4d N %4d K %4d  a %-7s b %-7s scales %-8s", m, n, k, a_blocks ? "128x128" : "1x128",
              b_blocks ? "128x128" : "1x128", pad ? "padded" : "unpadded");
  if (hs != CUBLAS_STATUS_SUCCESS || count == 0) {
    std::printf("  heuristic: %s, %d algorithms\n", cublasLtGetStatusString(hs), count);
  } else {
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t ms = cublasLtMatmul(h, desc, &alpha, db, la, da, lb, &beta, out, lo, out, lo, &result.algo,
                                             ws, kWorkspace, nullptr);
    CK(cudaDeviceSynchronize());
    std::vector<float> got(static_cast<size_t>(m) * n);
    CK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double err = 0.0;
    for (size_t e = 0; e < got.size(); ++e) err = std::max(err, std::fabs(got[e] - ref[e]));
    std::printf("  matmul: %s, max |err| / max |ref| %.2e %s\n", cublasLtGetStatusString(ms), err / ref_max,
                err / ref_max < 1e-3 ? "(right)" : "(WRONG)");
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lo);
  cublasLtMatmulDescDestroy(desc);
  for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(sa), static_cast<void*>(sb),
                  static_cast<void*>(out)})
    cudaFree(p);
}

int main() {
  cublasLtHandle_t h;
  CK(cublasLtCreate(&h));
  void* ws = nullptr;
  CK(cudaMalloc(&ws, kWorkspace));
  std::printf("cuBLASLt %zu\n", cublasLtGetVersion());
  const int shapes[][3] = {{128, 256, 512}, {130, 256, 512}, {3, 256, 512}, {128, 256, 384}, {132, 144, 272}};
  for (const auto& s : shapes) {
    for (const bool pad : {false, true}) {
      probe(h, ws, s[0], s[1], s[2], false, true, pad);   // 1x128 x 128x128
      probe(h, ws, s[0], s[1], s[2], false, false, pad);  // 1x128 x 1x128
      probe(h, ws, s[0], s[1], s[2], true, false, pad);   // 128x128 x 1x128
    }
  }
  cudaFree(ws);
  cublasLtDestroy(h);
  return 0;
}
