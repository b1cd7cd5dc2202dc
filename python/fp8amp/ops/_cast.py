"""Typed wrappers over the core's cast ops: quantize, cast + transpose, dequantize, amax (docs/numerics.md#numerics).

``scale`` multiplies high precision into a scaled format (stored = real * scale) and
``scale_inv`` brings it back (real = stored * scale_inv); both are float32 device tensors, one
element per tensor. Amax buffers are float32 ``[n]`` or ``[n, H]`` (an amax history): tensor i
max-accumulates its amax into ``amax[i, 0]``, NaN included.

The wrappers check Python types (TypeError) and dtype arguments (ValueError), make read-only
inputs contiguous, and leave every other check to the core, which raises ValueError naming the
argument. Buffers an op writes (``amax``, ``scale``, ``scale_inv``, ``counter``, the ``outs`` of
:func:`multi_dequantize`) are passed as they are: a contiguous copy would not receive the write.
No wrapper reads device values on the host, so all of them trace under
``torch.compile(fullgraph=True)`` and never sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..formats import HIGH_PRECISION_DTYPES, SCALED_FORMATS
from . import fast
from ._args import _bool, _dtype, _input, _inputs, _int, _optional_input, _outputs, _reduction_input, _tensor

__all__ = [
    "quantize",
    "quantize_current",
    "cast_transpose",
    "cast_transpose_dbias",
    "cast_transpose_rescaled",
    "dequantize",
    "amax",
    "multi_amax",
    "multi_quantize",
    "multi_dequantize",
]

_SCALED_FORMATS = tuple(SCALED_FORMATS)


def _scaling_args(
    op: str,
    scale: object,
    amax_buffer: object,
    dtype: object,
    warmup_counter: object,
    warmup_steps: object,
    margin: object,
    pow2_scale: object,
) -> tuple:
    """The arguments shared by the quantizing ops, checked, in schema order after x."""
    return (
        _input(scale, "scale", op),
        _tensor(amax_buffer, "amax", op),
        _dtype(dtype, _SCALED_FORMATS, "dtype", op),
        _optional_input(warmup_counter, "warmup_counter", op),
        _int(warmup_steps, "warmup_steps", op),
        _int(margin, "margin", op),
        _bool(pow2_scale, "pow2_scale", op),
    )


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    *,
    warmup_counter: torch.Tensor | None = None,
    warmup_steps: int = 0,
    margin: int = 0,
    pow2_scale: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` (float32/bfloat16/float16) into ``dtype`` (E4M3, E5M2 or FP16).

    Returns ``(out, scale_inv)``: ``out = saturate(round(x * s))`` of ``x``'s shape and
    ``scale_inv = [1 / s]``, where ``s`` is the scale actually used. ``amax`` (float32 ``[1]`` or
    ``[1, H]``) receives ``max(amax[0, 0], max|x|)`` in the same pass.

    ``s`` is ``scale[0]`` (delayed scaling) unless ``warmup_counter[0] < warmup_steps``: then it
    comes from ``amax[0, 0]`` after this fold, by the rule of ``margin`` and ``pow2_scale``
    (current scaling), or stays ``scale[0]`` if that amax is 0 or not finite.
    """
    op = "quantize"
    return fast.quantize(
        _input(x, "x", op),
        *_scaling_args(op, scale, amax, dtype, warmup_counter, warmup_steps, margin, pow2_scale),
    )


def quantize_current(
    x: torch.Tensor, dtype: torch.dtype, *, margin: int = 0, nan_if_nonfinite: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` (float32/bfloat16/float16) into ``dtype`` with current scaling, in one call.

    Returns ``(out, scale_inv, amax)``: ``amax`` float32 ``[1]`` is ``max|x|`` (NaN if x holds
    one); the scale is ``2^(floor(log2(fmax / amax)) - margin)``, or 1 for an amax of 0, inf or NaN;
    ``scale_inv`` float32 ``[1]`` is its inverse, or NaN with ``nan_if_nonfinite`` and an inf or
    NaN amax. The same bits as :func:`amax` into a zero, :func:`compute_scale` from (1, 1) and
    :func:`quantize` with that scale, in fewer launches and without mutable buffers (nothing for
    ``torch.compile`` to clone).
    """
    op = "quantize_current"
    return fast.quantize_current(
        _input(x, "x", op),
        _dtype(dtype, _SCALED_FORMATS, "dtype", op),
        _int(margin, "margin", op),
        _bool(nan_if_nonfinite, "nan_if_nonfinite", op),
    )


def cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    *,
    warmup_counter: torch.Tensor | None = None,
    warmup_steps: int = 0,
    margin: int = 0,
    pow2_scale: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` like :func:`quantize` and also writes its transpose, in one pass.

    ``x`` of shape ``[..., N]`` is viewed as a matrix ``[M, N]``. Returns ``(out, out_t,
    scale_inv)``: ``out`` has ``x``'s shape, ``out_t`` is ``[N, M]`` (the K-major operand FP8
    GEMMs need) and holds the same codes.
    """
    op = "cast_transpose"
    return fast.cast_transpose(
        _input(x, "x", op),
        *_scaling_args(op, scale, amax, dtype, warmup_counter, warmup_steps, margin, pow2_scale),
    )


def cast_transpose_dbias(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    *,
    warmup_counter: torch.Tensor | None = None,
    warmup_steps: int = 0,
    margin: int = 0,
    pow2_scale: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cast_transpose`, and in the same pass the column sums of ``x`` viewed as ``[M, N]``
    (a Linear's bias gradient, when ``x`` is its output gradient).

    Returns ``(out, out_t, scale_inv, dbias)``, ``dbias`` float32 ``[N]``: the sums over rows in
    float32, added in a fixed order that the CPU and CUDA kernels share (bit-identical results;
    the order is in ``src/cast/cast_kernels.h``), so they may differ from ``x.sum(0)`` by float32
    rounding.
    """
    op = "cast_transpose_dbias"
    return fast.cast_transpose_dbias(
        _input(x, "x", op),
        *_scaling_args(op, scale, amax, dtype, warmup_counter, warmup_steps, margin, pow2_scale),
    )


def cast_transpose_rescaled(
    x: torch.Tensor, scale_inv: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The transpose of a scaled FP16 tensor, quantized into ``dtype`` (E4M3, E5M2 or FP16) with a
    new scale, in one pass that writes nothing else.

    ``x`` (float16 codes of shape ``[..., N]``, viewed as ``[M, N]``) holds the real values ``x *
    scale_inv``; returns ``out_t`` ``[N, M]`` = ``saturate(round(x * (scale_inv * scale)))``, the
    product of the two float32 ``[1]`` scales rounded to float32 once, as ``scale_inv * scale`` in
    torch. With power-of-two scales this is the transpose of quantizing the real values with
    ``scale`` (a :class:`~fp8amp.MasterWeight`'s E4M3 copy). Unlike :func:`cast_transpose` there is
    no amax to fold, no codes in ``x``'s layout and no ``scale_inv`` returned.
    """
    op = "cast_transpose_rescaled"
    return fast.cast_transpose_rescaled(
        _input(x, "x", op),
        _input(scale_inv, "scale_inv", op),
        _input(scale, "scale", op),
        _dtype(dtype, _SCALED_FORMATS, "dtype", op),
    )


def dequantize(x: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Returns ``x * scale_inv`` (x in E4M3, E5M2 or FP16; scale_inv float32 ``[1]``) in ``dtype``
    (float32, bfloat16 or float16), rounded to nearest even."""
    op = "dequantize"
    return fast.dequantize(
        _input(x, "x", op),
        _input(scale_inv, "scale_inv", op),
        _dtype(dtype, HIGH_PRECISION_DTYPES, "dtype", op),
    )


def amax(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    warmup_counter: torch.Tensor | None = None,
    warmup_steps: int = 0,
) -> None:
    """Max-accumulates ``max|x|`` into ``amax[0]`` in place (NaN propagates).

    With ``warmup_counter`` (int32 ``[1]``), does nothing unless ``warmup_counter[0] <
    warmup_steps``: the amax pass current scaling needs before a quantize. A non-contiguous x is
    read in place where its elements are runs of equal length at one stride (a permutation of a
    contiguous tensor, a slice of a matrix's columns), else from a contiguous copy.
    """
    op = "amax"
    fast.amax(
        _reduction_input(x, "x", op),
        _tensor(amax, "amax", op),
        _optional_input(warmup_counter, "warmup_counter", op),
        _int(warmup_steps, "warmup_steps", op),
    )


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as a new float32 ``[1]`` (NaN if x holds one; 0 for an empty x): :func:`amax`
    into a fresh zero, as one functional op, which a compiled graph orders before its readers."""
    op = "amax_of"
    return fast.amax_of(_reduction_input(x, "x", op))


def multi_amax(xs: Sequence[torch.Tensor], amax: torch.Tensor) -> None:
    """:func:`amax` of many tensors of one dtype in one launch: ``xs[i]`` folds into ``amax[i, 0]``
    (``amax`` float32 ``[n]`` or ``[n, H]``). ``xs`` may also be FP8 codes (E4M3, E5M2): the amax of
    the codes' own values, NaN for a NaN code; times a power-of-two ``scale_inv`` it is the amax of
    the dequantized tensor, read at one byte an element."""
    op = "multi_amax"
    fast.multi_amax(_inputs(xs, "xs", op), _tensor(amax, "amax", op))


def multi_quantize(
    xs: Sequence[torch.Tensor],
    scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    *,
    warmup_counter: torch.Tensor | None = None,
    warmup_steps: int = 0,
    margin: int = 0,
    pow2_scale: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`quantize` of many tensors of one dtype in one launch; ``xs[i]`` uses row i of
    ``scale`` ``[n]``, ``amax`` ``[n]`` or ``[n, H]`` and ``warmup_counter`` ``[n]``.

    Returns ``(outs, scale_inv)`` with ``scale_inv`` float32 ``[n]``.
    """
    op = "multi_quantize"
    inputs = _inputs(xs, "xs", op)
    scale, amax, dtype, *rest = _scaling_args(op, scale, amax, dtype, warmup_counter, warmup_steps, margin, pow2_scale)
    outs = [torch.empty_like(x, dtype=dtype) for x in inputs]
    scale_inv = fast.multi_quantize(inputs, outs, scale, amax, *rest)
    return outs, scale_inv


def multi_dequantize(
    xs: Sequence[torch.Tensor],
    scale_inv: torch.Tensor,
    dtype: torch.dtype,
    *,
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """:func:`dequantize` of many tensors of one dtype in one launch; ``xs[i]`` uses
    ``scale_inv[i]`` (float32 ``[n]``). Returns the outputs, one per tensor.

    ``outs`` (optional): tensors to write into in place instead of new ones, as many as ``xs``,
    ``outs[i]`` contiguous, of ``dtype`` and of ``xs[i]``'s shape and device; they may be views
    into one larger buffer (no concatenation afterwards). Returned as a list.
    """
    op = "multi_dequantize"
    inputs = _inputs(xs, "xs", op)
    dtype = _dtype(dtype, HIGH_PRECISION_DTYPES, "dtype", op)
    outs = [torch.empty_like(x, dtype=dtype) for x in inputs] if outs is None else _outputs(outs, dtype, "outs", op)
    fast.multi_dequantize(inputs, _input(scale_inv, "scale_inv", op), outs)
    return outs
