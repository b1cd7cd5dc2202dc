"""The tiled recipes (rowwise, blockwise) with the features around Fp8Linear (docs/tiles.md,
"Features"): FP8 saved activations (eager and compiled), FSDP2 all-gather of tiled weights
(test_tiled_fsdp.py), CUDA-graph capture of a whole step (GPU) and blockwise weight gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import E4M3, ScaledTensor
from test_saved_activations import SQNR_FLOOR_DB, held_for_backward, sqnr_db

TILED = ["rowwise", "blockwise"]
ROWS, IN, HIDDEN = 64, 128, 256


def tiled_mlp(recipe: str, level: str) -> nn.Module:
    """Linear 128 -> 256, GELU, Linear 256 -> 128, FP8 compute ("fp8") or O1/O2 masters."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN))
    if level == "fp8":
        return fp8amp.convert(mlp, recipe=recipe, policy="all")
    return fp8amp.initialize(mlp, None, level, recipe=recipe, policy="all")[0]


def real(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, ScaledTensor) else t


# ------------------------------------------------------------------------- FP8 saved activations


def mlp_step(recipe: str, level: str, ctx, compiled: bool):
    """One forward and backward; the loss, the first weight's gradient and what the compiled
    graph holds for backward (by dtype; empty in eager mode)."""
    torch._dynamo.reset()
    mlp = tiled_mlp(recipe, level)
    model = torch.compile(mlp, backend="aot_eager") if compiled else mlp
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with ctx or contextlib.nullcontext():
        out = model(x)
    held = held_for_backward(out) if compiled else {}
    loss = out.square().mean()
    loss.backward()
    return loss.detach(), real(mlp[0].weight.grad), held


@pytest.mark.parametrize("recipe", TILED)
@pytest.mark.parametrize("level", ["fp8", "O2"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_saved_activations_compose_with_the_tiled_recipes(recipe, level, compiled):
    """The tiled Linear's saves (FP8 codes and their float32 tile scales) are left as they are:
    only GELU's input is stored in FP8, once (the first Linear saves x's FP8 cast); the
    forward is untouched and the gradient is within E4M3's floor of the one without the context.
    Compiled at O2 the backward's weight scales are a product (tile scales times the master's
    scale), which the graph rules keep too (before they did, its two floats were stored in FP8)."""
    loss, grad, held = mlp_step(recipe, level, None, compiled)
    ctx = fp8amp.save_activations_in_fp8(min_numel=1)
    loss_fp8, grad_fp8, held_fp8 = mlp_step(recipe, level, ctx, compiled)
    assert torch.equal(loss, loss_fp8)
    assert sqnr_db(grad_fp8, grad) > SQNR_FLOOR_DB[E4M3] and not torch.equal(grad_fp8, grad)
    gelu_input = ROWS * HIDDEN
    if not compiled:
        assert ctx.stored_tensors == 1 and ctx.stored_bytes == gelu_input * 4  # GELU's input, float32
        assert ctx.fp8_bytes == gelu_input + 4  # its codes and scale: a quarter
        return
    # Compiled: the graph holds GELU's input as E4M3 codes (a byte an element) and its one scale
    # instead of float32, and nothing else changes (the tile scales stay float32).
    assert held_fp8[torch.float8_e4m3fn] - held[torch.float8_e4m3fn] == gelu_input, (held, held_fp8)
    assert held[torch.float32] - held_fp8[torch.float32] == 4 * gelu_input - 4, (held, held_fp8)
