// FP8 GEMM on CUDA through cuBLASLt (host code; compiled only with CUDA).
//
// Layout. cuBLASLt is column-major and, on Ada and Hopper, runs FP8 only as "TN": op(A) = Aᵀ,
// op(B) = B, both operands K-major. Our row-major out[M, N] = a[M, K] · b[N, K]ᵀ is, read
// column-major, outᵀ[N, M] = b · aᵀ, so the call is
//   A := b, stored as a column-major K x N matrix with ld = ldb, TRANSA = T  (op(A) is N x K)
//   B := a, stored as a column-major K x M matrix with ld = lda, TRANSB = N  (op(B) is K x M)
//   C = D := out, a column-major N x M matrix with ld = ldo;  m = N, n = M, k = K,
// the per-tensor scales go to A_SCALE = b_scale_inv and B_SCALE = a_scale_inv, and the bias
// (one value per row of D, i.e. per column of out) goes to the BIAS epilogue.
//
// Caches, for the life of the process:
// - per device, behind one mutex: its compute capability and one cublasLt handle (created on
//   first use with that device current; never destroyed, because a static destructor can run
//   after the CUDA runtime has shut down). A handle is not tied to a stream, so one per device
//   serves every stream and thread.
// - the heuristic's algorithm per problem (device, shape, leading dims, dtypes, flags, pointer
//   alignments, workspace size), behind another mutex. Descriptors hold the call's pointers
//   (scales, bias), so they are built per call: host work of a few microseconds.
// The workspace is the caller's (GemmOptions): the core allocates no device memory.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "common/cuda_check.h"
#include "gemm/gemm_kernels.h"

namespace fp8amp {
namespace cuda {

namespace {

constexpr const char* kOp = "gemm";
// FP8 tensor cores arrived with Ada (8.9); Hopper (9.0) and Blackwell (10.x, 12.x) have them too.
constexpr int kMinComputeCapability = 89;

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    detail::throw_error(ErrorKind::kRuntime, "cublasLt", call, " failed: ", cublasLtGetStatusString(status), " (",
                        file, ":", line, ")");
  }
}
#define FP8AMP_CUBLAS_CHECK(expr) check_cublas((expr), #expr, __FILE__, __LINE__)

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
const DeviceState& device_state(int device) {
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

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat8E4M3: return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2: return CUDA_R_8F_E5M2;
    case DType::kInt32: break;
  }
  detail::throw_error(ErrorKind::kRuntime, kOp, "internal error: no cuBLASLt type for ", dtype_name(dtype));
}

// Largest power of two (up to 256, cuBLASLt's default assumption) that divides the address: the
// heuristic must not pick a kernel that needs more alignment than the call's pointers have.
uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
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

template <class V>
void set_attribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const V& value,
                   const char* name, int line) {
  check_cublas(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), name, __FILE__, line);
}
#define FP8AMP_SET_DESC(desc, attribute, value) \
  set_attribute(desc, attribute, value, "cublasLtMatmulDescSetAttribute(" #attribute ")", __LINE__)

template <class V>
void set_preference(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attribute,
                    const V& value, const char* name, int line) {
  check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)), name, __FILE__, line);
}
#define FP8AMP_SET_PREF(pref, attribute, value) \
  set_preference(pref, attribute, value, "cublasLtMatmulPreferenceSetAttribute(" #attribute ")", __LINE__)

// A column-major rows x cols matrix with leading dimension ld.
Layout layout(DType dtype, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, cuda_type(dtype), static_cast<uint64_t>(rows),
                                                 static_cast<uint64_t>(cols), ld));
  return Layout(raw);
}

// Everything the heuristic's answer depends on.
using AlgoKey = std::array<int64_t, 18>;

struct AlgoKeyHash {
  size_t operator()(const AlgoKey& key) const {
    size_t h = 0;
    for (const int64_t v : key) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

AlgoKey algo_key(const GemmArgs& g) {
  const bool has_bias = g.bias != nullptr;
  return AlgoKey{g.device_index,
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
                 g.accumulate,
                 g.fast_accum,
                 static_cast<int64_t>(g.workspace_bytes),
                 alignment(g.a),
                 alignment(g.b),
                 alignment(g.out),
                 has_bias ? static_cast<int64_t>(alignment(g.bias)) : -1};
}

// The heuristic's first choice for this problem, asked once per key.
cublasLtMatmulAlgo_t find_algo(const GemmArgs& g, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                               cublasLtMatrixLayout_t a_layout, cublasLtMatrixLayout_t b_layout,
                               cublasLtMatrixLayout_t out_layout) {
  static std::mutex mutex;
  static std::unordered_map<AlgoKey, cublasLtMatmulAlgo_t, AlgoKeyHash> cache;
  const AlgoKey key = algo_key(g);
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = cache.find(key);
    if (found != cache.end()) return found->second;
  }
  cublasLtMatmulPreference_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw));
  const Preference pref(raw);
  const uint64_t workspace_bytes = g.workspace_bytes;
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
  // cuBLASLt's A is our b and its B our a (see the top of this file); C and D are out.
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment(g.b));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment(g.a));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment(g.out));
  FP8AMP_SET_PREF(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment(g.out));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc, a_layout, b_layout, out_layout,
                                                               out_layout, pref.get(), 1, &result, &found);
  // NOT_SUPPORTED is cuBLASLt's way of saying "no kernel for this problem".
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  }
  FP8AMP_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0, kNotImplemented, kOp,
               "cuBLASLt has no FP8 kernel for M = ", g.m, ", N = ", g.n, ", K = ", g.k, ", a ",
               dtype_name(g.a_dtype), ", b ", dtype_name(g.b_dtype), ", out ", dtype_name(g.out_dtype),
               g.bias != nullptr ? " with bias" : "", " on cuda:", g.device_index, " (", g.workspace_bytes,
               " bytes of workspace)");
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, result.algo);
  return result.algo;
}

}  // namespace

void gemm(const GemmArgs& g, Stream stream) {
  const DeviceScope scope(g.device_index);
  const DeviceState& device = device_state(g.device_index);
  FP8AMP_CHECK(device.compute_capability >= kMinComputeCapability, kNotImplemented, kOp,
               "FP8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); cuda:",
               g.device_index, " has ", device.compute_capability / 10, ".", device.compute_capability % 10);
  if (g.k == 0) {
    gemm_empty_sum(g, stream);
    return;
  }

  cublasLtMatmulDesc_t raw = nullptr;
  FP8AMP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const MatmulDesc desc(raw);
  const int32_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, transa);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, transb);
  const int8_t fast_accum = g.fast_accum ? 1 : 0;
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum);
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(g.b_scale_inv));
  FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(g.a_scale_inv));
  if (g.bias != nullptr) {
    const uint32_t bias_epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = cuda_type(g.bias_dtype);
    FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, bias_epilogue);
    FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    FP8AMP_SET_DESC(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
  }
  const Layout a_layout = layout(g.b_dtype, g.k, g.n, g.ldb);
  const Layout b_layout = layout(g.a_dtype, g.k, g.m, g.lda);
  const Layout out_layout = layout(g.out_dtype, g.n, g.m, g.ldo);

  const cublasLtMatmulAlgo_t algo =
      find_algo(g, device.handle, desc.get(), a_layout.get(), b_layout.get(), out_layout.get());
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // In place (C = D, same layout) is how cuBLASLt accumulates; with beta = 0 C is not read.
  FP8AMP_CUBLAS_CHECK(cublasLtMatmul(device.handle, desc.get(), &alpha, g.b, a_layout.get(), g.a, b_layout.get(),
                                     &beta, g.out, out_layout.get(), g.out, out_layout.get(), &algo, g.workspace,
                                     g.workspace_bytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace cuda
}  // namespace fp8amp
