// Shared by the CUDA tests: checked CUDA calls, the clean skip on machines without a GPU, and the
// tensor held on both sides that the bit-exact CPU-against-CUDA tests compare.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/tensor.h"

namespace fp8amp {

// Throws, for helpers that return values (gtest reports the exception as a failure).
inline void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

inline bool has_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// A contiguous tensor held twice, in host memory (for the CPU reference) and in device memory (for
// CUDA), `offset` elements into its allocation so a test can misalign its start. kGuard elements
// of kGuardByte on each side of it, on both sides, show a stray write.
class MirroredTensor {
 public:
  static constexpr int64_t kGuard = 16;
  static constexpr uint8_t kGuardByte = 0xA5;

  MirroredTensor(DType dtype, std::vector<int64_t> shape, int64_t offset = 0)
      : dtype_(dtype), shape_(std::move(shape)), offset_(kGuard + offset) {
    numel_ = 1;
    for (int64_t d : shape_) numel_ *= d;
    host_.assign(static_cast<size_t>((offset_ + numel_ + kGuard) * elem()), kGuardByte);
    cuda_ok(cudaMalloc(&device_, host_.size()), "cudaMalloc");
  }
  MirroredTensor(const MirroredTensor&) = delete;
  MirroredTensor& operator=(const MirroredTensor&) = delete;
  ~MirroredTensor() { cudaFree(device_); }

  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  size_t elem() const { return dtype_size(dtype_); }

  // The elements in host memory, as raw bits of the element's width.
  void set_bits(int64_t i, uint32_t bits) { std::memcpy(host_.data() + (offset_ + i) * elem(), &bits, elem()); }
  void set_float(int64_t i, float v) { set_bits(i, numerics::float_bits(v)); }
  void set_int(int64_t i, int32_t v) { set_bits(i, static_cast<uint32_t>(v)); }
  uint32_t bits(int64_t i) const {
    uint32_t b = 0;
    std::memcpy(&b, host_.data() + (offset_ + i) * elem(), elem());
    return b;
  }
  float get_float(int64_t i) const { return numerics::bits_float(bits(i)); }  // float32 tensors

  // The host or the device copy, with its own shape or another one of the same numel.
  TensorView view(Device device, std::vector<int64_t> shape) const {
    uint8_t* base = device == Device::kCPU ? const_cast<uint8_t*>(host_.data()) : static_cast<uint8_t*>(device_);
    TensorView v;
    v.data = base + offset_ * elem();
    v.dtype = dtype_;
    v.shape = std::move(shape);
    v.device = device;
    v.device_index = device == Device::kCPU ? -1 : 0;
    return v;
  }
  TensorView view(Device device) const { return view(device, shape_); }

  void upload() { cuda_ok(cudaMemcpy(device_, host_.data(), host_.size(), cudaMemcpyHostToDevice), "upload"); }

  // Device bytes against host bytes, guards included; names the tensor (`name`, for a test that
  // compares many) and its first differing element, with that element's bits on both sides.
  ::testing::AssertionResult same_on_both(const std::string& name = "tensor") const {
    std::vector<uint8_t> got(host_.size());
    cuda_ok(cudaMemcpy(got.data(), device_, got.size(), cudaMemcpyDeviceToHost), "download");
    if (got == host_) return ::testing::AssertionSuccess();
    size_t byte = 0;
    while (got[byte] == host_[byte]) ++byte;
    const size_t first = byte / elem() * elem();
    const int64_t i = static_cast<int64_t>(byte / elem()) - offset_;
    uint32_t cpu = 0, cuda = 0;
    std::memcpy(&cpu, host_.data() + first, elem());
    std::memcpy(&cuda, got.data() + first, elem());
    std::ostringstream s;
    s << name << " (" << dtype_name(dtype_) << "[";
    for (size_t d = 0; d < shape_.size(); ++d) s << (d ? ", " : "") << shape_[d];
    s << "], " << numel_ << " elements) differs first at element " << i << (i < 0 || i >= numel_ ? " (a guard)" : "")
      << ": cpu 0x" << std::hex << cpu << ", cuda 0x" << cuda;
    return ::testing::AssertionFailure() << s.str();
  }

 private:
  DType dtype_;
  std::vector<int64_t> shape_;
  int64_t offset_;  // in elements, guard included
  int64_t numel_;
  std::vector<uint8_t> host_;
  void* device_ = nullptr;
};

// Uploads every tensor, runs op(Device::kCPU) then op(Device::kCUDA), and expects every tensor
// byte-identical afterwards.
inline void expect_cuda_matches_cpu(const std::vector<MirroredTensor*>& tensors, const std::function<void(Device)>& op,
                                    const std::string& what) {
  SCOPED_TRACE(what);
  for (MirroredTensor* t : tensors) t->upload();
  op(Device::kCPU);
  op(Device::kCUDA);
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (MirroredTensor* t : tensors) EXPECT_TRUE(t->same_on_both());
}

}  // namespace fp8amp

#define REQUIRE_GPU()                                             \
  do {                                                            \
    if (!::fp8amp::has_gpu()) GTEST_SKIP() << "no CUDA device";   \
  } while (0)
