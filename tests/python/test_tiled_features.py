"""The tiled recipes (rowwise, blockwise) with the features around Fp8Linear (docs/tiles.md,
"Features"): FP8 saved activations (eager and compiled), FSDP2 all-gather of tiled weights
(test_tiled_fsdp.py; CUDA-graph capture: test_cuda_graph.py) and the blockwise O1/O2 weight
gradients in 128 x 128 blocks: accumulation, the optimizer, clipping and unscaling."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import E4M3, ScaledTensor, ops
from fp8amp.block_scaled_tensor import BlockScaledTensor
from saved_activations_reference import SQNR_FLOOR_DB, held_for_backward, sqnr_db

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


# ------------------------------------------------------------------------ blockwise weight gradients

MICRO_BATCHES = 3
# Five E4M3 roundings (each micro-batch's gradient as the backward returns it, and the
# accumulator's after each of the two adds): 28.8 - 10 log10(5) = 21.8 dB, the floor 3 dB under,
# as the others.
ACCUMULATED_FLOOR_DB = 18.8


def blockwise_o2_linear(weight_grad: str = "fp8") -> nn.Module:
    torch.manual_seed(0)
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(256, 384)), None, "O2", recipe="blockwise", policy="all",
                                 weight_grad=weight_grad)
    return model


def micro_batches():
    """70 tokens each (padded to 128), output gradients with one 128-row block of the weight's
    gradient 2^14 larger than the rest (a per-tensor scale flushes most of the rest to E4M3's
    subnormals)."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(MICRO_BATCHES):
        dy = torch.randn(70, 384, generator=g)
        dy[:, :128] *= 2.0 ** 14
        out.append((torch.randn(70, 256, generator=g), dy))
    return out


def accumulated(model: nn.Module) -> torch.Tensor:
    for x, dy in micro_batches():
        model(x).backward(dy)
    return model[0].weight.grad


def per_micro_batch_grads() -> list[torch.Tensor]:
    """Each micro-batch's float32 weight gradient (the same GEMM output the FP8 path quantizes)."""
    model = blockwise_o2_linear("fp32")
    grads = []
    for x, dy in micro_batches():
        model.zero_grad()
        model(x).backward(dy)
        grads.append(model[0].weight.grad.clone())
    return grads


def test_blockwise_weight_gradients_accumulate_in_blocks():
    """O2 blockwise: the weight gradient is a BlockScaledTensor (E4M3, 128 x 128 block scales);
    each micro-batch's gradient arrives in blocks and is added by scaled_accumulate_tiles, bit for
    bit that composition, and the sum is within five E4M3 roundings of the float32 sum, where the
    per-tensor gradient loses the small blocks to the large one's scale."""
    grad = accumulated(blockwise_o2_linear())
    assert isinstance(grad, BlockScaledTensor) and grad.codes.dtype == E4M3 and grad.scale_inv.shape == (3, 2)
    grads = per_micro_batch_grads()
    codes, scale_inv = ops.quantize_tiles(grads[0], E4M3, (128, 128))
    for g in grads[1:]:
        update = ops.dequantize_tiles(*ops.quantize_tiles(g, E4M3, (128, 128)), (128, 128))
        codes, scale_inv = ops.scaled_accumulate_tiles(codes, scale_inv, update, (128, 128))
    assert torch.equal(grad.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(grad.scale_inv, scale_inv)
    reference = sum(g.double() for g in grads)
    small = slice(128, None)  # the blocks of the small gradients
    assert sqnr_db(grad.dequantize()[small], reference[small]) > ACCUMULATED_FLOOR_DB
    per_tensor = ScaledTensor.from_tensor(grads[0], E4M3)
    for g in grads[1:]:
        per_tensor = ScaledTensor.from_tensor(per_tensor.dequantize() + ScaledTensor.from_tensor(g, E4M3).dequantize(),
                                              E4M3)
    assert sqnr_db(per_tensor.dequantize()[small], reference[small]) < ACCUMULATED_FLOOR_DB - 6


def test_the_optimizer_steps_block_gradients_as_their_real_values():
    """fp8amp's AdamW reads a block gradient with its block scales: bit for bit the step on its
    float32 real values. Against the step on the float32 sum
    of the micro-batches' gradients, it and the per-tensor E4M3 gradient's step stay within Adam's
    2 lr; the blocks part from it in fewer weights (the per-tensor gradient flushes small ones)."""
    lr = 1e-3
    masters = {}
    for how in ("blocks", "real values", "per tensor", "float32"):
        model = blockwise_o2_linear()
        if how == "blocks":
            block_grad = accumulated(model)
        elif how == "real values":
            model[0].weight.grad = block_grad.dequantize(torch.float32)
        elif how == "per tensor":
            model[0].weight.grad = ScaledTensor.from_tensor(sum(per_micro_batch_grads()), E4M3)
        else:
            model[0].weight.grad = sum(per_micro_batch_grads())
        model[0].bias.grad = torch.ones(384)
        optimizer = fp8amp.optim.AdamW(model.parameters(), lr=lr, state_dtypes="O2")
        optimizer.step()
        masters[how] = model[0].weight
    assert torch.equal(masters["blocks"].codes, masters["real values"].codes)
    assert torch.equal(masters["blocks"].scale_inv, masters["real values"].scale_inv)
    moved = (masters["blocks"].dequantize() - blockwise_o2_linear()[0].weight.dequantize()).abs()
    assert moved.max() > lr / 2  # it stepped
    exact = masters["float32"].dequantize()
    parted = {}
    for how in ("blocks", "per tensor"):
        diff = (masters[how].dequantize() - exact).abs()
        # Adam's first step moves a weight by ~lr whatever its gradient (more for none, plus the
        # FP16 master's rounding, < 1e-4 here): two runs part by at most 2 lr.
        assert diff.max() <= 2 * lr + 1e-4, how
        parted[how] = (diff > 1e-4).float().mean().item()
    assert parted["blocks"] < 0.03 and parted["per tensor"] > 0.1, parted  # measured 1.5 % and 14.5 %


def test_block_gradients_clip_and_unscale_in_place():
    """clip_grad_norm_ reads the real values and scales the gradient in place (its block scales,
    the codes kept); GradScaler-style unscaling too, and a non-finite value poisons its block only."""
    model = blockwise_o2_linear()
    grad = accumulated(model)
    before, codes = grad.dequantize(torch.float32), grad.codes.clone()
    norm = torch.nn.utils.clip_grad_norm_([model[0].weight], max_norm=1.0, foreach=True)
    torch.testing.assert_close(norm, before.norm(), rtol=1e-5, atol=0)
    coef = (1.0 / (norm + 1e-6)).clamp(max=1.0)
    after = model[0].weight.grad
    assert after is grad and isinstance(after, BlockScaledTensor)
    assert torch.equal(after.codes.view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(after.dequantize(torch.float32), before * coef, rtol=1e-6, atol=0)
    after.mul_(2.0)  # one tensor, a number: the same in-place scaling
    torch.testing.assert_close(after.dequantize(torch.float32), 2 * before * coef, rtol=1e-6, atol=0)
    plain = torch.ones(3)
    torch._foreach_mul_([after, plain], torch.tensor(0.5))  # a mixed list: each scaled its own way
    assert torch.equal(plain, torch.full((3,), 0.5))
    torch.testing.assert_close(after.dequantize(torch.float32), before * coef, rtol=1e-6, atol=0)
    found_inf = torch.zeros(1)
    grad.codes.view(torch.uint8)[0, 0] = 0x7F  # an E4M3 NaN in block (0, 0)
    torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, torch.full((1,), 0.5))
    assert found_inf.item() == 1.0
    assert grad.scale_inv[0, 0].isnan() and grad.scale_inv[1:].isfinite().all() and grad.scale_inv[0, 1:].isfinite().all()


@pytest.mark.parametrize("ord", [2, 1, 3, float("inf"), float("-inf")])
def test_block_gradient_norms_come_from_the_blocks(ord):
    """vector_norm and _foreach_norm (clip_grad_norm_'s) of a block gradient: from its codes and
    block scales, no float32 copy. The 2-norm (multi_norm_tiles: float32 sums of 16 squares, then
    float64) within 2^-21 of the float64 norm of the real values, for any shape; other orders, the
    blocks' code norms times their scales, within the error of float32 sums over a block's 16384
    codes (1e-4 relative: far inside the n * 2^-24 worst case, and deterministic data), and blocks
    that do not tile the tensor read its real values. In a list with plain and per-tensor FP8
    tensors; a NaN block reads NaN."""
    g = torch.Generator().manual_seed(4)
    big = torch.exp2(torch.randint(-8, 8, (2, 3), generator=g).float()).repeat_interleave(128, 0)
    blocks = BlockScaledTensor.from_tensor(torch.randn(256, 384, generator=g) * big.repeat_interleave(128, 1))
    ragged = BlockScaledTensor.from_tensor(torch.randn(200, 128, generator=g))
    plain, scaled = torch.randn(7, generator=g), ScaledTensor.from_tensor(torch.randn(9, 9, generator=g), E4M3)
    def exact(t):
        values = t.dequantize() if isinstance(t, (ScaledTensor, BlockScaledTensor)) else t
        return torch.linalg.vector_norm(values.double(), ord).float()

    torch.testing.assert_close(torch.linalg.vector_norm(blocks, ord), exact(blocks), rtol=1e-4, atol=0)
    norms = torch._foreach_norm([plain, blocks, scaled, ragged], ord)
    for norm, t in zip(norms, [plain, blocks, scaled, ragged]):
        assert norm.shape == () and norm.dtype == torch.float32
        torch.testing.assert_close(norm, exact(t), rtol=1e-4, atol=0)
    if ord == 2:
        for norm, t in zip(norms[1:], [blocks, scaled, ragged]):
            torch.testing.assert_close(norm, exact(t), rtol=2.0**-21, atol=0)
    else:
        assert torch.equal(norms[3], torch.linalg.vector_norm(ragged.dequantize(), ord))  # the real values' norm
    blocks.scale_inv[1, 2] = float("nan")
    assert torch.linalg.vector_norm(blocks, ord).isnan() and torch._foreach_norm([blocks], ord)[0].isnan()
