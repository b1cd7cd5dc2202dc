// What the cuBLASLt paths of the FP8 GEMMs share (gemm_cuda.cpp, gemm_tiles_cuda.cpp): checked
// cuBLASLt calls, the per-device state (compute capability and one handle, created on first use
// with that device current and never destroyed, because a static destructor can run after the
// CUDA runtime has shut down; a handle is not tied to a stream, so one per device serves every
// stream and thread), owners of descriptors, matrix layouts, and the keys (algo_key) and hash of
// their algorithm caches. Host code; CUDA builds only.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "common/cuda_check.h"
#include "fp8amp/dtype.h"
#include "fp8amp/error.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cuda {
namespace cublaslt {

// FP8 tensor cores arrived with Ada (8.9); Hopper (9.0) and Blackwell (10.x, 12.x) have them too.
constexpr int kMinComputeCapability = 89;

inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    detail::throw_error(ErrorKind::kRuntime, "cublasLt", call, " failed: ", cublasLtGetStatusString(status), " (",
                        file, ":", line, ")");
  }
}
#define FP8AMP_CUBLAS_CHECK(expr) ::fp8amp::cuda::cublaslt::check_cublas((expr), #expr, __FILE__, __LINE__)

// The hash of an algorithm cache's key: the int64 fields the heuristic's answer depends on (each
// GEMM path has its own fields, hence its own N).
struct AlgoKeyHash {
  template <size_t N>
  size_t operator()(const std::array<int64_t, N>& key) const {
    size_t h = 0;
    for (const int64_t v : key) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

// Makes `device` current for the call (the handle, the stream and cuBLASLt's launches belong to
// it) and gives the caller's device back afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    FP8AMP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) FP8AMP_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceScope() {
    // A destructor must not throw. Going back to a device that was current a moment ago can only
    // fail with a broken context, which the caller's next checked CUDA call reports.
    if (switched_) static_cast<void>(cudaSetDevice(previous_));
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

struct DeviceState {
  int compute_capability;   // major * 10 + minor
  cublasLtHandle_t handle;  // only on devices with FP8 (null below kMinComputeCapability)
};

// The state of the current device, `device`, created on first use.
inline const DeviceState& device_state(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceState> states;  // node-based: references stay valid
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = states.find(device);
  if (found != states.end()) return found->second;
  int major = 0, minor = 0;
  FP8AMP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FP8AMP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  DeviceState state{major * 10 + minor, nullptr};
  if (state.compute_capability >= kMinComputeCapability) FP8AMP_CUBLAS_CHECK(cublasLtCreate(&state.handle));
  return states.emplace(device, state).first->second;
}

inline cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat8E4M3: return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2: return CUDA_R_8F_E5M2;
    case DType::kInt32:
    case DType::kUInt8: break;
  }
  detail::throw_error(ErrorKind::kRuntime, "cublasLt", "internal error: no cuBLASLt type for ", dtype_name(dtype));
}

// Largest power of two (up to 256, cuBLASLt's default assumption) that divides the address: the
// heuristic must not pick a kernel that needs more alignment than the call's pointers have.
inline uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// The fields of a problem that every GEMM path's algorithm depends on (device, shape, leading
// dimensions, dtypes, pointer alignments; -1 for an absent bias), followed by the path's own
// (flags, scale modes, workspace size...): the key of the path's algorithm cache.
constexpr size_t kProblemKeyFields = 15;
template <size_t Own>
using AlgoKey = std::array<int64_t, kProblemKeyFields + Own>;

template <class... Own>
AlgoKey<sizeof...(Own)> algo_key(const GemmProblem& g, Own... own) {
  const bool has_bias = g.bias != nullptr;
  return {g.device_index,
          g.m,
          g.n,
          g.k,
          g.lda,
          g.ldb,
          g.ldo,
          static_cast<int64_t>(g.a_dtype),
          static_cast<int64_t>(g.b_dtype),
          static_cast<int64_t>(g.out_dtype),
          has_bias ? static_cast<int64_t>(g.bias_dtype) : -1,
          static_cast<int64_t>(alignment(g.a)),
          static_cast<int64_t>(alignment(g.b)),
          static_cast<int64_t>(alignment(g.out)),
          has_bias ? static_cast<int64_t>(alignment(g.bias)) : -1,
          static_cast<int64_t>(own)...};
}

// Owners of cuBLASLt descriptors. Destroying a descriptor only frees host memory; its status
// cannot be acted on in a destructor.
template <class T, cublasStatus_t (*Destroy)(T)>
struct Destroyer {
  void operator()(T p) const { static_cast<void>(Destroy(p)); }
};
template <class T, cublasStatus_t (*Destroy)(T)>
using Owned = std::unique_ptr<std::remove_pointer_t<T>, Destroyer<T, Destroy>>;
using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

// Checked setters of descriptor and preference attributes; the macros name the attribute and the
// caller's line in the message.
template <class V>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const V& value,
                   const char* name, const char* file, int line) {
  check_cublas(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), name, file, line);
}
#define FP8AMP_SET_DESC(desc, attribute, value)                                                                \
  ::fp8amp::cuda::cublaslt::set_attribute(desc, attribute, value, "cublasLtMatmulDescSetAttribute(" #attribute ")", \
                                          __FILE__, __LINE__)

template <class V>
void set_preference(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attribute,
                    const V& value, const char* name, const char* file, int line) {
  check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)), name, file, line);
}
#define FP8AMP_SET_PREF(pref, attribute, value)                                                     \
  ::fp8amp::cuda::cublaslt::set_preference(pref, attribute, value,                                  \
                                           "cublasLtMatmulPreferenceSetAttribute(" #attribute ")", __FILE__, \
                                           __LINE__)

// A column-major rows x cols matrix with leading dimension ld.
inline Layout layout(DType dtype, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, cuda_type(dtype), static_cast<uint64_t>(rows),
                                                 static_cast<uint64_t>(cols), ld));
  return Layout(raw);
}

}  // namespace cublaslt
}  // namespace cuda
}  // namespace fp8amp
