// The GEMM paths' shared algorithm cache and autotuning (algo_tuner.h). Host code; CUDA builds only.
#include "gemm/algo_tuner.h"

#include <algorithm>
#include <array>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "common/cuda_check.h"

namespace fp8amp {
namespace cuda {
namespace cublaslt {

namespace {

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

Problem new_problem(std::vector<cublasLtMatmulAlgo_t> candidates) {
  Problem p;
  const size_t found = candidates.size();
  p.candidates = std::move(candidates);
  p.best_ms.assign(found, std::numeric_limits<float>::infinity());
  p.launched.assign(found, 0);
  p.timed.assign(found, 0);
  p.decided = found == 1;
  return p;
}

// The process's problems, behind one mutex; never destroyed (a static destructor can run after
// the CUDA runtime has shut down).
std::mutex& problems_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::unordered_map<TunerKey, Problem, AlgoKeyHash>& problems() {
  static auto* map = new std::unordered_map<TunerKey, Problem, AlgoKeyHash>;
  return *map;
}

// What one call runs: an algorithm, and the events to time it with (null: untimed).
struct Choice {
  cublasLtMatmulAlgo_t algo;
  Timing timing;
};

Choice choose(const TunerKey& key, cudaStream_t stream, const Candidates& candidates) {
  std::lock_guard<std::mutex> lock(problems_mutex());
  auto it = problems().find(key);
  if (it == problems().end()) {
    const bool autotune = key.back() != 0;
    it = problems().emplace(key, new_problem(candidates(autotune ? kAutotuneCandidates : 1))).first;
  }
  Problem& p = it->second;
  if (p.decided) return {p.candidates[p.chosen], {}};
  // No event work while a graph is being captured (a query of the legacy stream during another
  // stream's capture is an error that says as much).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    capture = cudaStreamCaptureStatusActive;
  }
  if (capture != cudaStreamCaptureStatusNone) return {p.candidates[fastest(p)], {}};
  harvest(p);
  if (p.decided) return {p.candidates[p.chosen], {}};
  const auto next = std::min_element(p.launched.begin(), p.launched.end());
  if (*next >= kAutotuneRounds) return {p.candidates[fastest(p)], {}};  // waiting for the last timings
  Timing t;
  t.candidate = static_cast<int>(next - p.launched.begin());
  FP8AMP_CUDA_CHECK(cudaEventCreate(&t.start));
  FP8AMP_CUDA_CHECK(cudaEventCreate(&t.stop));
  ++*next;
  return {p.candidates[t.candidate], t};
}

// A candidate cuBLASLt refused at run time: never timed again, and never chosen. Returns the
// problem's first choice.
cublasLtMatmulAlgo_t drop(const TunerKey& key, const Timing& timing) {
  std::lock_guard<std::mutex> lock(problems_mutex());
  Problem& p = problems().at(key);
  p.launched[timing.candidate] = p.timed[timing.candidate] = kAutotuneRounds;
  p.best_ms[timing.candidate] = std::numeric_limits<float>::infinity();
  FP8AMP_CUDA_CHECK(cudaEventDestroy(timing.start));
  FP8AMP_CUDA_CHECK(cudaEventDestroy(timing.stop));
  return p.candidates.front();
}

}  // namespace

cublasStatus_t run_tuned(const TunerKey& key, cudaStream_t stream, const Candidates& candidates,
                         const Matmul& matmul) {
  const Choice choice = choose(key, stream, candidates);
  if (choice.timing.start == nullptr) return matmul(choice.algo);
  FP8AMP_CUDA_CHECK(cudaEventRecord(choice.timing.start, stream));
  const cublasStatus_t status = matmul(choice.algo);
  if (status == CUBLAS_STATUS_SUCCESS) {
    FP8AMP_CUDA_CHECK(cudaEventRecord(choice.timing.stop, stream));
    std::lock_guard<std::mutex> lock(problems_mutex());
    problems().at(key).pending.push_back(choice.timing);
    return status;
  }
  // A candidate the heuristic offered but cuBLASLt refuses for this call: the first choice runs it.
  return matmul(drop(key, choice.timing));
}

std::vector<cublasLtMatmulAlgo_t> heuristic_algos(const GemmProblem& g, cublasLtHandle_t handle,
                                                  cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a_layout,
                                                  cublasLtMatrixLayout_t b_layout, cublasLtMatrixLayout_t out_layout,
                                                  size_t workspace_bytes, int count, cublasStatus_t* status) {
  cublasLtMatmulPreference_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw));
  const Preference pref(raw);
  const uint64_t max_workspace = workspace_bytes;
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
  // cuBLASLt's A is our b and its B our a (see gemm_cuda.cpp); C and D are out.
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.b));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.a));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.out));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.out));
  std::array<cublasLtMatmulHeuristicResult_t, kAutotuneCandidates> results{};
  int found = 0;
  *status = cublasLtMatmulAlgoGetHeuristic(handle, desc, a_layout, b_layout, out_layout, out_layout, pref.get(),
                                           std::min(count, kAutotuneCandidates), results.data(), &found);
  std::vector<cublasLtMatmulAlgo_t> algos;
  if (*status != CUBLAS_STATUS_SUCCESS) return algos;
  for (int i = 0; i < found; ++i) algos.push_back(results[i].algo);
  return algos;
}

}  // namespace cublaslt

GemmAutotuneStats autotune_stats() {
  std::lock_guard<std::mutex> lock(cublaslt::problems_mutex());
  GemmAutotuneStats stats;
  for (const auto& [key, p] : cublaslt::problems()) {
    if (key.back() == 0) continue;
    stats.tuning += p.decided ? 0 : 1;
    stats.tuned += p.decided ? 1 : 0;
    stats.changed += p.decided && p.chosen != 0 ? 1 : 0;
  }
  return stats;
}

}  // namespace cuda
}  // namespace fp8amp
