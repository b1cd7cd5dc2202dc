// The tile-scaled FP8 GEMM on CUDA (cuBLASLt's scale modes) against its CPU reference through the
// public API: every tiling pair x format pair x output dtype, with and without bias, on shapes
// with partial tiles in every direction. Each combination must match the reference within the
// bound of FP32 accumulation below, or be refused with NotImplementedError (kNotImplemented); the
// log lists which (M = 130 checks the refusal of (1, 128) scales of a with M % 4 != 0). Skips
// without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "cuda_test_util.h"
#include "expect_error.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"

namespace fp8amp {
namespace {

struct Tile {
  int64_t rows, cols;
};

// Host data and its device copy.
template <class T>
struct Buffer {
  std::vector<T> host;
  void* device = nullptr;
  explicit Buffer(size_t n, T fill = T{}) : host(n, fill) {
    cuda_ok(cudaMalloc(&device, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { cudaFree(device); }
  void upload() { cuda_ok(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "up"); }
  std::vector<T> download() const {
    std::vector<T> v(host.size());
    cuda_ok(cudaMemcpy(v.data(), device, v.size() * sizeof(T), cudaMemcpyDeviceToHost), "down");
    return v;
  }
  TensorView view(Device d, DType dtype, std::vector<int64_t> shape) {
    TensorView v;
    v.data = d == Device::kCPU ? static_cast<void*>(host.data()) : device;
    v.dtype = dtype;
    v.shape = std::move(shape);
    v.device = d;
    v.device_index = d == Device::kCPU ? -1 : 0;
    return v;
  }
};

void* workspace(size_t bytes) {
  static void* p = nullptr;
  static size_t have = 0;
  if (bytes > have) {
    cudaFree(p);
    cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc workspace");
    have = bytes;
  }
  return p;
}

int64_t grid(int64_t extent, int64_t tile) { return (extent + tile - 1) / tile; }

double decode(DType d, uint8_t c) {
  return d == DType::kFloat8E4M3 ? numerics::decode<numerics::E4M3>(c) : numerics::decode<numerics::E5M2>(c);
}

float to_float(DType d, const std::vector<uint8_t>& bytes, int64_t i) {
  uint32_t bits = 0;
  std::memcpy(&bits, bytes.data() + i * dtype_size(d), dtype_size(d));
  switch (d) {
    case DType::kFloat32: return numerics::bits_float(bits);
    case DType::kBFloat16: return numerics::bf16_to_float(static_cast<uint16_t>(bits));
    default: return numerics::fp16_to_float(static_cast<uint16_t>(bits));
  }
}

double unit_roundoff(DType d) {
  return d == DType::kFloat32 ? std::ldexp(1.0, -24) : (d == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11));
}

// The operands of one shape and pair: codes of N(0, 1) data times a power-of-two scale per tile,
// and S = sum over k of |scaled products| per output element, the scale of the accumulation error.
struct Operands {
  int64_t m, n, k;
  Tile at, bt;
  DType fa, fb;
  Buffer<uint8_t> a, b;
  Buffer<float> sa, sb;
  std::vector<double> abs_sum;

  Operands(int64_t m_, int64_t n_, int64_t k_, Tile at_, Tile bt_, DType fa_, DType fb_)
      : m(m_), n(n_), k(k_), at(at_), bt(bt_), fa(fa_), fb(fb_), a(m_ * k_), b(n_ * k_),
        sa(grid(m_, at_.rows) * grid(k_, at_.cols)), sb(grid(n_, bt_.rows) * grid(k_, bt_.cols)), abs_sum(m_ * n_) {
    std::mt19937 rng(static_cast<uint32_t>(m * 7 + n * 3 + k + at.rows + bt.cols));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-8, 8);
    const auto fill = [&](Buffer<uint8_t>& x, Buffer<float>& s, int64_t rows, DType f) {
      for (float& v : s.host) v = std::ldexp(1.0f, exponent(rng));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          const float v = normal(rng) * 8.0f;  // in code units; each tile's value is v * its scale_inv
          x.host[r * k + c] = f == DType::kFloat8E4M3 ? numerics::quantize_to<numerics::fp8_e4m3>(v).bits
                                                      : numerics::quantize_to<numerics::fp8_e5m2>(v).bits;
        }
      }
    };
    fill(a, sa, m, fa);
    fill(b, sb, n, fb);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (int64_t c = 0; c < k; ++c) {
          const double scale = double(sa.host[(i / at.rows) * grid(k, at.cols) + c / at.cols]) *
                               sb.host[(j / bt.rows) * grid(k, bt.cols) + c / bt.cols];
          s += std::fabs(decode(fa, a.host[i * k + c]) * decode(fb, b.host[j * k + c]) * scale);
        }
        abs_sum[i * n + j] = s;
      }
    }
    for (auto* x : {&a, &b}) x->upload();
    for (auto* x : {&sa, &sb}) x->upload();
  }
};

// Runs one combination on both devices; true when CUDA took it (and then checks the bound).
bool check(Operands& p, DType out_dtype, bool with_bias, const std::string& name) {
  const DType bias_dtype = out_dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
  Buffer<uint16_t> bias(p.n);
  for (int64_t j = 0; j < p.n; ++j) {
    const float v = 0.5f * static_cast<float>(j % 7) - 1.5f;
    bias.host[j] = bias_dtype == DType::kFloat16 ? numerics::float_to_fp16(v) : numerics::float_to_bf16(v);
  }
  bias.upload();
  const size_t out_bytes = p.m * p.n * dtype_size(out_dtype);
  Buffer<uint8_t> out(out_bytes, 0xFF);  // NaN in every output dtype: an unwritten element fails
  out.upload();
  const auto run = [&](Device d) {
    GemmTilesOptions o;
    if (d == Device::kCUDA) {
      o.workspace_bytes = kGemmWorkspaceBytes + gemm_tiles_scale_bytes(p.m, p.n, p.k, p.at.rows, p.at.cols, p.bt.rows,
                                                                       p.bt.cols);
      o.workspace = workspace(o.workspace_bytes);
    }
    const TensorView bias_view = bias.view(d, bias_dtype, {p.n});
    gemm_tiles(p.a.view(d, p.fa, {p.m, p.k}), p.sa.view(d, DType::kFloat32, {grid(p.m, p.at.rows), grid(p.k, p.at.cols)}),
               p.at.rows, p.at.cols, p.b.view(d, p.fb, {p.n, p.k}),
               p.sb.view(d, DType::kFloat32, {grid(p.n, p.bt.rows), grid(p.k, p.bt.cols)}), p.bt.rows, p.bt.cols,
               with_bias ? &bias_view : nullptr, out.view(d, out_dtype, {p.m, p.n}), o, nullptr);
  };
  run(Device::kCPU);
  try {
    run(Device::kCUDA);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotImplemented) << name << ": " << e.what();
    std::printf("  %-72s not supported: %s\n", name.c_str(), e.what());
    return false;
  }
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const std::vector<uint8_t> gpu = out.download();
  // The tensor cores keep about 14 bits of a partial sum over at most 4 MMAs of k = 32 before
  // cuBLASLt promotes it to FP32 (every 128-wide block with tile scales), then FP32 adds K / 32
  // parts (tests/cpp/test_gemm_cuda.cu derives the same model); each side rounds to out's dtype.
  const double steps = std::min(std::ceil(p.k / 32.0), 4.0);
  const double gamma = steps * std::ldexp(1.0, -13) + p.k / 32.0 * std::ldexp(1.0, -24);
  const double u = unit_roundoff(out_dtype), tiny = out_dtype == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0;
  int64_t violations = 0;
  double worst = 0.0;
  std::string first;
  for (int64_t e = 0; e < p.m * p.n; ++e) {
    const double got = to_float(out_dtype, gpu, e), ref = to_float(out_dtype, out.host, e);
    const double bound = gamma * p.abs_sum[e] + u * (std::fabs(got) + std::fabs(ref)) + tiny;
    // Equal values match, infinities included (a float16 output of these sums can overflow).
    const double err = got == ref ? 0.0 : std::fabs(got - ref);
    if (!(err <= bound) && violations++ == 0) {
      first = "[" + std::to_string(e / p.n) + ", " + std::to_string(e % p.n) + "]: gpu " + std::to_string(got) +
              ", cpu " + std::to_string(ref) + ", bound " + std::to_string(bound);
    }
    if (bound > 0) worst = std::max(worst, err / bound);
  }
  EXPECT_EQ(violations, 0) << name << ": " << violations << " element(s) outside the bound, first " << first;
  std::printf("  %-72s supported, worst err/bound %.3f\n", name.c_str(), worst);
  return true;
}

TEST(GemmTilesCuda, EveryCombinationMatchesTheReferenceOrIsRefused) {
  REQUIRE_GPU();
  const Tile pairs[][2] = {{{1, 128}, {128, 128}}, {{1, 128}, {1, 128}}, {{128, 128}, {1, 128}}, {{1, 0}, {1, 0}}};
  const DType formats[][2] = {{DType::kFloat8E4M3, DType::kFloat8E4M3}, {DType::kFloat8E5M2, DType::kFloat8E4M3}};
  const int64_t shapes[][3] = {{256, 512, 384}, {132, 144, 272}, {4, 16, 128}, {130, 144, 272}};
  int supported = 0, refused = 0;
  for (const auto& shape : shapes) {
    for (const auto& pair : pairs) {
      // {1, 0} stands for rowwise: (1, K).
      const Tile at = pair[0].cols == 0 ? Tile{1, shape[2]} : pair[0];
      const Tile bt = pair[1].cols == 0 ? Tile{1, shape[2]} : pair[1];
      for (const auto& f : formats) {
        Operands p(shape[0], shape[1], shape[2], at, bt, f[0], f[1]);
        for (const DType out : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          for (const bool bias : {false, true}) {
            const std::string name = std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + "x" +
                                     std::to_string(shape[2]) + " (" + std::to_string(at.rows) + "," +
                                     std::to_string(at.cols) + ")x(" + std::to_string(bt.rows) + "," +
                                     std::to_string(bt.cols) + ") " + dtype_name(f[0]) + " x " + dtype_name(f[1]) +
                                     " -> " + dtype_name(out) + (bias ? " +bias" : "");
            (check(p, out, bias, name) ? supported : refused)++;
          }
        }
      }
    }
  }
  std::printf("  %d combinations supported, %d refused\n", supported, refused);
}

TEST(GemmTilesCuda, TooSmallAWorkspaceIsRefused) {
  REQUIRE_GPU();
  Operands p(16, 16, 128, {1, 128}, {128, 128}, DType::kFloat8E4M3, DType::kFloat8E4M3);
  Buffer<float> out(16 * 16);
  GemmTilesOptions o;
  o.workspace = workspace(64);
  o.workspace_bytes = 64;
  expect_value_error(
      [&] {
        gemm_tiles(p.a.view(Device::kCUDA, p.fa, {16, 128}), p.sa.view(Device::kCUDA, DType::kFloat32, {16, 1}), 1,
                   128, p.b.view(Device::kCUDA, p.fb, {16, 128}), p.sb.view(Device::kCUDA, DType::kFloat32, {1, 1}),
                   128, 128, nullptr, out.view(Device::kCUDA, DType::kFloat32, {16, 16}), o, nullptr);
      },
      "options.workspace must hold at least");
}

}  // namespace
}  // namespace fp8amp
