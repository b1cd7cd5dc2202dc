"""ScalingState on CUDA against the CPU over training steps, bit for bit (quantize, cast_transpose and
cast_transpose_dbias, with NaN, inf and spikes); under torch.compile (Inductor) against eager; free
of host synchronization (sync debug mode); and a cast on a side stream. The single ops against the
CPU are in test_cuda.py. Marked gpu: skipped where torch.cuda.is_available() is False."""

import copy
import math

import pytest
import torch

import fp8amp
from cast_reference import assert_all_same, assert_bits_equal

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def sequence_step(state, step, g):
    """One training step through a 3-tensor state: quantize, cast_transpose, a NaN, a spike."""
    scale = 1e4 if step == 9 else float(2 ** (step % 5))
    x = torch.randn(257, 129, generator=g) * scale
    grad = torch.randn(300, 64, generator=g, dtype=torch.float32).to(torch.bfloat16) * 10.0 ** -(step % 4)
    weight = torch.randn(4096, generator=g) * 3
    if step == 6:
        grad[7, 7] = float("nan")
    if step == 14:
        x[0, 0] = float("inf")
    device = state.scale.device
    outs = [*state.quantize(x.to(device), 0), *state.cast_transpose(grad.to(device), 1),
            *state.quantize(weight.to(device), 2)]
    state.update()
    return outs


@pytest.mark.parametrize("dtype,recipe", [(fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=4)),
                                          (fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=5, margin=1,
                                                                             pow2_scale=False))])
def test_scaling_state_20_steps(dtype, recipe):
    cpu_state = fp8amp.ScalingState(3, dtype, recipe)
    cuda_state = copy.deepcopy(cpu_state).to(CUDA)
    assert cuda_state.scale.device.type == CUDA
    g_cpu, g_cuda = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for step in range(20):
        assert_all_same(sequence_step(cpu_state, step, g_cpu), [t.cpu() for t in sequence_step(cuda_state, step, g_cuda)])
        for name, value in cpu_state.named_buffers():
            assert_bits_equal(getattr(cuda_state, name).cpu(), value)


def compiled_step(state, x, grad, weights):
    x8, x_scale_inv = state.quantize(x, 0)
    g8, g8_t, g_scale_inv = state.cast_transpose(grad, 1)
    x_back = fp8amp.ops.dequantize(x8, x_scale_inv, torch.bfloat16)
    weight_amax = torch.zeros(len(weights), 2, device=x.device)
    fp8amp.ops.multi_amax(weights, weight_amax)
    weight_scale = torch.ones(len(weights), device=x.device)
    weight_scale_inv = torch.ones(len(weights), device=x.device)
    fp8amp.ops.compute_scale(weight_amax, weight_scale, weight_scale_inv, fp8amp.E4M3_MAX)
    w_back = fp8amp.ops.multi_dequantize([w.half() for w in weights], weight_scale_inv, torch.float32)
    state.update()
    return [x8, x_scale_inv, g8, g8_t, g_scale_inv, x_back * 2, weight_amax, weight_scale, *w_back]


def test_torch_compile_inductor():
    eager_state = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2), device=CUDA)
    compiled_state = copy.deepcopy(eager_state)
    compiled = torch.compile(compiled_step, fullgraph=True)
    g = torch.Generator(device=CUDA).manual_seed(0)
    for step in range(4):
        x = torch.randn(256, 512, device=CUDA, generator=g).to(torch.bfloat16) * (step + 1)
        grad = torch.randn(384, 256, device=CUDA, generator=g) * 10.0**-step
        weights = [torch.randn(512, 256, device=CUDA, generator=g), torch.randn(77, device=CUDA, generator=g)]
        expected = compiled_step(eager_state, x, grad, weights)
        assert_all_same([t.cpu() for t in expected], [t.cpu() for t in compiled(compiled_state, x, grad, weights)])
        for name, value in eager_state.named_buffers():
            assert_bits_equal(getattr(compiled_state, name), value)


def test_no_host_sync():
    state = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2), device=CUDA)
    x = torch.randn(1024, 512, device=CUDA)
    xs = [torch.randn(1000, device=CUDA), torch.randn(33, 7, device=CUDA)]
    amax = torch.zeros(2, device=CUDA)
    scale, scale_inv = torch.ones(2, device=CUDA), torch.ones(2, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            x8, x_scale_inv = state.quantize(x, 0)
            state.cast_transpose(x.t(), 1)  # non-contiguous: made contiguous on the device
            fp8amp.ops.dequantize(x8, x_scale_inv, torch.bfloat16)
            fp8amp.ops.amax(x, amax[:1])
            fp8amp.ops.multi_amax(xs, amax)
            fp8amp.ops.compute_scale(amax, scale, scale_inv, fp8amp.E5M2_MAX)
            outs, scale_invs = fp8amp.ops.multi_quantize(xs, scale, amax, fp8amp.E5M2)
            fp8amp.ops.multi_dequantize(outs, scale_invs, torch.float32)
            state.update()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert state.counter.tolist() == [2, 2]
    assert math.isfinite(state.scale[0].item())


def test_cuda_quantize_on_another_stream():
    x = torch.randn(4096, 1024, device=CUDA)
    expected = fp8amp.ops.quantize(x, torch.ones(1, device=CUDA), torch.zeros(1, device=CUDA), fp8amp.E4M3)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fp8amp.ops.quantize(x, torch.ones(1, device=CUDA), torch.zeros(1, device=CUDA), fp8amp.E4M3)[0]
    torch.cuda.current_stream().wait_stream(stream)
    assert_bits_equal(out, expected)


@pytest.mark.parametrize("dtype,recipe", [(fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=3)),
                                          (fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2, margin=1,
                                                                             pow2_scale=False))])
def test_scaling_state_cast_transpose_dbias_steps(dtype, recipe):
    cpu_state = fp8amp.ScalingState(2, dtype, recipe)
    cuda_state = copy.deepcopy(cpu_state).to(CUDA)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        grad = (torch.randn(300, 96, generator=g) * 10.0 ** (step % 4 - 2)).to(torch.bfloat16)
        if step == 5:
            grad[17, 3] = float("inf")
        expected = cpu_state.cast_transpose_dbias(grad, 1)
        got = cuda_state.cast_transpose_dbias(grad.to(CUDA), 1)
        assert_all_same(expected, [t.cpu() for t in got])
        cpu_state.update()
        cuda_state.update()
        for name, value in cpu_state.named_buffers():
            assert_bits_equal(getattr(cuda_state, name).cpu(), value)


def test_torch_compile_inductor_cast_transpose_dbias():
    def step(state, grad):
        g8, g8_t, g_scale_inv, dbias = state.cast_transpose_dbias(grad, 0)
        state.update()
        return [g8, g8_t, g_scale_inv, dbias * 2]

    eager_state = fp8amp.ScalingState(1, fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=2), device=CUDA)
    compiled_state = copy.deepcopy(eager_state)
    compiled = torch.compile(step, fullgraph=True)
    g = torch.Generator(device=CUDA).manual_seed(0)
    for i in range(4):
        grad = torch.randn(384, 256, device=CUDA, generator=g).to(torch.bfloat16) * 10.0**-i
        assert_all_same([t.cpu() for t in step(eager_state, grad)], [t.cpu() for t in compiled(compiled_state, grad)])
        for name, value in eager_state.named_buffers():
            assert_bits_equal(getattr(compiled_state, name), value)


def test_cast_transpose_dbias_no_host_sync():
    state = fp8amp.ScalingState(1, fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=2), device=CUDA)
    x = torch.randn(1000, 72, device=CUDA, dtype=torch.bfloat16)
    scale, amax = torch.ones(1, device=CUDA), torch.zeros(1, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            state.cast_transpose_dbias(x)
            state.cast_transpose_dbias(x.t())  # non-contiguous: made contiguous on the device
            fp8amp.ops.cast_transpose_dbias(x, scale, amax, fp8amp.E4M3)
            state.update()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert state.counter.tolist() == [2]
