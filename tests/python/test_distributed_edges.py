"""Distributed edge cases on 2 gloo processes (FP8 emulation on the CPU).

``distribute_tensor(master, mesh, [Shard(d)])`` of an O1/O2 master aborted gloo on the source rank
(torch scatters the chunks, a list torch does not dispatch to the subclass, from the wrapper's empty
storage): now a NotImplementedError on every rank naming fully_shard.
"""

import datetime

import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from ranks import run_on_ranks

WORLD = 2
# A rank left waiting in a collective gives up after this, not gloo's 30 minutes.
TIMEOUT = datetime.timedelta(seconds=20)


def error_of(call) -> str:
    try:
        call()
    except (NotImplementedError, ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def distribute_master_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for recipe, dim in (("tensorwise", 0), ("tensorwise", 1), ("blockwise", 0)):
        torch.manual_seed(0)
        model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(128, 128)), None, "O2", recipe=recipe)
        w = model[0].weight
        before = w.dequantize().clone()
        if dim == 1:  # column chunks are dequantized views, made contiguous as plain tensors: the values sharded
            d = distribute_tensor(w, mesh, [Shard(dim)])
            out[recipe, dim] = type(d.to_local()) is torch.Tensor and torch.equal(d.full_tensor(), before)
        else:
            out[recipe, dim] = error_of(lambda: distribute_tensor(w, mesh, [Shard(dim)]))
        out[recipe, dim, "kept"] = torch.equal(w.dequantize(), before)
        # What the error names for a DTensor of the values works.
        values = distribute_tensor(w.dequantize(), mesh, [Shard(dim)])
        out[recipe, dim, "values"] = torch.equal(values.full_tensor(), before)
    t = torch.ones(1)
    dist.all_reduce(t)  # the ranks still line up
    out["after"] = t.item()
    return out


def test_distribute_tensor_of_a_master_is_refused_on_every_rank():
    for r in run_on_ranks(distribute_master_rank, WORLD, timeout=TIMEOUT):
        assert r["tensorwise", 1] is True
        for key in (("tensorwise", 0), ("blockwise", 0)):
            assert r[key].startswith("NotImplementedError") and "fully_shard" in r[key], (key, r[key])
            assert "distribute_tensor" in r[key], r[key]
        for key in (("tensorwise", 0), ("tensorwise", 1), ("blockwise", 0)):
            assert r[key + ("kept",)] and r[key + ("values",)], key
        assert r["after"] == WORLD
