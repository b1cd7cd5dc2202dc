"""References for the FP8 gradient all-reduce tests (test_distributed.py, test_distributed_models.py):
synthetic gradients, the exact mean with its derived bound, and the algorithm of
fp8amp/distributed.py written out plainly in one process (reference_mean), with NCCL's float8 SUM
emulated for method "native".

The bound (method "all_to_all", per element, derived in fp8amp/distributed.py's docstring): with
``u`` the format's unit roundoff (E4M3 2^-4, E5M2 2^-3), ``eta`` half its smallest subnormal
(2^-10, 2^-17), ``u32 = 2^-24``, ``s`` the shared scale of the element's gradient
``2^floor(log2(fmax / A))`` (A = the max over ranks of that gradient's amax) and ``t`` the scale of
the mean's piece (bounded below from the largest ``|mean| + e1 + e2`` of the piece or, when the
test does not know the shard cut, of the whole gradient):

    e1 = u mean_r|x_r| + eta / s                  one FP8 rounding of each rank's contribution
    e2 = u32 (N - 1) mean_r|q_r| + u32 (|m| + e1)  the FP32 sum in rank order and the division by N
    e3 = u (|m| + e1 + e2) + eta / t              one FP8 rounding of the mean
    |out - m| <= e1 + e2 + e3      (mean_r|q_r| <= (1 + u) mean_r|x_r| + eta / s)
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

import fp8amp
from fp8amp import comm_amax, comm_layout
from fp8amp import distributed as fd

E4M3, E5M2 = fp8amp.E4M3, fp8amp.E5M2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
U = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
ETA = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
U32 = 2.0 ** -24


def synth(rank: int, sizes, dtype, seed: int = 0) -> torch.Tensor:
    """Flat gradients of ``sizes`` whose magnitudes differ by 10^2 per gradient and spread over 2^24
    within one (down into the FP8 subnormals), with exact zeros; deterministic in (rank, seed)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    parts = []
    for i, n in enumerate(sizes):
        mag = 10.0 ** (2 * (i % 3) - 2)
        x = torch.randn(n, generator=g, dtype=torch.float64) * mag * 2.0 ** (-24 * torch.rand(n, generator=g, dtype=torch.float64))
        x[torch.rand(n, generator=g) < 0.05] = 0
        parts.append(x)
    return torch.cat(parts).to(dtype)


class FakeBucket:
    """What fp8_allreduce_hook reads of a dist.GradBucket. ``param_grads``: what each parameter's
    ``.grad`` holds (DDP copied its values into the bucket); None for every one by default."""

    def __init__(self, flat: torch.Tensor, sizes, param_grads=None) -> None:
        self._flat = flat
        self._grads = list(torch.split(flat, list(sizes)))
        grads = [None] * len(self._grads) if param_grads is None else list(param_grads)
        self._params = [SimpleNamespace(grad=g) for g in grads]

    def buffer(self) -> torch.Tensor:
        return self._flat

    def gradients(self) -> list:
        return self._grads

    def parameters(self) -> list:
        return self._params


@contextlib.contextmanager
def amax_input_dtypes(seen: set):
    """Records the dtype of every multi_amax input of the FP8 all-reduce."""
    real = comm_amax.ops.multi_amax

    def spy(xs, amax):
        seen.update(str(x.dtype) for x in xs)
        return real(xs, amax)

    with mock.patch.object(comm_amax.ops, "multi_amax", spy):
        yield


def pow2_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """2^floor(log2(fmax / amax)) within 2^+-126, 1 where amax is 0 (compute_scale's rule)."""
    e = torch.floor(torch.log2(fmax / amax.double())).clamp(-126, 126)
    return torch.where(amax > 0, 2.0 ** e, torch.ones_like(e))


def bound_all_to_all(xs: list, sizes, fmt, pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact mean, bound) per element. ``xs``: every rank's flat input (float64). ``pieces``: the
    (start, end) ranges that share a requantization scale (pieces of shards, or whole gradients)."""
    n_ranks = len(xs)
    x = torch.stack(xs).double()
    m = x.mean(0)
    mean_abs = x.abs().mean(0)
    u, eta = U[fmt], ETA[fmt]
    s = torch.empty_like(m)
    o = 0
    for c in sizes:
        s[o:o + c] = pow2_scale(x[:, o:o + c].abs().max(), FMAX[fmt])
        o += c
    e1 = u * mean_abs + eta / s
    q_abs = (1 + u) * mean_abs + eta / s
    e2 = U32 * (n_ranks - 1) * q_abs + U32 * (m.abs() + e1)
    big = m.abs() + e1 + e2
    t = torch.empty_like(m)
    for a, b in pieces:
        t[a:b] = pow2_scale(big[a:b].max(), FMAX[fmt])
    return m, e1 + e2 + u * big + eta / t


def native_fmax(fmt, world: int) -> float:
    """F of method "native": the largest code magnitude whose sum over ``world`` ranks, rounded at
    every partial sum, stays within fmax."""
    return FMAX[fmt] / (world * (1 + U[fmt]) ** max(world - 2, 0))


def headroom_worst(rank: int, world: int, fmt) -> torch.Tensor:
    """Every rank just below the headroom's limit F, with one sign: the shared scale is 1 and the
    codes round up to F or near it, so the FP8 partial sums come as close to fmax as the headroom
    allows (exactly fmax for 2 ranks)."""
    return torch.full((9,), native_fmax(fmt, world) * (1 - 2.0 ** -10) * (1 - rank * 1e-3))


def shard_pieces(sizes, world: int, chunks=None) -> list:
    """The (start, end) ranges that share a requantization scale: each shard's part of each
    gradient, the shards cut from each of ``chunks`` (default: the whole bucket)."""
    offsets = list(itertools.accumulate(sizes, initial=0))
    pieces = []
    for lo, hi in chunks or [(0, offsets[-1])]:
        inside = [min(b, hi) - max(a, lo) for a, b in zip(offsets[:-1], offsets[1:]) if min(b, hi) > max(a, lo)]
        layout = comm_layout.make_layout(tuple(inside), world)
        pieces += [(lo + k * layout.L + a, lo + k * layout.L + b) for k in range(world) for a, b, _ in layout.pieces[k]]
    return pieces


def cut_at_chunks(sizes, chunks) -> tuple:
    """The gradient sizes cut at the chunks' bounds: the parts that get a scale of their own when
    a chunked bucket's scales are per chunk (FP8CommState.scales_per_chunk)."""
    offsets = list(itertools.accumulate(sizes, initial=0))
    return tuple(min(b, hi) - max(a, lo) for lo, hi in chunks for a, b in zip(offsets[:-1], offsets[1:])
                 if min(b, hi) > max(a, lo))


def fp8_ring_sum(codes: list) -> torch.Tensor:
    """The sum of every rank's FP8 codes as NCCL's float8 SUM does it, emulated: partial sums in
    FP8, rounded at every hop in rank order (a ring), an overflow made visible as NaN."""
    fmt = codes[0].dtype
    partial = codes[0].double()
    for c in codes[1:]:
        v = partial + c.double()
        partial = torch.where(v.abs() > FMAX[fmt], torch.nan, v.to(fmt).double())
    return partial.to(fmt)


def emulated_native_all_reduce(codes: torch.Tensor, group) -> None:
    """fd._native_fp8_all_reduce with NCCL's float8 SUM emulated (fp8_ring_sum) over an all_gather
    of the codes, so that any backend can run method "native" and its sum is known."""
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(codes.view(torch.uint8)) for _ in range(world)]
    dist.all_gather(gathered, codes.view(torch.uint8).clone(), group=group)
    codes.copy_(fp8_ring_sum([g.view(codes.dtype) for g in gathered]))


@contextlib.contextmanager
def emulated_native(backend: str):
    """Method "native" accepted on ``backend`` and run with emulated_native_all_reduce."""
    original = fd.NATIVE_BACKENDS, fd._native_fp8_all_reduce
    fd.NATIVE_BACKENDS, fd._native_fp8_all_reduce = (backend,), emulated_native_all_reduce
    try:
        yield
    finally:
        fd.NATIVE_BACKENDS, fd._native_fp8_all_reduce = original


def reference_mean(xs: list, sizes, fmt, method: str, chunks=None) -> torch.Tensor:
    """What every rank's hook must return, bit for bit: the algorithm of fp8amp/distributed.py's
    docstring written out plainly in one process, with the single-tensor cast ops, one gradient (or
    piece of a shard) and one rank at a time, every intermediate a tensor of its own. ``xs``: every
    rank's flat bucket, finite. Method "native" sums the codes with fp8_ring_sum (its emulated
    NCCL SUM); the division by N is a float32 division, as the comm kernels do it on both devices.
    ``chunks``: the pipelined chunks' ``(lo, hi)`` (default: the whole bucket); "all_to_all" cuts
    each chunk into its own N shards, "native" does not depend on them. The first scales are one
    per entry of ``sizes`` (the gradients', or with :func:`cut_at_chunks` their parts')."""
    world, dtype, n = len(xs), xs[0].dtype, xs[0].numel()
    offsets = list(itertools.accumulate(sizes, initial=0))
    segments = list(zip(offsets[:-1], offsets[1:]))
    shared_fmax = FMAX[fmt] if method == "all_to_all" else native_fmax(fmt, world)
    scale_invs, codes = [], [[] for _ in xs]
    for a, b in segments:  # steps 1-4: the gradient's amax over all ranks, its scale, every rank's codes
        amax, scale, scale_inv = torch.zeros(1), torch.ones(1), torch.ones(1)
        for x in xs:
            fp8amp.ops.amax(x[a:b], amax)
        fp8amp.ops.compute_scale(amax, scale, scale_inv, shared_fmax)
        scale_invs.append(scale_inv)
        for rank_codes, x in zip(codes, xs):
            rank_codes.append(fp8amp.ops.quantize(x[a:b], scale, torch.zeros(1), fmt)[0])
    if method == "native":
        total = fp8_ring_sum([torch.cat(c) for c in codes])
        mean = torch.cat([fp8amp.ops.dequantize(total[a:b], si, torch.float32) for (a, b), si in zip(segments, scale_invs)])
        return (mean / world).to(dtype)
    codes = [torch.cat(c) for c in codes]
    out = torch.empty(n, dtype=dtype)
    shards = []
    for lo, hi in chunks or [(0, n)]:
        shard_len = -(-(hi - lo) // world)
        shards += [(lo + k * shard_len, min(lo + (k + 1) * shard_len, hi)) for k in range(world)]
    for lo, hi in shards:  # steps 5-7, shard by shard: its pieces summed in rank order, requantized, dequantized
        for (a, b), si in zip(segments, scale_invs):
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            acc = fp8amp.ops.dequantize(codes[0][a:b], si, torch.float32)
            for rank_codes in codes[1:]:
                acc = acc + fp8amp.ops.dequantize(rank_codes[a:b], si, torch.float32)
            acc = acc / world
            amax, scale, scale_inv = torch.zeros(1), torch.ones(1), torch.ones(1)
            fp8amp.ops.amax(acc, amax)
            fp8amp.ops.compute_scale(amax, scale, scale_inv, FMAX[fmt])
            piece, piece_scale_inv = fp8amp.ops.quantize(acc, scale, torch.zeros(1), fmt)
            out[a:b] = fp8amp.ops.dequantize(piece, piece_scale_inv, dtype)
    return out
