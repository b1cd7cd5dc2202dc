// Checks of CUDA runtime calls and kernel launches: a failure throws fp8amp::Error (kRuntime)
// naming the call, CUDA's own message and where in the source it happened.
#pragma once

#include <cuda_runtime.h>

#include "fp8amp/error.h"

// FP8AMP_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream));
#define FP8AMP_CUDA_CHECK(expr)                                                                   \
  do {                                                                                            \
    const cudaError_t fp8amp_cuda_status_ = (expr);                                               \
    if (fp8amp_cuda_status_ != cudaSuccess) {                                                     \
      ::fp8amp::detail::throw_error(::fp8amp::ErrorKind::kRuntime, "cuda", #expr, " failed: ",    \
                                    cudaGetErrorString(fp8amp_cuda_status_), " (", __FILE__, ":", \
                                    __LINE__, ")");                                               \
    }                                                                                             \
  } while (0)

// After every kernel launch: a bad configuration is reported by the next runtime call, so ask
// for it right away, while the launch that caused it can still be named.
#define FP8AMP_CUDA_CHECK_LAUNCH() FP8AMP_CUDA_CHECK(cudaGetLastError())
