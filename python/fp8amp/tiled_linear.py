"""Fp8Linear's GEMMs under the tiled recipes, rowwise, blockwise and mxfp8 (docs/tiles.md#recipes).

Every operand gets current scales, one per tile, from the tile's own amax; each cast writes the
operand and its transpose in one pass (:func:`fp8amp.ops.cast_transpose_tiles`), because each of
the three GEMMs (:func:`fp8amp.ops.gemm_tiles`, ``a @ b.T`` of K-major operands) wants its
operands' tiles along its own contraction dimension:

============  ==========================  ===========================  ============================
GEMM          a                           b                            blockwise tiles (a, b)
============  ==========================  ===========================  ============================
forward       x [M, K]                    W [N, K]                     (1, 128), (128, 128)
dgrad         dY [M, N]                   Wᵀ [K, N]                    (1, 128), (128, 128)
wgrad         dYᵀ [N, M]                  xᵀ [K, M]                    (1, 128), (1, 128)
============  ==========================  ===========================  ============================

Rowwise has one tile per row of every operand, ``(1, K)`` of the GEMM's contraction K: Wᵀ's rows
are W's columns, so the weight is scaled again along its other dimension. A 128 x 128 block of Wᵀ
holds the values of one block of W, so blockwise's Wᵀ is W's codes transposed, with the block
scales transposed.

mxfp8 (docs/tiles.md#mxfp8) cuts every operand into 1 x 32 blocks along its own rows, with uint8
E8M0 scales: the same three GEMMs through :func:`fp8amp.ops.cast_transpose_mx` and
:func:`fp8amp.ops.gemm_mx`, its branches below marked ``# mxfp8``.

At O1/O2 the weight is an FP16 master (:class:`~fp8amp.MasterWeight`, with no E4M3 copy: a
per-tensor copy would not serve) and the forward quantizes its codes with tile scales: with the
master's power-of-two scale the codes give the same E4M3 values as its real values, and the
tile scales come out multiplied by the master's. The O1/O2 weight gradient is E4M3: a
BlockScaledTensor with 128 x 128 block scales under blockwise, a per-tensor ScaledTensor under
rowwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import cast_recorder, ops
from .formats import E4M3, FP16
from .linear_common import first_order_backward, fp8_weight_grad, output_dtype, pad_rows, unpadded_output
from .master_weight import MasterWeight
from .recipes import BLOCK, MX_BLOCK, Recipe
from .scaled_tensor import ScaledTensor
from .block_scaled_tensor import BLOCK_TILE, BlockScaledTensor

__all__ = ["TiledLinearFunction"]


#: The rowwise recipe's tile length: longer than any row, so that one tile (one scale) covers a
#: whole row. A constant, not the row's length: that is a symbolic size under torch.compile's
#: dynamic shapes, which the ops' int tile arguments would fix (a recompile per token count).
WHOLE_ROW = 1 << 62


def _tile(recipe: Recipe, role: str, cols: int) -> tuple[int, int]:
    """The tile of an operand of ``cols`` columns (its GEMM's contraction) in ``role``."""
    if recipe.kind == "rowwise":
        return 1, WHOLE_ROW
    if recipe.kind == "mxfp8":  # mxfp8
        return 1, MX_BLOCK
    return (BLOCK, BLOCK) if role == "weight" else (1, BLOCK)


def _cast(recipe: Recipe, role: str, t: torch.Tensor, fmt: torch.dtype):
    """``(codes, scale_inv, codes_t, scale_inv_t)`` of ``t`` [rows, cols] and its transpose, each
    cut into tiles along its own rows (mxfp8: E8M0 codes for scale_inv)."""
    if recipe.kind == "mxfp8":  # mxfp8
        return ops.cast_transpose_mx(t, fmt)
    rows, cols = t.shape
    return ops.cast_transpose_tiles(t, fmt, _tile(recipe, role, cols), tile_t=_tile(recipe, role, rows),
                                    margin=recipe.margin, pow2_scale=recipe.pow2_scale)


def _gemm(recipe: Recipe, a: torch.Tensor, a_scale_inv: torch.Tensor, a_role: str, b: torch.Tensor,
          b_scale_inv: torch.Tensor, b_role: str, out_dtype: torch.dtype, bias=None) -> torch.Tensor:
    """``a @ b.T`` of two tiled operands (K-major: their columns are the contraction)."""
    if recipe.kind == "mxfp8":  # mxfp8
        return ops.gemm_mx(a, a_scale_inv, b, b_scale_inv, out_dtype=out_dtype, bias=bias)
    return ops.gemm_tiles(a, a_scale_inv, _tile(recipe, a_role, a.shape[1]), b, b_scale_inv,
                          _tile(recipe, b_role, b.shape[1]), out_dtype=out_dtype, bias=bias)


def _weight_operands(weight: torch.Tensor, recipe: Recipe):
    """W's cast (as :func:`_cast`) from what the weight holds: FSDP2's gathered blocks (a
    BlockScaledTensor, already the blockwise cast), an FP16 master's codes (its scale a power of two,
    so the codes times a tile scale round as the real values do, and the scale joins scale_inv;
    exact), any other ScaledTensor's real values, or the plain tensor. mxfp8 casts the master's
    real values (its E8M0 codes cannot take the master's scale as a product)."""
    if isinstance(weight, BlockScaledTensor):
        if recipe.kind != "blockwise":
            raise ValueError(f"Fp8Linear: the weight holds 128 x 128 blocks (FSDP2's blockwise all-gather) but the "
                             f"layer's recipe is {recipe}")
        return weight.block_operands()
    if isinstance(weight, ScaledTensor):
        if weight.storage_format == FP16 and recipe.kind != "mxfp8":
            codes, scale_inv, codes_t, scale_inv_t = _cast(recipe, "weight", weight.codes, E4M3)
            return codes, scale_inv * weight.scale_inv, codes_t, scale_inv_t * weight.scale_inv
        weight = weight.dequantize(torch.float32)
    return _cast(recipe, "weight", weight, E4M3)


def _per_element(scale_inv: torch.Tensor, tile: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """scale_inv [tiles] spread over the elements (for the numerics report only)."""
    rows, cols = min(tile[0], shape[0]), min(tile[1], shape[1])
    return scale_inv.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def _record(state, role: str, real: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor,
            tile: tuple[int, int]) -> None:
    if scale_inv.dtype == torch.uint8:  # mxfp8's E8M0 codes
        scale_inv = ops.e8m0_to_float(scale_inv)
    cast_recorder.record(state, role, real, codes, _per_element(scale_inv, tile, codes.shape))


def _fp8_weight_grad(recipe: Recipe, grad: torch.Tensor, dtype: torch.dtype):
    """O1/O2's E4M3 weight gradient: in 128 x 128 blocks under blockwise (accumulated over
    micro-batches by scaled_accumulate_tiles), per tensor under rowwise (whose weight tiles are
    no blocks the optimizer or an accumulation could keep)."""
    if recipe.kind == "blockwise":
        return BlockScaledTensor.from_tensor(grad, E4M3, dtype)
    return fp8_weight_grad(grad, dtype)


class TiledLinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` with rowwise, blockwise or mxfp8 tile scales. ``input_state`` and
    ``grad_state`` are the layer's scaling states, which name the layer to the numerics report."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Recipe,
                input_state, grad_state, fp8_grad: bool) -> torch.Tensor:
        out_dtype = output_dtype(x)
        x2d = x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        x_in = pad_rows(x2d, recipe.token_multiple)
        x_fp8, x_si, x_fp8_t, x_si_t = _cast(recipe, "input", x_in, E4M3)
        w_fp8, w_si, w_fp8_t, w_si_t = _weight_operands(weight, recipe)
        # The bias in the output dtype (gemm_tiles adds a float32 one to its float32 result: exact).
        y = _gemm(recipe, x_fp8, x_si, "input", w_fp8, w_si, "weight", out_dtype,
                  None if bias is None else bias.to(out_dtype))
        if cast_recorder.recording():
            _record(input_state, "input", x2d, x_fp8[:rows], x_si, _tile(recipe, "input", x2d.shape[1]))
            w_real = weight.dequantize(torch.float32) if isinstance(weight, (ScaledTensor, BlockScaledTensor)) else weight
            _record(input_state, "weight", w_real, w_fp8, w_si, _tile(recipe, "weight", w_fp8.shape[1]))
        ctx.save_for_backward(x_fp8_t, x_si_t, w_fp8_t, w_si_t)
        ctx.recipe, ctx.grad_state, ctx.rows = recipe, grad_state, rows
        # FP8 weight gradients are for O1/O2's masters only, as in the per-tensor path.
        ctx.fp8_grad = isinstance(weight, MasterWeight) and fp8_grad
        ctx.input_dtype, ctx.output_dtype, ctx.weight_dtype = x.dtype, out_dtype, weight.dtype
        ctx.has_bias = bias is not None
        return unpadded_output(y, x)

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_output: torch.Tensor):
        x_fp8_t, x_si_t, w_fp8_t, w_si_t = ctx.saved_tensors
        recipe, rows = ctx.recipe, ctx.rows
        dy2d = grad_output.reshape(-1, grad_output.shape[-1])
        dy_in = pad_rows(dy2d, recipe.token_multiple)
        dy_fp8, dy_si, dy_fp8_t, dy_si_t = _cast(recipe, "grad_output", dy_in, recipe.grad_format)
        if cast_recorder.recording():
            _record(ctx.grad_state, "grad_output", dy2d, dy_fp8[:rows], dy_si,
                    _tile(recipe, "grad_output", dy2d.shape[1]))
        grad_x = grad_weight = grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy2d.sum(0, dtype=torch.float32).to(ctx.weight_dtype)
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(recipe, dy_fp8, dy_si, "grad_output", w_fp8_t, w_si_t, "weight", ctx.input_dtype)
            grad_x = grad_x[:rows].view(*grad_output.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = _gemm(recipe, dy_fp8_t, dy_si_t, "grad_output", x_fp8_t, x_si_t, "input",
                                ctx.output_dtype if ctx.fp8_grad else ctx.weight_dtype)
            if ctx.fp8_grad:
                real, grad_weight = grad_weight, _fp8_weight_grad(recipe, grad_weight, ctx.weight_dtype)
                if cast_recorder.recording():
                    scale_inv = grad_weight.scale_inv
                    if isinstance(grad_weight, BlockScaledTensor):
                        scale_inv = _per_element(scale_inv, BLOCK_TILE, real.shape)
                    cast_recorder.record(ctx.grad_state, "weight_grad", real, grad_weight.codes, scale_inv)
        return grad_x, grad_weight, grad_bias, None, None, None, None
