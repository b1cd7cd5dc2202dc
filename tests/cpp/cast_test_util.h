// Shared by the CPU cast tests (test_cast_cpu.cpp, test_cast_transpose_cpu.cpp,
// test_cast_errors_cpu.cpp): one tensor's delayed-scaling state in host vectors.
#pragma once

#include <vector>

#include "fp8amp/dtype.h"
#include "fp8amp/scaling.h"
#include "host_view.h"

namespace fp8amp {

// scale 1, amax 0, scale_inv 0 (each op must write it), as the Scaling the cast ops take.
struct State {
  std::vector<float> scale{1.0f}, amax{0.0f}, scale_inv{0.0f};
  Scaling scaling() {
    return Scaling{view(scale, DType::kFloat32, {1}), view(amax, DType::kFloat32, {1}),
                   view(scale_inv, DType::kFloat32, {1})};
  }
};

}  // namespace fp8amp
