"""The order of work of a chunked FP8 all-reduce with scales per chunk (FP8CommState.scales_per_chunk,
docs/distributed.md#scales-per-chunk), on 2 gloo processes: no amax pass over a whole gradient, the
chunks' amaxes reduced over a group of their own, chunk c + 1's issued before chunk c's data
collective (so that its latency is not on the data collectives' path), and the same bits as one
reduction per chunk whatever the state's cached group."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist

from comm_ranks import run_hook
from comm_reference import emulated_native, synth
from fp8amp import comm_amax, comm_groups
from fp8amp import distributed as fd
from ranks import run_on_ranks

SIZES = (37, 1, 200, 5, 64)  # chunks of 3: [0, 128), [128, 256), [256, 307); gradient 2 is 200 long
CHUNKS = 3


@contextlib.contextmanager
def recorded(log: list, state: fd.FP8CommState):
    """Every collective (which group: the state's "data" or the chunks' "amax") and every amax
    pass (the largest part it reads) appended to ``log`` in issue order."""
    all_reduce, a2a, native, multi_amax = (dist.all_reduce, dist.all_to_all_single, fd._native_fp8_all_reduce,
                                           comm_amax.ops.multi_amax)

    def group_name(group):
        return "data" if group is state.process_group else "amax"

    def spy_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        log.append(("all_reduce", group_name(group), tensor.numel()))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    def spy_a2a(out, inp, *args, group=None, **kwargs):
        log.append(("all_to_all", group_name(group), inp.numel()))
        return a2a(out, inp, *args, group=group, **kwargs)

    def spy_native(codes, group):
        log.append(("native", group_name(group), codes.numel()))
        return native(codes, group)

    def spy_amax(xs, amax):
        log.append(("amax pass", max(x.numel() for x in xs)))
        return multi_amax(xs, amax)

    with mock.patch.object(dist, "all_reduce", spy_all_reduce), mock.patch.object(dist, "all_to_all_single", spy_a2a), \
            mock.patch.object(fd, "_native_fp8_all_reduce", spy_native), \
            mock.patch.object(comm_amax.ops, "multi_amax", spy_amax):
        yield


def orders(rank: int) -> dict:
    out = {}
    with emulated_native("gloo"):
        for method in ("native", "all_to_all"):
            state = fd.FP8CommState(method=method, pipeline_chunks=CHUNKS, scales_per_chunk=True)
            log: list = []
            with recorded(log, state):
                out[method] = run_hook(synth(rank, SIZES, torch.float32), SIZES, state, torch.device("cpu"))
            out[method, "log"] = log
            group = comm_groups.amax_group(state.process_group)
            out[method, "group"] = group not in (None, state.process_group, dist.group.WORLD)
            # a second call reuses the state's amax group: the same bits
            out[method, "again"] = run_hook(synth(rank, SIZES, torch.float32), SIZES, state, torch.device("cpu"))
    return out


def test_chunks_amaxes_are_reduced_chunk_by_chunk_ahead_of_their_data():
    results = run_on_ranks(orders, 2)
    for r in results:
        for method, data in (("native", "native"), ("all_to_all", "all_to_all")):
            log = r[method, "log"]
            passes = [e for e in log if e[0] == "amax pass"]
            assert passes and max(size for _, size in passes) <= 128, log  # parts of chunks, never gradient 2 whole
            collectives = [(kind, group) for kind, group, *_ in (e for e in log if e[0] != "amax pass")]
            firsts = collectives[:6]
            assert firsts == [("all_reduce", "amax"), ("all_reduce", "amax"), (data, "data"), ("all_reduce", "amax"),
                              (data, "data"), (data, "data")], log
            assert r[method, "group"]
            assert torch.equal(r[method], r[method, "again"])
    assert torch.equal(results[0]["native"], results[1]["native"])
    assert torch.equal(results[0]["all_to_all"], results[1]["all_to_all"])
