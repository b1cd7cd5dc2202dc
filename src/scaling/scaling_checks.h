// Checks of the scaling arguments, shared by the ops that take them (cast.cpp, scaling.cpp,
// accumulate.cpp); defined in scaling.cpp. Each throws a ValueError naming `op`.
#pragma once

#include <cstdint>

#include "fp8amp/scaling.h"
#include "fp8amp/tensor.h"
#include "scaling/scaling_kernels.h"

namespace fp8amp {

// Scale exponents are clamped to [-126, 126], so a larger margin could change nothing.
void check_recipe(const ScalingRecipe& recipe, const char* op);

void check_warmup_steps(int warmup_steps, const char* op);

// Row stride of an amax buffer for n tensors: [n] -> 1, [n, k] -> k; one tensor also takes any
// 0-D or 1-D buffer (a single amax history).
int64_t amax_stride(const TensorView& amax, int64_t n, const char* op);

// The checked scaling of n tensors on x's device, as the kernels take it.
ScalingPtrs scaling_ptrs(const Scaling& s, int64_t n, const TensorView& x, const char* op);

}  // namespace fp8amp
