"""The chunked FP8 all-reduce with scales per chunk (FP8CommState(pipeline_chunks=...),
docs/distributed.md#scales-per-chunk) as training loops drive it, on 2 and 3 gloo processes: a state
made per call, chunk bounds at and around gradient boundaries against the plain reference bit for bit,
an FP8 gradient's NaN code in a middle chunk, and the next call after it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

import fp8amp
from comm_ranks import run_hook
from comm_reference import E4M3, E5M2, FakeBucket, cut_at_chunks, emulated_native, reference_mean, synth
from fp8amp import comm_layout
from fp8amp import distributed as fd
from ranks import run_on_ranks

CPU = torch.device("cpu")
# (gradient sizes, chunks): chunk bounds (multiples of 64) at, just before and just after gradient
# boundaries, 1-element gradients, parts smaller than 3 ranks, more chunks than gradients, a chunk of 1 part
BOUNDS = (((64, 64, 64), 3), ((63, 1, 64, 65), 3), ((65, 63, 1), 2), ((1, 1, 1), 8), ((200,), 4),
          ((1, 127, 1, 64, 3), 5))
# An O1/O2 bucket: FP8 gradients (read from their codes) and float32 ones, parts of both in each chunk
FP8_SIZES, FP8_FMTS = (70, 1, 130, 64, 5), (E4M3, None, E5M2, None, E4M3)


def state_per_call(rank: int) -> dict:
    """all_reduce_grads with a new FP8CommState(pipeline_chunks=4) at every call (as a loop writing
    ``all_reduce_grads(model, FP8CommState(...))`` does), then with one state reused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 5))
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + rank))
              for p in model.parameters()] for step in range(4)]
    out: dict = {"fresh": [], "reused": [], "groups": []}
    reused = fd.FP8CommState(pipeline_chunks=4, scales_per_chunk=True)
    fresh = lambda: fd.FP8CommState(pipeline_chunks=4, scales_per_chunk=True)  # noqa: E731
    for key, make in (("fresh", fresh), ("reused", lambda: reused)):
        for step in range(4):
            for p, g in zip(model.parameters(), grads[step]):
                p.grad = g.clone()
            fd.all_reduce_grads(model, make(), bucket_cap_mb=1024)
            out[key].append([p.grad.clone() for p in model.parameters()])
            out["groups"].append(c10d._world.group_count)
    return out


def test_a_state_made_per_call_makes_no_process_group_per_call():
    results = run_on_ranks(state_per_call, 2)
    for r in results:
        assert len(set(r["groups"])) == 1, r["groups"]  # the chunks' amax group made once, by the first call
        for fresh, reused in zip(r["fresh"], r["reused"]):
            assert all(torch.equal(a, b) for a, b in zip(fresh, reused))


def chunked_runs(rank: int, world: int) -> dict:
    """BOUNDS with scales per chunk, both methods; an FP8 gradient's NaN code in the middle chunk
    on the last rank, then the next call on the same state; a state over ranks 0 and 1 only."""
    out: dict = {}
    with emulated_native("gloo"):
        for i, (sizes, chunks) in enumerate(BOUNDS):
            for method in ("all_to_all", "native"):
                x = synth(rank, sizes, torch.float32, seed=i)
                state = fd.FP8CommState(method=method, pipeline_chunks=chunks, scales_per_chunk=True)
                out[i, method] = x, run_hook(x, sizes, state, CPU)
    # chunks [0, 128), [128, 256), [256, 270)
    state = fd.FP8CommState(method="all_to_all", pipeline_chunks=3, scales_per_chunk=True)
    for key, seed in (("nan_code", 1), ("after", 2)):
        xs = synth(rank, FP8_SIZES, torch.float32, seed=seed).split(FP8_SIZES)
        grads = [x.clone() if f is None else fp8amp.ScaledTensor.from_tensor(x, f) for x, f in zip(xs, FP8_FMTS)]
        if key == "nan_code" and rank == world - 1:
            grads[2].codes.view(torch.uint8)[100] = 0x7F  # element 171: the middle chunk
        flat = torch.cat([g.dequantize() if isinstance(g, fp8amp.ScaledTensor) else g for g in grads])
        out[key] = flat, fd.fp8_allreduce_hook(state, FakeBucket(flat, FP8_SIZES, grads)).wait()
    sub = dist.new_group([0, 1])
    before = c10d._world.group_count
    if rank in (0, 1):
        x = synth(rank, (37, 1, 200), torch.float32)
        state = fd.FP8CommState(sub, method="all_to_all", pipeline_chunks=3, scales_per_chunk=True)
        out["sub"] = x, run_hook(x, (37, 1, 200), state, CPU)
    out["sub_groups_made"] = c10d._world.group_count - before
    return out


def reference(xs, sizes, chunks, method):
    bounds = comm_layout.chunk_bounds(sum(sizes), chunks, method)
    pairs = list(zip(bounds[:-1], bounds[1:]))
    return reference_mean(xs, cut_at_chunks(sizes, pairs), E4M3, method, pairs)


def test_chunk_bounds_around_gradients_nan_codes_and_a_subgroup_state():
    results = run_on_ranks(chunked_runs, 3, 3)
    for i, (sizes, chunks) in enumerate(BOUNDS):
        for method in ("all_to_all", "native"):
            expected = reference([r[i, method][0] for r in results], sizes, chunks, method)
            for r in results:
                assert torch.equal(r[i, method][1], expected), (sizes, chunks, method)
    for r in results:
        assert r["nan_code"][1].isnan().all()
    expected = reference([r["after"][0] for r in results], FP8_SIZES, 3, "all_to_all")
    assert all(torch.equal(r["after"][1], expected) for r in results)
    expected = reference([r["sub"][0] for r in results[:2]], (37, 1, 200), 3, "all_to_all")
    assert all(torch.equal(r["sub"][1], expected) for r in results[:2])
    # A state over a subgroup reduces its chunks' amaxes over that group: no group made by its
    # members alone, which would put torch's count of groups out of step on the other ranks.
    assert [r["sub_groups_made"] for r in results] == [0, 0, 0]
