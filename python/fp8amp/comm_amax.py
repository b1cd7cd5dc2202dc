"""Steps 1-2 of the FP8 all-reduce (fp8amp.distributed, docs/distributed.md#algorithm): the amax of
each gradient of a bucket, MAX all-reduced over the group; or, for a bucket reduced in pipelined
chunks, of each gradient's part in each chunk, reduced chunk by chunk (:class:`ChunkAmaxes`).

A float32 bucket that holds an FP8 gradient (an O1/O2 weight gradient, a :class:`ScaledTensor` with
one scale) holds its dequantized values, ``code * scale_inv`` rounded once in float32, so the amax of
that segment is ``amax(codes) * scale_inv`` rounded once: the same float (rounding is monotonic), read
at one byte an element instead of four (docs/distributed.md#amaxes-from-the-codes).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import ops
from .comm_layout import Chunk
from .formats import E4M3, E5M2
from .scaled_tensor import ScaledTensor
from .scaling import max_over_ranks

__all__ = ["shared_amax", "reads_codes", "code_sources", "local_amax", "BucketAmaxes", "ChunkAmaxes"]


def reads_codes(grad: object, seg: torch.Tensor) -> bool:
    """Whether the amax of bucket segment ``seg`` may be read from ``grad``'s codes: ``grad`` an FP8
    ScaledTensor of one scale with ``seg``'s element count and device, and ``seg`` float32, where
    every dequantized value is exact (the caller guarantees that ``seg`` holds ``grad``'s values)."""
    return (type(grad) is ScaledTensor and grad.storage_format in (E4M3, E5M2) and seg.dtype == torch.float32
            and grad.numel() == seg.numel() and grad.scale_inv.numel() == 1 and grad.device == seg.device
            and grad.codes.is_contiguous())


def code_sources(grads: Optional[Sequence], segs: Sequence[torch.Tensor]) -> Optional[list]:
    """Per segment, ``(grads[i], 0)`` where :func:`reads_codes` allows reading its amax from the
    codes, else None; None where no segment's can be (or ``grads`` is None)."""
    if grads is None:
        return None
    sources = [(g, 0) if reads_codes(g, s) else None for g, s in zip(grads, segs)]
    return sources if any(s is not None for s in sources) else None


def local_amax(segs: Sequence[torch.Tensor], sources: Optional[Sequence], order_cache: dict,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The amax of each segment, into ``out`` (float32 zeros, one per segment) if given. ``sources[i]``,
    where not None, is ``(grad, start)``: ``segs[i]`` holds ``grad``'s values from its element ``start``
    on (see :func:`code_sources`), read from its codes instead."""
    device = segs[0].device
    if out is None:
        out = torch.zeros(len(segs), dtype=torch.float32, device=device)
    coded = [] if sources is None else [i for i, s in enumerate(sources) if s is not None]
    if not coded:
        ops.multi_amax(segs, out)
        return out
    # One multi_amax per codes' dtype and one over the other segments, then the rows back in
    # bucket order through an index made once per bucket layout (copied without a host sync).
    groups: dict = {}
    for i in coded:
        groups.setdefault(sources[i][0].storage_format, []).append(i)
    coded_set = set(coded)
    groups["bucket"] = [i for i in range(len(segs)) if i not in coded_set]
    groups = {key: idx for key, idx in groups.items() if idx}
    parts, order = [], []
    for key, idx in groups.items():
        part = out if len(groups) == 1 else torch.zeros(len(idx), dtype=torch.float32, device=device)
        if key == "bucket":
            ops.multi_amax([segs[i] for i in idx], part)
        else:
            codes = [sources[i][0].codes.reshape(-1)[sources[i][1]:sources[i][1] + segs[i].numel()] for i in idx]
            ops.multi_amax(codes, part)
            scale_inv = [sources[i][0].scale_inv.reshape(1) for i in idx]
            part.mul_(scale_inv[0] if len(idx) == 1 else torch.cat(scale_inv))
        parts.append(part)
        order.extend(idx)
    if len(parts) == 1:  # one kind of segment: already in bucket order, in out
        return out
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
    return torch.index_select(torch.cat(parts), 0, position, out=out)


def shared_amax(segs: Sequence[torch.Tensor], group, grads: Optional[Sequence] = None,
                order_cache: Optional[dict] = None) -> torch.Tensor:
    """The per-gradient amax of the bucket segments ``segs``, MAX all-reduced over ``group`` (NaN sent
    as inf: a MAX reduction need not propagate NaN, gloo's does not). ``grads[i]``, if given, is the
    gradient whose values ``segs[i]`` holds (read as its codes where :func:`reads_codes` allows);
    ``order_cache`` keeps the index that puts those rows back in bucket order."""
    amax = local_amax(segs, code_sources(grads, segs), {} if order_cache is None else order_cache)
    max_over_ranks(amax, group)
    return amax


class BucketAmaxes:
    """Each chunk's slice of the whole bucket's reduced amaxes (one scale a gradient, in every chunk),
    with a non-finite one anywhere already made NaN in all."""

    def __init__(self, amax: torch.Tensor, chunks: Sequence[Chunk]) -> None:
        if len(chunks) > 1:
            # Each chunk's comm_quantize sees its gradients' amaxes only: a non-finite one anywhere
            # (inf after the MAX) becomes NaN in all (inf * 0), so that every chunk decodes NaN.
            amax = amax + amax.amax() * 0
        self.amax, self.chunks = amax, chunks

    def __call__(self, c: int) -> torch.Tensor:
        chunk = self.chunks[c]
        return self.amax[chunk.first:chunk.first + len(chunk.layout.segments)]

    def poison(self) -> Optional[torch.Tensor]:
        return None


class ChunkAmaxes:
    """The amaxes of each chunk's gradient parts, MAX-reduced over ``group`` chunk by chunk
    (docs/distributed.md#scales-per-chunk). Asked for chunk c, it issues the local amax pass and the
    asynchronous reduction of chunks c and c + 1 (those not issued yet) and waits for chunk c's, so
    that chunk c + 1's run while chunk c is quantized and sent, and no pass over the whole bucket
    comes before the first chunk's collective. ``group`` is a communicator of its own where the
    state's group is the world's (fp8amp.comm_groups.amax_group: its reductions then run beside the
    chunks' collectives, not queued between them). Every chunk's
    amaxes are rows of one buffer, zeroed once: a chunk costs its amax pass, the NaN-to-inf map and
    the reduction (the host's launches bound a small chunk)."""

    def __init__(self, buf: torch.Tensor, chunks: Sequence[Chunk], segments: Sequence[tuple],
                 sources: Optional[Sequence], group, order_cache: dict) -> None:
        self.buf, self.chunks, self.segments, self.sources = buf, chunks, segments, sources
        self.group, self.order_cache = group, order_cache
        self.rows = [0]
        for chunk in chunks:
            self.rows.append(self.rows[-1] + len(chunk.layout.segments))
        self.amax = torch.zeros(self.rows[-1], dtype=torch.float32, device=buf.device)
        self.works: dict = {}

    def _issue(self, c: int) -> None:
        if c >= len(self.chunks) or c in self.works:
            return
        chunk = self.chunks[c]
        segs, sources = [], []
        for j, (o, n) in enumerate(chunk.layout.segments):
            segs.append(self.buf[chunk.lo + o:chunk.lo + o + n])
            source = None if self.sources is None else self.sources[chunk.first + j]
            # the part's first element, counted within its gradient
            sources.append(None if source is None else (source[0], chunk.lo + o - self.segments[chunk.first + j][0]))
        amax = local_amax(segs, sources if self.sources is not None else None, self.order_cache,
                          self.amax[self.rows[c]:self.rows[c + 1]])
        self.works[c] = max_over_ranks(amax, self.group, async_op=True)

    def __call__(self, c: int) -> torch.Tensor:
        self._issue(c)
        self._issue(c + 1)
        work = self.works[c]
        if work is not None:
            work.wait()
        return self.amax[self.rows[c]:self.rows[c + 1]]

    def poison(self) -> torch.Tensor:
        """0, or NaN where any chunk's reduced amax is non-finite: added to every chunk's scale_inv
        before its codes are decoded, so that an inf or NaN anywhere makes the whole bucket NaN.
        Every chunk must have been asked for."""
        if len(self.works) != len(self.chunks):
            raise RuntimeError("fp8amp.comm_amax.ChunkAmaxes.poison: asked before every chunk's amax was")
        return self.amax.amax() * 0
