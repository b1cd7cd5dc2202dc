#include "fp8amp/tensor.h"

#include <sstream>

#include "fp8amp/error.h"

namespace fp8amp {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  if (strides.empty() || numel() == 0) return true;  // torch calls every empty tensor contiguous
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream s;
  s << dtype_name(dtype) << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "] on " << (device == Device::kCPU ? "cpu" : "cuda");
  if (device == Device::kCUDA) s << ":" << device_index;
  return s.str();
}

namespace check {

void dtype_is(const TensorView& t, DType expected, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(t.dtype == expected, op, arg, " must be ", dtype_name(expected), ", got ", t.describe());
}

void high_precision(const TensorView& t, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(is_high_precision(t.dtype), op, arg, " must be float32, bfloat16 or float16, got ",
                     t.describe());
}

void scaled_format(DType dtype, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(is_scaled_format(dtype), op, arg, " must be float8_e4m3fn, float8_e5m2 or float16, got ",
                     dtype_name(dtype));
}

void contiguous(const TensorView& t, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(t.is_contiguous(), op, arg, " must be contiguous, got strides that are not (",
                     t.describe(), "); call .contiguous() first");
}

void same_device(const TensorView& a, const TensorView& b, const char* op, const char* arg_a, const char* arg_b) {
  FP8AMP_CHECK_VALUE(a.device == b.device && a.device_index == b.device_index, op, arg_a, " and ", arg_b,
                     " must be on the same device, got ", a.describe(), " and ", b.describe());
}

void same_shape(const TensorView& a, const TensorView& b, const char* op, const char* arg_a, const char* arg_b) {
  FP8AMP_CHECK_VALUE(a.shape == b.shape, op, arg_a, " and ", arg_b, " must have the same shape, got ",
                     a.describe(), " and ", b.describe());
}

void numel_is(const TensorView& t, int64_t expected, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(t.numel() == expected, op, arg, " must have ", expected, " element(s), got ", t.describe());
}

void numel_at_least(const TensorView& t, int64_t expected, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(t.numel() >= expected, op, arg, " must have at least ", expected, " element(s), got ",
                     t.describe());
}

void dim_is(const TensorView& t, int64_t expected, const char* op, const char* arg) {
  FP8AMP_CHECK_VALUE(t.dim() == expected, op, arg, " must be ", expected, "-D, got ", t.describe());
}

}  // namespace check
}  // namespace fp8amp
