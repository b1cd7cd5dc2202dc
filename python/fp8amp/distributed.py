"""FP8 gradient all-reduce on stock ``torch.distributed`` (docs/distributed.md#design): a DDP comm hook and
:func:`all_reduce_grads` for training loops without DDP.

Usage::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(fp8amp.distributed.FP8CommState(), fp8amp.distributed.fp8_allreduce_hook)

    # or, without DDP, after backward and before optimizer.step():
    fp8amp.distributed.all_reduce_grads(model)

Both average the gradients over the ranks of the process group (as DDP does) and move FP8 codes
on the wire: 1 byte per element each way instead of BF16's 2 or FP32's 4.

Each gradient of a bucket gets its own power-of-two scale from the MAX over the ranks of its
amax, so every rank quantizes with the same scales; in a large bucket, reduced in pipelined chunks,
each gradient's part in each chunk gets its own (``FP8CommState.scales_per_chunk``). Two methods,
and ``"auto"`` (the default) choosing between them:

* ``"all_to_all"`` (any backend): the codes travel in an all-to-all, each rank sums its
  shard of the N copies in FP32 (in rank order), requantizes the mean with a scale per piece and
  all-gathers it: two FP8 roundings whatever N, and half the bytes of a BF16 ring all-reduce.
* ``"native"`` (NCCL): ``dist.all_reduce(SUM)`` of the FP8 codes themselves, at a scale with the
  headroom that keeps the FP8 partial sums from saturating; its error grows with N. A backend that
  cannot reduce float8 (gloo) raises a ValueError naming the methods.
* ``"auto"``: ``"native"`` where its error bound is all_to_all's (two FP8 roundings: at most 2
  ranks) and the group's backend reduces float8 (NCCL; probed once with a one-element all-reduce),
  where it was measured faster at every bucket size; ``"all_to_all"`` otherwise.

The local work around the collectives is the comm kernels (``fp8amp.ops.comm_quantize``: the
bucket into the send buffer with the shared scales; ``fp8amp.ops.comm_sum_shards``: the received
copies summed in FP32, divided, requantized or written in the bucket's dtype). The algorithm, the
headroom derivation, the error bound of each method and the measurements are in
docs/distributed.md ("Algorithm", "FP8 communication kernels", "Scales and headroom", "Accuracy:
which method").

Non-finite gradients: an inf or NaN anywhere in a bucket on any rank makes that rank's amax
``+inf`` before the MAX all-reduce (NaN is mapped to inf first: a MAX reduction need not propagate
NaN; gloo's does not), so every rank sees a non-finite ``A``, comm_quantize makes every scale_inv
of the bucket NaN, and every rank writes NaN into its whole bucket.
GradScaler's ``unscale_`` then finds it, and fp8amp's optimizer skips the step, on every rank.

No host synchronization: amaxes, scales and the non-finite flag stay on the device; the shard
layout of a bucket is computed on the host from the gradients' sizes. On CUDA the work runs on a
side stream that waits for the current one, and the hook's Future carries that stream's event, so
DDP's backward keeps overlapping the communication.
"""


import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .comm_amax import BucketAmaxes, ChunkAmaxes, code_sources, shared_amax
from .comm_groups import amax_group, device_backend, host_group
from .comm_layout import Chunk, Layout, make_chunks, make_layout, uses_chunk_scales, wire_bytes
from .amax_sync import ranks_agree
from .ops import fast
from .formats import E4M3, E5M2, HIGH_PRECISION_DTYPES, format_max
from .scaled_tensor import ScaledTensor

__all__ = ["FP8CommState", "fp8_allreduce_hook", "all_reduce_grads", "METHODS", "FORMATS", "wire_bytes"]

#: The accepted ``method`` values.
METHODS = ("all_to_all", "native")
#: What ``method`` accepts: a method, or "auto".
ACCEPTED_METHODS = ("auto",) + METHODS
#: "auto" picks "native" up to this many ranks: there its error bound equals all_to_all's.
AUTO_NATIVE_MAX_RANKS = 2
#: The accepted ``fmt`` values.
FORMATS = (E4M3, E5M2)
#: Backends known to reduce float8 tensors natively (``method="native"``).
NATIVE_BACKENDS = ("nccl",)

#: Unit roundoff (half an ulp, relative) and half the smallest subnormal of each format.
UNIT_ROUNDOFF = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
HALF_MIN_SUBNORMAL = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}

@dataclass
class FP8CommState:
    """The state of :func:`fp8_allreduce_hook` and :func:`all_reduce_grads`.

    Args:
        process_group: the group to average over; ``None`` = the default group.
        fmt: ``fp8amp.E4M3`` (default: 3 mantissa bits, max 448) or ``fp8amp.E5M2`` (2 bits, max
            57344; wider range, coarser).
        method: ``"auto"`` (default: ``"native"`` on NCCL with at most 2 ranks, else
            ``"all_to_all"``), ``"all_to_all"`` (uint8 all-to-all + FP32 sum + uint8 all-gather,
            any backend, error independent of the rank count) or ``"native"`` (``dist.all_reduce``
            on a float8 tensor; NCCL only; FP8 partial sums, error grows with the rank count).
        pipeline_chunks: how many chunks a bucket is reduced in, each chunk's collectives running
            while the next chunk's local work does (docs/distributed.md#pipelined-chunks). ``None``
            (default): as many chunks as the bucket holds of at least 2^24 elements (native) or
            2^26 (all_to_all), at most 8 (``fp8amp.comm_layout.PIPELINE_MIN_CHUNK``,
            ``PIPELINE_MAX_CHUNKS``), so buckets under 2^25 elements, DDP's 25 MB ones included,
            are one chunk; ``1``: never chunked. Chunks start at multiples of 64 elements, so a
            small bucket gets fewer chunks than asked for.
        scales_per_chunk: in a chunked bucket, each gradient's part in each chunk gets its own
            scale, from its amax MAX-reduced chunk by chunk over a communicator of its own (``True``:
            no pass over the whole bucket before the first chunk's collective;
            docs/distributed.md#scales-per-chunk), or each gradient one scale in every chunk
            (``False``: the amaxes of the whole bucket reduced first). ``None`` (default): per chunk
            where chunks hold 2^26 elements or more (``fp8amp.comm_layout.PER_CHUNK_SCALES_MIN``).

    The rest (shard layouts per bucket shape, CUDA side streams) is a cache the hook fills.
    """

    process_group: Optional[dist.ProcessGroup] = None
    fmt: torch.dtype = E4M3
    method: str = "auto"
    pipeline_chunks: Optional[int] = None
    scales_per_chunk: Optional[bool] = None
    _layouts: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _streams: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _backend_checked: bool = field(default=False, init=False, repr=False, compare=False)
    _auto_methods: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _amax_orders: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = "fp8amp.distributed.FP8CommState"
        if self.process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"{where}: this rank is not a member of process_group (dist.new_group returned "
                             "GroupMember.NON_GROUP_MEMBER): pass a group this rank belongs to")
        if self.process_group is not None and not isinstance(self.process_group, dist.ProcessGroup):
            raise TypeError(f"{where}: process_group must be a torch.distributed.ProcessGroup or None; "
                            f"got {type(self.process_group).__name__}")
        names = ", ".join(str(f) for f in FORMATS)
        if not isinstance(self.fmt, torch.dtype) or self.fmt not in FORMATS:
            raise ValueError(f"{where}: fmt must be one of {names} (fp8amp.E4M3, fp8amp.E5M2); got {self.fmt!r}")
        if not isinstance(self.method, str) or self.method not in ACCEPTED_METHODS:
            raise ValueError(f"{where}: method must be one of {', '.join(map(repr, ACCEPTED_METHODS))}; "
                             f"got {self.method!r}")
        chunks = self.pipeline_chunks
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"{where}: pipeline_chunks must be None (automatic) or an int >= 1; got {chunks!r}")
        if self.scales_per_chunk is not None and not isinstance(self.scales_per_chunk, bool):
            raise ValueError(f"{where}: scales_per_chunk must be None (automatic), True or False; "
                             f"got {self.scales_per_chunk!r}")


# ---------------------------------------------------------------------------- layout


def _layout(state: FP8CommState, numels: tuple, world: int) -> Layout:
    key = (numels, world)
    layout = state._layouts.get(key)
    if layout is None:
        layout = state._layouts[key] = make_layout(numels, world)
    return layout


def _chunks(state: FP8CommState, layout: Layout, method: str) -> tuple:
    """The bucket of ``layout`` cut into its pipelined chunks for ``method`` (cached with the layouts)."""
    key = ("chunks", layout.segments, layout.world, state.pipeline_chunks, method)
    chunks = state._layouts.get(key)
    if chunks is None:
        chunks = state._layouts[key] = make_chunks(layout, state.pipeline_chunks, method)
    return chunks


def _native_fp8_all_reduce(codes: torch.Tensor, group):
    """``dist.all_reduce(SUM)`` on a float8 tensor, in place, issued asynchronously: returns the
    work to wait for, or None when done (a seam for tests that emulate it)."""
    return dist.all_reduce(codes, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _check_native_backend(state: FP8CommState, group, device: torch.device) -> None:
    if state._backend_checked:
        return
    backend = device_backend(group, device)
    if backend not in NATIVE_BACKENDS:
        raise ValueError(
            f"fp8amp.distributed: method='native' reduces float8 tensors with dist.all_reduce, which the "
            f"group's backend for {device.type} tensors, {backend!r}, does not support (accepted backends: "
            f"{', '.join(NATIVE_BACKENDS)}); use method='all_to_all' (any backend). Accepted methods: "
            f"{', '.join(map(repr, METHODS))}")
    state._backend_checked = True


def _method(state: FP8CommState, group, device: torch.device, world: int) -> str:
    """The method a bucket is reduced with: ``state.method``, or what "auto" picks (once per
    device type and rank count). Every rank decides alike: the backend and the probe's outcome
    are the same on all of them."""
    if state.method != "auto":
        if state.method == "native":
            _check_native_backend(state, group, device)
        return state.method
    key = (device.type, world)
    method = state._auto_methods.get(key)
    if method is None:
        method = "all_to_all"
        if world <= AUTO_NATIVE_MAX_RANKS and device_backend(group, device) in NATIVE_BACKENDS:
            try:  # a torch or NCCL build may refuse float8 reductions
                work = _native_fp8_all_reduce(torch.zeros(1, dtype=E4M3, device=device), group)
                if work is not None:
                    work.wait()
                method = "native"
            except RuntimeError:
                pass
        state._auto_methods[key] = method
    return method


def _side_stream(state: FP8CommState, device: torch.device):
    """On CUDA: a context running on a side stream that first waits for the current stream."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = state._streams.get(device)
    if stream is None:
        stream = state._streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def _reduce_flat(buf: torch.Tensor, numels: tuple, state: FP8CommState, grads: Optional[list] = None) -> torch.Tensor:
    """The mean over the group of the flat gradients ``buf`` (segments of ``numels``), FP8 on the
    wire; returns a new flat tensor of ``buf``'s dtype and shape. Every rank must call it with the
    same ``numels``. ``grads`` (optional, one per entry of ``numels``): the gradients whose values
    the segments hold, whose FP8 codes the amax pass reads instead (comm_amax.py)."""
    where = "fp8amp.distributed"
    if buf.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"{where}: gradient buckets must be one of "
                         f"{', '.join(str(d) for d in HIGH_PRECISION_DTYPES)}; got {buf.dtype}")
    group = state.process_group
    world = dist.get_world_size(group)
    method = _method(state, group, buf.device, world)
    if grads is not None:
        grads = [g for g, c in zip(grads, numels) if c > 0] if len(grads) == len(numels) else None
    numels = tuple(c for c in numels if c > 0)
    if buf.numel() == 0 or not numels:
        return buf.clone()
    if sum(numels) != buf.numel():
        numels, grads = (buf.numel(),), None  # an unexpected bucket layout: one scale for the whole bucket
    layout = _layout(state, numels, world)
    chunks = _chunks(state, layout, method)
    segs = [buf[o:o + c] for o, c in layout.segments]
    if uses_chunk_scales(chunks, state.scales_per_chunk):
        amaxes = ChunkAmaxes(buf, chunks, layout.segments, code_sources(grads, segs), amax_group(group),
                             state._amax_orders)
    else:
        amaxes = BucketAmaxes(shared_amax(segs, group, grads, state._amax_orders), chunks)
    mean = torch.empty(layout.n, dtype=buf.dtype, device=buf.device)
    # The local work is the comm kernels (fp8amp.ops.comm_quantize, comm_sum_shards): the scales,
    # the quantize into the send buffer, and the sum of the received copies with the division and
    # the requantize, each one pass (docs/distributed.md counts the bytes). A non-finite amax makes
    # every scale_inv NaN (in a chunked bucket: `poison`, before any chunk is decoded), so the whole
    # bucket comes out NaN on every rank. Chunk by chunk, every collective is issued asynchronously
    # and waited for only where its result is needed, so it runs while the next chunk is quantized
    # and the previous one summed.
    reduce = _reduce_native if method == "native" else _reduce_all_to_all
    reduce(buf, amaxes, chunks, mean, state, group, world)
    return mean


def _chunk_segments(buf: torch.Tensor, chunk: Chunk) -> list:
    """The chunk's gradient parts, as views of ``buf``."""
    return [buf[chunk.lo + o:chunk.lo + o + c] for o, c in chunk.layout.segments]


def _poison(scale_invs: list, amaxes) -> None:
    """Adds ``amaxes.poison()`` (0, or NaN for a non-finite amax in any chunk) to every chunk's
    ``scale_invs``, in one launch, before any chunk is decoded (scales per chunk)."""
    poison = amaxes.poison()
    if poison is not None:
        torch._foreach_add_(scale_invs, poison)


def _reduce_native(buf, amaxes, chunks, mean, state, group, world) -> None:
    fmt, u = state.fmt, UNIT_ROUNDOFF[state.fmt]
    fmax = format_max(fmt) / (world * (1.0 + u) ** max(world - 2, 0))
    issued = []
    for c, chunk in enumerate(chunks):
        codes = torch.empty(chunk.hi - chunk.lo, dtype=fmt, device=buf.device)
        scale_inv = fast.comm_quantize(_chunk_segments(buf, chunk), amaxes(c), fmax, codes)
        try:
            work = _native_fp8_all_reduce(codes, group)
        except RuntimeError as e:
            raise ValueError(f"fp8amp.distributed: method='native': dist.all_reduce of a {fmt} tensor failed ({e}); "
                             f"use method='all_to_all'. Accepted methods: {', '.join(map(repr, METHODS))}") from e
        issued.append((chunk, codes, scale_inv, work))
    _poison([scale_inv for _, _, scale_inv, _ in issued], amaxes)
    for chunk, codes, scale_inv, work in issued:
        if work is not None:
            work.wait()
        fast.comm_sum_shards(codes.view(1, -1), scale_inv, chunk.layout.bounds, float(world), mean[chunk.lo:chunk.hi])


def _reduce_all_to_all(buf, amaxes, chunks, mean, state, group, world) -> None:
    # The send buffer's padding (the chunk's tail up to N L) is zeroed by comm_quantize and a
    # payload's by hand: sent but never decoded, it is defined all the same, so that no stale
    # memory of this process goes to the other ranks and the bytes sent are deterministic
    # (compute-sanitizer's initcheck has nothing to report).
    fmt, rank, device = state.fmt, dist.get_rank(group), buf.device
    sent = []
    for c, chunk in enumerate(chunks):
        send = torch.empty(world * chunk.layout.L, dtype=torch.uint8, device=device)
        scale_inv = fast.comm_quantize(_chunk_segments(buf, chunk), amaxes(c), format_max(fmt), send.view(fmt))
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        sent.append((chunk, scale_inv, send, recv, work))  # send referenced until the work is waited for

    # Rank `rank` owns shard `rank` of each chunk: the N copies summed in rank order, divided by N,
    # each piece (the part of one gradient in the shard) requantized with its own scale; the
    # scales travel after the codes.
    _poison([scale_inv for _, scale_inv, _, _, _ in sent], amaxes)
    gathering = []
    for chunk, scale_inv, _, recv, work in sent:
        layout = chunk.layout
        L, P = layout.L, layout.max_pieces
        mine = layout.pieces[rank]
        payload = torch.empty(L + 4 * P, dtype=torch.uint8, device=device)
        shard_len = mine[-1][1] if mine else 0
        payload[shard_len:L].zero_()
        payload[L + 4 * len(mine):].zero_()
        work.wait()
        if mine:
            first = mine[0][2]
            mean_scale_inv, _ = fast.comm_sum_requantize(recv.view(fmt).view(world, L),
                                                         scale_inv[first:first + len(mine)],
                                                         layout.shard_bounds[rank], float(world),
                                                         payload[:shard_len].view(fmt))
            payload[L:L + 4 * len(mine)].copy_(mean_scale_inv.view(torch.uint8))
        gathered = torch.empty(world * (L + 4 * P), dtype=torch.uint8, device=device)
        work = dist.all_gather_into_tensor(gathered, payload, group=group, async_op=True)
        gathering.append((chunk, payload, gathered, work))

    for chunk, _, gathered, work in gathering:
        layout = chunk.layout
        L, P = layout.L, layout.max_pieces
        work.wait()
        rows = gathered.view(world, L + 4 * P)
        scales = rows[:, L:].flatten().clone().view(torch.float32).view(world, P)  # a copy: aligned, even of one row
        out = mean[chunk.lo:chunk.hi]
        xs, sinv, outs = [], [], []
        for k in range(world):
            if layout.pieces[k]:
                codes_k = rows[k, :L].view(fmt)
                xs.extend(codes_k[a:b] for a, b, _ in layout.pieces[k])
                outs.extend(out[k * L + a:k * L + b] for a, b, _ in layout.pieces[k])
                sinv.append(scales[k, :len(layout.pieces[k])])
        fast.multi_dequantize(xs, torch.cat(sinv), outs)


# ---------------------------------------------------------------------------- public API


def fp8_allreduce_hook(state: Optional[FP8CommState], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` over the group with FP8 on the wire.

    Register it with ``ddp.register_comm_hook(FP8CommState(...), fp8_allreduce_hook)`` (``state``
    ``None`` = ``FP8CommState()``). Returns a Future holding the mean, a tensor of the bucket
    buffer's shape and dtype (float32, bfloat16 or float16). See the module docstring for the
    algorithm, the scales and the error bound.
    """
    if state is None:
        state = FP8CommState()
    elif not isinstance(state, FP8CommState):
        raise TypeError(f"fp8amp.distributed.fp8_allreduce_hook: state must be an FP8CommState or None; "
                        f"got {type(state).__name__}")
    buf = bucket.buffer()
    numels = tuple(g.numel() for g in bucket.gradients())
    # DDP has copied each parameter's gradient into the bucket: an FP8 one (O1/O2) as its
    # dequantized values, so its amax can be read from its codes.
    grads = [p.grad for p in bucket.parameters()]
    if buf.device.type == "cuda":
        fut = torch.futures.Future(devices=[buf.device])
        with _side_stream(state, buf.device):
            fut.set_result(_reduce_flat(buf, numels, state, grads))  # records the side stream's event
        return fut
    fut = torch.futures.Future()
    fut.set_result(_reduce_flat(buf, numels, state, grads))
    return fut


def all_reduce_grads(model: nn.Module, state: Optional[FP8CommState] = None, *, bucket_cap_mb: float = 25.0) -> None:
    """Averages the gradients of ``model``'s parameters over the group, FP8 on the wire (for
    training loops without DDP; call it after backward, before ``optimizer.step()``).

    Parameters with a gradient are bucketed by device and dtype (at most ``bucket_cap_mb`` MiB
    of gradients per bucket, in ``model.parameters()`` order), each bucket is reduced as
    :func:`fp8_allreduce_hook` does, and the mean is written back into each ``.grad``. An FP8
    :class:`~fp8amp.ScaledTensor` gradient (O1/O2) is dequantized into its logical dtype's bucket
    and the mean written back through its ``copy_`` (re-quantized with a fresh scale: one more
    E4M3 rounding). Every rank must hold gradients for the same parameters, of the same shapes.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``state`` not an FP8CommState.
        ValueError: ``model`` is a DistributedDataParallel (its gradients are already reduced:
            register :func:`fp8_allreduce_hook` instead), ``bucket_cap_mb`` is not positive, or a
            gradient's dtype is not float32, bfloat16 or float16.
    """
    where = "fp8amp.distributed.all_reduce_grads"
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(f"{where}: model is a DistributedDataParallel, whose gradients DDP already reduces; "
                         f"register fp8amp.distributed.fp8_allreduce_hook on it instead")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module; got {type(model).__name__}")
    if state is None:
        state = FP8CommState()
    elif not isinstance(state, FP8CommState):
        raise TypeError(f"{where}: state must be an FP8CommState or None; got {type(state).__name__}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"{where}: bucket_cap_mb must be a positive number; got {bucket_cap_mb!r}")
    cap = bucket_cap_mb * 2**20
    buckets: dict = {}
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if g.dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(f"{where}: gradients must be one of {', '.join(str(d) for d in HIGH_PRECISION_DTYPES)} "
                             f"(or ScaledTensor); got {g.dtype}")
        lists = buckets.setdefault((g.device, g.dtype), [[]])
        if lists[-1] and sum(x.numel() for x in lists[-1]) * g.element_size() + g.numel() * g.element_size() > cap:
            lists.append([])
        lists[-1].append(g)
    _check_same_gradients(buckets, state)
    for (device, _), lists in buckets.items():
        for grads in lists:
            flat = torch.cat([(g.dequantize() if isinstance(g, ScaledTensor) else g).reshape(-1) for g in grads])
            with _side_stream(state, device):
                mean = _reduce_flat(flat, tuple(g.numel() for g in grads), state, grads)
            if device.type == "cuda":
                torch.cuda.current_stream(device).wait_stream(state._streams[device])
                mean.record_stream(torch.cuda.current_stream(device))
            offset = 0
            with torch.no_grad():
                for g in grads:
                    g.copy_(mean[offset:offset + g.numel()].view(g.shape))
                    offset += g.numel()


def _check_same_gradients(buckets: dict, state: FP8CommState) -> None:
    """Every rank must reduce gradients of the same dtypes and shapes in the same buckets, or the
    collectives would not line up (a hang, or codes of one gradient summed into another's).
    Checked at every call, as a rank's layout may change on its own (a parameter unused on one
    rank in one step): one all-reduce of 4 int64 on the host, or over a subgroup without gloo on the
    gradients' device (comm_groups.host_group)."""
    layout = tuple((HIGH_PRECISION_DTYPES.index(dtype), len(lists), *(tuple(g.shape) for grads in lists for g in grads))
                   for (_, dtype), lists in buckets.items())
    device = next(iter(buckets))[0] if buckets else None
    disagreement = ranks_agree(layout, *host_group(state.process_group, device))
    if disagreement is not None:
        raise ValueError("fp8amp.distributed.all_reduce_grads: the ranks hold gradients of different shapes, dtypes "
                         "or parameters (a parameter with a gradient on one rank and none on another, or a model "
                         "built differently): every rank must have gradients for the same parameters, of the same "
                         "shapes and dtypes")
