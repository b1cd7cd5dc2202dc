"""The FP8 GEMM with tile scales (cuBLASLt's scale modes on Hopper, a reference on CPU): the typed
wrapper over ``torch.ops.fp8amp.gemm_tiles`` (docs/tiles.md, "The GEMM with tile scales").

``gemm_tiles(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile)`` computes ``a @ b.T`` of the
dequantized operands, ``a`` ``[M, K]`` and ``b`` ``[N, K]`` both K-major, each with the scales
:func:`fp8amp.ops.quantize_tiles` returns for its tiling. See ``include/fp8amp/gemm.h`` for the
exact rules and numerics.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ._args import _dtype, _input, _int, _optional_input
from ._library import lib

__all__ = ["gemm_tiles"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# cuBLASLt's FP8 bias type per output dtype, and float32 for a float32 output (added after the GEMM).
_BIAS_DTYPES = {torch.float32: (torch.float32, torch.bfloat16), torch.bfloat16: (torch.bfloat16,),
                torch.float16: (torch.float16,)}
_TILES = "(1, 128), (128, 128) or rowwise (1, K)"

_gemm_tiles = lib.gemm_tiles.default


def _tile(tile: object, arg: str, op: str) -> tuple[int, int]:
    if not isinstance(tile, (tuple, list)) or len(tile) != 2:
        raise TypeError(f"fp8amp.ops.{op}: {arg} must be a pair (tile_rows, tile_cols) of ints, {_TILES}; "
                        f"got {tile!r}")
    return _int(tile[0], f"{arg}[0]", op), _int(tile[1], f"{arg}[1]", op)


def gemm_tiles(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_tile: tuple[int, int],
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_tile: tuple[int, int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns ``[M, N]`` ``out_dtype``: ``dequant(a) @ dequant(b).T (+ bias)``.

    ``a`` ``[M, K]`` and ``b`` ``[N, K]`` are float8 codes (E4M3×E4M3, E4M3×E5M2 or E5M2×E4M3);
    ``a_scale_inv`` and ``b_scale_inv`` are float32 in the layout of
    :func:`fp8amp.ops.quantize_tiles` for ``a_tile`` and ``b_tile``: ``(1, 128)`` tiles,
    ``(128, 128)`` blocks or rowwise ``(1, K)``, paired as ``(1, 128) × (128, 128)``,
    ``(1, 128) × (1, 128)``, ``(128, 128) × (1, 128)`` or rowwise × rowwise. ``bias`` is ``[N]``:
    of ``out_dtype``, or bfloat16 for a float32 output. K and N must be multiples of 16. On CUDA
    it needs a Hopper GPU (cuBLASLt offers these scale modes there only).
    """
    op = "gemm_tiles"
    a_tile_rows, a_tile_cols = _tile(a_tile, "a_tile", op)
    b_tile_rows, b_tile_cols = _tile(b_tile, "b_tile", op)
    out_dtype = _dtype(out_dtype, _OUT_DTYPES, "out_dtype", op)
    bias, added_bias = split_bias(_optional_input(bias, "bias", op), out_dtype, b, op)
    out = _gemm_tiles(_input(a, "a", op), _input(a_scale_inv, "a_scale_inv", op), a_tile_rows, a_tile_cols,
                      _input(b, "b", op), _input(b_scale_inv, "b_scale_inv", op), b_tile_rows, b_tile_cols,
                      out_dtype, bias)
    return add_bias(out, added_bias, op)


def split_bias(bias: torch.Tensor | None, out_dtype: torch.dtype, b: object,
               op: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(the kernel's bias, a float32 bias to add after)`` of a block-scaled GEMM (gemm_tiles,
    gemm_mx): cuBLASLt's FP8 epilogue takes ``out_dtype``'s 16-bit bias (bfloat16 for a float32
    output) but no float32 one, which is added to the float32 result instead."""
    if bias is None:
        return None, None
    accepted = _BIAS_DTYPES[out_dtype]
    if bias.dtype not in accepted:
        names = " or ".join(str(d) for d in accepted)
        raise ValueError(f"fp8amp.ops.{op}: bias must be {names} for out_dtype {out_dtype}, got {bias.dtype}")
    if bias.dtype != torch.float32:
        return bias, None
    n = b.shape[0] if isinstance(b, torch.Tensor) and b.dim() == 2 else None
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"fp8amp.ops.{op}: bias must be [N] = [{n}] (the rows of b), got {list(bias.shape)}")
    return None, bias


def add_bias(out: torch.Tensor, added_bias: torch.Tensor | None, op: str) -> torch.Tensor:
    """``out`` plus the float32 bias :func:`split_bias` kept for after the GEMM: in place, but out
    of place while traced (torch 2.11's Dynamo gives zero gradients to an autograd.Function whose
    output is an in-place op's result, as a Linear's forward returning this would be) and under a
    TorchDispatchMode (selective activation checkpointing's caches the GEMM's output, which it
    refuses to hand back once written)."""
    if added_bias is None:
        return out
    if added_bias.device != out.device:
        raise ValueError(f"fp8amp.ops.{op}: bias must be on the device of a ({out.device}), got "
                         f"{added_bias.device}")
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return out + added_bias
    return out.add_(added_bias)
