"""Steps 1-2 of the FP8 all-reduce (fp8amp.distributed, docs/distributed.md#algorithm): the amax of
each gradient of a bucket, MAX all-reduced over the group.

A float32 bucket that holds an FP8 gradient (an O1/O2 weight gradient, a :class:`ScaledTensor` with
one scale) holds its dequantized values, ``code * scale_inv`` rounded once in float32, so the amax of
that segment is ``amax(codes) * scale_inv`` rounded once: the same float (rounding is monotonic), read
at one byte an element instead of four. The amax pass is the one piece of local work that the
pipelined chunks cannot hide (every chunk's scale needs it), so this shortens the reduction's
critical path (docs/distributed.md#amaxes-from-the-codes).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import ops
from .formats import E4M3, E5M2
from .scaled_tensor import ScaledTensor

__all__ = ["shared_amax", "reads_codes"]


def reads_codes(grad: object, seg: torch.Tensor) -> bool:
    """Whether the amax of bucket segment ``seg`` may be read from ``grad``'s codes: ``grad`` an FP8
    ScaledTensor of one scale with ``seg``'s element count and device, and ``seg`` float32, where
    every dequantized value is exact (the caller guarantees that ``seg`` holds ``grad``'s values)."""
    return (type(grad) is ScaledTensor and grad.storage_format in (E4M3, E5M2) and seg.dtype == torch.float32
            and grad.numel() == seg.numel() and grad.scale_inv.numel() == 1 and grad.device == seg.device
            and grad.codes.is_contiguous())


def _local_amax(segs: Sequence[torch.Tensor], grads: Optional[Sequence], order_cache: dict) -> torch.Tensor:
    """The amax of each segment, ``grads[i]``'s codes where :func:`reads_codes` allows."""
    device = segs[0].device
    coded = [] if grads is None else [i for i, (g, s) in enumerate(zip(grads, segs)) if reads_codes(g, s)]
    if not coded:
        amax = torch.zeros(len(segs), dtype=torch.float32, device=device)
        ops.multi_amax(segs, amax)
        return amax
    # One multi_amax per codes' dtype and one over the other segments, then the rows back in
    # bucket order through an index made once per bucket layout (copied without a host sync).
    groups: dict = {}
    for i in coded:
        groups.setdefault(grads[i].storage_format, []).append(i)
    coded_set = set(coded)
    groups["bucket"] = [i for i in range(len(segs)) if i not in coded_set]
    parts, order = [], []
    for key, idx in groups.items():
        if not idx:
            continue
        part = torch.zeros(len(idx), dtype=torch.float32, device=device)
        if key == "bucket":
            ops.multi_amax([segs[i] for i in idx], part)
        else:
            ops.multi_amax([grads[i].codes.reshape(-1) for i in idx], part)
            scale_inv = [grads[i].scale_inv.reshape(1) for i in idx]
            part.mul_(scale_inv[0] if len(idx) == 1 else torch.cat(scale_inv))
        parts.append(part)
        order.extend(idx)
    if len(parts) == 1:  # one kind of segment: already in bucket order
        return parts[0]
    key = (device, tuple(order))
    position = order_cache.get(key)
    if position is None:
        inverse = [0] * len(order)
        for row, i in enumerate(order):
            inverse[i] = row
        position = torch.tensor(inverse, dtype=torch.int64)
        if device.type == "cuda":
            position = position.pin_memory().to(device, non_blocking=True)
        order_cache[key] = position
    return torch.cat(parts).index_select(0, position)


def shared_amax(segs: Sequence[torch.Tensor], group, grads: Optional[Sequence] = None,
                order_cache: Optional[dict] = None) -> torch.Tensor:
    """The per-gradient amax of the bucket segments ``segs``, MAX all-reduced over ``group`` (NaN sent
    as inf: a MAX reduction need not propagate NaN, gloo's does not). ``grads[i]``, if given, is the
    gradient whose values ``segs[i]`` holds (read as its codes where :func:`reads_codes` allows);
    ``order_cache`` keeps the index that puts those rows back in bucket order."""
    amax = _local_amax(segs, grads, {} if order_cache is None else order_cache)
    amax.nan_to_num_(nan=float("inf"), posinf=float("inf"))
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax
