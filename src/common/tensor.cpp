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
  std::vector<const TensorView*> written = written_list, read = read_list;
  std::vector<const char*> written_names, read_names;  // of the named views after the lists'
  for (const auto& [args, views, names] :
       {std::tuple{&written_args, &written, &written_names}, std::tuple{&read_args, &read, &read_names}}) {
    for (const NamedView& a : *args) {
      if (a.view == nullptr) continue;  // an optional argument not given
      views->push_back(a.view);
      names->push_back(a.name);
    }
  }
  const auto name = [&](bool is_written, size_t i) {
    const size_t listed = (is_written ? written_list : read_list).size();
    return i < listed ? list_names(is_written, i) : std::string((is_written ? written_names : read_names)[i - listed]);
  };
  // The non-empty written views by address: if two overlap, so do two neighbours (a view that
  // begins between them begins inside the first). Once they are disjoint their ends are sorted
  // too, so a read view overlaps some written one iff it overlaps the last one that begins
  // before its end.
  std::vector<std::pair<ByteRange, size_t>> sorted;
  sorted.reserve(written.size());
  for (size_t i = 0; i < written.size(); ++i) {
    const ByteRange r = bytes_of(*written[i]);
    if (r.begin < r.end) sorted.push_back({r, i});
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
  const auto refuse_if_overlapping = [&](const TensorView& a, ByteRange ra, bool a_written, size_t i,
                                         const std::pair<ByteRange, size_t>& w) {
    if (!overlap(ra, w.first)) return;
    no_overlap(a, *written[w.second], op, name(a_written, i).c_str(), name(true, w.second).c_str());
  };
  for (size_t k = 1; k < sorted.size(); ++k) {
    const auto& [range, i] = sorted[k - 1];
    refuse_if_overlapping(*written[i], range, true, i, sorted[k]);
  }
  for (size_t i = 0; i < read.size(); ++i) {
    const ByteRange r = bytes_of(*read[i]);
    const auto after = std::partition_point(sorted.begin(), sorted.end(),
                                            [&](const auto& w) { return w.first.begin < r.end; });
    if (after != sorted.begin()) refuse_if_overlapping(*read[i], r, false, i, *(after - 1));
  }
}

void disjoint_writes(std::initializer_list<NamedView> written, std::initializer_list<NamedView> read, const char* op) {
  disjoint_writes({}, {}, written, read, op, [](bool, size_t) { return std::string(); });
}

}  // namespace check
}  // namespace fp8amp
