// torch.library registration of the comm ops (fp8amp/comm.h): argument plumbing only. The
// outputs that land in caller-owned buffers (the send buffer, the gradients) are mutated
// arguments; the small per-tensor scales are allocated here.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "binding_utils.h"
#include "meta_kernel.h"
#include "fp8amp/comm.h"

namespace fp8amp::torch_binding {
namespace {

at::Tensor per_tensor_floats(int64_t n, const at::Tensor& like) { return at::empty({n}, like.options().dtype(at::kFloat)); }

at::Tensor comm_quantize(at::TensorList xs, const at::Tensor& amax, double fmax, const at::Tensor& out) {
  const char* op = "comm_quantize";
  at::Tensor scale_inv = per_tensor_floats(static_cast<int64_t>(xs.size()), out);
  call(out, [&](Stream stream) {
    std::vector<TensorView> x_views;
    x_views.reserve(xs.size());
    for (const at::Tensor& x : xs) x_views.push_back(view(x, op, "xs"));
    fp8amp::comm_quantize(x_views, view(amax, op, "amax"), static_cast<float>(fmax), view(out, op, "out"),
                          view(scale_inv, op, "scale_inv"), stream);
  });
  return scale_inv;
}

void comm_sum_shards(const at::Tensor& codes, const at::Tensor& scale_inv, at::IntArrayRef bounds, double divisor,
                     const at::Tensor& out) {
  const char* op = "comm_sum_shards";
  call(codes, [&](Stream stream) {
    fp8amp::comm_sum_shards(view(codes, op, "codes"), view(scale_inv, op, "scale_inv"), bounds.vec(),
                            static_cast<float>(divisor), view(out, op, "out"), nullptr, nullptr, stream);
  });
}

// The pieces' count for the outputs; the core refuses bounds of fewer than 2 offsets.
int64_t piece_count(at::IntArrayRef bounds) { return bounds.size() < 2 ? 0 : static_cast<int64_t>(bounds.size()) - 1; }

std::tuple<at::Tensor, at::Tensor> comm_sum_requantize(const at::Tensor& codes, const at::Tensor& scale_inv,
                                                       at::IntArrayRef bounds, double divisor, const at::Tensor& out) {
  const char* op = "comm_sum_requantize";
  at::Tensor out_scale_inv = per_tensor_floats(piece_count(bounds), codes);
  at::Tensor out_amax = per_tensor_floats(piece_count(bounds), codes);
  call(codes, [&](Stream stream) {
    const TensorView osi = view(out_scale_inv, op, "out_scale_inv"), oa = view(out_amax, op, "out_amax");
    fp8amp::comm_sum_shards(view(codes, op, "codes"), view(scale_inv, op, "scale_inv"), bounds.vec(),
                            static_cast<float>(divisor), view(out, op, "out"), &osi, &oa, stream);
  });
  return {out_scale_inv, out_amax};
}

at::Tensor comm_quantize_meta(at::TensorList xs, const at::Tensor&, double, const at::Tensor& out) {
  return per_tensor_floats(static_cast<int64_t>(xs.size()), out);
}
void comm_sum_shards_meta(const at::Tensor&, const at::Tensor&, at::IntArrayRef, double, const at::Tensor&) {}
std::tuple<at::Tensor, at::Tensor> comm_sum_requantize_meta(const at::Tensor& codes, const at::Tensor&,
                                                            at::IntArrayRef bounds, double, const at::Tensor&) {
  return {per_tensor_floats(piece_count(bounds), codes), per_tensor_floats(piece_count(bounds), codes)};
}

constexpr char kCommQuantize[] = "comm_quantize";
constexpr char kCommSumShards[] = "comm_sum_shards";
constexpr char kCommSumRequantize[] = "comm_sum_requantize";

}  // namespace
}  // namespace fp8amp::torch_binding

TORCH_LIBRARY_FRAGMENT(fp8amp, m) {
  m.def("comm_quantize(Tensor[] xs, Tensor amax, float fmax, Tensor(a!) out) -> Tensor");
  m.def("comm_sum_shards(Tensor codes, Tensor scale_inv, int[] bounds, float divisor, Tensor(a!) out) -> ()");
  m.def(
      "comm_sum_requantize(Tensor codes, Tensor scale_inv, int[] bounds, float divisor, Tensor(a!) out) "
      "-> (Tensor, Tensor)");
}

#define FP8AMP_REGISTER_COMM_KERNELS(m)                                   \
  m.impl("comm_quantize", fp8amp::torch_binding::comm_quantize);        \
  m.impl("comm_sum_shards", fp8amp::torch_binding::comm_sum_shards);    \
  m.impl("comm_sum_requantize", fp8amp::torch_binding::comm_sum_requantize)

// The same functions serve CPU and CUDA: the core dispatches on the tensors' device.
TORCH_LIBRARY_IMPL(fp8amp, CPU, m) { FP8AMP_REGISTER_COMM_KERNELS(m); }
TORCH_LIBRARY_IMPL(fp8amp, CUDA, m) { FP8AMP_REGISTER_COMM_KERNELS(m); }
TORCH_LIBRARY_IMPL(fp8amp, Meta, m) {
  m.impl("comm_quantize", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCommQuantize,
                                                           fp8amp::torch_binding::comm_quantize_meta>::run);
  m.impl("comm_sum_shards", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCommSumShards,
                                                             fp8amp::torch_binding::comm_sum_shards_meta>::run);
  m.impl("comm_sum_requantize", &fp8amp::torch_binding::MetaKernel<fp8amp::torch_binding::kCommSumRequantize,
                                                                 fp8amp::torch_binding::comm_sum_requantize_meta>::run);
}
TORCH_LIBRARY_IMPL(fp8amp, Autograd, m) {
  fp8amp::torch_binding::register_no_derivative(
      m, "comm_quantize", "comm_sum_shards", "comm_sum_requantize");
}
