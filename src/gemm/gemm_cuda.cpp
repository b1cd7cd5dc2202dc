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
//   workspace size, autotuning on or off), behind another mutex: the heuristic's first choice, or
//   with autotuning (gemm.h) the fastest of its first kAutotuneCandidates, timed on the problem's
//   own calls (below). Descriptors hold the call's pointers (scales, bias), so they are built per
//   call: host work of a few microseconds.
// The workspace is the caller's (GemmOptions): the core allocates no device memory.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common/cuda_check.h"
#include "gemm/cublaslt_util.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

using namespace cublaslt;

constexpr const char* kOp = "gemm";

// Everything the heuristic's answer depends on, and (last) whether the algorithm is autotuned.
using Key = AlgoKey<4>;

Key gemm_key(const GemmArgs& g) { return algo_key(g, g.accumulate, g.fast_accum, g.workspace_bytes, gemm_autotune()); }

// Autotuning. The heuristic's first kAutotuneCandidates algorithms take turns on the problem's
// own calls, each call timed by a pair of events around its cublasLtMatmul on the caller's stream;
// a later call reads the events that have completed (cudaEventQuery: no host sync). Once every
// candidate has kAutotuneRounds timings, the problem keeps the candidate with the least time (its
// fastest round), or the heuristic's first unless another is kAutotuneMargin faster. Calls made
// while the stream is being captured into a CUDA graph take the best choice so far, untimed.
constexpr int kAutotuneCandidates = 8;
constexpr int kAutotuneRounds = 3;
constexpr float kAutotuneMargin = 0.01f;

struct Timing {
  cudaEvent_t start = nullptr, stop = nullptr;
  int candidate = 0;
};

struct Problem {
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's order
  std::vector<float> best_ms;                    // per candidate: its fastest timed call
  std::vector<int> launched, timed;              // per candidate: calls started, calls timed
  std::vector<Timing> pending;                   // timed calls whose events may not have completed
  bool decided = false;
  int chosen = 0;
};

// The candidate with the least time so far, preferring the heuristic's first within the margin.
int fastest(const Problem& p) {
  int best = 0;
  for (int c = 1; c < static_cast<int>(p.candidates.size()); ++c) {
    if (p.best_ms[c] < p.best_ms[best]) best = c;
  }
  return p.best_ms[best] < (1.0f - kAutotuneMargin) * p.best_ms[0] ? best : 0;
}

// Folds the completed timings into p; decides when every candidate has its rounds.
void harvest(Problem& p) {
  auto done = [&](Timing& t) {
    const cudaError_t status = cudaEventQuery(t.stop);
    if (status == cudaErrorNotReady) return false;
    float ms = std::numeric_limits<float>::infinity();
    if (status == cudaSuccess) FP8AMP_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    FP8AMP_CUDA_CHECK(status);
    p.best_ms[t.candidate] = std::min(p.best_ms[t.candidate], ms);
    ++p.timed[t.candidate];
    FP8AMP_CUDA_CHECK(cudaEventDestroy(t.start));
    FP8AMP_CUDA_CHECK(cudaEventDestroy(t.stop));
    return true;
  };
  p.pending.erase(std::remove_if(p.pending.begin(), p.pending.end(), done), p.pending.end());
  if (std::all_of(p.timed.begin(), p.timed.end(), [](int n) { return n >= kAutotuneRounds; })) {
    p.decided = true;
    p.chosen = fastest(p);
  }
}

// The problem's candidates: the heuristic's first (autotuning off) or first kAutotuneCandidates.
Problem new_problem(const GemmArgs& g, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                    cublasLtMatrixLayout_t a_layout, cublasLtMatrixLayout_t b_layout,
                    cublasLtMatrixLayout_t out_layout, bool autotune) {
  cublasLtMatmulPreference_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw));
  const Preference pref(raw);
  const uint64_t workspace_bytes = g.workspace_bytes;
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
  // cuBLASLt's A is our b and its B our a (see the top of this file); C and D are out.
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.b));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.a));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.out));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.out));

  std::array<cublasLtMatmulHeuristicResult_t, kAutotuneCandidates> results{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, desc, a_layout, b_layout, out_layout, out_layout, pref.get(), autotune ? kAutotuneCandidates : 1,
      results.data(), &found);
  // NOT_SUPPORTED is cuBLASLt's way of saying "no kernel for this problem".
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  }
  FP8AMP_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0, kNotImplemented, kOp,
               "cuBLASLt has no FP8 kernel for M = ", g.m, ", N = ", g.n, ", K = ", g.k, ", a ",
               dtype_name(g.a_dtype), ", b ", dtype_name(g.b_dtype), ", out ", dtype_name(g.out_dtype),
               g.bias != nullptr ? " with bias" : "", " on cuda:", g.device_index, " (", g.workspace_bytes,
               " bytes of workspace)");
  Problem p;
  for (int i = 0; i < found; ++i) p.candidates.push_back(results[i].algo);
  p.best_ms.assign(found, std::numeric_limits<float>::infinity());
  p.launched.assign(found, 0);
  p.timed.assign(found, 0);
  p.decided = found == 1;
  return p;
}

std::mutex problems_mutex;
std::unordered_map<Key, Problem, AlgoKeyHash> problems;

// What one call runs: an algorithm, and the events to time it with (null: untimed).
struct Choice {
  cublasLtMatmulAlgo_t algo;
  Timing timing;
  Key key;
};

Choice choose_algo(const GemmArgs& g, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                   cublasLtMatrixLayout_t a_layout, cublasLtMatrixLayout_t b_layout,
                   cublasLtMatrixLayout_t out_layout, cudaStream_t stream) {
  const Key key = gemm_key(g);
  std::lock_guard<std::mutex> lock(problems_mutex);
  auto it = problems.find(key);
  if (it == problems.end()) {
    it = problems.emplace(key, new_problem(g, handle, desc, a_layout, b_layout, out_layout, key.back() != 0)).first;
  }
  Problem& p = it->second;
  if (p.decided) return {p.candidates[p.chosen], {}, key};
  // No event work while a graph is being captured (a query of the legacy stream during another
  // stream's capture is an error that says as much).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    capture = cudaStreamCaptureStatusActive;
  }
  if (capture != cudaStreamCaptureStatusNone) return {p.candidates[fastest(p)], {}, key};
  harvest(p);
  if (p.decided) return {p.candidates[p.chosen], {}, key};
  const auto next = std::min_element(p.launched.begin(), p.launched.end());
  if (*next >= kAutotuneRounds) return {p.candidates[fastest(p)], {}, key};  // waiting for the last timings
  Timing t;
  t.candidate = static_cast<int>(next - p.launched.begin());
  FP8AMP_CUDA_CHECK(cudaEventCreate(&t.start));
  FP8AMP_CUDA_CHECK(cudaEventCreate(&t.stop));
  ++*next;
  return {p.candidates[t.candidate], t, key};
}

cublasLtMatmulAlgo_t problems_first_choice(const Key& key) {
  std::lock_guard<std::mutex> lock(problems_mutex);
  return problems.at(key).candidates.front();
}

// A candidate cuBLASLt refused at run time: never timed again, and never chosen.
void drop_candidate(const Choice& choice) {
  std::lock_guard<std::mutex> lock(problems_mutex);
  Problem& p = problems.at(choice.key);
  p.launched[choice.timing.candidate] = p.timed[choice.timing.candidate] = kAutotuneRounds;
  p.best_ms[choice.timing.candidate] = std::numeric_limits<float>::infinity();
  FP8AMP_CUDA_CHECK(cudaEventDestroy(choice.timing.start));
  FP8AMP_CUDA_CHECK(cudaEventDestroy(choice.timing.stop));
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
  const Choice choice = choose_algo(g, device.handle, desc.get(), a_layout.get(), b_layout.get(), out_layout.get(), s);
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // In place (C = D, same layout) is how cuBLASLt accumulates; with beta = 0 C is not read.
  const auto matmul = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(device.handle, desc.get(), &alpha, g.b, a_layout.get(), g.a, b_layout.get(), &beta, g.out,
                          out_layout.get(), g.out, out_layout.get(), &algo, g.workspace, g.workspace_bytes, s);
  };
  if (choice.timing.start == nullptr) {
    FP8AMP_CUBLAS_CHECK(matmul(choice.algo));
    return;
  }
  FP8AMP_CUDA_CHECK(cudaEventRecord(choice.timing.start, s));
  const cublasStatus_t status = matmul(choice.algo);
  if (status == CUBLAS_STATUS_SUCCESS) {
    FP8AMP_CUDA_CHECK(cudaEventRecord(choice.timing.stop, s));
    std::lock_guard<std::mutex> lock(problems_mutex);
    problems.at(choice.key).pending.push_back(choice.timing);
    return;
  }
  // A candidate the heuristic offered but cuBLASLt refuses for this call: the first choice runs it.
  drop_candidate(choice);
  FP8AMP_CUBLAS_CHECK(matmul(problems_first_choice(choice.key)));
}

GemmAutotuneStats autotune_stats() {
  std::lock_guard<std::mutex> lock(problems_mutex);
  GemmAutotuneStats stats;
  for (const auto& [key, p] : problems) {
    if (key.back() == 0) continue;
    stats.tuning += p.decided ? 0 : 1;
    stats.tuned += p.decided ? 1 : 0;
    stats.changed += p.decided && p.chosen != 0 ? 1 : 0;
  }
  return stats;
}

}  // namespace cuda
}  // namespace fp8amp
