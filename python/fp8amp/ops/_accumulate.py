"""Fused dequantize-add-requantize of a scaled tensor (``torch.ops.fp8amp.scaled_accumulate``).

It accumulates FP8 weight gradients across micro-batches (docs/architecture.md#fp8linear-dataflow) without a high-precision
copy: the scaled accumulator ``dst`` receives ``alpha * src`` and is re-quantized with a new
current scale in one op. Like the cast wrappers, it checks Python types (TypeError), makes the
read-only ``src`` and ``src_scale_inv`` contiguous, and leaves every other check to the core,
which raises ValueError naming the argument and the accepted values. It reads no device value on
the host, so it never syncs and traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch

from . import fast
from ._args import _bool, _float, _input, _int, _optional_input, _tensor

__all__ = ["scaled_accumulate"]


def scaled_accumulate(
    dst: torch.Tensor,
    dst_scale_inv: torch.Tensor,
    src: torch.Tensor,
    src_scale_inv: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    margin: int = 0,
    pow2_scale: bool = True,
) -> torch.Tensor:
    """``dst <- requantize(dst * dst_scale_inv + alpha * src)``, in place; returns the amax.

    ``dst`` holds codes (``float8_e4m3fn``, ``float8_e5m2`` or ``float16``, contiguous) with
    ``dst_scale_inv`` float32 ``[1]``; both are rewritten in place. ``src`` has ``dst``'s number of
    elements and is either high precision (float32, bfloat16, float16; ``src_scale_inv=None``) or
    a scaled tensor (E4M3, E5M2 or FP16 codes with ``src_scale_inv`` float32 ``[1]``).

    Per element, in float32 with each product and the sum rounded once (no fused multiply-add)::

        s = dst * dst_scale_inv + alpha * (src [* src_scale_inv])

    Returns ``amax`` (float32 ``[1]``, on ``dst``'s device) ``= max |s|`` (NaN if any ``s`` is
    NaN, 0 for empty tensors). The new scale comes from that amax with ``dst``'s format max by
    the rule of ``margin`` and ``pow2_scale`` (see :func:`fp8amp.ops.compute_scale`); ``dst`` becomes
    ``saturate(round(s * scale))`` as :func:`fp8amp.ops.quantize` writes it, and ``dst_scale_inv``
    becomes ``1 / scale``. Special cases:

    - amax 0 (all sums zero, or no element): ``scale = dst_scale_inv = 1``, codes zero;
    - amax inf or NaN (a non-finite sum anywhere, including a NaN ``dst_scale_inv`` on entry):
      ``dst_scale_inv`` becomes NaN and every code the NaN code, so the whole accumulator reads
      NaN and GradScaler or the optimizer's non-finite check catches it (an E4M3 code cannot hold
      inf, and saturating would hide the overflow).

    ``src`` may be ``dst`` itself but must not partly overlap it.
    """
    op = "scaled_accumulate"
    dst = _tensor(dst, "dst", op)
    amax = torch.empty(1, dtype=torch.float32, device=dst.device)
    fast.scaled_accumulate(
        dst,
        _tensor(dst_scale_inv, "dst_scale_inv", op),
        _input(src, "src", op),
        _optional_input(src_scale_inv, "src_scale_inv", op),
        _float(alpha, "alpha", op),
        amax,
        _int(margin, "margin", op),
        _bool(pow2_scale, "pow2_scale", op),
    )
    return amax
