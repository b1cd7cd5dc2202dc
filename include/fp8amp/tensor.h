// Non-owning views of tensors: the only way data enters the core.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "fp8amp/dtype.h"

namespace fp8amp {

enum class Device : int8_t { kCPU = 0, kCUDA = 1 };

// An opaque cudaStream_t (nullptr: the legacy default stream). CPU ops ignore it.
using Stream = void*;

// A tensor's sizes or strides. Up to kInline of them live in the object itself: a view is made
// for every tensor argument of every call, so a heap allocation each would be most of the host
// time of a call over many tensors (the optimizer's). More dims spill to the heap.
class Dims {
 public:
  static constexpr size_t kInline = 6;

  Dims() = default;
  Dims(std::initializer_list<int64_t> values) { assign(values.begin(), values.end()); }
  Dims(const std::vector<int64_t>& values) { assign(values.begin(), values.end()); }  // NOLINT: implicit
  Dims& operator=(std::initializer_list<int64_t> values) {
    assign(values.begin(), values.end());
    return *this;
  }
  Dims& operator=(const std::vector<int64_t>& values) {
    assign(values.begin(), values.end());
    return *this;
  }

  template <class It>
  void assign(It first, It last) {
    size_ = static_cast<size_t>(std::distance(first, last));
    if (size_ <= kInline) {
      spilled_.clear();
      std::copy(first, last, inline_.begin());
    } else {
      spilled_.assign(first, last);
    }
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* begin() const { return size_ <= kInline ? inline_.data() : spilled_.data(); }
  const int64_t* end() const { return begin() + size_; }
  int64_t operator[](size_t i) const { return begin()[i]; }
  int64_t& operator[](size_t i) { return (size_ <= kInline ? inline_.data() : spilled_.data())[i]; }
  int64_t back() const { return begin()[size_ - 1]; }
  bool operator==(const Dims& other) const { return std::equal(begin(), end(), other.begin(), other.end()); }
  bool operator!=(const Dims& other) const { return !(*this == other); }

 private:
  std::array<int64_t, kInline> inline_{};
  std::vector<int64_t> spilled_;
  size_t size_ = 0;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Dims shape;
  Dims strides;  // in elements; empty means contiguous
  Device device = Device::kCPU;
  int device_index = -1;

  int64_t numel() const;
  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  bool is_contiguous() const;
  std::string describe() const;  // "bfloat16[4, 16] on cuda:0", for error messages

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// A layout whose elements, taken in some order of the tensor's dims, are `rows` runs of `cols`
// consecutive elements, run r starting r * row_stride elements after data (row_stride >= cols):
// a contiguous tensor or a permutation of one (one run), a slice of a matrix's columns (a single
// column: runs of one element), SDPA's q, k, v as views of one projection's output. Order-free
// reductions (amax) read these without a copy.
struct RowRuns {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
};
// The runs of t, or nullopt where its elements do not form them (broadcast, overlapping, or more than
// one outer stride). An empty tensor is one run of 0 elements.
std::optional<RowRuns> row_runs(const TensorView& t);

// Argument checks shared by every op. `op` and `arg` name the op and the argument in the message.
namespace check {
void dtype_is(const TensorView& t, DType expected, const char* op, const char* arg);
void high_precision(const TensorView& t, const char* op, const char* arg);
void scaled_format(DType dtype, const char* op, const char* arg);
void contiguous(const TensorView& t, const char* op, const char* arg);
void same_device(const TensorView& a, const TensorView& b, const char* op, const char* arg_a,
                 const char* arg_b);
void same_shape(const TensorView& a, const TensorView& b, const char* op, const char* arg_a,
                const char* arg_b);
void numel_is(const TensorView& t, int64_t expected, const char* op, const char* arg);
void numel_at_least(const TensorView& t, int64_t expected, const char* op, const char* arg);
void dim_is(const TensorView& t, int64_t expected, const char* op, const char* arg);
// a and b occupy no common byte (an element written through one would race with, or change, an
// element read through the other). A view occupies the bytes from its lowest to its highest
// element: for a strided view the whole span, so two interleaved views of one buffer (the even and
// the odd columns) count as overlapping. An empty view occupies none, wherever it points.
void no_overlap(const TensorView& a, const TensorView& b, const char* op, const char* arg_a, const char* arg_b);

// A tensor argument of an op, as its messages name it; a null view is an optional argument that
// was not given.
struct NamedView {
  const TensorView* view;
  const char* name;
};
// The aliasing rule of every op: no view the op writes (an output, or a buffer updated in place)
// shares a byte with another written view or with a view it only reads. Read views may share
// memory with each other. The error (a ValueError) names both arguments.
void disjoint_writes(std::initializer_list<NamedView> written, std::initializer_list<NamedView> read, const char* op);
// The same where the op also takes lists (hundreds of tensors: O((n + m) log n), not n * m):
// the views of written_list and read_list, named by list_names(true, i) for written_list[i] and
// list_names(false, i) for read_list[i] (called only to build the message), join the named ones.
void disjoint_writes(const std::vector<const TensorView*>& written_list, const std::vector<const TensorView*>& read_list,
                     std::initializer_list<NamedView> written, std::initializer_list<NamedView> read, const char* op,
                     const std::function<std::string(bool written, size_t i)>& list_names);

// The written views of an op that is called many times over the same buffers (the fused Adam
// step's plan), checked once for overlap among themselves (as disjoint_writes does); each call
// then checks only its own views against them, in O(log n) each. It copies the views: the
// buffers must outlive it. name(i) names views[i] (called only to build a message).
class WrittenViews {
 public:
  WrittenViews(std::vector<TensorView> views, const char* op, std::function<std::string(size_t i)> name);
  // Refuses `view` sharing a byte with one of the views; view_name() names it (called only to
  // build the message).
  void refuse_overlap(const TensorView& view, const std::function<std::string()>& view_name) const;

 private:
  struct Range {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<TensorView> views_;
  std::vector<Range> sorted_;  // the non-empty views' bytes, by address
  const char* op_;
  std::function<std::string(size_t)> name_;
};
}  // namespace check

}  // namespace fp8amp
