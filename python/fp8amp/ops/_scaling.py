"""Typed wrappers over the core's scale computations: a scale pair from an amax, and the
delayed-scaling update after an optimizer step (docs/numerics.md#numerics).

Every wrapper checks Python types (TypeError) and leaves value checks to the core (ValueError
naming the argument); the buffers they update are passed as they are, so the writes land.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import fast
from ._args import _bool, _float, _input, _int, _tensor, _tensors

__all__ = ["compute_scale", "update_delayed_scaling", "multi_update_delayed_scaling"]


def _rule_args(fmax: object, margin: object, pow2_scale: object, op: str) -> tuple[float, int, bool]:
    """The scale rule's arguments, checked, in schema order: ``fmax``, ``margin``, ``pow2_scale``."""
    return _float(fmax, "fmax", op), _int(margin, "margin", op), _bool(pow2_scale, "pow2_scale", op)


def compute_scale(
    amax: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    fmax: float,
    *,
    margin: int = 0,
    pow2_scale: bool = True,
) -> None:
    """Sets ``scale[i]`` and ``scale_inv[i]`` in place from ``amax[i, 0]`` (docs/numerics.md#numerics).

    ``pow2_scale=True``: ``scale = 2^(floor(log2(fmax / amax)) - margin)`` (exponent kept within
    +-126), so ``scale_inv`` is exact; ``False``: ``scale = fmax / amax / 2^margin`` (TE's rule).
    An amax of 0 or not finite keeps the previous pair. ``fmax`` comes from
    :func:`fp8amp.formats.format_max`.
    """
    op = "compute_scale"
    fast.compute_scale(
        _input(amax, "amax", op),
        _tensor(scale, "scale", op),
        _tensor(scale_inv, "scale_inv", op),
        *_rule_args(fmax, margin, pow2_scale, op),
    )


def update_delayed_scaling(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    counter: torch.Tensor,
    fmax: float,
    *,
    margin: int = 0,
    pow2_scale: bool = True,
) -> None:
    """The delayed-scaling update after an optimizer step, for n tensors at once, in place.

    With ``amax_history`` float32 ``[n, H]``, ``scale`` / ``scale_inv`` float32 ``[n]`` and
    ``counter`` int32 ``[n]``, for each i: a non-finite ``amax_history[i, 0]`` is zeroed and sets
    ``counter[i] = 0``, otherwise ``counter[i] += 1`` (at most H) if it is > 0 (an amax of 0, nothing
    recorded, leaves the warm-up where it is); the scale pair is recomputed as
    in :func:`compute_scale` from the max of the row (kept if that max is 0); then the row rolls
    by one and ``amax_history[i, 0] = 0``.
    """
    op = "update_delayed_scaling"
    fast.update_delayed_scaling(
        _tensor(amax_history, "amax_history", op),
        _tensor(scale, "scale", op),
        _tensor(scale_inv, "scale_inv", op),
        _tensor(counter, "counter", op),
        *_rule_args(fmax, margin, pow2_scale, op),
    )


def multi_update_delayed_scaling(
    amax_histories: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    scale_invs: Sequence[torch.Tensor],
    counters: Sequence[torch.Tensor],
    fmax: float,
    *,
    margin: int = 0,
    pow2_scale: bool = True,
) -> None:
    """:func:`update_delayed_scaling` of many states with one ``fmax`` and recipe in one launch:
    state i is ``amax_histories[i]`` ``[n_i, H_i]``, ``scales[i]``, ``scale_invs[i]`` and
    ``counters[i]`` ``[n_i]``, all on one device, no two sharing memory."""
    op = "multi_update_delayed_scaling"
    lists = (_tensors(amax_histories, "amax_histories", op), _tensors(scales, "scales", op),
             _tensors(scale_invs, "scale_invs", op), _tensors(counters, "counters", op))
    if not any(lists):
        return  # no state (and no tensor for torch to dispatch on)
    fast.multi_update_delayed_scaling(
        *lists,
        *_rule_args(fmax, margin, pow2_scale, op),
    )
