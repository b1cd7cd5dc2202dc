"""Distributed edge cases on 2 and 3 gloo processes (FP8 emulation on the CPU).

``distribute_tensor(master, mesh, [Shard(d)])`` of an O1/O2 master aborted gloo on the source rank
(torch scatters the chunks, a list torch does not dispatch to the subclass, from the wrapper's empty
storage): now a NotImplementedError on every rank naming fully_shard. ``all_reduce_grads`` over a
subgroup without gloo made its layout check's group by the subgroup's members alone (torch's group
count out of step: a later world group hung). The groups derived from a process group outlived it
after ``dist.destroy_process_group``. A state over a destroyed group failed inside torch. fp8amp's
optimizer over frozen parameters warned about fully_shard. Kept working: mixed gradient dtypes in
``all_reduce_grads``, the FP8 hook under static_graph, find_unused_parameters and no_sync. A limit:
a weight unused on some ranks only under DDP parts the ranks at FP8 weight gradients.
"""

import datetime
import gc
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from comm_ranks import run_hook
from comm_reference import cut_at_chunks, reference_mean, synth
from fp8amp import comm_groups, comm_layout
from fp8amp import distributed as fd
from ranks import error_of, free_port, run_on_ranks

WORLD = 2
# A rank left waiting in a collective gives up after this, not gloo's 30 minutes.
TIMEOUT = datetime.timedelta(seconds=20)


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


def layout_check_subgroup_rank(rank: int) -> dict:
    """all_reduce_grads over a subgroup of ranks 0 and 1 of 3, its layout check run as on NCCL (the
    group has no gloo backend for host tensors), then a group over the whole world."""
    from torch.distributed import distributed_c10d as c10d

    sub = dist.new_group([0, 1])
    out = {}
    if rank in (0, 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)) for p in model.parameters()]
        for device_backend in (comm_groups.device_backend, lambda group, device: "nccl"):
            comm_groups.device_backend = device_backend
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            fd.all_reduce_grads(model, fd.FP8CommState(sub, method="all_to_all"))
            out.setdefault("grads", []).append([p.grad for p in model.parameters()])
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, c10d._world.group_count)  # over the default group: no new group
    out["counts"] = counts
    if len(set(counts)) == 1:  # else the world group below would hang in its rendezvous
        t = torch.ones(1)
        dist.all_reduce(t, group=dist.new_group([0, 1, 2]))
        out["world"] = t.item()
    return out


def test_layout_check_over_a_subgroup_keeps_the_group_count_in_step():
    results = run_on_ranks(layout_check_subgroup_rank, 3, timeout=TIMEOUT)
    for r in results:
        assert len(set(r["counts"])) == 1, r["counts"]
        assert r["world"] == 3
    for r in results[:2]:
        gloo, as_nccl = r["grads"]
        assert all(torch.equal(a, b) for a, b in zip(gloo, as_nccl))


SIZES, CHUNKS = (70, 1, 130, 64), 3  # a chunked bucket: its amaxes go over the derived communicator


def registered(group) -> bool:
    try:
        dist.get_backend(group)
    except ValueError:
        return False
    return True


def chunked(rank: int, group) -> tuple:
    x = synth(rank, SIZES, torch.float32)
    state = fd.FP8CommState(group, method="all_to_all", pipeline_chunks=CHUNKS, scales_per_chunk=True)
    return x, run_hook(x, SIZES, state, torch.device("cpu"))


def destroyed_groups_rank(rank: int, port: int) -> dict:
    """Chunked reductions over a group of every rank, destroyed and made again (its object then
    collected, so that its id may be reused), then over the world, destroyed and initialized again."""
    out = {"runs": []}
    group = dist.new_group([0, 1])
    out["runs"].append(chunked(rank, group))
    derived = [g for key, g in comm_groups._DERIVED_GROUPS.items() if key[0] is group]
    dist.destroy_process_group(group)
    del group
    gc.collect()
    out["runs"].append(chunked(rank, dist.new_group([0, 1])))
    out["first_derived_destroyed"] = [not registered(g) for g in derived]
    dist.destroy_process_group()  # every group, the derived ones too
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=TIMEOUT)
    out["runs"].append(chunked(rank, None))
    # Every cached group is one torch still holds, and so is every group derived from one.
    out["live_keys"] = [registered(key[0]) for key in comm_groups._DERIVED_GROUPS]
    out["live_derived"] = [registered(g) for g in comm_groups._DERIVED_GROUPS.values()]
    return out


def test_derived_groups_do_not_outlive_their_group():
    results = run_on_ranks(destroyed_groups_rank, WORLD, free_port(), timeout=TIMEOUT)
    bounds = comm_layout.chunk_bounds(sum(SIZES), CHUNKS, "all_to_all")
    pairs = list(zip(bounds[:-1], bounds[1:]))
    for run in range(3):
        xs = [r["runs"][run][0] for r in results]
        expected = reference_mean(xs, cut_at_chunks(SIZES, pairs), fp8amp.E4M3, "all_to_all", pairs)
        assert all(torch.equal(r["runs"][run][1], expected) for r in results), run
    for r in results:
        assert r["live_keys"] == [True] and r["live_derived"] == [True], r
        assert r["first_derived_destroyed"] == [True]


def values(model: nn.Module) -> list:
    return [p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p.detach().clone() for p in model.parameters()]


def test_an_optimizer_over_frozen_parameters_does_not_warn_about_fully_shard():
    """The warning that an optimizer holds parameters the model no longer uses (built before
    fully_shard) came for parameters that are frozen, which get no gradient by design."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
    model.requires_grad_(False)  # a backbone frozen for a phase of training
    before = values(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, values(model)))
    model[1].bias.requires_grad_(True)  # a trainable parameter without a gradient is still said
    with pytest.warns(UserWarning, match="none of its 1 parameter.s. has a gradient"):
        optimizer.step()


def destroyed_state_group_rank(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    group = dist.new_group([0, 1])
    state = fd.FP8CommState(group)
    dist.destroy_process_group(group)
    return {"error": error_of(lambda: fd.all_reduce_grads(model, state))}


def test_a_state_over_a_destroyed_group_says_so():
    # It was a TypeError from inside torch: "Invariant encountered: value was None when it should not be".
    for r in run_on_ranks(destroyed_state_group_rank, WORLD, timeout=TIMEOUT):
        assert r["error"].startswith("ValueError") and "process_group" in r["error"], r["error"]
        assert "destroy_process_group" in r["error"], r["error"]


class Branch(nn.Module):
    """A block whose middle layer runs only where ``use_b`` (conditional computation, a router)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(h)) if use_b else h)


def unused_on_one_rank_rank(rank: int, weight_grad: str) -> dict:
    """DDP (find_unused_parameters) at O2, 3 ranks: the second step uses layer b on ranks 1 and 2 only."""
    torch.manual_seed(0)
    model = Branch()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2",
                                         weight_grad=weight_grad)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    for step in range(2):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x, step == 0 or rank != 0).square().mean().backward()
        grad_type = type(model.b.weight.grad).__name__
        optimizer.step()
        optimizer.zero_grad()
    return {"b": model.b.weight.dequantize(), "grad_type": grad_type}


def test_a_weight_unused_on_one_rank_under_ddp_parts_the_ranks_at_fp8_weight_gradients():
    """A limit (docs/hardening.md): DDP gives the rank that did not use the weight the float32 mean
    in a new plain tensor, the others its E4M3 requantization in their FP8 gradients; fp8amp has no
    hook in DDP's reducer. Float32 weight gradients (weight_grad="fp32") keep the ranks identical."""
    fp8 = run_on_ranks(unused_on_one_rank_rank, 3, "fp8", timeout=TIMEOUT)
    assert [r["grad_type"] for r in fp8] == ["Tensor", "ScaledTensor", "ScaledTensor"]
    assert torch.equal(fp8[1]["b"], fp8[2]["b"]) and not torch.equal(fp8[0]["b"], fp8[1]["b"])
    fp32 = run_on_ranks(unused_on_one_rank_rank, 3, "fp32", timeout=TIMEOUT)
    assert all(torch.equal(r["b"], fp32[0]["b"]) for r in fp32)


def mixed_dtypes_rank(rank: int) -> tuple:
    """all_reduce_grads of an O2 model whose layers are float32, bfloat16 (FP8 weight gradients of
    both logical dtypes) and float16 (a Linear FP8 cannot take: 8 outputs), in one call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16).to(torch.bfloat16),
                          nn.Linear(16, 8).to(torch.float16))
    model, _ = fp8amp.initialize(model, None, "O2")
    g = torch.Generator().manual_seed(rank)
    for p in model.parameters():
        v = (torch.randn(p.shape, generator=g) * (1 + 5 * rank)).to(p.dtype)
        p.grad = fp8amp.ScaledTensor.from_tensor(v, fp8amp.E4M3) if isinstance(p, fp8amp.ScaledTensor) else v
    before = values_of_grads(model)
    fd.all_reduce_grads(model, fd.FP8CommState(method="all_to_all"))
    return before, values_of_grads(model), [type(p.grad) for p in model.parameters()]


def values_of_grads(model: nn.Module) -> list:
    return [p.grad.dequantize() if isinstance(p.grad, fp8amp.ScaledTensor) else p.grad.clone()
            for p in model.parameters()]


def test_all_reduce_grads_of_mixed_dtypes_equals_the_reference_per_dtype_bucket():
    results = run_on_ranks(mixed_dtypes_rank, WORLD, timeout=TIMEOUT)
    before, _, types = results[0]
    assert types.count(fp8amp.ScaledTensor) == 2  # the FP8 gradients stay FP8 (written back through copy_)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one bucket each, in parameter order
        idx = [i for i, g in enumerate(before) if g.dtype == dtype]
        xs = [torch.cat([r[0][i].reshape(-1) for i in idx]) for r in results]
        expected = reference_mean(xs, [before[i].numel() for i in idx], fp8amp.E4M3, "all_to_all")
        for i, piece in zip(idx, expected.split([before[i].numel() for i in idx])):
            piece = piece.view(before[i].shape)
            if types[i] is fp8amp.ScaledTensor:  # the mean requantized by copy_
                piece = fp8amp.ScaledTensor.from_tensor(piece, fp8amp.E4M3).dequantize()
            assert all(torch.equal(r[1][i], piece) for r in results), (dtype, i)


DDP_CONFIGS = ("static_graph", "find_unused", "no_sync")
LR = 1e-2


def ddp_configs_rank(rank: int) -> dict:
    """DDP at O2 with static_graph, with find_unused_parameters (layer b unused by every rank in the
    second step) and with a no_sync micro-batch before each synced one, each with the FP8 hook and
    with DDP's float32 all-reduce: the weights after each of 3 steps."""
    out = {}
    for config in DDP_CONFIGS:
        for hook in (True, False):
            torch.manual_seed(0)
            model = Branch()
            model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2")
            ddp = nn.parallel.DistributedDataParallel(model, static_graph=config == "static_graph",
                                                      find_unused_parameters=config == "find_unused")
            if hook:
                ddp.register_comm_hook(fd.FP8CommState(method="all_to_all"), fd.fp8_allreduce_hook)
            for step in range(3):
                use_b = not (config == "find_unused" and step == 1)
                xs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + 10 * m + rank))
                      for m in range(2)]
                if config == "no_sync":
                    with ddp.no_sync():
                        ddp(xs[1], use_b).square().mean().backward()
                ddp(xs[0], use_b).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                out[config, hook, step] = values(model)
    return out


def test_the_fp8_hook_under_static_graph_unused_parameters_and_no_sync():
    results = run_on_ranks(ddp_configs_rank, WORLD, timeout=TIMEOUT)
    for config in DDP_CONFIGS:
        for step in range(3):
            hook = results[0][config, True, step]
            assert all(torch.equal(a, b) for a, b in zip(hook, results[1][config, True, step])), (config, step)
            # FP8 gradients against float32 ones: Adam moves a weight by at most about lr a step
            for a, b in zip(hook, results[0][config, False, step]):
                assert (a - b).abs().max() <= 2 * LR * (step + 1), (config, step)


def broadcast_into_views_rank(rank: int) -> dict:
    torch.manual_seed(rank)
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(32, 32)), None, "O2")
    w = model[0].weight
    before = w.dequantize()
    out = {}
    with torch.no_grad():  # where a master's views write into it (docs/hardening.md)
        for name, view in (("transpose", lambda: w.t()), ("columns", lambda: w[:, :8])):
            out[name] = error_of(lambda: dist.broadcast(view(), 0))
    out["kept"] = torch.equal(w.dequantize(), before)
    return out


def test_a_collective_on_a_view_of_a_master_is_refused():
    # It ran on a dequantized copy: a broadcast into w.t() left every rank's master as it was, silently.
    for r in run_on_ranks(broadcast_into_views_rank, WORLD, timeout=TIMEOUT):
        for name in ("transpose", "columns"):
            assert r[name].startswith("NotImplementedError") and "dequantize()" in r[name], r[name]
        assert r["kept"]
