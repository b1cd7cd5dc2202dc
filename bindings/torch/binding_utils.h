// Argument plumbing shared by the torch.library registrations (ops.cpp, gemm_ops.cpp, tile_ops.cpp):
// torch tensors become core TensorViews, outputs are allocated in symbolic sizes, calls run on the
// tensor's current CUDA stream, and core errors become Python ValueError / TypeError /
// NotImplementedError / RuntimeError.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "common/op_args.h"
#include "fp8amp/error.h"
#include "fp8amp/tensor.h"

#ifdef FP8AMP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fp8amp::torch_binding {

inline DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DType::kFloat8E5M2;
    case at::kInt: return DType::kInt32;
    case at::kByte: return DType::kUInt8;
    default:
      detail::throw_error(ErrorKind::kValue, op, arg, " has unsupported dtype ", c10::toString(t),
                          "; accepted: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 (int32 for counters, uint8 for E8M0 scales)");
  }
}

inline TensorView view(const at::Tensor& t, const char* op, const char* arg) {
  TensorView v;
  v.data = t.data_ptr();
  // (a wrapper subclass reaches a custom class's method unwrapped by no dispatch: no data of its own)
  FP8AMP_CHECK_VALUE(v.data != nullptr || t.numel() == 0, op, arg, " has no data of its own (a tensor subclass that "
                     "wraps another?), got ", c10::toString(t.scalar_type()), t.sizes());
  v.dtype = to_dtype(t.scalar_type(), op, arg);
  v.shape.assign(t.sizes().begin(), t.sizes().end());
  v.strides.assign(t.strides().begin(), t.strides().end());
  if (t.is_cuda()) {
    v.device = Device::kCUDA;
    v.device_index = t.get_device();
  } else {
    FP8AMP_CHECK_VALUE(t.is_cpu(), op, arg, " must be on cpu or cuda, got ", t.device().str());
  }
  return v;
}

// The views of a list argument; an unsupported element is named "xs[3]".
inline std::vector<TensorView> views(at::TensorList ts, const char* op, const char* arg) {
  std::vector<TensorView> v;
  v.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) v.push_back(view(ts[i], op, ListItem(arg, i).c_str()));
  return v;
}

inline std::optional<TensorView> optional_view(const std::optional<at::Tensor>& t, const char* op, const char* arg) {
  if (!t) return std::nullopt;
  return view(*t, op, arg);
}

// An int argument of the schema (int64) narrowed to the core's int, refused when out of range.
inline int narrow_int(int64_t value, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(value >= INT32_MIN && value <= INT32_MAX, op, arg, " must fit in 32 bits, got ", value);
  return static_cast<int>(value);
}

// Output allocation, in symbolic sizes so the same code serves the Meta kernels under
// torch.compile's dynamic shapes.
inline at::Tensor empty_as(const at::Tensor& x, at::ScalarType dtype) {
  return at::empty_symint(x.sym_sizes(), x.options().dtype(dtype));
}

// x viewed as a matrix [rows, cols]: cols is its last dim, rows matrix_rows(x.sym_sizes()) (op_args.h).
inline c10::SymInt columns(const at::Tensor& x) { return x.dim() == 0 ? c10::SymInt(1) : x.sym_size(-1); }

// [cols, rows]: the transpose of that matrix.
inline at::Tensor empty_transposed(const at::Tensor& x, at::ScalarType dtype) {
  return at::empty_symint({columns(x), matrix_rows(x.sym_sizes())}, x.options().dtype(dtype));
}

// A core error as the Python exception of its kind (ValueError, TypeError, ...).
[[noreturn]] inline void raise(const Error& e) {
  switch (e.kind()) {
    case ErrorKind::kValue: C10_THROW_ERROR(ValueError, e.what());
    case ErrorKind::kType: C10_THROW_ERROR(TypeError, e.what());
    case ErrorKind::kNotImplemented: C10_THROW_ERROR(NotImplementedError, e.what());
    case ErrorKind::kRuntime: break;
  }
  C10_THROW_ERROR(Error, e.what());
}

// Runs `f` and translates core errors.
template <class F>
auto translating_errors(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    raise(e);
  }
}

// Runs `f` on the current stream of `t`'s device and translates core errors.
template <class F>
void call(const at::Tensor& t, F&& f) {
  translating_errors([&] {
    Stream stream = nullptr;
#ifdef FP8AMP_WITH_CUDA
    std::optional<c10::cuda::CUDAGuard> guard;
    if (t.is_cuda()) {
      guard.emplace(t.device());
      stream = c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
    }
#endif
    f(stream);
  });
}

// The ops have no derivative (Fp8Linear's autograd Function holds the backward): a backward that
// reaches one, through a program torch.export made of a converted model or an op called on tensors
// that require grad, raises torch's "derivative for fp8amp::<op> is not implemented", where torch's
// default for custom ops gives None gradients with only a warning. For TORCH_LIBRARY_IMPL(fp8amp, Autograd, m).
template <typename... Names>
void register_no_derivative(torch::Library& m, Names... names) {
  (m.impl(names, torch::autograd::autogradNotImplementedFallback()), ...);
}

}  // namespace fp8amp::torch_binding
