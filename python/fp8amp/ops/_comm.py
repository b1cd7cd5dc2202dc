"""The local passes of an FP8 gradient all-reduce or reduce-scatter (``torch.ops.fp8amp.comm_*``;
docs/distributed.md#fp8-communication-kernels).

:func:`comm_quantize` writes a bucket of gradients into one flat FP8 send buffer, each gradient
with its own power-of-two scale from an amax every rank shares; :func:`comm_sum_shards` sums the
N received FP8 copies of a shard in float32 and writes the result in high precision or requantized.
Like the other wrappers they check Python types (TypeError), make read-only inputs contiguous and
leave value checks to the core (ValueError naming the argument). Neither reads a device value on
the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import fast
from ._args import _float, _input, _inputs, _tensor

__all__ = ["comm_quantize", "comm_sum_shards"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def comm_quantize(xs: Sequence[torch.Tensor], amax: torch.Tensor, fmax: float, out: torch.Tensor) -> torch.Tensor:
    """Quantizes ``xs`` (one high-precision dtype) into ``out`` in place; returns ``scale_inv``.

    ``out`` (E4M3 or E5M2, contiguous) receives tensor i's codes at offset
    ``numel(xs[0]) + ... + numel(xs[i-1])`` and zeros after the last one. ``amax`` (float32
    ``[len(xs)]``) is the MAX over the ranks of each tensor's amax; tensor i is quantized with
    ``scale = 2^floor(log2(fmax / amax[i]))`` (1 for an amax of 0 or a non-finite one), saturating,
    and ``scale_inv[i] = 1 / scale`` (float32 ``[len(xs)]``), except that a non-finite amax
    anywhere makes every ``scale_inv`` NaN, so that whatever is decoded with them reads NaN.
    ``fmax`` below the format's max leaves headroom for FP8 partial sums.
    """
    op = "comm_quantize"
    return fast.comm_quantize(_inputs(xs, "xs", op), _input(amax, "amax", op), _float(fmax, "fmax", op),
                              _tensor(out, "out", op))


def comm_sum_shards(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    bounds: Sequence[int],
    out: torch.Tensor,
    *,
    divisor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``out <- (codes[0] * s_0 + ... + codes[N-1] * s_{N-1}) / divisor`` per column, in place.

    ``codes``: E4M3 or E5M2 ``[N, L]``, row j = rank j's copy of the shard. ``bounds``: ``P + 1``
    non-decreasing column offsets; piece p = columns ``[bounds[p], bounds[p+1])``, decoded with
    ``scale_inv[p]`` (float32 ``[P]``, shared by the rows) or ``scale_inv[j * P + p]`` (``[N * P]``).
    The sum runs in float32, in rank order, each operation rounded once. ``out`` (contiguous,
    ``bounds[-1] - bounds[0]`` elements, column c at ``out[c - bounds[0]]``):

    - float32, bfloat16 or float16: the result rounded to it; returns None;
    - E4M3 or E5M2: each piece requantized with a new power-of-two scale from its own amax (1 for an
      amax of 0; NaN for a non-finite one, the piece then reads NaN); returns
      ``(out_scale_inv, out_amax)``, float32 ``[P]`` each.
    """
    op = "comm_sum_shards"
    codes = _input(codes, "codes", op)
    scale_inv = _input(scale_inv, "scale_inv", op)
    if not isinstance(bounds, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise TypeError(f"fp8amp.ops.{op}: bounds must be a list or tuple of ints, got {bounds!r}")
    out = _tensor(out, "out", op)
    divisor = _float(divisor, "divisor", op)
    if out.dtype in _FP8:
        return fast.comm_sum_requantize(codes, scale_inv, list(bounds), divisor, out)
    fast.comm_sum_shards(codes, scale_inv, list(bounds), divisor, out)
    return None
