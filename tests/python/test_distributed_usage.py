"""fp8amp used as users do with torch.distributed: 2 processes on CPU with gloo (FP8 emulation).

DDP with uneven inputs (torch's ``Join`` context: a rank that runs out of batches shadows the
others' collectives until they finish): the amax reduction of ``fp8amp.update_scaling`` is one
more collective a step, which ``fp8amp.amax_sync.AmaxReductionJoin`` shadows on the rank that
has joined (without it the ranks waited for each other until the collective timeout); at the end
every rank takes the last joiner's scaling buffers, also with ``broadcast_buffers=False``.

The FP8 gradient hook on a model with a frozen layer, a zero-size, a 0-dim and an odd-sized
parameter, a NaN in one rank's batch: every rank skips that step together and trains on after it.

``fp8amp.initialize`` of a model already wrapped in DDP (the wrong order) is refused by name: DDP's
reducer holds the Linear weights that initialize replaces by masters, so with
``find_unused_parameters=True`` the masters' gradients were never all-reduced and the ranks' weights
parted silently (without it, DDP's own error blamed unused parameters).

FSDP2: ``enable_fp8_all_gather`` after ``fully_shard`` (the wrong order) is refused by name (FSDP2
failed at the first forward with an AttributeError about ``_local_tensor``); ``fp8_reduce_scatter``
given a process group this rank is not in says so (it said "world size (-1)").
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8amp
from fp8amp.amax_sync import AmaxReductionJoin
from fp8amp.distributed import FP8CommState, fp8_allreduce_hook
from ranks import run_on_ranks

WORLD = 2
# A rank left waiting in a collective gives up after this, not gloo's 30 minutes.
TIMEOUT = datetime.timedelta(seconds=20)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + 3 * rank)


def real(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, fp8amp.ScaledTensor) else t.detach().clone()


def uneven_rank(rank: int, hook: bool, accumulate: bool, broadcast_buffers: bool) -> dict:
    """Rank 1 has 2 batches more than rank 0 (2 micro-batches a step when ``accumulate``)."""
    model = make_model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    if hook:
        ddp.register_comm_hook(FP8CommState(method="all_to_all"), fp8_allreduce_hook)
    steps = 2 + 2 * rank
    with torch.distributed.algorithms.Join([ddp, AmaxReductionJoin(model, ddp)]):
        for step in range(steps):
            if accumulate:
                with ddp.no_sync():
                    ddp(batch(step + 50, rank)).pow(2).mean().backward()
            ddp(batch(step, rank)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"params": {k: real(p) for k, p in model.named_parameters()},
            "buffers": {k: b.clone() for k, b in model.named_buffers()}}


@pytest.mark.parametrize("hook, accumulate, broadcast_buffers", [
    (False, False, True), (True, False, True), (False, True, True), (True, True, False)],
    ids=["allreduce", "fp8_hook", "no_sync", "fp8_hook-no_sync-no_broadcast_buffers"])
def test_uneven_inputs_under_join_finish_with_identical_ranks(hook, accumulate, broadcast_buffers):
    res = run_on_ranks(uneven_rank, WORLD, hook, accumulate, broadcast_buffers, timeout=TIMEOUT)
    # At the end the last joiner's parameters go to the others (DDP's join hook), and its scaling
    # buffers (AmaxReductionJoin's: DDP's sends buffers only with broadcast_buffers=True).
    for kind in ("params", "buffers"):
        for name, value in res[1][kind].items():
            assert torch.equal(res[0][kind][name], value), name
    # 4 steps on rank 1 (the last 2 with rank 0's share zero): the counters counted them.
    assert res[0]["buffers"]["0.input_scaling.counter"].tolist() == [4]


class Odd(nn.Module):
    """A Linear FP8 takes, a frozen one, one it cannot (7 outputs), a zero-size and a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.frozen, self.odd = nn.Linear(32, 48), nn.Linear(48, 48), nn.Linear(48, 7)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0))
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.odd(torch.relu(self.frozen(torch.relu(self.a(x))))) * self.gain + self.empty.sum()


def nan_on_one_rank_rank(rank: int) -> list:
    model = Odd()
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(trained, lr=1e-2), "O2")
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(FP8CommState(method="all_to_all"), fp8_allreduce_hook)
    params = []
    for step in range(3):
        x = batch(step, rank)
        if step == 1 and rank == 1:
            x[0, 0] = float("nan")
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        params.append({k: real(p) for k, p in model.named_parameters()})
    return params


def test_fp8_hook_nan_on_one_rank_skips_the_step_on_every_rank_with_odd_parameters():
    res = run_on_ranks(nan_on_one_rank_rank, WORLD, timeout=TIMEOUT)
    for step in range(3):
        for name, value in res[0][step].items():
            assert torch.equal(value, res[1][step][name]), (step, name)
    for name, value in res[0][1].items():
        assert torch.equal(value, res[0][0][name]), name  # the NaN step: skipped
    assert not torch.equal(res[0][2]["a.weight"], res[0][1]["a.weight"])  # and training goes on
    assert torch.equal(res[0][2]["frozen.weight"], res[0][0]["frozen.weight"])


def value_error_of(call) -> str:
    """The message of the ValueError ``call()`` raises on this rank, or "accepted"."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return "accepted"


def wrong_order_rank(rank: int) -> str:
    model = make_model()
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    ddp = nn.parallel.DistributedDataParallel(model)
    return value_error_of(lambda: torch.distributed.algorithms.Join([AmaxReductionJoin(model, ddp), ddp]))


def test_amax_reduction_join_listed_before_ddp_is_refused():
    for message in run_on_ranks(wrong_order_rank, WORLD, timeout=TIMEOUT):
        assert "list the DistributedDataParallel first" in message, message
    with pytest.raises(TypeError, match="ddp must be"):
        AmaxReductionJoin(make_model(), make_model())


def fp8_all_gather_after_fully_shard_rank(rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8amp.fsdp import enable_fp8_all_gather

    model = fp8amp.convert(make_model(), policy="all")
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return value_error_of(lambda: enable_fp8_all_gather(model))


def test_enable_fp8_all_gather_after_fully_shard_is_refused_by_name():
    for message in run_on_ranks(fp8_all_gather_after_fully_shard_rank, WORLD, timeout=TIMEOUT):
        assert "0 is already sharded by fully_shard" in message, message
        assert "before fully_shard" in message


def initialize_after_ddp_rank(rank: int) -> str:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    return value_error_of(lambda: fp8amp.initialize(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), "O2"))


def test_initialize_of_a_ddp_wrapped_model_is_refused_by_name():
    for message in run_on_ranks(initialize_after_ddp_rank, WORLD, timeout=TIMEOUT):
        assert "DistributedDataParallel" in message and "before wrapping" in message, message


def reduce_scatter_outside_group_rank(rank: int) -> str:
    from fp8amp.fsdp import fp8_reduce_scatter

    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes both
    return value_error_of(lambda: fp8_reduce_scatter(torch.zeros(4), torch.ones(4), groups[1 - rank]))


def test_fp8_reduce_scatter_over_a_group_without_this_rank_is_refused_by_name():
    for message in run_on_ranks(reduce_scatter_outside_group_rank, WORLD, timeout=TIMEOUT):
        assert "not a member of group" in message, message
