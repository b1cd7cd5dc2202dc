"""Typed wrappers over the core's tile ops: fine-grained scaling with one scale per tile (docs/tiles.md).

``x`` is viewed as ``[rows, cols]`` (its last dim is cols) and cut into ``tile = (tile_rows,
tile_cols)`` tiles, the last ones in each direction possibly partial: ``(1, cols)`` is rowwise
scaling, ``(1, 128)`` DeepSeek-V3's activation tiles, ``(128, 128)`` its weight blocks. Each
tile's scale comes from its own amax (current scaling); ``scale_inv`` is float32
``[ceil(rows / tile_rows), ceil(cols / tile_cols)]``. :func:`cast_transpose_tiles` writes ``x`` and
its transpose, each by its own tiles, in one pass; :func:`scaled_accumulate_tiles` adds an update
into a tiled FP8 accumulator; :func:`multi_norm_tiles` takes the 2-norms of tile-scaled tensors
from their codes.
"""

from __future__ import annotations

import torch

from ..formats import E4M3, E5M2, HIGH_PRECISION_DTYPES
from . import fast
from ._args import _bool, _dtype, _input, _inputs, _int

__all__ = ["quantize_tiles", "dequantize_tiles", "cast_transpose_tiles", "scaled_accumulate_tiles", "multi_norm_tiles"]

_FP8_FORMATS = (E4M3, E5M2)
# multi_norm_tiles' tile for tile=None: larger than any matrix, so one tile (one scale) covers each.
_WHOLE_TENSOR = (1 << 62, 1 << 62)


def _tile(tile: object, op: str, arg: str = "tile") -> tuple[int, int]:
    if not isinstance(tile, (tuple, list)) or len(tile) != 2:
        raise TypeError(f"fp8amp.ops.{op}: {arg} must be a pair (tile_rows, tile_cols) of positive ints, e.g. (1, 128) "
                        f"or (128, 128); got {tile!r}")
    return _int(tile[0], f"{arg}[0]", op), _int(tile[1], f"{arg}[1]", op)


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype = E4M3, tile: tuple[int, int] = (1, 128), *,
                   margin: int = 0, pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(codes, scale_inv)``: ``x`` (float32, bfloat16 or float16) in ``dtype`` (E4M3 or
    E5M2) with one current scale per tile, from the tile's amax by the rule of
    :class:`~fp8amp.ScalingRecipe` (``margin``, ``pow2_scale``). A tile of zeros gets scale 1; a
    tile holding an inf or NaN gets a NaN ``scale_inv`` (it reads NaN; no other tile changes)."""
    op = "quantize_tiles"
    tile_rows, tile_cols = _tile(tile, op)
    return fast.quantize_tiles(_input(x, "x", op), _dtype(dtype, _FP8_FORMATS, "dtype", op), tile_rows, tile_cols,
                               _int(margin, "margin", op), _bool(pow2_scale, "pow2_scale", op))


def dequantize_tiles(x: torch.Tensor, scale_inv: torch.Tensor, tile: tuple[int, int] = (1, 128),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Returns ``x * scale_inv[tile]`` (``x``: E4M3 or E5M2 codes) in ``dtype`` (float32, bfloat16
    or float16), rounded to nearest even: the inverse of :func:`quantize_tiles` up to the
    format's rounding."""
    op = "dequantize_tiles"
    tile_rows, tile_cols = _tile(tile, op)
    return fast.dequantize_tiles(_input(x, "x", op), _input(scale_inv, "scale_inv", op), tile_rows, tile_cols,
                                 _dtype(dtype, HIGH_PRECISION_DTYPES, "dtype", op))


def cast_transpose_tiles(x: torch.Tensor, dtype: torch.dtype = E4M3, tile: tuple[int, int] = (1, 128), *,
                         tile_t: tuple[int, int] | None = None, margin: int = 0,
                         pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(codes, scale_inv, codes_t, scale_inv_t)`` from one pass over ``x`` (float32,
    bfloat16 or float16, viewed as ``[rows, cols]``), bit for bit::

        codes, scale_inv = quantize_tiles(x, dtype, tile)
        codes_t, scale_inv_t = quantize_tiles(x.reshape(rows, cols).t().contiguous(), dtype, tile_t)

    ``codes_t`` is ``[cols, rows]``. ``tile_t`` (the transpose's tiles) defaults to ``tile``, so
    each copy's tiles run along its own rows, the contraction dim of the GEMM that reads it.
    Rowwise scaling is ``tile=(1, cols), tile_t=(1, rows)`` (per-column scales for the transpose).
    On CUDA, (1, 128) and (128, 128) tiles (with ``tile_t == tile``) take the fused one-pass
    kernel, other one-row tiles (rowwise) a row pass and a column pass; any other tiles are
    correct but slower (docs/tiles.md)."""
    op = "cast_transpose_tiles"
    tile_rows, tile_cols = _tile(tile, op)
    tile_rows_t, tile_cols_t = (tile_rows, tile_cols) if tile_t is None else _tile(tile_t, op, "tile_t")
    return fast.cast_transpose_tiles(_input(x, "x", op), _dtype(dtype, _FP8_FORMATS, "dtype", op), tile_rows, tile_cols,
                                     tile_rows_t, tile_cols_t, _int(margin, "margin", op),
                                     _bool(pow2_scale, "pow2_scale", op))


def scaled_accumulate_tiles(acc: torch.Tensor, acc_scale_inv: torch.Tensor, update: torch.Tensor,
                            tile: tuple[int, int], *, margin: int = 0,
                            pow2_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(codes, scale_inv)``: ``acc`` (E4M3 or E5M2 codes with ``acc_scale_inv`` by
    ``tile``) plus ``update`` (float32, bfloat16 or float16, ``acc``'s shape), requantized into
    ``acc``'s format with a fresh current scale per tile, in one op; bit for bit::

        quantize_tiles(dequantize_tiles(acc, acc_scale_inv, tile) + update.float(), acc.dtype, tile)

    (each product and the sum rounded once in float32). The blockwise weight-gradient
    accumulation. A tile whose ``acc_scale_inv`` is NaN, or whose sums hold an inf or NaN, reads
    NaN again; no other tile changes. ``acc`` and ``acc_scale_inv`` are not modified."""
    op = "scaled_accumulate_tiles"
    tile_rows, tile_cols = _tile(tile, op)
    return fast.scaled_accumulate_tiles(_input(acc, "acc", op), _input(acc_scale_inv, "acc_scale_inv", op),
                                        _input(update, "update", op), tile_rows, tile_cols,
                                        _int(margin, "margin", op), _bool(pow2_scale, "pow2_scale", op))


def multi_norm_tiles(xs, scale_invs, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """Returns float32 ``[len(xs)]``: the 2-norm of each tensor's real values, ``decode(xs[i]) *
    scale_invs[i][tile]``, from the codes (E4M3, E5M2 or float16, one dtype for the list; each
    viewed as ``[rows, cols]``) read once, with no dequantized copy. ``scale_invs[i]`` is float32
    with one element per tile, in row-major order (``[ceil(rows / tile_rows), ceil(cols /
    tile_cols)]`` as :func:`quantize_tiles` gives it, or any shape of that many elements);
    ``tile=None``: one scale_inv (of one element) for the whole of each tensor, as a
    :class:`~fp8amp.ScaledTensor` has. The squares of each 16 bytes of a row's codes are summed in
    float32, then scaled and summed in float64: within about an ulp of the float64 norm of the
    real values, rounded to float32, and an overflow only where the norm exceeds float32's range.
    A NaN or inf in a tensor, or a non-finite scale_inv it uses, makes that tensor's norm NaN or
    inf and no other. ``clip_grad_norm_`` of FP8 gradients calls this."""
    op = "multi_norm_tiles"
    xs = _inputs(xs, "xs", op)
    if not xs:  # (the dispatcher could not even tell the device)
        raise ValueError(f"fp8amp.ops.{op}: xs must hold at least one tensor")
    scale_invs = _inputs(scale_invs, "scale_invs", op)
    tile_rows, tile_cols = _WHOLE_TENSOR if tile is None else _tile(tile, op)
    return fast.multi_norm_tiles(xs, scale_invs, tile_rows, tile_cols)
