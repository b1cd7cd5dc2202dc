// Argument helpers shared by the ops' checks (cast.cpp, scaling.cpp, tiles.cpp, adam.cpp) and the
// torch bindings: how an element of a list argument is named in messages, the float32 buffers that
// scales and amaxes live in, and a tensor viewed as a matrix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "fp8amp/tensor.h"

namespace fp8amp {

// The multi-tensor ops take lists and name their elements xs[i] and outs[i]; the single-tensor
// ops name theirs x and out, and the dtype argument their output is allocated from. Each op passes
// its Arity; its name only appears in messages.
enum class Arity : int8_t { kSingle, kMulti };

// The name of element i of a list argument, "exp_avgs[3]", built in place: a call over hundreds of
// tensors names each one for checks that almost always pass, and a heap string each was a large
// part of its host time. Lists are named by the op's schema: short, fixed words.
class ListItem {
 public:
  ListItem(const char* list, size_t i) {
    size_t n = 0;
    while (list[n] != '\0' && n < kMaxList) {
      text_[n] = list[n];
      ++n;
    }
    text_[n++] = '[';
    char digits[24];
    size_t d = 0;
    do {
      digits[d++] = static_cast<char>('0' + i % 10);
      i /= 10;
    } while (i != 0);
    while (d != 0) text_[n++] = digits[--d];
    text_[n++] = ']';
    text_[n] = '\0';
  }
  const char* c_str() const { return text_; }

 private:
  static constexpr size_t kMaxList = 40;
  char text_[kMaxList + 24] = {};
};

// "x" for a single-tensor op, "xs[3]" for a multi-tensor one (short enough for std::string's
// small-buffer storage: no allocation per tensor).
inline std::string element_name(Arity arity, const char* single_name, const char* list_name, size_t i) {
  return arity == Arity::kMulti ? std::string(ListItem(list_name, i).c_str()) : std::string(single_name);
}

// t is float32, contiguous and on like's device (like is named "x" in the message).
inline void check_float32(const TensorView& t, const TensorView& like, const char* op, const char* arg) {
  check::dtype_is(t, DType::kFloat32, op, arg);
  check::contiguous(t, op, arg);
  check::same_device(t, like, op, arg, "x");
}

// The rows of a tensor viewed as a matrix [rows, cols] whose cols is its last dim: the product of
// the other dims (1 for a 0- or 1-dim tensor). Shape is any sequence of sizes: a TensorView's
// shape, or torch's symbolic sizes in the bindings (where the product stays symbolic).
template <class Shape>
std::decay_t<decltype(std::declval<const Shape&>()[0])> matrix_rows(const Shape& shape) {
  std::decay_t<decltype(std::declval<const Shape&>()[0])> rows = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) rows = rows * shape[d];
  return rows;
}

}  // namespace fp8amp
