"""FSDP2 (``fully_shard``): 2 processes on CPU with gloo (FP8 emulation).

FP8 compute (``fp8amp.convert`` before ``fully_shard``, the optimizer built after it) trains as one
process does on both ranks' batches. O1/O2 models are refused by name at the first forward:
``fully_shard`` replaces each parameter, so the optimizer ``initialize`` returned would update the
old FP16 masters while the model trained nothing; the same refusal covers
``load_state_dict(assign=True)``, in one process.
"""

import pytest
import torch
from torch import nn

import fp8amp
from ranks import run_on_ranks

WORLD_SIZE = 2
STEPS = 4
LR = 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with the same amax on every rank (one element at 4, the rest inside +-3.9), so that
    both ranks' current scales equal the one process's over both batches."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=g).clamp(-3.9, 3.9)
    x[0, 0] = 4.0
    return x, torch.randn(16, 16, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(x) - target).square().mean()


def shard(model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module)
    fully_shard(model)


def fp8_compute_rank(rank: int) -> dict:
    model = fp8amp.convert(make_model(), policy="all")
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss_of(model, *batch(step, rank)).backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8amp.update_scaling(model)
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def test_fp8_compute_under_fully_shard_trains_as_one_process():
    ranks = run_on_ranks(fp8_compute_rank, WORLD_SIZE)
    # One process: both ranks' batches as micro-batches of one step (FSDP2 averages the gradients).
    model = fp8amp.convert(make_model(), policy="all")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        for rank in range(WORLD_SIZE):
            (loss_of(model, *batch(step, rank)) / WORLD_SIZE).backward()
        optimizer.step()
        optimizer.zero_grad()
        fp8amp.update_scaling(model)
    initial = dict(make_model().named_parameters())
    assert set(ranks[0]) == set(initial) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, reference in model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        torch.testing.assert_close(ranks[0][name], reference.detach(), msg=name)
        assert not torch.equal(ranks[0][name], initial[name].detach()), name  # it trained


def o2_rank(rank: int) -> str:
    model = make_model()
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), "O2")
    shard(model)
    try:
        loss_of(model, *batch(0, rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_o2_under_fully_shard_is_refused_by_name():
    messages = run_on_ranks(o2_rank, WORLD_SIZE)
    for message in messages:
        assert "FP16 master (O1/O2)" in message and "fully_shard" in message, message
        assert "fp8amp.convert(model)" in message, message


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_replaced_master_is_refused_at_forward(level):
    model = make_model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), level)
    x, target = batch(0, 0)
    loss_of(model, x, target).backward()  # the masters are in place: it runs
    plain = {k: v.clone() for k, v in model.state_dict().items()}  # real values, plain tensors
    model.load_state_dict(plain, assign=True)
    with pytest.raises(RuntimeError, match=r"weight is now a Parameter of torch.float32.*assign=True"):
        model(x)
