"""Typed wrappers over the core's MXFP8 ops (OCP Microscaling; docs/tiles.md#mxfp8).

``x`` is viewed as ``[rows, cols]`` (its last dim is cols) and cut into blocks of 1 x 32
consecutive elements of a row, the last one of a row possibly partial. Each block has one E8M0
scale, stored as a ``torch.uint8`` exponent code: ``X = 2^(code - 127)``, ``0xFF`` is NaN.
``scales`` is uint8 ``[rows, ceil(cols / 32)]``. :func:`gemm_mx` multiplies two such operands
(cuBLASLt's ``VEC32_UE8M0`` mode on Blackwell, a reference on CPU).
"""

from __future__ import annotations

import torch

from ..formats import E4M3, E5M2, HIGH_PRECISION_DTYPES
from ._args import _dtype, _input, _optional_input
from ._gemm_tiles import add_bias, split_bias
from ._library import lib

__all__ = ["MX_BLOCK", "quantize_mx", "dequantize_mx", "cast_transpose_mx", "gemm_mx", "e8m0_to_float"]

#: The elements of an MX block.
MX_BLOCK = 32

_FP8_FORMATS = (E4M3, E5M2)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_quantize_mx = lib.quantize_mx.default
_cast_transpose_mx = lib.cast_transpose_mx.default
_dequantize_mx = lib.dequantize_mx.default
_gemm_mx = lib.gemm_mx.default


def quantize_mx(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(codes, scales)``: ``x`` (float32, bfloat16 or float16) in ``dtype`` (E4M3 or
    E5M2), one E8M0 scale per 1 x 32 block. A block's scale is the smallest ``X = 2^e`` (``e >= -127``)
    with ``amax / X <= fmax`` (448 for E4M3, 57344 for E5M2), so that no element saturates
    (docs/tiles.md#mxfp8: OCP MX's exponent, or one more), its elements ``v / X`` rounded to nearest. A
    block of zeros gets ``X = 1`` (code 127); a block holding an inf or NaN gets code 0xFF (it reads
    NaN; no other block changes)."""
    op = "quantize_mx"
    return _quantize_mx(_input(x, "x", op), _dtype(dtype, _FP8_FORMATS, "dtype", op))


def cast_transpose_mx(x: torch.Tensor,
                      dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(codes, scales, codes_t, scales_t)``, bit for bit::

        codes, scales = quantize_mx(x, dtype)
        codes_t, scales_t = quantize_mx(x.reshape(rows, cols).t().contiguous(), dtype)

    ``codes_t`` is ``[cols, rows]`` and ``scales_t`` ``[cols, ceil(rows / 32)]``: blocks of 32 rows
    of ``x`` per column, the operand of a weight-gradient GEMM that contracts over x's rows."""
    op = "cast_transpose_mx"
    return _cast_transpose_mx(_input(x, "x", op), _dtype(dtype, _FP8_FORMATS, "dtype", op))


def dequantize_mx(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Returns ``decode(x) * 2^(scales[block] - 127)`` in ``dtype`` (float32, bfloat16 or
    float16), rounded once to nearest even; NaN for a block whose code is 0xFF."""
    op = "dequantize_mx"
    return _dequantize_mx(_input(x, "x", op), _input(scales, "scales", op),
                          _dtype(dtype, HIGH_PRECISION_DTYPES, "dtype", op))


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``2^(code - 127)`` of uint8 E8M0 codes (NaN for 0xFF): what a code means as a
    ``scale_inv`` (for reports and tests; the ops read the codes)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        raise TypeError(f"fp8amp.ops.e8m0_to_float: scales must be a torch.uint8 tensor, got "
                        f"{getattr(scales, 'dtype', type(scales).__name__)}")
    value = torch.exp2(scales.to(torch.float32) - 127.0)
    return torch.where(scales == 0xFF, torch.full_like(value, float("nan")), value)


def gemm_mx(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, *,
            out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Returns ``[M, N]`` ``out_dtype``: ``dequant(a) @ dequant(b).T (+ bias)``.

    ``a`` ``[M, K]`` and ``b`` ``[N, K]`` are float8 codes (E4M3×E4M3, E4M3×E5M2 or E5M2×E4M3),
    both K-major, with the uint8 E8M0 ``scales`` :func:`quantize_mx` returns (``[rows, K / 32]``).
    K must be a multiple of 32 and N of 16. ``bias`` is ``[N]`` of ``out_dtype``, or bfloat16 for
    a float32 output (a float32 bias is added to the float32 result). On CUDA it needs a Blackwell GPU (compute capability 10.0+): elsewhere it
    raises NotImplementedError. On the CPU it is the reference (exact 32-element block sums)."""
    op = "gemm_mx"
    out_dtype = _dtype(out_dtype, _OUT_DTYPES, "out_dtype", op)
    bias, added_bias = split_bias(_optional_input(bias, "bias", op), out_dtype, b, op)
    out = _gemm_mx(_input(a, "a", op), _input(a_scales, "a_scales", op), _input(b, "b", op),
                   _input(b_scales, "b_scales", op), out_dtype, bias)
    return add_bias(out, added_bias, op)
