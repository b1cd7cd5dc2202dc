// The CUDA Adam step against the CPU reference, bit for bit: one call over many tensors of odd
// sizes in every format combination (misaligned starts included, so both the vector and the
// element-wise paths run, and more tensors than one launch takes), several steps, on both devices
// from the same bytes; every buffer, scale, amax, the step counter and counts and found_inf must end
// up byte-identical, guard bytes around each buffer untouched. Skips cleanly without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
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
  bool scales_given = true;  // false: only the scale_invs (the op derives the old scales)
  bool counted = true;       // its step count given (AdamTensors::step_count)
  bool kept = false;         // its kept master amax given (AdamTensors::param_amax), NaN at first
  std::unique_ptr<MirroredTensor> p, g, m, v, w;
  std::unique_ptr<MirroredTensor> p_s, p_si, g_si, m_s, m_si, v_s, v_si, w_s, w_si, count, amax;

  Param(int64_t numel, Formats formats, int64_t offset, std::mt19937& rng) : n(numel), f(formats) {
    p = std::make_unique<MirroredTensor>(f.p, Shape{n}, offset);
    g = std::make_unique<MirroredTensor>(f.g, Shape{n}, offset);
    m = std::make_unique<MirroredTensor>(f.m, Shape{n}, offset);
    v = std::make_unique<MirroredTensor>(f.v, Shape{n}, offset);
    w = std::make_unique<MirroredTensor>(DType::kFloat8E4M3, Shape{n}, offset);
    for (auto* s : {&p_s, &p_si, &g_si, &m_s, &m_si, &v_s, &v_si, &w_s, &w_si, &count, &amax}) {
      *s = std::make_unique<MirroredTensor>(DType::kFloat32, Shape{1});
      (*s)->set_float(0, 1.0f);
    }
    amax->set_float(0, std::nanf(""));
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
            {w_s.get(), "weight_scales" + k}, {w_si.get(), "weight_scale_invs" + k}, {count.get(), "step_counts" + k},
            {amax.get(), "param_amaxes" + k}};
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
    if (!scales_given) t.param_scale = t.exp_avg_scale = t.exp_avg_sq_scale = t.weight_scale = std::nullopt;
    if (counted) t.step_count = scalar(count);
    if (kept) t.param_amax = scalar(amax);
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
  const int64_t sizes[] = {1, 7, 8, 9, 255, 8191, 8192, 8193, 16383, 16384, 16385, 100003, 131073, 262144};
  Call call(formats.size() * 2);
  for (size_t i = 0; i < formats.size() * 2; ++i) {
    const int64_t n = sizes[i % (sizeof(sizes) / sizeof(sizes[0]))];
    call.params.push_back(std::make_unique<Param>(n, formats[i % formats.size()], i % 5 == 4 ? 1 : 0, rng));
    call.params.back()->scales_given = i % 4 != 3;
    call.params.back()->counted = i % 3 != 2;
    call.params.back()->kept = i % 2 == 0;  // from the second step on, pass 1 leaves the master unread
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

TEST(AdamCuda, StochasticRoundingBitExact) {
  // Stochastic rounding of the float16 masters (and the stored-magnitude amax it folds) against the
  // CPU: every format, sizes across pack, chunk and launch boundaries, kept amaxes, small and
  // large updates, a seed with high bits.
  REQUIRE_GPU();
  std::mt19937 rng(12);
  const std::vector<Formats> formats = all_formats();
  const int64_t sizes[] = {1, 2, 3, 9, 8191, 16383, 16384, 16385, 32769, 100003};
  Call call(formats.size());
  for (size_t i = 0; i < formats.size(); ++i) {
    call.params.push_back(std::make_unique<Param>(sizes[i % (sizeof(sizes) / sizeof(sizes[0]))], formats[i], 0, rng));
    call.params.back()->kept = i % 2 == 0;
  }
  call.hyper.stochastic_rounding = true;
  for (const uint64_t seed : {uint64_t{0}, uint64_t{0x123456789ABCDEF0u}}) {
    for (const double lr : {1e-6, 1e-3}) {
      call.hyper.rounding_seed = seed;
      call.hyper.lr = lr;
      for (auto& p : call.params) p->new_grad(rng);
      call.step_and_compare("seed " + std::to_string(seed) + " lr " + std::to_string(lr));
    }
  }
}

TEST(AdamCuda, MoreTensorsThanALaunchHolds) {
  // 300 tensors of one format: several launches a pass and several commits; an empty one and a
  // large one among them. Bit-exact against the CPU over two steps.
  REQUIRE_GPU();
  std::mt19937 rng(8);
  const Formats o2{DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true};
  const size_t n = 300;
  Call call(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = i == 7 ? 0 : i == 150 ? 70001 : static_cast<int64_t>(1 + i % 37);
    call.params.push_back(std::make_unique<Param>(numel, o2, 0, rng));
    call.params.back()->kept = i % 3 != 0;
  }
  for (int t = 0; t < 2; ++t) {
    for (auto& p : call.params) p->new_grad(rng);
    call.step_and_compare("step " + std::to_string(t));
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
  call.params.front()->kept = true;
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
  // The grad column is max |code| * |scale_inv| (optim.h): with an infinite scale_inv and zero
  // codes beside others, inf (not the NaN of 0 * inf), on both; a negative scale_inv's magnitude.
  call.found_inf.set_float(0, 0.0f);
  call.params[1]->g->set_bits(7, 0x00);
  call.params[1]->g_si->set_float(0, INFINITY);
  call.step_and_compare("an infinite grad scale_inv");
  call.found_inf.set_float(0, 0.0f);
  call.params[1]->g_si->set_float(0, -1.0f / 4096.0f);
  call.step_and_compare("a negative grad scale_inv");
  // v * b2 is code * f32(scale_inv * b2), which a scale_inv of 1/3 rounds unlike (code * scale_inv) * b2.
  call.params[1]->g_si->set_float(0, 1.0f / 4096.0f);
  call.params[2]->v_si->set_float(0, 1.0f / 3.0f);
  call.step_and_compare("a float16 v with a scale_inv of 1/3");
}

// ------------------------------------------------------------------------------------------------
// The CUDA amax pass evaluates p' exactly only where a cheap bracket cannot prove it below the
// maximum (src/optim/adam_bound.h); a wrong skip would change the amax row, hence the new scales and
// every stored byte. These cases put the maximum |p'| where a skip would be wrong: a large update
// on a zero weight (in the first pack, a block's first element, mid-tensor and in the partial last
// pack), ties of both signs, all-equal tensors, 1-ulp neighbours, and the non-finite corners
// (eps = 0 with zero state: 0/0; a huge lr: overflow; a negative or subnormal second moment).
// The tensors span many blocks, so that later blocks start from earlier blocks' maxima.

struct Element {
  float p, g, m, v;
};

// Sets every element of q to f(j), with fixed scales that hold the values used here: master
// |p| <= 4 (FP16 scale 2^14), |g| <= 0.1 (E4M3 scale 2^12), |m| <= 1.75 (E4M3 scale 2^8),
// v <= 64 (FP16 scale 2^10).
void fill(Param& q, const std::function<Element(int64_t)>& f) {
  const auto scales = [](MirroredTensor& s, MirroredTensor& si, float x) { s.set_float(0, x), si.set_float(0, 1.0f / x); };
  scales(*q.p_s, *q.p_si, 0x1p14f);
  scales(*q.m_s, *q.m_si, 0x1p8f);
  scales(*q.v_s, *q.v_si, 0x1p10f);
  q.g_si->set_float(0, 0x1p-12f);
  const auto scale_of = [](DType d, float x) { return d == DType::kFloat32 || d == DType::kBFloat16 ? 1.0f : x; };
  for (int64_t j = 0; j < q.n; ++j) {
    const Element e = f(j);
    q.p->set_bits(j, Param::encode(q.f.p, e.p, scale_of(q.f.p, 0x1p14f)));
    q.g->set_bits(j, Param::encode(q.f.g, e.g, is_fp8(q.f.g) ? 0x1p12f : 1.0f));
    q.m->set_bits(j, Param::encode(q.f.m, e.m, scale_of(q.f.m, 0x1p8f)));
    q.v->set_bits(j, Param::encode(q.f.v, e.v, scale_of(q.f.v, 0x1p10f)));
  }
}

TEST(AdamCuda, AmaxPassSkipsNothingThatMatters) {
  REQUIRE_GPU();
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const Formats o2{DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat16, true};
  const Formats f32{DType::kFloat32, DType::kFloat32, DType::kFloat32, DType::kFloat32, true};
  const int64_t n = 300001;  // 3 blocks of pass 1 (131072 each), 19 of pass 2 (16384), the last pack partial
  Call call(2);
  call.params.push_back(std::make_unique<Param>(n, o2, 0, rng));
  call.params.push_back(std::make_unique<Param>(n, f32, 0, rng));
  const auto each = [&](const std::function<Element(int64_t)>& f) {
    for (auto& q : call.params) fill(*q, f);
  };
  const auto start = [&](double lr, double eps) {
    call.hyper = AdamHyper{};
    call.hyper.lr = lr, call.hyper.eps = eps, call.hyper.weight_decay = 0.01;
    call.found_inf.set_float(0, 0.0f);
    call.step_tensor.set_float(0, 0.0f);
  };

  // Small weights with small updates (a large v), and at `at` a zero weight with a zero state: its
  // update is lr, the largest |p'|, made of a small p and a large step.
  for (const int64_t at : {int64_t{0}, int64_t{5}, int64_t{8192}, int64_t{16384}, int64_t{16384 * 9 + 2049},
                           int64_t{131072}, int64_t{131072 * 2 + 2049}, n - 1}) {
    start(1e-3, 1e-8);
    std::vector<float> ps(n), gs(n);
    for (int64_t j = 0; j < n; ++j) ps[j] = 1e-4f * normal(rng), gs[j] = 0x1p-10f * normal(rng);
    each([&](int64_t j) { return j == at ? Element{0.0f, 0.05f, 0.0f, 0.0f} : Element{ps[j], gs[j], 0.0f, 16.0f}; });
    call.step_and_compare("large update on a zero weight at " + std::to_string(at));
    call.step_and_compare("the step after");
  }
  start(1e-3, 1e-8);
  each([](int64_t) { return Element{0.5f, 0x1p-8f, 0x1p-9f, 0x1p-16f}; });
  call.step_and_compare("all equal");
  start(1e-3, 1e-8);
  each([](int64_t j) { return Element{j % 2 ? 0.5f : -0.5f, j % 3 ? 0x1p-8f : -0x1p-8f, 0.0f, 0.0f}; });
  call.step_and_compare("ties of both signs");
  start(1e-3, 1e-8);
  each([](int64_t j) { return Element{std::nextafter(0.5f, j % 2 ? 1.0f : 0.0f), 0.0f, 0.0f, 0.0f}; });
  call.step_and_compare("1-ulp neighbours, zero updates");
  start(1e-3, 1e-8);
  each([](int64_t) { return Element{0.0f, 0.0f, 0.0f, 0.0f}; });
  call.step_and_compare("all zero");

  start(1e-3, 0.0);
  each([&](int64_t j) { return Element{0.1f * normal(rng), j % 7 ? 0x1p-10f * normal(rng) : 0.0f, 0.0f, 0x1p-20f}; });
  call.step_and_compare("eps = 0 with a nonzero v");
  start(1e-3, 0.0);
  each([&](int64_t j) { return Element{0.1f * normal(rng), j == n / 3 ? 0.0f : 0x1p-10f, 0.0f, j == n / 3 ? 0.0f : 0x1p-20f}; });
  call.step_and_compare("eps = 0, one element 0/0: skipped on both");
  start(1e30, 1e-8);
  each([&](int64_t) { return Element{0.1f * normal(rng), 0x1p-10f * normal(rng), 0.0f, 0.0f}; });
  call.step_and_compare("lr 1e30: p' overflows, skipped on both");
  start(10.0, 1e-8);
  each([&](int64_t) { return Element{0.1f * normal(rng), 0x1p-10f * normal(rng), 0.0f, 0.0f}; });
  call.step_and_compare("lr 10");

  // Second moments the FP32 tensor can hold exactly: a negative subnormal (sqrt: NaN, which the
  // approximate instruction would flush to -0) and a positive subnormal (flushed to 0) under a
  // tiny eps, where it decides the update.
  start(1e-3, 1e-8);
  each([&](int64_t) { return Element{0.1f * normal(rng), 0.0f, 0.0f, 1.0f}; });
  call.params[1]->v->set_float(777, -std::numeric_limits<float>::denorm_min());
  call.step_and_compare("a negative subnormal v: NaN p', skipped on both");
  for (const double eps : {1e-12, 1e-30}) {  // the bracket widens for it, or is switched off
    start(1e-3, eps);
    each([&](int64_t) { return Element{1e-3f * normal(rng), 0.0f, 0.0f, 1.0f}; });
    call.params[1]->p->set_float(4242, 0.0f);
    call.params[1]->m->set_float(4242, 1e-3f);
    call.params[1]->v->set_float(4242, 1e-40f);
    call.step_and_compare("a positive subnormal v under eps " + std::to_string(eps));
  }
}

// adam_bound.h's proof assumes of sqrt.approx.ftz.f32 and rcp.approx.ftz.f32: relative error at
// most 2^-16 on normal inputs (rcp: up to 2^126), zero/inf/NaN as IEEE, subnormal inputs flushed.
// Checked here for every float32 bit pattern on this GPU.
__global__ void count_approx_violations(unsigned long long* violations) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const float x = __uint_as_float(static_cast<uint32_t>(i));
    float s, r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(x));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    const float ax = fabsf(x);
    if (isnan(x)) {
      bad += !isnan(s) + !isnan(r);
    } else if (ax < 0x1p-126f) {  // zero or subnormal: flushed
      bad += !(s == 0.0f) + !(isinf(r) && signbit(r) == signbit(x));
    } else if (isinf(x)) {
      bad += (x > 0.0f ? !(isinf(s) && s > 0.0f) : !isnan(s)) + !(r == 0.0f);
    } else {
      bad += x > 0.0f ? !(fabs(static_cast<double>(s) / sqrt(static_cast<double>(x)) - 1.0) <= 0x1p-16) : !isnan(s);
      if (ax <= 0x1p126f) bad += !(fabs(static_cast<double>(r) * static_cast<double>(x) - 1.0) <= 0x1p-16);
    }
  }
  if (bad != 0) atomicAdd(violations, bad);
}

TEST(AdamCuda, ApproximateInstructionsMeetTheBoundsAssumptions) {
  REQUIRE_GPU();
  unsigned long long* d = nullptr;
  cuda_ok(cudaMalloc(&d, sizeof(*d)), "cudaMalloc");
  cuda_ok(cudaMemset(d, 0, sizeof(*d)), "cudaMemset");
  count_approx_violations<<<4096, 256>>>(d);
  cuda_ok(cudaGetLastError(), "launch");
  unsigned long long violations = 1;
  cuda_ok(cudaMemcpy(&violations, d, sizeof(violations), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cuda_ok(cudaFree(d), "cudaFree");
  EXPECT_EQ(violations, 0u);
}

}  // namespace
}  // namespace fp8amp
