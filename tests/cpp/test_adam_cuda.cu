// The CUDA Adam step against the CPU reference, bit for bit: one call over many tensors of odd
// sizes in every format combination (misaligned starts included, so both the vector and the
// element-wise paths run, and more tensors than one launch takes), several steps, on both devices
// from the same bytes; every buffer, scale, amax, the step counter and found_inf must end up
// byte-identical, guard bytes around each buffer untouched. Skips cleanly without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "common/numerics.h"
#include "fp8amp/dtype.h"
#include "fp8amp/optim.h"
#include "fp8amp/tensor.h"

namespace fp8amp {
namespace {

using Shape = std::vector<int64_t>;

struct Formats {
  DType p, g, m, v;
  bool weight;
};

// One parameter tensor's buffers on both sides.
struct Param {
  int64_t n;
  Formats f;
  std::unique_ptr<MirroredTensor> p, g, m, v, w;
  std::unique_ptr<MirroredTensor> p_s, p_si, g_si, m_s, m_si, v_s, v_si, w_s, w_si;

  Param(int64_t numel, Formats formats, int64_t offset, std::mt19937& rng) : n(numel), f(formats) {
    p = std::make_unique<MirroredTensor>(f.p, Shape{n}, offset);
    g = std::make_unique<MirroredTensor>(f.g, Shape{n}, offset);
    m = std::make_unique<MirroredTensor>(f.m, Shape{n}, offset);
    v = std::make_unique<MirroredTensor>(f.v, Shape{n}, offset);
    w = std::make_unique<MirroredTensor>(DType::kFloat8E4M3, Shape{n}, offset);
    for (auto* s : {&p_s, &p_si, &g_si, &m_s, &m_si, &v_s, &v_si, &w_s, &w_si}) {
      *s = std::make_unique<MirroredTensor>(DType::kFloat32, Shape{1});
      (*s)->set_float(0, 1.0f);
    }
    p_s->set_float(0, 2048.0f);
    p_si->set_float(0, 1.0f / 2048.0f);
    g_si->set_float(0, 1.0f / 4096.0f);
    std::normal_distribution<float> normal;
    for (int64_t j = 0; j < n; ++j) {
      const float x = normal(rng);
      p->set_bits(j, encode(f.p, x, 2048.0f));
      m->set_bits(j, 0);
      v->set_bits(j, 0);
    }
    new_grad(rng);
  }

  static uint32_t encode(DType d, float x, float scale) {
    switch (d) {
      case DType::kFloat32: return numerics::float_bits(x);
      case DType::kBFloat16: return numerics::float_to_bf16(x);
      case DType::kFloat16: return numerics::encode<numerics::FP16>(x * scale, true);
      case DType::kFloat8E4M3: return numerics::encode<numerics::E4M3>(x * scale, true);
      case DType::kFloat8E5M2: return numerics::encode<numerics::E5M2>(x * scale, true);
      default: throw std::runtime_error("no codec");
    }
  }

  void new_grad(std::mt19937& rng) {
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<int> exponent(-12, -4);
    // FP8 grads are stored with scale 4096 (their scale_inv is 1/4096); fp16 grads unscaled.
    const float scale = is_fp8(f.g) ? 4096.0f : 1.0f;
    for (int64_t j = 0; j < n; ++j) g->set_bits(j, encode(f.g, normal(rng) * std::ldexp(1.0f, exponent(rng)), scale));
  }

  std::vector<std::pair<MirroredTensor*, std::string>> all(int index) {
    const std::string k = "[" + std::to_string(index) + "]";
    return {{p.get(), "params" + k}, {g.get(), "grads" + k}, {m.get(), "exp_avgs" + k},
            {v.get(), "exp_avg_sqs" + k}, {w.get(), "weights_fp8" + k}, {p_s.get(), "param_scales" + k},
            {p_si.get(), "param_scale_invs" + k}, {g_si.get(), "grad_scale_invs" + k},
            {m_s.get(), "exp_avg_scales" + k}, {m_si.get(), "exp_avg_scale_invs" + k},
            {v_s.get(), "exp_avg_sq_scales" + k}, {v_si.get(), "exp_avg_sq_scale_invs" + k},
            {w_s.get(), "weight_scales" + k}, {w_si.get(), "weight_scale_invs" + k}};
  }

  AdamTensors tensors(Device d) const {
    const std::vector<int64_t> shape{n};
    AdamTensors t;
    t.param = p->view(d, shape);
    t.grad = g->view(d, shape);
    t.exp_avg = m->view(d, shape);
    t.exp_avg_sq = v->view(d, shape);
    const auto scalar = [d](const std::unique_ptr<MirroredTensor>& b) { return b->view(d, {1}); };
    if (f.p == DType::kFloat16) t.param_scale = scalar(p_s), t.param_scale_inv = scalar(p_si);
    if (is_fp8(f.g)) t.grad_scale_inv = scalar(g_si);
    if (f.m == DType::kFloat8E4M3) t.exp_avg_scale = scalar(m_s), t.exp_avg_scale_inv = scalar(m_si);
    if (f.v == DType::kFloat16) t.exp_avg_sq_scale = scalar(v_s), t.exp_avg_sq_scale_inv = scalar(v_si);
    if (f.weight) t.weight_fp8 = w->view(d, shape), t.weight_scale = scalar(w_s), t.weight_scale_inv = scalar(w_si);
    return t;
  }
};

// Every format combination the op takes, with and without the weight copy (the copy needs an FP16
// or FP32 master; both are covered).
std::vector<Formats> all_formats() {
  std::vector<Formats> r;
  for (DType p : {DType::kFloat32, DType::kFloat16}) {
    for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
      for (DType m : {DType::kFloat32, DType::kFloat8E4M3}) {
        for (DType v : {DType::kFloat32, DType::kFloat16}) r.push_back({p, g, m, v, (r.size() % 3) != 1});
      }
    }
  }
  return r;
}

class Call {
 public:
  std::vector<std::unique_ptr<Param>> params;
  MirroredTensor amax, found_inf, step_tensor;
  AdamHyper hyper;

  explicit Call(size_t n) : amax(DType::kFloat32, {static_cast<int64_t>(n) * kAdamAmaxColumns}),
                            found_inf(DType::kFloat32, {1}), step_tensor(DType::kFloat32, {1}) {
    found_inf.set_float(0, 0.0f);
    step_tensor.set_float(0, 0.0f);
  }

  // One step on each device from the same bytes, then every buffer compared.
  void step_and_compare(const std::string& what) {
    SCOPED_TRACE(what);
    for (auto& [b, name] : buffers()) b->upload();
    for (Device d : {Device::kCPU, Device::kCUDA}) {
      std::vector<AdamTensors> ts;
      for (const auto& p : params) ts.push_back(p->tensors(d));
      const TensorView step = step_tensor.view(d, {1});
      adam_step(ts, hyper, 0, &step, found_inf.view(d, {1}),
                amax.view(d, {static_cast<int64_t>(params.size()), kAdamAmaxColumns}), nullptr);
    }
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (auto& [b, name] : buffers()) EXPECT_TRUE(b->same_on_both(name));
  }

  std::vector<std::pair<MirroredTensor*, std::string>> buffers() {
    std::vector<std::pair<MirroredTensor*, std::string>> r{{&amax, "amax"}, {&found_inf, "found_inf"}, {&step_tensor, "step_tensor"}};
    for (size_t i = 0; i < params.size(); ++i) {
      for (auto& e : params[i]->all(static_cast<int>(i))) r.push_back(e);
    }
    return r;
  }
};

// CUDA writes results to the device copies only; the host copies hold the CPU's. To continue
// from the same state, the next step uploads the host (CPU) bytes again: a divergence would have
// been reported already.
TEST(AdamCuda, EveryFormatCombinationManySizesBitExact) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  const std::vector<Formats> formats = all_formats();
  const int64_t sizes[] = {1, 7, 8, 9, 255, 8191, 8192, 8193, 100003};
  Call call(formats.size() * 2);
  for (size_t i = 0; i < formats.size() * 2; ++i) {
    const int64_t n = sizes[i % (sizeof(sizes) / sizeof(sizes[0]))];
    call.params.push_back(std::make_unique<Param>(n, formats[i % formats.size()], i % 5 == 4 ? 1 : 0, rng));
  }
  for (const bool adamw : {true, false}) {
    call.hyper.adamw = adamw;
    call.hyper.weight_decay = 0.01;
    call.hyper.maximize = !adamw;
    for (int t = 0; t < 3; ++t) {
      for (auto& p : call.params) p->new_grad(rng);
      call.step_and_compare(std::string(adamw ? "AdamW" : "Adam") + " step " + std::to_string(t));
    }
  }
}

TEST(AdamCuda, TypicalAndExtremeHyperparameters) {
  REQUIRE_GPU();
  std::mt19937 rng(6);
  const Formats o2{DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true};
  const Formats o1{DType::kFloat32, DType::kBFloat16, DType::kFloat32, DType::kFloat32, false};
  Call call(2);
  call.params.push_back(std::make_unique<Param>(40000, o2, 0, rng));
  call.params.push_back(std::make_unique<Param>(3333, o1, 0, rng));
  struct H {
    double lr, beta1, beta2, eps, wd;
    int margin;
  };
  for (const H h : {H{1e-3, 0.9, 0.999, 1e-8, 0.0, 0}, H{0.5, 0.0, 0.0, 0.0, 0.5, 2}, H{1e-6, 0.5, 0.75, 1e-3, 0.1, 0},
                    H{3e-4, 0.99, 0.9999, 1e-12, 1e-4, 1}}) {
    call.hyper = AdamHyper{};
    call.hyper.lr = h.lr, call.hyper.beta1 = h.beta1, call.hyper.beta2 = h.beta2, call.hyper.eps = h.eps;
    call.hyper.weight_decay = h.wd, call.hyper.margin = h.margin;
    for (auto& p : call.params) p->new_grad(rng);
    call.step_and_compare("lr " + std::to_string(h.lr) + " beta1 " + std::to_string(h.beta1));
  }
}

TEST(AdamCuda, NonFiniteGradSkipsLikeTheCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(8);
  const Formats o2{DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true};
  Call call(3);
  for (int64_t n : {100, 20000, 5}) call.params.push_back(std::make_unique<Param>(n, o2, 0, rng));
  call.step_and_compare("a good step");
  call.params[1]->g->set_bits(12345, 0x7F);  // the E4M3 NaN code, in the second block of tensor 1
  call.step_and_compare("a NaN grad: skipped on both");
  call.params[1]->g->set_bits(12345, 0x00);
  call.found_inf.set_float(0, 1.0f);
  call.step_and_compare("found_inf set on entry");
}

}  // namespace
}  // namespace fp8amp
