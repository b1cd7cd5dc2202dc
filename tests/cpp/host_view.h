// Shared by the CPU tests: TensorViews over host vectors (no copy; the vector owns the data).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "fp8amp/tensor.h"

namespace fp8amp {

// A view of v as `shape` (and `strides`, in elements; empty: contiguous) of `dtype`.
template <class T>
TensorView view(std::vector<T>& v, DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
  TensorView t;
  t.data = v.data();
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.strides = std::move(strides);
  return t;
}

// A 1-D view of all of v.
template <class T>
TensorView view(std::vector<T>& v, DType dtype) {
  return view(v, dtype, {static_cast<int64_t>(v.size())});
}

}  // namespace fp8amp
