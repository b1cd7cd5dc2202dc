// The cuBLASLt FP8 GEMM against the CPU reference (gemm_cpu.cpp) through the public API: every
// accepted format pair, output dtype, bias on/off, accumulate, fast accumulation, odd M, strided
// operands and outputs, a misaligned bias, K == 0. Sums differ in order and in the tensor
// cores' accumulator precision, so the comparison is a per-element bound derived from those
// precisions (below); everything outside the output must stay untouched, and every output
// element must be written. Skips without a GPU of compute capability 8.9 or newer.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "common/numerics.h"
#include "expect_error.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"

namespace fp8amp {
namespace {

// Compute capability of device 0 as major * 10 + minor; 0 without a GPU.
int compute_capability() {
  int count = 0, major = 0, minor = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return 0;
  cuda_ok(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), "compute capability");
  cuda_ok(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), "compute capability");
  return major * 10 + minor;
}

#define REQUIRE_FP8_GPU()                                                                      \
  do {                                                                                         \
    const int cc = compute_capability();                                                       \
    if (cc == 0) GTEST_SKIP() << "no CUDA device";                                             \
    if (cc < 89) GTEST_SKIP() << "compute capability " << cc << " has no FP8 GEMM (needs 89+)"; \
  } while (0)

constexpr uint8_t kGuardByte = 0xA5;  // E4M3 and E5M2 -> a negative normal; every padding byte
constexpr size_t kGuardBytes = 256;   // on each side of every buffer, checked untouched

// A 2-D row-major matrix [rows, cols] with row stride ld, held in host memory (for the CPU
// reference) and in device memory, `offset` bytes past a guard so a test can misalign it.
class Matrix {
 public:
  Matrix(DType dtype, int64_t rows, int64_t cols, int64_t ld, size_t offset = 0)
      : dtype_(dtype), rows_(rows), cols_(cols), ld_(ld), begin_(kGuardBytes + offset) {
    const size_t bytes = static_cast<size_t>(rows > 0 ? (rows - 1) * ld + cols : 0) * elem();
    host_.assign(begin_ + bytes + kGuardBytes, kGuardByte);
    cuda_ok(cudaMalloc(&device_, host_.size()), "cudaMalloc");
  }
  Matrix(const Matrix&) = delete;
  Matrix& operator=(const Matrix&) = delete;
  ~Matrix() { cudaFree(device_); }

  DType dtype() const { return dtype_; }
  size_t elem() const { return dtype_size(dtype_); }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  uint8_t* at(int64_t r, int64_t c) { return host_.data() + begin_ + (r * ld_ + c) * elem(); }
  const uint8_t* at(int64_t r, int64_t c) const { return host_.data() + begin_ + (r * ld_ + c) * elem(); }

  float get(int64_t r, int64_t c) const {
    uint32_t bits = 0;
    std::memcpy(&bits, at(r, c), elem());
    switch (dtype_) {
      case DType::kFloat32: return numerics::bits_float(bits);
      case DType::kBFloat16: return numerics::bf16_to_float(static_cast<uint16_t>(bits));
      case DType::kFloat16: return numerics::fp16_to_float(static_cast<uint16_t>(bits));
      case DType::kFloat8E4M3: return numerics::decode<numerics::E4M3>(bits);
      case DType::kFloat8E5M2: return numerics::decode<numerics::E5M2>(bits);
      case DType::kInt32: break;
    }
    throw std::runtime_error("no value for this dtype");
  }
  // Stores v rounded to the dtype (FP8 saturating, as the quantizer would).
  void set(int64_t r, int64_t c, float v) {
    uint32_t bits = 0;
    switch (dtype_) {
      case DType::kFloat32: bits = numerics::float_bits(v); break;
      case DType::kBFloat16: bits = numerics::float_to_bf16(v); break;
      case DType::kFloat16: bits = numerics::float_to_fp16(v); break;
      case DType::kFloat8E4M3: bits = numerics::quantize_to<numerics::fp8_e4m3>(v).bits; break;
      case DType::kFloat8E5M2: bits = numerics::quantize_to<numerics::fp8_e5m2>(v).bits; break;
      case DType::kInt32: throw std::runtime_error("no value for this dtype");
    }
    std::memcpy(at(r, c), &bits, elem());
  }

  TensorView view(Device device) {
    uint8_t* base = device == Device::kCPU ? host_.data() : static_cast<uint8_t*>(device_);
    TensorView v;
    v.data = base + begin_;
    v.dtype = dtype_;
    v.shape = {rows_, cols_};
    v.strides = {ld_, 1};
    v.device = device;
    v.device_index = device == Device::kCPU ? -1 : 0;
    return v;
  }
  // As a 1-D tensor (a bias row).
  TensorView vector_view(Device device) {
    TensorView v = view(device);
    v.shape = {cols_};
    v.strides = {1};
    return v;
  }

  void upload() { cuda_ok(cudaMemcpy(device_, host_.data(), host_.size(), cudaMemcpyHostToDevice), "upload"); }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> bytes(host_.size());
    cuda_ok(cudaMemcpy(bytes.data(), device_, bytes.size(), cudaMemcpyDeviceToHost), "download");
    return bytes;
  }
  // The same matrix with the device's bytes (guards and padding included).
  void take(const std::vector<uint8_t>& bytes) { host_ = bytes; }
  // Whether byte i of the buffer is outside the matrix's elements.
  bool outside(size_t i) const {
    if (i < begin_ || rows_ == 0 || cols_ == 0) return true;
    const int64_t e = static_cast<int64_t>((i - begin_) / elem());
    return e >= (rows_ - 1) * ld_ + cols_ || e % ld_ >= cols_;
  }
  const std::vector<uint8_t>& bytes() const { return host_; }

 private:
  DType dtype_;
  int64_t rows_, cols_, ld_;
  size_t begin_;
  std::vector<uint8_t> host_;
  void* device_ = nullptr;
};

// cuBLASLt's workspace for every test: what the torch binding gives it.
void* workspace() {
  static void* p = [] {
    void* w = nullptr;
    cuda_ok(cudaMalloc(&w, kGemmWorkspaceBytes), "cudaMalloc workspace");
    return w;
  }();
  return p;
}

struct Case {
  int64_t m, n, k;
  DType a_dtype = DType::kFloat8E4M3, b_dtype = DType::kFloat8E4M3, out_dtype = DType::kBFloat16;
  bool bias = false, accumulate = false, fast_accum = false;
  int64_t pad = 0;            // extra columns in the rows of a, b and out (a multiple of 16)
  size_t workspace_bytes = kGemmWorkspaceBytes;

  std::string name() const {
    std::ostringstream s;
    s << m << "x" << n << "x" << k << " " << dtype_name(a_dtype) << " x " << dtype_name(b_dtype) << " -> "
      << dtype_name(out_dtype) << (bias ? " +bias" : "") << (accumulate ? " +out" : "")
      << (fast_accum ? " fast_accum" : "") << (pad ? " padded" : "")
      << (workspace_bytes ? "" : " no workspace");
    return s.str();
  }
};

// Bounds. Products of FP8 values are exact in FP32; what differs is the sum. Hopper's FP8 tensor
// cores keep about 14 bits of a partial sum (DeepSeek-V3 report, §3.3.2: "around 14 bits") and
// cuBLASLt promotes the partial sum to an FP32 register every few MMA instructions of k = 32,
// unless fast accumulation is on, when it never does. Model: each of the L additions done in
// the tensor core's accumulator loses at most 2^-13 of the sum of |products| so far, so
//   |gpu - exact| <= L * 2^-13 * S,  S = |a_scale_inv * b_scale_inv| * sum_k |a_ik * b_jk|,
// with L = K / 32 for fast accumulation and at most kPromotionInterval otherwise (the FP32 sums
// of the promoted parts add K / 32 * 2^-24 * S, folded in below). Then each side rounds to the
// output dtype (unit roundoff u: 2^-24, 2^-8, 2^-11, plus fp16's subnormal spacing), twice when
// accumulating (gemm.h), and adds out and bias in FP32.
constexpr int kPromotionInterval = 4;

double unit_roundoff(DType dtype) {
  return dtype == DType::kFloat32 ? std::ldexp(1.0, -24) : (dtype == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11));
}

struct Errors {
  double worst_ratio = 0.0;  // max over elements of |gpu - cpu| / bound
  double accum_ratio = 0.0;  // max over elements of (|gpu - cpu| - rounding) / (2^-13 * S): the measured L
  double rel_frobenius = 0.0;  // ||gpu - exact|| / ||exact||, exact in double
  int64_t violations = 0;
  std::string first_violation;
};

void run_case(const Case& c, Errors* errors) {
  std::mt19937 rng(static_cast<uint32_t>(c.m * 131 + c.n * 31 + c.k + c.bias * 7 + c.accumulate * 3));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t lda = c.k + c.pad, ldb = c.k + c.pad, ldo = c.n + c.pad;
  Matrix a(c.a_dtype, c.m, c.k, lda), b(c.b_dtype, c.n, c.k, ldb), out(c.out_dtype, c.m, c.n, ldo);
  Matrix a_si(DType::kFloat32, 1, 1, 1), b_si(DType::kFloat32, 1, 1, 1);
  Matrix bias(c.out_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16, 1, c.n, c.n);

  // Operands as the quantizer makes them: N(0, sigma) data times the power-of-two scale that maps
  // its amax near the format's max (docs/numerics.md#numerics); sigma differs per side.
  auto quantize = [&](Matrix& m, Matrix& scale_inv, float sigma) {
    std::vector<float> x(m.rows() * m.cols());
    float amax = 0.0f;
    for (float& v : x) {
      v = sigma * normal(rng);
      amax = std::max(amax, std::fabs(v));
    }
    const numerics::ScalePair pair =
        numerics::scale_from_amax(amax, dtype_info(m.dtype()).max_finite, 0, true, numerics::ScalePair{1.0f, 1.0f});
    for (int64_t r = 0; r < m.rows(); ++r)
      for (int64_t col = 0; col < m.cols(); ++col) m.set(r, col, x[r * m.cols() + col] * pair.scale);
    scale_inv.set(0, 0, pair.scale_inv);
  };
  quantize(a, a_si, 1.0f);
  quantize(b, b_si, 0.05f);
  for (int64_t j = 0; j < c.n; ++j) bias.set(0, j, normal(rng));
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) out.set(i, j, c.accumulate ? 4.0f * normal(rng) : std::nanf(""));
  for (Matrix* m : {&a, &b, &out, &a_si, &b_si, &bias}) m->upload();
  Matrix old(c.out_dtype, c.m, c.n, ldo);  // out before the call
  old.take(out.bytes());

  auto run = [&](Device d) {
    GemmOptions o;
    o.accumulate = c.accumulate;
    o.fast_accum = c.fast_accum;
    if (d == Device::kCUDA) {
      o.workspace = c.workspace_bytes ? workspace() : nullptr;
      o.workspace_bytes = c.workspace_bytes;
    }
    const TensorView bias_view = bias.vector_view(d);
    gemm(a.view(d), b.view(d), a_si.view(d), b_si.view(d), c.bias ? &bias_view : nullptr, out.view(d), o, nullptr);
  };
  run(Device::kCPU);
  run(Device::kCUDA);
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const std::vector<uint8_t> gpu_bytes = out.download();

  // Nothing outside out's elements may change (padding between rows, guards).
  for (size_t i = 0; i < gpu_bytes.size(); ++i) {
    if (out.outside(i) && gpu_bytes[i] != old.bytes()[i]) {
      ADD_FAILURE() << c.name() << ": byte " << i << " outside the output changed";
      return;
    }
  }
  Matrix gpu(c.out_dtype, c.m, c.n, ldo);
  gpu.take(gpu_bytes);

  // S and the exact result, in double, with b decoded once as [K, N].
  const double s = double(a_si.get(0, 0)) * b_si.get(0, 0);
  std::vector<double> bt(c.k * c.n), abs_sum(c.n), exact(c.n);  // exact: the product sums
  for (int64_t j = 0; j < c.n; ++j)
    for (int64_t k = 0; k < c.k; ++k) bt[k * c.n + j] = b.get(j, k);
  const double u = unit_roundoff(c.out_dtype), tiny = c.out_dtype == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0;
  const double accum_steps = c.fast_accum ? std::ceil(c.k / 32.0) : std::min(std::ceil(c.k / 32.0), double(kPromotionInterval));
  const double gamma = accum_steps * std::ldexp(1.0, -13) + c.k / 32.0 * std::ldexp(1.0, -24);
  double err2 = 0.0, ref2 = 0.0;
  for (int64_t i = 0; i < c.m; ++i) {
    std::fill(abs_sum.begin(), abs_sum.end(), 0.0);
    std::fill(exact.begin(), exact.end(), 0.0);
    for (int64_t k = 0; k < c.k; ++k) {
      const double av = a.get(i, k);
      for (int64_t j = 0; j < c.n; ++j) {
        exact[j] += av * bt[k * c.n + j];
        abs_sum[j] += std::fabs(av * bt[k * c.n + j]);
      }
    }
    for (int64_t j = 0; j < c.n; ++j) {
      const double old_v = c.accumulate ? old.get(i, j) : 0.0, bias_v = c.bias ? bias.get(0, j) : 0.0;
      const double added = std::fabs(old_v) + std::fabs(bias_v);
      const double ref = out.get(i, j), got = gpu.get(i, j);
      const double sum_s = s * abs_sum[j];
      // Accumulating, each side first rounds its product plus bias (gemm.h): 2u of that more.
      const double result = c.accumulate ? std::fabs(s * exact[j] + bias_v) : 0.0;
      const double rounding =
          u * (std::fabs(ref) + std::fabs(got) + 2.0 * result) + std::ldexp(1.0, -23) * added + tiny;
      const double bound = gamma * sum_s + rounding;
      const double err = std::fabs(got - ref);
      if (!(err <= bound)) {  // NaN fails too
        if (errors->violations++ == 0) {
          std::ostringstream msg;
          msg << "[" << i << ", " << j << "]: gpu " << got << ", cpu " << ref << ", bound " << bound;
          errors->first_violation = msg.str();
        }
      }
      if (bound > 0) errors->worst_ratio = std::max(errors->worst_ratio, err / bound);
      if (sum_s > 0) errors->accum_ratio = std::max(errors->accum_ratio, (err - rounding) / (std::ldexp(1.0, -13) * sum_s));
      const double x = s * exact[j] + old_v + bias_v;
      err2 += (got - x) * (got - x);
      ref2 += x * x;
    }
  }
  errors->rel_frobenius = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
}

void expect_close(const Case& c) {
  SCOPED_TRACE(c.name());
  Errors e;
  run_case(c, &e);
  EXPECT_EQ(e.violations, 0) << e.violations << " element(s) outside the bound, first " << e.first_violation;
  // The log records how much of the bound was used; a tiny fraction would mean a vacuous bound.
  std::printf("  %-70s worst/bound %.3f  err/(2^-13 S) %.3f  rel frobenius %.2e\n", c.name().c_str(), e.worst_ratio,
              e.accum_ratio, e.rel_frobenius);
}

const std::pair<DType, DType> kFormats[] = {{DType::kFloat8E4M3, DType::kFloat8E4M3},
                                            {DType::kFloat8E4M3, DType::kFloat8E5M2},
                                            {DType::kFloat8E5M2, DType::kFloat8E4M3}};
const DType kOutputs[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Every option combination on small and medium shapes (odd M included).
TEST(GemmCuda, AllOptionsMatchTheReference) {
  REQUIRE_FP8_GPU();
  const int64_t shapes[][3] = {{16, 16, 16}, {17, 48, 64}, {128, 256, 512}};
  for (const auto& shape : shapes) {
    for (const auto& [fa, fb] : kFormats) {
      for (const DType out : kOutputs) {
        for (int flags = 0; flags < 8; ++flags) {
          Case c{shape[0], shape[1], shape[2], fa, fb, out};
          c.bias = flags & 1;
          c.accumulate = flags & 2;
          c.fast_accum = flags & 4;
          expect_close(c);
        }
      }
    }
  }
}

// Large and Linear-like shapes, M not a multiple of 16; a few combinations each.
TEST(GemmCuda, LargeShapes) {
  REQUIRE_FP8_GPU();
  const int64_t shapes[][3] = {{1000, 1008, 1024}, {1, 4096, 1024}, {333, 64, 4096}};
  for (const auto& shape : shapes) {
    for (const auto& [fa, fb] : kFormats) {
      Case c{shape[0], shape[1], shape[2], fa, fb, DType::kBFloat16};
      c.bias = true;
      c.fast_accum = fa == fb;
      expect_close(c);
    }
    Case c{shape[0], shape[1], shape[2]};
    c.out_dtype = DType::kFloat32;
    c.accumulate = true;
    expect_close(c);
  }
}

// Autotuning: every call of a new problem while its candidates take turns is within the bound
// (accumulating ones too), and the problem is decided after at most 8 candidates x 3 rounds.
TEST(GemmCuda, AutotuneCallsMatchTheReferenceUntilDecided) {
  REQUIRE_FP8_GPU();
  struct Off {
    ~Off() { set_gemm_autotune(false); }
  } off;
  set_gemm_autotune(true);
  for (const bool accumulate : {false, true}) {
    const GemmAutotuneStats before = gemm_autotune_stats();
    Case c{144, 336, 512, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kBFloat16};
    c.bias = true;
    c.accumulate = accumulate;
    for (int call = 0; call < 30; ++call) expect_close(c);  // run_case synchronizes after each call
    const GemmAutotuneStats after = gemm_autotune_stats();
    EXPECT_EQ(after.tuned, before.tuned + 1) << "accumulate " << accumulate;
    EXPECT_EQ(after.tuning, before.tuning);
  }
}

TEST(GemmCuda, StridedViewsAndNoWorkspace) {
  REQUIRE_FP8_GPU();
  for (const DType out : kOutputs) {
    Case c{40, 64, 96};
    c.out_dtype = out;
    c.pad = 32;
    c.bias = true;
    c.accumulate = true;
    expect_close(c);
    c.pad = 0;
    c.workspace_bytes = 0;
    expect_close(c);
  }
}

// K == 0: no cuBLASLt call; our kernel must give the reference's bits.
TEST(GemmCuda, EmptySumIsExact) {
  REQUIRE_FP8_GPU();
  for (const DType out_dtype : kOutputs) {
    for (int flags = 0; flags < 4; ++flags) {
      Matrix a(DType::kFloat8E4M3, 3, 0, 16), b(DType::kFloat8E4M3, 32, 0, 16), out(out_dtype, 3, 32, 48);
      Matrix a_si(DType::kFloat32, 1, 1, 1), b_si(DType::kFloat32, 1, 1, 1);
      Matrix bias(out_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16, 1, 32, 32);
      a_si.set(0, 0, std::nanf(""));
      b_si.set(0, 0, 1.0f);
      for (int64_t j = 0; j < 32; ++j) bias.set(0, j, 0.1f * j - 1.0f);
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 32; ++j) out.set(i, j, 0.37f * (i - j));
      for (Matrix* m : {&a, &b, &out, &a_si, &b_si, &bias}) m->upload();
      GemmOptions o;
      o.accumulate = flags & 2;
      for (const Device d : {Device::kCPU, Device::kCUDA}) {
        const TensorView bias_view = bias.vector_view(d);
        gemm(a.view(d), b.view(d), a_si.view(d), b_si.view(d), (flags & 1) ? &bias_view : nullptr, out.view(d), o,
             nullptr);
      }
      cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      EXPECT_EQ(out.download(), out.bytes()) << dtype_name(out_dtype) << " flags " << flags;
    }
  }
}

TEST(GemmCuda, IllegalShapesAreRefusedBeforeAnyLaunch) {
  REQUIRE_FP8_GPU();
  Matrix a(DType::kFloat8E4M3, 32, 24, 32), b(DType::kFloat8E4M3, 32, 24, 32), out(DType::kBFloat16, 32, 32, 32);
  Matrix a_si(DType::kFloat32, 1, 1, 1), b_si(DType::kFloat32, 1, 1, 1);
  auto run = [&](const TensorView& va, const TensorView& vb) {
    gemm(va, vb, a_si.view(Device::kCUDA), b_si.view(Device::kCUDA), nullptr, out.view(Device::kCUDA), {}, nullptr);
  };
  expect_value_error([&] { run(a.view(Device::kCUDA), b.view(Device::kCUDA)); }, "K (the columns of a and b) must be a multiple of 16");
  TensorView e5 = a.view(Device::kCUDA), e5b = b.view(Device::kCUDA);
  e5.dtype = e5b.dtype = DType::kFloat8E5M2;
  e5.shape[1] = e5b.shape[1] = 16;
  expect_value_error([&] { run(e5, e5b); }, "both float8_e5m2");
}

}  // namespace
}  // namespace fp8amp
