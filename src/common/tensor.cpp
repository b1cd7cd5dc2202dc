#include "fp8amp/tensor.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <tuple>
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

// The bytes a view occupies, [begin, end): from its lowest to its highest element.
struct ByteRange {
  uintptr_t begin, end;
};

ByteRange bytes_of(const TensorView& t) {
  const uintptr_t data = reinterpret_cast<uintptr_t>(t.data);
  const int64_t n = t.numel();
  if (n == 0) return {data, data};
  int64_t lowest = 0, highest = n - 1;  // element offsets from data
  if (!t.strides.empty()) {
    lowest = highest = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t step = (t.shape[d] - 1) * t.strides[d];
      (step < 0 ? lowest : highest) += step;
    }
  }
  const auto size = static_cast<intptr_t>(dtype_size(t.dtype));
  return {data + static_cast<uintptr_t>(lowest * size), data + static_cast<uintptr_t>((highest + 1) * size)};
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

void disjoint_writes(const std::vector<const TensorView*>& written_list, const std::vector<const TensorView*>& read_list,
                     std::initializer_list<NamedView> written_args, std::initializer_list<NamedView> read_args,
                     const char* op, const std::function<std::string(bool written, size_t i)>& list_names) {
  std::vector<TensorView> written;
  std::vector<const char*> written_names;  // of the named views after the list's
  written.reserve(written_list.size() + written_args.size());
  for (const TensorView* v : written_list) written.push_back(*v);
  for (const NamedView& a : written_args) {
    if (a.view == nullptr) continue;  // an optional argument not given
    written.push_back(*a.view);
    written_names.push_back(a.name);
  }
  const size_t listed = written_list.size();
  const WrittenViews views(std::move(written), op, [&](size_t i) {
    return i < listed ? list_names(true, i) : std::string(written_names[i - listed]);
  });
  for (size_t i = 0; i < read_list.size(); ++i) {
    views.refuse_overlap(*read_list[i], [&] { return list_names(false, i); });
  }
  for (const NamedView& a : read_args) {
    if (a.view != nullptr) views.refuse_overlap(*a.view, [&] { return std::string(a.name); });
  }
}

WrittenViews::WrittenViews(std::vector<TensorView> views, const char* op, std::function<std::string(size_t)> name)
    : views_(std::move(views)), op_(op), name_(std::move(name)) {
  sorted_.reserve(views_.size());
  for (size_t i = 0; i < views_.size(); ++i) {
    const ByteRange r = bytes_of(views_[i]);
    if (r.begin < r.end) sorted_.push_back({r.begin, r.end, i});
  }
  // (stable: two views that begin at one address are named in the order given)
  std::stable_sort(sorted_.begin(), sorted_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  // If two views overlap, so do two neighbours (a view that begins between them begins inside the
  // first).
  for (size_t k = 1; k < sorted_.size(); ++k) {
    const Range& a = sorted_[k - 1];
    const Range& b = sorted_[k];
    if (overlap({a.begin, a.end}, {b.begin, b.end})) {
      no_overlap(views_[a.index], views_[b.index], op_, name_(a.index).c_str(), name_(b.index).c_str());
    }
  }
}

void WrittenViews::refuse_overlap(const TensorView& view, const std::function<std::string()>& view_name) const {
  // The views are disjoint, so their ends are sorted too: `view` overlaps one of them iff it
  // overlaps the last one that begins before its end.
  const ByteRange r = bytes_of(view);
  const auto after =
      std::partition_point(sorted_.begin(), sorted_.end(), [&](const Range& w) { return w.begin < r.end; });
  if (after == sorted_.begin()) return;
  const Range& w = *(after - 1);
  if (overlap(r, {w.begin, w.end})) {
    no_overlap(view, views_[w.index], op_, view_name().c_str(), name_(w.index).c_str());
  }
}

void disjoint_writes(std::initializer_list<NamedView> written, std::initializer_list<NamedView> read, const char* op) {
  disjoint_writes({}, {}, written, read, op, [](bool, size_t) { return std::string(); });
}

}  // namespace check
}  // namespace fp8amp
