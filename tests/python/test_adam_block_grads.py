"""torch.ops.fp8amp.adam_step with FP8 grads in 128 x 128 block scales (the blockwise recipe's
weight gradients): the step reads each element's block scale, so it equals, bit for bit, the step
on the grads' float32 real values (code * scale_inv is exact in float32, and the element math is
the same); in one call with one-scale and float32 grads; CUDA against CPU bit for bit (GPU); and
the errors for block scales the op cannot index."""

from __future__ import annotations

import pytest
import torch

import fp8amp
from test_adam_op import FP16, E4M3, LowPrecisionParam, adam_step, bytes_equal, random_like

BLOCK = (128, 128)
# [rows, cols]: cols multiples of 128; rows that end inside a block; a single row; more than one
# launch's worth of tensors is not needed (batching is the one-scale path's).
SHAPES = [(256, 384), (200, 128), (1, 256), (129, 640), (128, 8320)]


def block_grad(shape, gen, dtype=E4M3):
    """FP8 codes and their block scale_invs, with blocks of very different magnitudes."""
    rows, cols = shape
    x = torch.randn(rows, cols, generator=gen)
    exps = torch.randint(-14, -2, (-(-rows // 128), -(-cols // 128)), generator=gen).float()
    x = x * torch.exp2(exps).repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return fp8amp.ops.quantize_tiles(x, dtype, BLOCK)


def o2_param(shape, gen, device):
    x = LowPrecisionParam(shape[0] * shape[1], gen, device=device)
    for name in ("p", "m", "v", "w"):
        setattr(x, name, getattr(x, name).view(shape))
    return x


def clone(x: LowPrecisionParam, device) -> LowPrecisionParam:
    y = LowPrecisionParam.__new__(LowPrecisionParam)
    y.__dict__ = {k: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in x.__dict__.items()}
    return y


def step_all(params, grads, grad_scale_invs, **kw):
    lists = LowPrecisionParam.lists(params)
    lists["grad_scale_invs"] = grad_scale_invs
    return adam_step([x.p for x in params], grads, [x.m for x in params], [x.v for x in params], **lists, **kw)


def run(params, grads_per_step, real, **kw):
    """Three steps; ``real``: the grads as float32 real values (no grad scale) instead of codes + block scales."""
    counter = torch.zeros(1, device=params[0].p.device)
    amaxes = []
    for grads in grads_per_step:
        if real:
            values = [fp8amp.ops.dequantize_tiles(c, s, BLOCK, torch.float32) if s.numel() > 1 else c.float() * s
                      for c, s in grads]
            amaxes.append(step_all(params, values, [None] * len(params), step_tensor=counter, **kw))
        else:
            amaxes.append(step_all(params, [c for c, _ in grads], [s for _, s in grads], step_tensor=counter, **kw))
    return amaxes


def make(device, seed=7, grad_dtype=E4M3):
    gen = torch.Generator().manual_seed(seed)
    params = [o2_param(shape, gen, "cpu") for shape in SHAPES]
    # One tensor with a single grad scale in the same call: both kernel variants in one step.
    params.append(o2_param((64, 96), gen, "cpu"))
    grads_per_step = []
    for _ in range(3):
        grads = [block_grad(shape, gen, grad_dtype) for shape in SHAPES]
        one = random_like(64 * 96, gen, -10, -6).view(64, 96)
        grads.append((one.mul(2.0**12).to(grad_dtype), torch.tensor([2.0**-12])))
        grads_per_step.append(grads)
    to = lambda t: t.to(device)  # noqa: E731
    return [clone(x, device) for x in params], [[(to(c), to(s)) for c, s in g] for g in grads_per_step]


def assert_same(a: list[LowPrecisionParam], b: list[LowPrecisionParam], what: str):
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (u, w) in enumerate(zip(x.tensors(), y.tensors())):
            assert bytes_equal(u.cpu(), w), f"{what}: tensor {i}, buffer {j}"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adamw,maximize", [(True, False), (False, True)])
@pytest.mark.parametrize("grad_dtype", [E4M3, torch.float8_e5m2])
def test_block_grads_step_as_their_float32_values(device, adamw, maximize, grad_dtype):
    blocks, grads = make(device, grad_dtype=grad_dtype)
    reals, _ = make(device, grad_dtype=grad_dtype)
    kw = dict(lr=1e-3, weight_decay=0.01, adamw=adamw, maximize=maximize)
    a = run(blocks, grads, real=False, **kw)
    b = run(reals, grads, real=True, **kw)
    for t, (x, y) in enumerate(zip(a, b)):
        assert bytes_equal(x.cpu(), y), f"amax, step {t}"
    assert_same(blocks, reals, "blocks vs float32 values")
    assert not torch.equal(blocks[0].p, make(device, grad_dtype=grad_dtype)[0][0].p)  # it stepped


@pytest.mark.gpu
def test_block_grads_cuda_matches_cpu_bit_for_bit():
    cpu, grads = make("cpu", seed=11)
    cuda = [clone(x, "cuda") for x in cpu]
    kw = dict(lr=1e-3, weight_decay=0.01)
    a = run(cpu, grads, real=False, **kw)
    b = run(cuda, [[(c.cuda(), s.cuda()) for c, s in g] for g in grads], real=False, **kw)
    for t, (x, y) in enumerate(zip(a, b)):
        assert bytes_equal(x, y), f"amax, step {t}"
    assert_same(cpu, cuda, "cuda vs cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_a_nonfinite_block_skips_the_step(device):
    """A NaN block scale_inv (a block that held an inf or NaN) makes the call a no-op."""
    params, grads = make(device)
    before = [t.clone() for x in params for t in x.tensors()]
    codes, scale_inv = grads[0][1]
    scale_inv[1, 0] = float("nan")
    found = torch.zeros(1, device=device)
    amax = step_all(params, [c for c, _ in grads[0]], [s for _, s in grads[0]], step=1, found_inf=found)
    assert found.item() == 1.0 and amax[1, 0].isnan().item()
    assert all(bytes_equal(a.cpu(), b) for a, b in zip(before, [t for x in params for t in x.tensors()]))


def test_block_scales_the_op_cannot_index_are_refused():
    gen = torch.Generator().manual_seed(3)

    def attempt(shape, scale_inv):
        step_all([o2_param(shape, gen, "cpu")], [torch.zeros(shape, dtype=E4M3)], [scale_inv], step=1)

    with pytest.raises(ValueError, match=r"grad_scale_invs\[0\] must have one element or be the block scales "
                                         r"\[2, 3\] of its param float16\[256, 384\] on cpu, got float32\[3, 2\]"):
        attempt((256, 384), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"grad_scale_invs\[0\] must have one element, or be the 128 x 128 block "
                                         r"scales of a 2-D grad whose columns are a multiple of 128"):
        attempt((256, 200), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"columns are a multiple of 128.*float16\[32768\]"):
        step_all([LowPrecisionParam(32768, gen)], [torch.zeros(32768, dtype=E4M3)], [torch.ones(2, 128)], step=1)
    with pytest.raises(ValueError, match=r"grad_scale_invs\[0\] must be float32"):
        attempt((256, 384), torch.ones(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"grad_scale_invs\[0\] must be contiguous"):
        attempt((256, 384), torch.ones(3, 2).t())
    with pytest.raises(ValueError, match=r"grad_scale_invs\[0\] must be None: its grad is not float8"):
        x = o2_param((256, 384), gen, "cpu")
        step_all([x], [torch.zeros(256, 384, dtype=FP16)], [torch.ones(2, 3)], step=1)
