#include "fp8amp/tensor.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <utility>

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

std::optional<RowRuns> row_runs(const TensorView& t) {
  const int64_t n = t.numel();
  if (t.strides.empty() || n == 0) return RowRuns{1, n, n};
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.shape[d] != 1) dims.emplace_back(t.strides[d], t.shape[d]);
  }
  if (dims.empty()) return RowRuns{1, 1, 1};
  std::sort(dims.begin(), dims.end(), std::greater<>());  // outermost first
  // Merge each dim into the next inner one where it steps over exactly that dim's extent.
  std::vector<std::pair<int64_t, int64_t>> merged{dims.back()};
  for (auto it = dims.rbegin() + 1; it != dims.rend(); ++it) {
    auto& inner = merged.back();
    if (it->first == inner.first * inner.second) {
      inner.second *= it->second;
    } else {
      merged.push_back(*it);
    }
  }
  if (merged.front().first != 1) merged.insert(merged.begin(), {1, 1});  // runs of one element
  const auto [inner_stride, cols] = merged.front();
  if (merged.size() > 2) return std::nullopt;
  if (merged.size() == 1) return RowRuns{1, cols, cols};
  const auto [row_stride, rows] = merged.back();
  if (row_stride < cols) return std::nullopt;  // runs would overlap
  return RowRuns{rows, cols, row_stride};
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

namespace {

// The bytes a contiguous view occupies, [begin, end).
struct ByteRange {
  uintptr_t begin, end;
};

ByteRange bytes_of(const TensorView& t) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + static_cast<uintptr_t>(t.numel()) * dtype_size(t.dtype)};
}

// A common byte (an empty view has none, wherever it points).
bool overlap(ByteRange a, ByteRange b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

}  // namespace

void no_overlap(const TensorView& a, const TensorView& b, const char* op, const char* arg_a, const char* arg_b) {
  FP8AMP_CHECK_VALUE(!overlap(bytes_of(a), bytes_of(b)), op, arg_a, " and ", arg_b,
                     " must not share memory, got overlapping ", a.describe(), " and ", b.describe());
}

void disjoint_outputs(const std::vector<TensorView>& outs, const std::vector<TensorView>& xs, const char* op,
                      const std::function<std::string(const char* list, size_t i)>& names) {
  // The non-empty outs by address: if two overlap, so do two neighbours (an out that begins
  // between them begins inside the first). Once they are disjoint their ends are sorted too, so
  // a view overlaps some out iff it overlaps the last one that begins before its end.
  // O((n + m) log m), not n * m, for the hundreds of tensors a multi-tensor call takes; the
  // names are made only for the message.
  std::vector<std::pair<ByteRange, size_t>> sorted;
  for (size_t i = 0; i < outs.size(); ++i) {
    const ByteRange r = bytes_of(outs[i]);
    if (r.begin < r.end) sorted.push_back({r, i});
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
  const auto refuse_if_overlapping = [&](const TensorView& a, ByteRange ra, const char* list_a, size_t i,
                                         const std::pair<ByteRange, size_t>& out) {
    if (!overlap(ra, out.first)) return;
    no_overlap(a, outs[out.second], op, names(list_a, i).c_str(), names("outs", out.second).c_str());
  };
  for (size_t k = 1; k < sorted.size(); ++k) {
    const auto& [range, i] = sorted[k - 1];
    refuse_if_overlapping(outs[i], range, "outs", i, sorted[k]);
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    const ByteRange x = bytes_of(xs[i]);
    const auto after = std::partition_point(sorted.begin(), sorted.end(),
                                            [&](const auto& out) { return out.first.begin < x.end; });
    if (after != sorted.begin()) refuse_if_overlapping(xs[i], x, "xs", i, *(after - 1));
  }
}

}  // namespace check
}  // namespace fp8amp
