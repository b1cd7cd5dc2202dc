// The core's one exception type. Library code never exits, aborts or prints: it throws this,
// with a message that names the offending argument and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fp8amp {

enum class ErrorKind {
  kValue,           // bad argument value, shape, dtype or device -> Python ValueError
  kType,            // argument of the wrong kind -> Python TypeError
  kNotImplemented,  // valid request this build or device cannot serve -> NotImplementedError
  kRuntime,         // failure of CUDA, cuBLAS or the like -> RuntimeError
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
[[noreturn]] void throw_error(ErrorKind kind, const char* op, const Args&... args) {
  std::ostringstream s;
  s << "fp8amp." << op << ": ";
  (s << ... << args);
  throw Error(kind, s.str());
}
}  // namespace detail

}  // namespace fp8amp

// FP8AMP_CHECK(cond, kind, op, message parts...): throws fp8amp::Error when cond is false.
#define FP8AMP_CHECK(cond, kind, op, ...)                                      \
  do {                                                                         \
    if (!(cond)) ::fp8amp::detail::throw_error(::fp8amp::ErrorKind::kind, op, __VA_ARGS__); \
  } while (0)

#define FP8AMP_CHECK_VALUE(cond, op, ...) FP8AMP_CHECK(cond, kValue, op, __VA_ARGS__)
