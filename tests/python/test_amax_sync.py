"""Rank-consistent delayed scaling (fp8amp.amax_sync, docs/distributed.md#rank-consistent-scaling):
2 and 3 processes on CPU with gloo.

The ranks get batches whose amaxes differ by 10^2 per rank (inputs and output gradients). After
every step each rank snapshots every scaling buffer of the model (amax histories, scales,
scale_inv, counters); the tests require the snapshots to be bit-identical on all ranks, under DDP
(O2, O2 stepped with a closure as Lightning steps, and FP8 compute with the FP8 gradient hook),
FSDP2 (O2, and with more ranks than a weight has
rows: an empty shard), ``all_reduce_grads`` in a plain loop and a plain loop whose model and
update_scaling are compiled, and the recorded amax to be the largest rank's. With the reduction
turned off the ranks' scales part (so the check can fail). Also what the reduction adds to a step
(one collective, three ops), the reduction inside a captured CUDA graph (one GPU, NCCL) and the
walk that finds the delayed states. Each world size spawns its processes once (a module fixture)
and runs every scenario there.

A non-finite gradient on one rank, an optimizer step that raises and bad input are in
test_amax_sync_failures.py; the model, the batches and the spawn in amax_sync_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8amp
from amax_sync_ranks import LR, STEPS, WORLDS, batch, loss_of, make_model, scaling_buffers, spawn
from fp8amp import amax_sync
from fp8amp import distributed as fd
from ranks import free_port


def shard(model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build(scenario: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, bool]:
    """(the model the step runs, the one holding the scaling states, its optimizer, whether the
    loop calls update_scaling and all_reduce_grads itself)."""
    if scenario in ("ddp_o2", "ddp_o2_off", "ddp_o2_closure"):
        model = make_model()
        model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2", policy="all")
        if scenario == "ddp_o2_off":
            assert amax_sync.set_amax_reduction(model, enabled=False) == 6  # 3 states a layer
        return nn.parallel.DistributedDataParallel(model), model, optimizer, False
    if scenario == "ddp_fp8_hook":
        model = fp8amp.convert(make_model(), policy="all")
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(fd.FP8CommState(), fd.fp8_allreduce_hook)
        return ddp, model, torch.optim.SGD(model.parameters(), lr=LR), True
    if scenario == "fsdp_o2":
        model, _ = fp8amp.initialize(make_model(), None, "O2", policy="all")
        shard(model)
        optimizer = fp8amp.optim.AdamW(model.parameters(), lr=LR, state_dtypes="O2")
        optimizer.register_step_post_hook(lambda *_: fp8amp.update_scaling(model))
        return model, model, optimizer, False
    if scenario in ("plain", "plain_compiled"):
        model = fp8amp.convert(make_model(), policy="all")
        stepped = torch.compile(model) if scenario == "plain_compiled" else model
        return stepped, model, torch.optim.SGD(model.parameters(), lr=LR), True
    raise AssertionError(scenario)


def train(rank: int, scenario: str) -> dict:
    """STEPS steps; every scaling buffer after each, and the parameters at the end."""
    stepped, model, optimizer, manual = build(scenario)
    # Compiled, update_scaling breaks its graph at the reduction (torch.compiler.disable).
    update_scaling = torch.compile(fp8amp.update_scaling) if scenario == "plain_compiled" else fp8amp.update_scaling
    snapshots = []
    for step in range(STEPS):
        if scenario == "ddp_o2_closure":  # Lightning's way: the forward and backward inside step()
            def closure(step=step):
                loss = loss_of(stepped, *batch(step, rank))
                loss.backward()
                return loss

            optimizer.step(closure)
            optimizer.zero_grad()
            snapshots.append(scaling_buffers(model))
            continue
        loss_of(stepped, *batch(step, rank)).backward()
        if manual and not isinstance(stepped, nn.parallel.DistributedDataParallel):
            fd.all_reduce_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        if manual:
            update_scaling(model)
        snapshots.append(scaling_buffers(model))

    def real(p):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        return p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p.detach().clone()

    return dict(snapshots=snapshots, params={name: real(p) for name, p in model.named_parameters()})


SCENARIOS = ("ddp_o2", "ddp_o2_off", "ddp_o2_closure", "ddp_fp8_hook", "fsdp_o2", "plain", "plain_compiled")


class OpCounter(TorchDispatchMode):
    """The ops a call dispatches, by name (each compute op is a kernel launch on the GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name().partition(".")[0])  # without the overload
        return func(*args, **(kwargs or {}))


def launches_run(rank: int) -> dict:
    """The ops one update_scaling of an 8-layer model dispatches, with and without the reduction
    (after a first call, whose one-off layout check is not part of a step)."""
    torch.manual_seed(0)
    model = fp8amp.convert(nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)]), policy="all")
    loss_of(model, *batch(0, rank)[:1], torch.ones(16, 32)).backward()
    fp8amp.update_scaling(model)
    out = {}
    for enabled in (True, False):
        amax_sync.set_amax_reduction(model, enabled=enabled)
        loss_of(model, *batch(1, rank)[:1], torch.ones(16, 32)).backward()
        with OpCounter() as counter:
            fp8amp.update_scaling(model)
        out[enabled] = counter.ops
    # With convert's optimizer hooks the collective is issued before the step and waited for after it.
    amax_sync.set_amax_reduction(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    fp8amp.convert(model, optimizer=optimizer, policy="all")
    loss_of(model, *batch(2, rank)[:1], torch.ones(16, 32)).backward()
    with OpCounter() as counter:
        optimizer.step()
    out["hooked_step"] = counter.ops
    return out


def head_model() -> nn.Module:
    """Two Fp8Linears and a 2-row head FP8 cannot take: with 3 ranks the head's last shard is empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 2))


def head_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    return model(batch(step, rank)[0]).square().mean()


def empty_shard_run(rank: int) -> dict:
    """O2 under FSDP2 with more ranks than the head has rows: the local shapes and the weights after
    STEPS steps."""
    model, _ = fp8amp.initialize(head_model(), None, "O2", policy="all")
    shard(model)
    optimizer = fp8amp.optim.AdamW(model.parameters(), lr=LR, state_dtypes="O2")
    optimizer.register_step_post_hook(lambda *_: fp8amp.update_scaling(model))
    for step in range(STEPS):
        head_loss(model, step, rank).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return dict(local={name: tuple(p.to_local().shape) for name, p in model.named_parameters()},
                params={name: p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p for name, p in full.items()},
                buffers=scaling_buffers(model))


def worker(rank: int, world: int) -> dict:
    """Every scenario of this file on one rank (amax_sync_ranks.spawn runs it in each process)."""
    res = {scenario: train(rank, scenario) for scenario in SCENARIOS}
    res["launches"] = launches_run(rank)
    res["empty_shard"] = empty_shard_run(rank)
    return res


@pytest.fixture(scope="module", params=WORLDS)
def run(request):
    return spawn(worker, request.param)


@pytest.mark.parametrize("scenario", [
    "ddp_o2", "ddp_o2_closure", "ddp_fp8_hook", "fsdp_o2", "plain", "plain_compiled"])
def test_scaling_buffers_bit_identical_on_every_rank_after_every_step(run, scenario):
    world, res = run
    for step in range(STEPS):
        snapshot = res[0][scenario]["snapshots"][step]
        assert len(snapshot) == 2 * 3 * 5  # 2 layers, 3 states, 5 buffers (4 saved + the weights' counter)
        for r in res[1:]:
            for name, value in snapshot.items():
                assert torch.equal(r[scenario]["snapshots"][step][name], value), (scenario, step, name)
    for name, value in res[0][scenario]["params"].items():
        for r in res[1:]:
            assert torch.equal(r[scenario]["params"][name], value), (scenario, name)


@pytest.mark.parametrize("scenario", [
    "ddp_o2", "ddp_o2_closure", "ddp_fp8_hook", "fsdp_o2", "plain", "plain_compiled"])
def test_recorded_input_amax_is_the_largest_ranks(run, scenario):
    """After step s the history's column 1 holds step s's amax: for the first layer's input, the
    max over the ranks' batches (the last rank's, 100^r times the others'), not rank 0's."""
    world, res = run
    for step in range(STEPS):
        expected = max(batch(step, r)[0].abs().max() for r in range(world))
        assert expected == batch(step, world - 1)[0].abs().max()
        for r in res:
            history = r[scenario]["snapshots"][step]["0.input_scaling.amax_history"]
            assert history[0, 1] == expected, (scenario, step)


def test_without_the_reduction_the_ranks_scales_part(run):
    """set_amax_reduction(enabled=False): DDP trains the same weights but each rank updates its
    scales from its own amaxes, so the ranks' scaling buffers differ after a step."""
    world, res = run
    for step in range(STEPS):
        first = res[0]["ddp_o2_off"]["snapshots"][step]
        last = res[-1]["ddp_o2_off"]["snapshots"][step]
        assert not torch.equal(first["0.input_scaling.amax_history"], last["0.input_scaling.amax_history"])
        assert not torch.equal(first["2.grad_output_scaling.scale"], last["2.grad_output_scaling.scale"])


def test_one_collective_and_three_ops_per_step(run):
    """What the reduction adds to update_scaling for 8 Fp8Linears (16 delayed states): one
    all_reduce, and three compute ops (the flattening cat, NaN -> inf, one multi-tensor copy back);
    the rest are views. Without it: the two fused updates alone."""
    _, res = run
    for r in res:
        with_reduction, without = r["launches"][True], r["launches"][False]
        assert without == ["fp8amp::multi_update_delayed_scaling"] * 2, without
        views = {"aten::select", "aten::split_with_sizes"}
        added = [op for op in with_reduction[:-2] if op not in views]
        assert added == ["aten::cat", "aten::nan_to_num_", "c10d::allreduce_", "aten::_foreach_copy_"], with_reduction
        assert with_reduction[-2:] == without
        step = r["launches"]["hooked_step"]  # the optimizer's update between the issue and the copy back
        assert step.count("c10d::allreduce_") == 1
        assert step.index("c10d::allreduce_") < step.index("aten::_foreach_add_") < step.index("aten::_foreach_copy_")


@pytest.mark.gpu
def test_reduction_inside_a_captured_cuda_graph():
    """One CUDA rank with NCCL and the group named explicitly (so the all-reduce runs with one
    rank): test_cuda_graph's whole O2 step, captured and replayed, matches eager bit for bit with
    the reduction in it; and a step's reduction reads nothing on the host (sync debug mode)."""
    from test_cuda_graph import WARMUP, assert_bit_identical, data, setup, snapshot
    from fp8amp.testing import train_step

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        batches = data()
        model, optimizer, _ = setup("O2")
        assert amax_sync.set_amax_reduction(model, dist.group.WORLD) == 15
        for x, y in batches:
            train_step(model, optimizer, x, y)
        torch.cuda.synchronize()
        eager = snapshot(model, optimizer)
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert amax_sync.reduce_amaxes(s for m in model.modules() if isinstance(m, fp8amp.Fp8Linear)
                                           for s in (m.input_scaling, m.grad_output_scaling)) == 1
        finally:
            torch.cuda.set_sync_debug_mode(0)

        model, optimizer, _ = setup("O2")
        amax_sync.set_amax_reduction(model, dist.group.WORLD)
        static_x, static_y = (t.clone() for t in batches[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x, y in batches[:WARMUP]:
                train_step(model, optimizer, x, y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            train_step(model, optimizer, static_x, static_y)
        for x, y in batches[WARMUP:]:
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
        torch.cuda.synchronize()
        assert_bit_identical(snapshot(model, optimizer), eager)
    finally:
        dist.destroy_process_group()


def test_more_ranks_than_a_weights_rows(run):
    """A 2-row weight sharded over 3 ranks leaves the last rank an empty shard: it trains all the
    same, the ranks identical, as one process's O2 run on all ranks' batches (within Adam's 2 lr a
    step: the shards' own master scales round differently)."""
    world, res = run
    if world == 3:
        assert [r["empty_shard"]["local"]["4.weight"] for r in res] == [(1, 16), (1, 16), (0, 16)]
    for r in res[1:]:
        for kind in ("params", "buffers"):
            for name, value in res[0]["empty_shard"][kind].items():
                assert torch.equal(r["empty_shard"][kind][name], value), (kind, name)
    model = head_model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2", policy="all",
                                         weight_grad="fp32")
    for step in range(STEPS):
        for rank in range(world):
            (head_loss(model, step, rank) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
    initial = dict(head_model().named_parameters())
    for name, value in model.named_parameters():
        real = value.dequantize() if isinstance(value, fp8amp.ScaledTensor) else value.detach()
        got = res[0]["empty_shard"]["params"][name]
        torch.testing.assert_close(got, real, rtol=0, atol=2 * LR * STEPS, msg=name)
        assert not torch.equal(got, initial[name].detach()), name  # it trained


def test_delayed_states_are_every_fp8_linears_in_module_order_each_once():
    """The hand-made walk finds what model.modules() would: the states of each delayed-scaled
    Fp8Linear once (a shared layer where modules() first meets it), in module order, through
    nested containers, skipping tiled-recipe layers and gaps (None children)."""
    from fp8amp.amax_sync import delayed_states

    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(shared, nn.ReLU(), nn.Sequential(nn.Linear(32, 32))),
                          shared, nn.Linear(32, 32))
    model.register_module("gap", None)
    model.append(nn.Linear(32, 32))
    fp8amp.convert(model, policy="all")
    tiled = fp8amp.convert(nn.Sequential(nn.Linear(128, 128)), recipe="rowwise", policy="all")
    model.append(tiled)
    expected = [s for m in model.modules() if isinstance(m, fp8amp.Fp8Linear) and not m.recipe.tiled
                for s in (m.input_scaling, m.grad_output_scaling)]
    assert len(expected) == 2 * 5
    assert [id(s) for s in delayed_states(model)] == [id(s) for s in expected]
    with pytest.raises(TypeError, match="delayed_states: model must be an nn.Module, got NoneType"):
        delayed_states(None)  # an AttributeError on '_modules', before
