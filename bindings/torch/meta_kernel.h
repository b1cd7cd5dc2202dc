// Meta kernels with a device check. The dispatcher runs an op's Meta kernel for torch.compile's
// fake tensors and also whenever any argument is a meta tensor: a meta tensor among real ones (a
// meta scale_inv with CPU codes) would otherwise get an uninitialized result or no write at all.
// MetaKernel<op, kernel>::run first checks that every tensor argument is on the first one's device
// and raises a ValueError naming the two arguments.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>

namespace fp8amp::torch_binding {

class OneDevice {
 public:
  explicit OneDevice(const char* op) : op_(op) {}

  void add(const at::Tensor& t) { see(t, -1); ++arg_; }
  void add(const std::optional<at::Tensor>& t) {
    if (t) see(*t, -1);
    ++arg_;
  }
  void add(at::TensorList ts) {
    for (size_t i = 0; i < ts.size(); ++i) see(ts[i], static_cast<int64_t>(i));
    ++arg_;
  }
  void add(const c10::List<std::optional<at::Tensor>>& ts) {
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::optional<at::Tensor> t = ts[i];
      if (t) see(*t, static_cast<int64_t>(i));
    }
    ++arg_;
  }
  template <class T>
  void add(const T&) {  // not a tensor
    ++arg_;
  }

 private:
  void see(const at::Tensor& t, int64_t element) {
    if (!first_) {
      first_ = t.device();
      first_name_ = name(element);
    } else if (t.device() != *first_) {
      C10_THROW_ERROR(ValueError, std::string("fp8amp.") + op_ + ": every tensor argument must be on one device, got " +
                                      name(element) + " on " + t.device().str() + " and " + first_name_ + " on " +
                                      first_->str());
    }
  }

  std::string name(int64_t element) const {
    const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow((std::string("fp8amp::") + op_).c_str(), "");
    std::string n = schema.schema().arguments().at(arg_).name();
    return element < 0 ? n : n + "[" + std::to_string(element) + "]";
  }

  const char* op_;
  size_t arg_ = 0;
  std::optional<c10::Device> first_;
  std::string first_name_;
};

template <const char* Op, auto Kernel>
struct MetaKernel;

template <const char* Op, class R, class... Args, R (*Kernel)(Args...)>
struct MetaKernel<Op, Kernel> {
  static R run(Args... args) {
    OneDevice check(Op);
    (check.add(args), ...);
    return Kernel(args...);
  }
};

}  // namespace fp8amp::torch_binding
