// The algorithm each cuBLASLt GEMM problem runs, shared by the GEMM paths (gemm_cuda.cpp,
// gemm_tiles_cuda.cpp): the heuristic's first choice, or with autotuning (gemm.h) the fastest of
// its first kAutotuneCandidates, timed on the problem's own calls. Host code; CUDA builds only.
//
// Autotuning. The candidates take turns on the problem's calls, each call timed by a pair of
// events around its cublasLtMatmul on the caller's stream; a later call reads the events that have
// completed (cudaEventQuery: no host sync). Once every candidate has kAutotuneRounds timings, the
// problem keeps the candidate with the least time (its fastest round), or the heuristic's first
// unless another is kAutotuneMargin faster. Calls made while the stream is being captured into a
// CUDA graph take the best choice so far, untimed. A candidate cuBLASLt refuses at run time is
// dropped and the call runs the first choice.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "gemm/cublaslt_util.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cuda {
namespace cublaslt {

// A problem's key: the problem's fields, the GEMM path's tag (its own fields differ in meaning),
// three fields of the path's own, and (last) whether the algorithm is autotuned.
using TunerKey = AlgoKey<5>;

enum class GemmPath : int64_t { kPerTensor = 1, kTiles = 2 };

template <class A, class B, class C>
TunerKey tuner_key(const GemmProblem& g, GemmPath path, A a, B b, C c, bool autotune) {
  return algo_key(g, static_cast<int64_t>(path), a, b, c, autotune);
}

// The heuristic's first `count` algorithms for the problem (at least one: where it has none the
// function throws the path's NotImplementedError).
using Candidates = std::function<std::vector<cublasLtMatmulAlgo_t>(int count)>;
// One cublasLtMatmul of the call with an algorithm.
using Matmul = std::function<cublasStatus_t(const cublasLtMatmulAlgo_t&)>;

// Runs the call's matmul with its problem's algorithm (asking `candidates` the first time the key
// is seen) and returns its status: the first choice's where a candidate was refused.
cublasStatus_t run_tuned(const TunerKey& key, cudaStream_t stream, const Candidates& candidates,
                         const Matmul& matmul);

// The heuristic's first `count` algorithms for a matmul descriptor and its layouts, with the
// call's workspace and pointer alignments as preferences; an empty list where it has none (the
// caller names the problem in its error).
std::vector<cublasLtMatmulAlgo_t> heuristic_algos(const GemmProblem& g, cublasLtHandle_t handle,
                                                  cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a_layout,
                                                  cublasLtMatrixLayout_t b_layout, cublasLtMatrixLayout_t out_layout,
                                                  size_t workspace_bytes, int count, cublasStatus_t* status);

constexpr int kAutotuneCandidates = 8;

}  // namespace cublaslt
}  // namespace cuda
}  // namespace fp8amp
