// The aliasing rule of every op with a written argument (tensor.h, check::disjoint_writes): a
// written view sharing a byte with another written view or with a read one is a ValueError naming
// both arguments, and nothing is written; read views may share memory; strided views occupy their
// whole span.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "expect_error.h"
#include "host_view.h"
#include "fp8amp/cast.h"
#include "fp8amp/error.h"
#include "fp8amp/gemm.h"
#include "fp8amp/optim.h"
#include "fp8amp/scaling.h"

namespace fp8amp {
namespace {

// Views at byte offsets of one float32 buffer (float32 elements unless another dtype is given).
struct Arena {
  std::vector<float> buf = std::vector<float>(256, 1.0f);
  TensorView at(int64_t element, std::vector<int64_t> shape, DType dtype = DType::kFloat32,
                std::vector<int64_t> strides = {}) {
    TensorView t;
    t.data = buf.data() + element;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.strides = std::move(strides);
    return t;
  }
};

TEST(Aliasing, StridedViewsOccupyTheirSpanAndEmptyViewsNothing) {
  Arena m;
  // Column 0 of a [4, 8] matrix spans elements 0..24: element 10 is inside, 25 is not.
  const TensorView column = m.at(0, {4}, DType::kFloat32, {8});
  expect_value_error([&] { check::no_overlap(column, m.at(10, {1}), "op", "col", "one"); },
                     "op: col and one must not share memory, got overlapping float32[4] on cpu and float32[1] on cpu");
  check::no_overlap(column, m.at(25, {4}), "op", "col", "one");
  check::no_overlap(m.at(0, {0, 4}), m.at(0, {4}), "op", "empty", "full");  // an empty view shares nothing
  // Size-1 dims address nothing, whatever their stride.
  check::no_overlap(m.at(0, {1, 2}, DType::kFloat32, {1000, 1}), m.at(2, {2}), "op", "a", "b");
}

TEST(Aliasing, ReadViewsMayShareWrittenMayNot) {
  Arena m;
  const TensorView x = m.at(0, {8}), same_x = m.at(4, {8}), out = m.at(64, {8}), other = m.at(68, {8});
  check::disjoint_writes({{&out, "out"}}, {{&x, "x"}, {&same_x, "y"}, {nullptr, "absent"}}, "op");
  expect_value_error([&] { check::disjoint_writes({{&out, "out"}, {&other, "amax"}}, {{&x, "x"}}, "op"); },
                     "op: out and amax must not share memory");
  expect_value_error([&] { check::disjoint_writes({{&out, "out"}}, {{&x, "x"}, {&other, "scale"}}, "op"); },
                     "op: scale and out must not share memory");
}

TEST(Aliasing, CastOpsRefuseScalingBuffersOverInputsAndOutputs) {
  Arena m;
  std::vector<uint8_t> codes(16), codes_t(16);
  const TensorView x = m.at(0, {16}), scale = m.at(100, {1}), amax = m.at(101, {1}), scale_inv = m.at(102, {1});
  const TensorView out = view(codes, DType::kFloat8E4M3, {16});
  // quantize with its amax buffer viewing the input: the amax would be folded into x mid-read.
  expect_value_error([&] { quantize(x, out, Scaling{scale, m.at(3, {1}), scale_inv}, nullptr); },
                     "quantize: x and amax must not share memory");
  expect_value_error([&] { quantize(x, out, Scaling{scale, amax, scale}, nullptr); },
                     "quantize: scale and scale_inv must not share memory");
  expect_value_error([&] { quantize(x, out, Scaling{scale, amax, amax}, nullptr); },
                     "quantize: amax and scale_inv must not share memory");
  const TensorView counter = m.at(101, {1}, DType::kInt32);
  expect_value_error([&] {
    Scaling s{scale, amax, scale_inv, &counter, 1};
    quantize(x, out, s, nullptr);
  }, "quantize: warmup_counter and amax must not share memory");
  // multi_quantize: one tensor's amax row inside another tensor's input.
  std::vector<uint8_t> codes2(8);
  expect_value_error([&] {
    multi_quantize({m.at(0, {8}), m.at(8, {8})}, {view(codes, DType::kFloat8E4M3, {8}), view(codes2, DType::kFloat8E4M3, {8})},
                   Scaling{m.at(100, {2}), m.at(9, {2}), m.at(110, {2})}, nullptr);
  }, "multi_quantize: xs[1] and amax must not share memory");
  // cast_transpose: amax inside x; dbias inside x.
  const TensorView x2 = m.at(0, {4, 4});
  const TensorView out2 = view(codes, DType::kFloat8E4M3, {4, 4}), out_t = view(codes_t, DType::kFloat8E4M3, {4, 4});
  expect_value_error([&] { cast_transpose(x2, out2, out_t, Scaling{scale, m.at(15, {1}), scale_inv}, nullptr); },
                     "cast_transpose: x and amax must not share memory");
  expect_value_error([&] {
    cast_transpose_dbias(x2, out2, out_t, m.at(12, {4}), m.at(120, {cast_transpose_dbias_workspace(4, 4)}),
                         Scaling{scale, amax, scale_inv}, nullptr);
  }, "cast_transpose_dbias: x and dbias must not share memory");
  // dequantize: scale_inv inside out.
  expect_value_error([&] { dequantize(out, m.at(5, {1}), m.at(0, {16}), nullptr); },
                     "dequantize: scale_inv and out must not share memory");
  // amax and multi_amax with the amax buffer viewing the input (a strided x: its span counts).
  expect_value_error([&] { fp8amp::amax(m.at(0, {4}, DType::kFloat32, {8}), m.at(20, {1}), nullptr, 0, nullptr); },
                     "amax: x and amax must not share memory");
  expect_value_error([&] { multi_amax({m.at(0, {4}), m.at(30, {4})}, m.at(32, {2}), nullptr); },
                     "multi_amax: xs[1] and amax must not share memory");
  // Nothing was written by the refused calls.
  for (float v : m.buf) ASSERT_EQ(v, 1.0f);
  // Disjoint buffers pass.
  quantize(x, out, Scaling{scale, amax, scale_inv}, nullptr);
  EXPECT_EQ(m.buf[102], 1.0f);
}

TEST(Aliasing, ScaleUpdatesRefuseSharedStateBuffers) {
  Arena m;
  std::vector<int32_t> counter{0};
  const TensorView history = m.at(0, {1, 4}), scale = m.at(10, {1}), scale_inv = m.at(11, {1});
  const TensorView c = view(counter, DType::kInt32, {1});
  expect_value_error([&] { update_delayed_scaling(history, scale, scale, c, 448.0f, {}, nullptr); },
                     "update_delayed_scaling: scale and scale_inv must not share memory");
  expect_value_error([&] { update_delayed_scaling(history, m.at(3, {1}), scale_inv, c, 448.0f, {}, nullptr); },
                     "update_delayed_scaling: amax_history and scale must not share memory");
  expect_value_error(
      [&] { update_delayed_scaling(history, scale, scale_inv, m.at(2, {1}, DType::kInt32), 448.0f, {}, nullptr); },
      "update_delayed_scaling: amax_history and counter must not share memory");
  expect_value_error([&] { compute_scale(m.at(20, {1}), scale, scale, 448.0f, {}, nullptr); },
                     "compute_scale: scale and scale_inv must not share memory");
  expect_value_error([&] { compute_scale(scale_inv, scale, scale_inv, 448.0f, {}, nullptr); },
                     "compute_scale: amax and scale_inv must not share memory");
  update_delayed_scaling(history, scale, scale_inv, c, 448.0f, {}, nullptr);  // disjoint: fine
}

TEST(Aliasing, GemmOutMustNotOverlapItsOperands) {
  // a [16, 16] E4M3 and out [16, 16] float32 in one buffer: out over a's bytes, then over b_scale_inv.
  std::vector<float> buf(16 * 16 * 2 + 64, 0.0f);
  const auto at = [&](size_t byte, DType dtype, std::vector<int64_t> shape) {
    TensorView t;
    t.data = reinterpret_cast<uint8_t*>(buf.data()) + byte;
    t.dtype = dtype;
    t.shape = std::move(shape);
    return t;
  };
  const TensorView a = at(0, DType::kFloat8E4M3, {16, 16}), b = at(256, DType::kFloat8E4M3, {16, 16});
  const TensorView sa = at(2048, DType::kFloat32, {1}), sb = at(2064, DType::kFloat32, {1});
  GemmOptions accumulate;
  accumulate.accumulate = true;
  expect_value_error([&] { gemm(a, b, sa, sb, nullptr, at(0, DType::kFloat32, {16, 16}), accumulate, nullptr); },
                     "gemm: a and out must not share memory");
  expect_value_error([&] { gemm(a, b, sa, sb, nullptr, at(1040, DType::kFloat32, {16, 16}), {}, nullptr); },
                     "gemm: a_scale_inv and out must not share memory");
  gemm(a, b, sa, sb, nullptr, at(1024, DType::kFloat32, {16, 16}), accumulate, nullptr);  // just below sa: fine
}

TEST(Aliasing, AdamRefusesSharedStateAndGradsInsideWrittenBuffers) {
  Arena m;
  std::vector<float> found{0.0f}, amax(kAdamAmaxColumns);
  const TensorView found_inf = view(found, DType::kFloat32, {1}),
                   amax_out = view(amax, DType::kFloat32, {1, kAdamAmaxColumns});
  const auto step = [&](AdamTensors t) { adam_step({t}, AdamHyper{}, 1, nullptr, found_inf, amax_out, nullptr); };
  const TensorView p = m.at(0, {8}), g = m.at(8, {8}), m1 = m.at(16, {8}), v = m.at(24, {8});
  expect_value_error([&] { step({p, g, m1, m1}); }, "adam_step: exp_avgs[0] and exp_avg_sqs[0] must not share memory");
  expect_value_error([&] { step({p, m.at(4, {8}), m1, v}); }, "adam_step: grads[0] and params[0] must not share memory");
  expect_value_error([&] { step({p, g, m1, m.at(23, {8})}); },
                     "adam_step: exp_avgs[0] and exp_avg_sqs[0] must not share memory");
  // Across tensors of the call, and the call's own buffers.
  std::vector<float> amax2(2 * kAdamAmaxColumns);
  expect_value_error([&] { adam_step({{p, g, m1, v}, {m.at(40, {8}), m.at(48, {8}), m.at(56, {8}), m.at(3, {8})}},
                                     AdamHyper{}, 1, nullptr, found_inf, view(amax2, DType::kFloat32, {2, kAdamAmaxColumns}), nullptr); },
                     "adam_step: params[0] and exp_avg_sqs[1] must not share memory");
  expect_value_error([&] { adam_step({{p, g, m1, v}}, AdamHyper{}, 1, nullptr, m.at(30, {1}), amax_out, nullptr); },
                     "adam_step: found_inf and exp_avg_sqs[0] must not share memory");
  // A param's step count is written too: not inside another buffer, nor the call's step_tensor.
  AdamTensors counted{p, g, m1, v};
  counted.step_count = m.at(17, {1});
  expect_value_error([&] { step(counted); }, "adam_step: exp_avgs[0] and step_counts[0] must not share memory");
  counted.step_count = m.at(80, {1});
  const TensorView counter = m.at(80, {1});
  expect_value_error([&] { adam_step({counted}, AdamHyper{}, 0, &counter, found_inf, amax_out, nullptr); },
                     "step_counts[0] must not share memory");
  for (float x : m.buf) ASSERT_EQ(x, 1.0f);  // nothing written
  // Grads may share memory with each other: they are only read.
  adam_step({{p, g, m1, v}, {m.at(40, {8}), g, m.at(56, {8}), m.at(64, {8})}}, AdamHyper{}, 1, nullptr, found_inf,
            view(amax2, DType::kFloat32, {2, kAdamAmaxColumns}), nullptr);
  EXPECT_NE(m.buf[0], 1.0f);
}

}  // namespace
}  // namespace fp8amp
