"""How the FP8 all-reduce cuts a flat gradient bucket (fp8amp.distributed, docs/distributed.md#algorithm):
where each gradient lies, the N shards of all_to_all and the pieces (shard ∩ gradient) whose scales
travel with them, the pipelined chunks, each with its own shards, and the bytes a rank sends
(:func:`wire_bytes`). Pure host arithmetic on sizes: no tensors, no collectives.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PIPELINE_MIN_CHUNK", "PIPELINE_MAX_CHUNKS", "CHUNK_ALIGN", "PER_CHUNK_SCALES_MIN", "Layout", "make_layout",
           "chunk_bounds", "Chunk", "make_chunks", "uses_chunk_scales", "wire_bytes"]

#: A bucket is reduced in pipelined chunks of at least this many elements, by method
#: (FP8CommState.pipeline_chunks): all_to_all's launches and host work make a small chunk of it cost
#: more than it hides (docs/distributed.md#pipelined-chunks)...
PIPELINE_MIN_CHUNK = {"native": 2**24, "all_to_all": 2**26}
#: ... and at most this many chunks.
PIPELINE_MAX_CHUNKS = 8
#: Chunks start at multiples of this many elements (256 bytes of a float32 bucket: the kernels' packs stay aligned).
CHUNK_ALIGN = 64
#: Scales per chunk (FP8CommState.scales_per_chunk=None) where a chunk holds at least this many elements: in a
#: smaller one, its own amax pass and reduction cost the host more launch time than the pass they hide
#: (docs/distributed.md#scales-per-chunk).
PER_CHUNK_SCALES_MIN = 2**26


@dataclass(frozen=True)
class Layout:
    """Where each gradient of a flat bucket of n elements lies, and how N shards cut it.

    ``segments[i] = (offset, numel)`` of gradient i; ``L`` elements per shard (the bucket padded
    to ``N L``); ``pieces[k]`` = ``(start, end, i)`` of every non-empty intersection of shard k
    with gradient i, ``start``/``end`` relative to the shard, in order; ``first[k]`` the index of
    the first gradient in shard k (pieces of a shard are consecutive gradients);
    ``max_pieces`` = the most pieces in a shard (the scale slots each shard carries);
    ``bounds`` the gradients' offsets and ``n`` (comm_sum_shards' pieces over the whole bucket);
    ``shard_bounds[k]`` those of shard k's pieces, relative to the shard.
    """

    n: int
    world: int
    segments: tuple
    L: int
    pieces: tuple
    max_pieces: int
    bounds: tuple
    shard_bounds: tuple


def make_layout(numels: tuple, world: int) -> Layout:
    segments, offset = [], 0
    for numel in numels:
        segments.append((offset, numel))
        offset += numel
    n = offset
    L = -(-n // world)
    pieces = []
    for k in range(world):
        lo, hi = k * L, min((k + 1) * L, n)
        shard = []
        for i, (o, c) in enumerate(segments):
            a, b = max(o, lo), min(o + c, hi)
            if a < b:
                shard.append((a - lo, b - lo, i))
        pieces.append(tuple(shard))
    bounds = tuple(o for o, _ in segments) + (n,)
    shard_bounds = tuple(tuple(a for a, _, _ in p) + (p[-1][1],) if p else () for p in pieces)
    return Layout(n, world, tuple(segments), L, tuple(pieces), max(1, max(len(p) for p in pieces)), bounds,
                   shard_bounds)


def chunk_bounds(n: int, chunks: Optional[int], method: str) -> tuple:
    """The offsets ``0 = b_0 < b_1 < ... < b_C = n`` of a bucket's pipelined chunks: ``chunks`` of
    them (``None``: as many as hold ``PIPELINE_MIN_CHUNK[method]`` elements each, 1 to
    ``PIPELINE_MAX_CHUNKS``), each but the last a multiple of ``CHUNK_ALIGN`` elements long, so
    fewer where n is small."""
    if chunks is None:
        chunks = max(1, min(PIPELINE_MAX_CHUNKS, n // PIPELINE_MIN_CHUNK[method]))
    per_chunk = -(-n // chunks)
    size = -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
    return tuple(range(0, n, size)) + (n,)


@dataclass(frozen=True)
class Chunk:
    """Elements ``[lo, hi)`` of a bucket: the parts of gradients ``first, first + 1, ...`` in it,
    with their own shard layout (``layout``, offsets relative to ``lo``)."""

    lo: int
    hi: int
    first: int
    layout: Layout


def make_chunks(layout: Layout, chunks: Optional[int], method: str) -> tuple:
    """The bucket of ``layout`` cut at :func:`chunk_bounds`, each chunk with the shard layout of the
    gradient parts in it."""
    bounds = chunk_bounds(layout.n, chunks, method)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        inside = [(i, min(o + c, hi) - max(o, lo)) for i, (o, c) in enumerate(layout.segments)
                  if min(o + c, hi) > max(o, lo)]
        out.append(Chunk(lo, hi, inside[0][0], make_layout(tuple(c for _, c in inside), layout.world)))
    return tuple(out)


def uses_chunk_scales(chunks: tuple, asked: Optional[bool]) -> bool:
    """Whether a bucket cut into ``chunks`` gets a scale per gradient part in each chunk: as
    ``asked`` (FP8CommState.scales_per_chunk), or for None where its first chunk holds at least
    ``PER_CHUNK_SCALES_MIN`` elements; never in one chunk."""
    if len(chunks) < 2:
        return False
    return asked if asked is not None else chunks[0].hi - chunks[0].lo >= PER_CHUNK_SCALES_MIN


def wire_bytes(numels, world: int, method: str, dtype: torch.dtype = torch.float32, *,
               scales_per_chunk: Optional[bool] = None) -> int:
    """Bytes one rank sends to reduce one bucket holding gradients of ``numels`` elements over
    ``world`` ranks (``fp8amp.distributed.wire_bytes``).

    ``method``: ``"all_to_all"`` or ``"native"`` (FP8, as fp8amp.distributed does them, in their
    automatic pipelined chunks) or ``"all_reduce"`` (a ring all-reduce of ``dtype``: ``2 (N-1)/N``
    of the bytes). The FP8 methods include the amax all-reduce (a ring of one float32 per gradient,
    or with scales per chunk, as ``scales_per_chunk`` says it, per gradient part in each chunk) and, for
    all_to_all, the padding to ``N L`` elements and the float32 scale slots of each shard.
    """
    where = "fp8amp.distributed.wire_bytes"
    try:
        numels, world = tuple(operator.index(c) for c in numels), operator.index(world)
    except TypeError as e:
        raise TypeError(f"{where}: numels must be integers (the gradients' element counts) and world an integer "
                        f"(the number of ranks); got {numels!r} and {world!r}") from e
    if any(c < 0 for c in numels) or world < 1:
        raise ValueError(f"{where}: numels must be >= 0 and world >= 1; got {numels!r} and {world}")
    numels = tuple(c for c in numels if c > 0)
    if method not in ("all_to_all", "native", "all_reduce"):
        raise ValueError(f"{where}: method must be one of 'all_to_all', 'native', 'all_reduce'; got {method!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: dtype must be the gradients' floating-point torch.dtype; got {dtype!r}")
    if scales_per_chunk is not None and not isinstance(scales_per_chunk, bool):
        raise ValueError(f"{where}: scales_per_chunk must be None (automatic), True or False; got {scales_per_chunk!r}")
    if world <= 1 or not numels:
        return 0
    n = sum(numels)

    def ring(nbytes: int) -> int:
        return 2 * (world - 1) * nbytes // world

    if method == "all_reduce":
        return ring(n * dtype.itemsize)
    chunks = make_chunks(make_layout(numels, world), None, method)
    if uses_chunk_scales(chunks, scales_per_chunk):
        amax = sum(ring(4 * len(c.layout.segments)) for c in chunks)
    else:
        amax = ring(4 * len(numels))
    if method == "native":
        return amax + ring(n)
    return amax + sum((world - 1) * c.layout.L + (world - 1) * (c.layout.L + 4 * c.layout.max_pieces) for c in chunks)
