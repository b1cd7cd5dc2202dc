"""The ops' schemas and fake (Meta) kernels: torch.library.opcheck, and torch.compile(fullgraph=True)
with the aot_eager backend on CPU giving eager's results and buffer mutations bit for bit."""

import copy
import math

import pytest
import torch

import fp8amp
from cast_reference import assert_bits_equal

ops = torch.ops.fp8amp

# Present in torch 2.11 and later.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

def opcheck_cases():
    x = torch.randn(8, 16)
    counter = torch.zeros(1, dtype=torch.int32)
    # test_schema compares inputs with ops float8 lacks on CPU: dequantize samples read FP16.
    return {
        "quantize": (ops.quantize.default, (x, torch.ones(1), torch.zeros(1, 4), fp8amp.E4M3),
                     dict(warmup_counter=counter, warmup_steps=4)),
        "quantize_current": (ops.quantize_current.default, (x, fp8amp.E4M3), dict(margin=1, nan_if_nonfinite=True)),
        "cast_transpose": (ops.cast_transpose.default, (x, torch.ones(1), torch.zeros(1, 4), fp8amp.E5M2),
                           dict(warmup_counter=counter, warmup_steps=4)),
        "cast_transpose_dbias": (ops.cast_transpose_dbias.default,
                                 (torch.randn(2, 300, 16), torch.ones(1), torch.zeros(1, 4), fp8amp.E5M2),
                                 dict(warmup_counter=counter, warmup_steps=4)),
        "cast_transpose_rescaled": (ops.cast_transpose_rescaled.default,
                                    (x.half(), torch.full((1,), 0.25), torch.full((1,), 8.0), fp8amp.FP16), {}),
        "dequantize": (ops.dequantize.default, (x.half(), torch.ones(1), torch.bfloat16), {}),
        "amax": (ops.amax.default, (x, torch.zeros(1, 4)), dict(warmup_counter=counter, warmup_steps=4)),
        "amax_of": (ops.amax_of.default, (x,), {}),
        "multi_amax": (ops.multi_amax.default, ([x, x[:3]], torch.zeros(2, 3)), {}),
        "multi_quantize": (ops.multi_quantize.default,
                           ([x, x[:3]], [torch.empty_like(x, dtype=fp8amp.FP16), torch.empty_like(x[:3], dtype=fp8amp.FP16)],
                            torch.ones(2), torch.zeros(2, 3)), {}),
        "multi_dequantize": (ops.multi_dequantize.default,
                             ([x.half(), x[:3].half()], torch.ones(2), [torch.empty_like(x), torch.empty_like(x[:3])]),
                             {}),
        "compute_scale": (ops.compute_scale.default, (torch.rand(2, 3), torch.ones(2), torch.ones(2), 448.0), {}),
        "multi_update_delayed_scaling": (ops.multi_update_delayed_scaling.default,
                                         ([torch.rand(2, 3), torch.rand(1, 5)], [torch.ones(2), torch.ones(1)],
                                          [torch.ones(2), torch.ones(1)],
                                          [torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)],
                                          448.0), {}),
        "update_delayed_scaling": (ops.update_delayed_scaling.default,
                                   (torch.rand(2, 3), torch.ones(2), torch.ones(2),
                                    torch.zeros(2, dtype=torch.int32), 448.0), {}),
    }


@pytest.mark.parametrize("name", list(opcheck_cases()))
@pytest.mark.parametrize("test_util", OPCHECK_UTILS)
def test_opcheck(name, test_util):
    op, args, kwargs = opcheck_cases()[name]
    torch.library.opcheck(op, args, kwargs, test_utils=test_util)


def training_step(state: fp8amp.ScalingState, x: torch.Tensor, grad: torch.Tensor, weights: list):
    """Everything the front end does per step with the single-tensor ops, in one function."""
    x8, x_scale_inv = state.quantize(x, 0)
    g8, g8_t, g_scale_inv = state.cast_transpose(grad, 1)
    x_back = fp8amp.ops.dequantize(x8, x_scale_inv, torch.bfloat16)
    weight_amax = torch.zeros(len(weights), 2)
    fp8amp.ops.multi_amax(weights, weight_amax)
    fp8amp.ops.amax(x, weight_amax[0])
    weight_scale, weight_scale_inv = torch.ones(len(weights)), torch.ones(len(weights))
    fp8amp.ops.compute_scale(weight_amax, weight_scale, weight_scale_inv, fp8amp.E4M3_MAX)
    w_back = fp8amp.ops.multi_dequantize([w.half() for w in weights], weight_scale_inv, torch.float32)
    state.update()
    return [x8, x_scale_inv, g8, g8_t, g_scale_inv, x_back, weight_amax, weight_scale, weight_scale_inv, *w_back]


def test_compiled_step_equals_eager():
    eager_state = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
    compiled_state = copy.deepcopy(eager_state)
    compiled = torch.compile(training_step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for step in range(4):  # warm-up (2 steps), then delayed scaling
        x = torch.randn(16, 32, generator=g).to(torch.bfloat16) * (step + 1)
        grad = torch.randn(48, 16, generator=g) * 10.0**-step
        weights = [torch.randn(32, 16, generator=g), torch.randn(7, generator=g) * 100]
        for a, b in zip(training_step(eager_state, x, grad, weights), compiled(compiled_state, x, grad, weights)):
            assert_bits_equal(b, a)
        for name, value in eager_state.named_buffers():
            assert_bits_equal(getattr(compiled_state, name), value)
    assert eager_state.counter.tolist() == [2, 2]


def test_compiled_cast_transpose_with_changing_shapes():
    state = fp8amp.ScalingState(1)
    compiled = torch.compile(state.cast_transpose, backend="aot_eager", fullgraph=True)
    for rows in (8, 12, 20):  # the second shape makes dynamo compile a dynamic-shape graph
        x = torch.randn(rows, 16)
        out, out_t, _ = compiled(x)
        assert out_t.shape == (16, rows)


@pytest.mark.parametrize("shape", [(8, 16), (300, 33), (2, 3, 7), (5,), (0, 8), (7, 0)])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16])
def test_cast_transpose_dbias_fake_outputs_match_real(shape, in_dtype, dtype):
    x = torch.randn(shape).to(in_dtype)
    real = ops.cast_transpose_dbias.default(x, torch.ones(1), torch.zeros(1, 2), dtype)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = ops.cast_transpose_dbias.default(mode.from_tensor(x), mode.from_tensor(torch.ones(1)),
                                                mode.from_tensor(torch.zeros(1, 2)), dtype)
    assert len(fake) == len(real) == 4
    for f, r in zip(fake, real, strict=True):
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())
    assert real[3].shape == (shape[-1],) and real[3].dtype == torch.float32


def dbias_step(state: fp8amp.ScalingState, grad: torch.Tensor):
    g8, g8_t, g_scale_inv, dbias = state.cast_transpose_dbias(grad, 1)
    state.update()
    return [g8, g8_t, g_scale_inv, dbias, dbias.to(torch.bfloat16)]


def test_compiled_cast_transpose_dbias_equals_eager():
    eager_state = fp8amp.ScalingState(2, fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=2))
    compiled_state = copy.deepcopy(eager_state)
    compiled = torch.compile(dbias_step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for step in range(4):  # warm-up (2 steps), then delayed scaling
        grad = (torch.randn(300, 24, generator=g) * 10.0**-step).to(torch.bfloat16)
        for a, b in zip(dbias_step(eager_state, grad), compiled(compiled_state, grad), strict=True):
            assert_bits_equal(b, a)
        for name, value in eager_state.named_buffers():
            assert_bits_equal(getattr(compiled_state, name), value)
    assert eager_state.counter.tolist() == [0, 2]  # row 0 casts nothing: it stays in its warm-up


def test_compiled_cast_transpose_dbias_with_changing_shapes():
    def cast(x, scale, amax):
        return fp8amp.ops.cast_transpose_dbias(x, scale, amax, fp8amp.E4M3)

    compiled = torch.compile(cast, backend="aot_eager", fullgraph=True)
    for shape in ((8, 16), (12, 16), (20, 24), (2, 300, 24)):  # the second makes dynamo go dynamic
        x = torch.randn(shape)
        amax_c, amax_e = torch.zeros(1), torch.zeros(1)
        got, expected = compiled(x, torch.ones(1), amax_c), cast(x, torch.ones(1), amax_e)
        assert got[1].shape == (shape[-1], math.prod(shape[:-1])) and got[3].shape == (shape[-1],)
        for a, b in zip(got, expected, strict=True):
            assert_bits_equal(a, b)
        assert_bits_equal(amax_c, amax_e)


def test_compiled_multi_quantize():
    def quantize_all(xs, scale, amax):
        return fp8amp.ops.multi_quantize(xs, scale, amax, fp8amp.E4M3)

    xs = [torch.randn(4, 4), torch.randn(3)]
    compiled = torch.compile(quantize_all, backend="aot_eager", fullgraph=True)
    amax = torch.zeros(2)
    outs, _ = compiled(xs, torch.ones(2), amax)
    assert_bits_equal(outs[1], fp8amp.ops.quantize(xs[1], torch.ones(1), torch.zeros(1), fp8amp.E4M3)[0])


def test_compiled_multi_dequantize_into_views_of_one_buffer():
    """fp8amp.distributed's use: dequantize into the rows of a matrix made in the graph, then reduce
    it; and without outs, new outputs."""
    def dequantize_rows(codes, scale_inv):
        rows = torch.empty(len(codes), codes[0].numel())
        fp8amp.ops.multi_dequantize(codes, scale_inv, torch.float32, outs=rows.unbind())
        return rows.sum(0), *fp8amp.ops.multi_dequantize(codes, scale_inv, torch.bfloat16)

    codes = [torch.randn(6).half() for _ in range(3)]
    scale_inv = torch.tensor([0.5, 2.0, 3.0])
    compiled = torch.compile(dequantize_rows, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(codes, scale_inv), dequantize_rows(codes, scale_inv), strict=True):
        assert_bits_equal(a, b)


def test_fp8_linear_turns_off_inductor_loop_reordering():
    """torch 2.11's Inductor miscompiles a LayerNorm feeding an Fp8Linear with this reordering on
    (docs/compile.md): making an Fp8Linear turns it off, unless FP8AMP_KEEP_INDUCTOR_CONFIG=1."""
    import os

    from torch._inductor import config

    fp8amp.Fp8Linear(16, 16)
    expected = os.environ.get("FP8AMP_KEEP_INDUCTOR_CONFIG") == "1"
    assert config.loop_ordering_after_fusion is expected
