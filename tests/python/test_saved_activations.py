"""fp8amp.save_activations_in_fp8: the activations autograd saves for backward, stored in FP8.

What the backward reads is exactly the FP8 round trip of ScaledTensor.from_tensor; which saved
tensors are stored (activations) and which are kept (parameters and their views and autocast
casts, inputs, statistics, outputs of log_softmax/tanh, FP8, integer, float64, broadcast and
small tensors); non-contiguous inputs; non-finite values; gradients of a GPT block within the FP8
noise floor; Fp8Linear; activation checkpointing; double backward; errors; a small GPT training
on CPU (FP8 emulation) and the memory held for backward on a GPU. torch.compile's part is in
test_saved_activations_compile.py, the GPU loss check against BF16 in test_initialize.py, the
shared helpers and the SQNR floors in saved_activations_reference.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8amp
from fp8amp import E4M3, ScaledTensor
from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step
from saved_activations_reference import (FORMATS, SQNR_FLOOR_DB, activation, gpt_block_grads, sqnr_db,
                                         unpack)


def is_stored(packed: object) -> bool:
    return not isinstance(packed, torch.Tensor)


def round_trip(x: torch.Tensor, fmt=E4M3) -> torch.Tensor:
    return ScaledTensor.from_tensor(x.detach().contiguous(), fmt).dequantize()


# ------------------------------------------------------------------------------------------ values


@pytest.mark.parametrize("fmt", FORMATS)
def test_backward_reads_the_fp8_round_trip(fmt):
    g = torch.Generator().manual_seed(0)
    a0 = torch.randn(64, 128, generator=g).requires_grad_()
    b0 = (torch.randn(64, 128, generator=g) * 3).requires_grad_()
    with fp8amp.save_activations_in_fp8(fmt, min_numel=1) as ctx:
        a, b = a0 * 1, b0 * 1  # activations: mul by a number saves nothing
        (a * b).sum().backward()  # mul saves a and b: d/da = b as stored, d/db = a as stored
    assert torch.equal(a0.grad, round_trip(b0, fmt)) and torch.equal(b0.grad, round_trip(a0, fmt))
    assert not torch.equal(a0.grad, b0.detach())  # the rounding is really there
    assert ctx.stored_tensors == 2
    assert ctx.stored_bytes == 2 * 64 * 128 * 4 and ctx.fp8_bytes == 2 * (64 * 128 + 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_contiguous_tensors_come_back_contiguous_with_the_same_values(dtype):
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    x = activation(8, 4, 16, 32, dtype=dtype).transpose(1, 2)  # a strided view, as SDPA's q, k, v
    packed = ctx.pack_hook(x)
    assert is_stored(packed) and packed.scaled.storage_format == E4M3
    back = unpack(ctx, packed)
    assert back.dtype == dtype and back.shape == x.shape and back.is_contiguous()
    assert torch.equal(back, round_trip(x)) and sqnr_db(back, x) > SQNR_FLOOR_DB[E4M3]


def test_nonfinite_values_read_back_as_nan():
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    for bad in (math.inf, -math.inf, math.nan):
        x = activation(32, 32)
        with torch.no_grad():
            x[3, 5] = bad
        back = unpack(ctx, ctx.pack_hook(x))
        assert back.isnan().all(), bad  # never a saturated finite value
    big = activation(32, 32) * 1e30  # finite but far beyond E4M3: the scale takes it
    assert torch.isfinite(unpack(ctx, ctx.pack_hook(big))).all()


def test_nonfinite_activation_gives_nan_gradients():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(16, 16)
    x[0, 0] = math.inf
    with fp8amp.save_activations_in_fp8(min_numel=1):
        h = x @ w  # an activation holding inf (row 0)
        (h * w).sum().backward()
    assert w.grad.isnan().all()


# ------------------------------------------------------------------------------------------ which


def test_what_is_stored_and_what_is_kept():
    ctx = fp8amp.save_activations_in_fp8(min_numel=64)
    param = nn.Parameter(torch.randn(16, 16))
    leaf = torch.randn(16, 16, requires_grad=True)
    act = activation(16, 16)
    stored = {
        "activation": act,
        "bfloat16 activation": activation(16, 16, dtype=torch.bfloat16),
        "float16 activation": activation(16, 16, dtype=torch.float16),
        "view of an activation": act.t(),
        "cast of an activation": act.to(torch.bfloat16),
    }
    kept = {
        "parameter": param,
        "view of a parameter": param.t(),
        "autocast's cast of a parameter": param.to(torch.bfloat16),
        "leaf that requires grad": leaf,
        "no grad (a statistic, an input)": torch.randn(16, 16),
        "small": activation(7, 9),
        "float64": activation(16, 16, dtype=torch.float64),
        "FP8": torch.randn(16, 16).to(E4M3),
        "integer": torch.arange(256),
        "ScaledTensor": ScaledTensor.from_tensor(torch.randn(16, 16), E4M3),
        "broadcast": act[:1].expand(16, 16),
        "log_softmax output": F.log_softmax(act, -1),
        "tanh output": act.tanh(),
        "sigmoid output": act.sigmoid(),
    }
    for name, x in stored.items():
        assert is_stored(ctx.pack_hook(x)), name
    for name, x in kept.items():
        packed = ctx.pack_hook(x)
        assert isinstance(packed, torch.Tensor) and (packed.shape, packed.dtype) == (x.shape, x.dtype), name
        assert packed.grad_fn is None, name  # detached: a saved output would otherwise hold its own grad_fn


def test_mlp_under_autocast_stores_its_two_activations_only():
    """Linear -> GELU -> Linear in bfloat16 autocast: GELU's input and fc2's input are stored; the
    model input, the weights, autocast's weight copies and the biases are kept."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8amp.save_activations_in_fp8(min_numel=1) as ctx:
        y = mlp(x)
    y.float().sum().backward()
    assert ctx.stored_tensors == 2 and ctx.stored_bytes == 2 * 32 * 256 * 2
    assert ctx.fp8_bytes == 2 * (32 * 256 + 4)


def test_fp8linear_saves_are_left_alone():
    """Fp8Linear saves its input as FP8 codes already: only GELU's input is stored."""
    torch.manual_seed(0)
    mlp = fp8amp.convert(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), policy="all")
    with fp8amp.save_activations_in_fp8(min_numel=1) as ctx:
        y = mlp(torch.randn(32, 64))
    y.sum().backward()
    assert ctx.stored_tensors == 1 and ctx.stored_bytes == 32 * 256 * 4
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mlp.parameters())


# ------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpt_gradients_within_the_fp8_noise_floor(fmt):
    """Attention (SDPA's q, k, v, output), GELU and LayerNorm inputs stored: the forward is untouched
    (bit-identical loss), every gradient is within the floor of its format, and not exact."""
    loss, grads = gpt_block_grads()
    ctx = fp8amp.save_activations_in_fp8(fmt, min_numel=1024)
    loss_fp8, grads_fp8 = gpt_block_grads(ctx)
    assert torch.equal(loss_fp8, loss)
    # the block's 2 LayerNorm inputs, 4 Linear inputs, q, k, v, SDPA's output, GELU's input; ln_f's
    # input and the head's
    assert ctx.stored_tensors == 13
    for name, g in grads.items():
        assert sqnr_db(grads_fp8[name], g) > SQNR_FLOOR_DB[fmt], name
    everything = torch.cat([g.flatten() for g in grads.values()])
    assert sqnr_db(torch.cat([g.flatten() for g in grads_fp8.values()]), everything) < 60


def test_activation_checkpointing():
    """Checkpointed regions save nothing; checkpoint saves their input, which is stored, and the
    recomputation starts from it: gradients within the FP8 floor, for both implementations."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)

    def grad(use_reentrant=None, ctx=None):
        mlp.zero_grad()
        with ctx or contextlib.nullcontext():
            h = x * 2
            out = mlp(h) if use_reentrant is None else checkpoint(mlp, h, use_reentrant=use_reentrant)
        out.pow(2).sum().backward()
        return mlp[0].weight.grad.clone()

    reference = grad()
    for use_reentrant in (False, True):
        ctx = fp8amp.save_activations_in_fp8(min_numel=1)
        g = grad(use_reentrant, ctx)
        assert ctx.stored_tensors == 1 and ctx.stored_bytes == 32 * 64 * 4  # h only
        assert 0 < (g - reference).abs().max() and sqnr_db(g, reference) > SQNR_FLOOR_DB[E4M3]


def test_double_backward_raises():
    x = torch.randn(64, 64, requires_grad=True)
    with fp8amp.save_activations_in_fp8(min_numel=1):
        y = (x * 2).sin().sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y, x, create_graph=True)


# ------------------------------------------------------------------------------------------ errors


def test_bad_arguments_name_the_argument_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"fmt must be one of torch.float8_e4m3fn, torch.float8_e5m2; got torch.float16"):
        fp8amp.save_activations_in_fp8(torch.float16)
    with pytest.raises(TypeError, match="fmt must be a torch.dtype"):
        fp8amp.save_activations_in_fp8("e4m3")
    with pytest.raises(ValueError, match=r"min_numel must be a positive int \(1 or more\), got 0"):
        fp8amp.save_activations_in_fp8(min_numel=0)
    for bad in (2.0, True):
        with pytest.raises(TypeError, match="min_numel must be an int"):
            fp8amp.save_activations_in_fp8(min_numel=bad)


# ------------------------------------------------------------------------------------------ training


def test_small_gpt_trains_with_fp8_activations():
    """O2 on CPU (FP8 emulation) with and without the context, same data and initial weights: the
    loss falls as far. Measured: the means of the last 10 of 40 steps differ by 0.2 % (as much as O2
    and fp32 do), so the bound is 2 %."""
    data = load_text_bytes(max_bytes=1 << 20)
    cfg = GPTConfig(seq_len=64, n_layer=2, n_head=4, d_model=64)

    def losses(ctx=None) -> torch.Tensor:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        model, opt = fp8amp.initialize(model, opt, "O2", policy="all")
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return torch.stack([train_step(model, opt, x, y, scheduler=schedule, saved_tensors_hooks=ctx)
                            for _, (x, y) in zip(range(40), batches(data, 8, cfg.seq_len))])

    ctx = fp8amp.save_activations_in_fp8(min_numel=4096)
    plain, fp8 = losses(), losses(ctx)
    # in a step: 7 a block (2 LayerNorm inputs, q, k, v, SDPA's output, GELU's input; the Fp8Linears'
    # inputs are FP8 already), ln_f's input and the head's
    assert ctx.stored_tensors == 16
    assert fp8[-10:].mean() < fp8[0] - 2.0
    assert abs(fp8[-10:].mean() - plain[-10:].mean()) / plain[-10:].mean() < 0.02


# ------------------------------------------------------------------------------------------ GPU


def _held_for_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx=None) -> int:
    """Bytes a forward under BF16 autocast leaves allocated for its backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16), ctx or contextlib.nullcontext():
        _, loss = model(x, y)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


@pytest.mark.gpu
def test_cuda_memory_held_for_backward_matches_the_prediction():
    """O2 on the GPU: what a GPT forward keeps for its backward, per token, in bytes (docs/o1_o2.md):
    a block keeps 31 d without the context (qkv's and fc1's BF16 outputs 6 d + 8 d, SDPA's output
    2 d, two fp32 LayerNorm inputs 8 d, the Fp8Linears' FP8 inputs 7 d) and 17 d with it (3 d + 4 d +
    d + 2 d + 7 d); the rest keeps ln_f's fp32 input (4 d -> d), the head's BF16 input (2 d -> d) and
    log_softmax's fp32 output (4 vocab, kept). Statistics add ~0.3 %. The memory the context frees
    is what it accounts for (stored_bytes - fp8_bytes): the originals are really released."""
    cfg = GPTConfig(seq_len=512, n_layer=4, n_head=8, d_model=512)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    idx = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), device="cuda")
    x, y = idx[:, :-1], idx[:, 1:]
    d, vocab = cfg.d_model, cfg.vocab_size
    predicted = ((cfg.n_layer * 17 * d + 2 * d + 4 * vocab)
                 / (cfg.n_layer * 31 * d + 6 * d + 4 * vocab))  # 0.545
    _held_for_backward(model, x, y)  # warm-up: cuBLASLt workspaces and the like stay allocated
    without = _held_for_backward(model, x, y)
    ctx = fp8amp.save_activations_in_fp8()
    with_fp8 = _held_for_backward(model, x, y, ctx)
    assert abs(with_fp8 / without - predicted) < 0.03, (with_fp8, without, predicted)
    freed = ctx.stored_bytes - ctx.fp8_bytes
    assert abs((without - with_fp8) - freed) < 0.05 * freed, (without - with_fp8, freed)


@pytest.mark.gpu
def test_cuda_memory_held_for_backward_under_compile_matches_the_prediction():
    """O2 with each block compiled by Inductor, the context entered outside: a compiled block keeps
    29 d bytes a token without the context (eager's 31 d, but the proj GEMM's BF16 output 2 d, from
    which the backward recomputes the second LayerNorm's input, instead of that fp32 input 4 d) and
    17 d with it (its input d, q, k, v 3 d, SDPA's output d, the proj and fc1 outputs d + 4 d, the
    Fp8Linears' 7 d); the head and the loss run eagerly, as above (2 stored by the Python hooks)."""
    cfg = GPTConfig(seq_len=512, n_layer=4, n_head=8, d_model=512)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    for block in model.blocks:
        block.compile()
    idx = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), device="cuda")
    x, y = idx[:, :-1], idx[:, 1:]
    d, vocab = cfg.d_model, cfg.vocab_size
    predicted = ((cfg.n_layer * 17 * d + 2 * d + 4 * vocab)
                 / (cfg.n_layer * 29 * d + 6 * d + 4 * vocab))  # 0.581
    _held_for_backward(model, x, y)  # warm-up and compilation, without and with the context
    _held_for_backward(model, x, y, fp8amp.save_activations_in_fp8())
    without = _held_for_backward(model, x, y)
    ctx = fp8amp.save_activations_in_fp8()
    assert ctx.in_compiled_graphs, f"torch {torch.__version__} cannot inline the hooks"
    with_fp8 = _held_for_backward(model, x, y, ctx)
    assert ctx.stored_tensors == 2  # ln_f's input and the head's, outside the compiled blocks
    assert abs(with_fp8 / without - predicted) < 0.03, (with_fp8, without, predicted)

