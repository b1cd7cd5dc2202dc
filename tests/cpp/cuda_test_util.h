// Shared by the CUDA tests: checked CUDA calls and the clean skip on machines without a GPU.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace fp8amp {

// Throws, for helpers that return values (gtest reports the exception as a failure).
inline void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

inline bool has_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace fp8amp

#define REQUIRE_GPU()                                             \
  do {                                                            \
    if (!::fp8amp::has_gpu()) GTEST_SKIP() << "no CUDA device";   \
  } while (0)
