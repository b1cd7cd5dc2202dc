"""The chunked FP8 all-reduce with scales per chunk (FP8CommState(pipeline_chunks=...),
docs/distributed.md#scales-per-chunk) as training loops drive it, on 2 and 3 gloo processes: a state
made per call, chunk bounds at and around gradient boundaries against the plain reference bit for bit,
an FP8 gradient's NaN code in a middle chunk, and the next call after it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import distributed_c10d as c10d

from comm_ranks import run_hook
from comm_reference import synth
from fp8amp import distributed as fd
from ranks import run_on_ranks


def state_per_call(rank: int) -> dict:
    """all_reduce_grads with a new FP8CommState(pipeline_chunks=4) at every call (as a loop writing
    ``all_reduce_grads(model, FP8CommState(...))`` does), then with one state reused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 5))
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + rank))
              for p in model.parameters()] for step in range(4)]
    out: dict = {"fresh": [], "reused": [], "groups": []}
    reused = fd.FP8CommState(pipeline_chunks=4)
    for key, make in (("fresh", lambda: fd.FP8CommState(pipeline_chunks=4)), ("reused", lambda: reused)):
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
