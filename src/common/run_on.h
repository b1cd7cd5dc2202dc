// Device dispatch of the public ops: the CPU reference, or the CUDA path when this build has one.
#pragma once

#include "fp8amp/error.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// Runs cpu_fn when t is on the CPU, cuda_fn when it is on a GPU; a build without CUDA refuses
// GPU tensors with kNotImplemented. The arguments are validated before this is called.
template <class CpuFn, class CudaFn>
void run_on(const TensorView& t, [[maybe_unused]] const char* op, CpuFn&& cpu_fn, CudaFn&& cuda_fn) {
  if (t.device == Device::kCPU) {
    cpu_fn();
    return;
  }
#ifdef FP8AMP_WITH_CUDA
  cuda_fn();
#else
  (void)cuda_fn;
  FP8AMP_CHECK(false, kNotImplemented, op, "this build of fp8amp has no CUDA support; got a tensor on cuda");
#endif
}

}  // namespace fp8amp
