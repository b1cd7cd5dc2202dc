"""Typed wrappers over the core's tile ops: fine-grained scaling with one scale per tile (docs/tiles.md).

``x`` is viewed as ``[rows, cols]`` (its last dim is cols) and cut into ``tile = (tile_rows,
tile_cols)`` tiles, the last ones in each direction possibly partial: ``(1, cols)`` is rowwise
scaling, ``(1, 128)`` DeepSeek-V3's activation tiles, ``(128, 128)`` its weight blocks. Each
tile's scale comes from its own amax (current scaling); ``scale_inv`` is float32
``[ceil(rows / tile_rows), ceil(cols / tile_cols)]``.
"""

from __future__ import annotations

import torch

from ..formats import E4M3, E5M2, HIGH_PRECISION_DTYPES
from . import fast
from ._args import _bool, _dtype, _input, _int

__all__ = ["quantize_tiles", "dequantize_tiles"]

_FP8_FORMATS = (E4M3, E5M2)


def _tile(tile: object, op: str) -> tuple[int, int]:
    if not isinstance(tile, (tuple, list)) or len(tile) != 2:
        raise TypeError(f"fp8amp.ops.{op}: tile must be a pair (tile_rows, tile_cols) of positive ints, e.g. (1, 128) "
                        f"or (128, 128); got {tile!r}")
    return _int(tile[0], "tile[0]", op), _int(tile[1], "tile[1]", op)


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
