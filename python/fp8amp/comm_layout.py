"""How the FP8 all-reduce cuts a flat gradient bucket (fp8amp.distributed, docs/distributed.md#algorithm):
where each gradient lies, the N shards of all_to_all and the pieces (shard ∩ gradient) whose scales
travel with them, and the pipelined chunks, each with its own shards. Pure host arithmetic on
sizes: no tensors, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["PIPELINE_MIN_CHUNK", "PIPELINE_MAX_CHUNKS", "CHUNK_ALIGN", "Layout", "make_layout", "chunk_bounds",
           "Chunk", "make_chunks"]

#: A bucket is reduced in pipelined chunks of at least this many elements, by method
#: (FP8CommState.pipeline_chunks): all_to_all's launches and host work make a small chunk of it cost
#: more than it hides (docs/distributed.md#pipelined-chunks)...
PIPELINE_MIN_CHUNK = {"native": 2**24, "all_to_all": 2**26}
#: ... and at most this many chunks.
PIPELINE_MAX_CHUNKS = 8
#: Chunks start at multiples of this many elements (256 bytes of a float32 bucket: the kernels' packs stay aligned).
CHUNK_ALIGN = 64


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
