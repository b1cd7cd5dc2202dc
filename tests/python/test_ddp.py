"""Fp8Linear under stock DistributedDataParallel: 2 processes on CPU with gloo (FP8 emulation).

DDP all-reduces the (high-precision) gradients of the shared parameters and broadcasts rank 0's
buffers, the scaling state included, before each forward. fp8amp.update_scaling MAX-reduces the
ranks' amaxes before it updates the scales (fp8amp.amax_sync), so the buffers are already the same
on every rank when DDP broadcasts them, and the delayed scales follow the largest amax over the
ranks, not rank 0's (tests/python/test_amax_sync.py checks every buffer after every step).
"""

import torch
from torch import nn

import fp8amp
from ranks import run_on_ranks

WORLD_SIZE = 2
STEPS = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return fp8amp.convert(model)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))


def train_rank(rank: int) -> dict:
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        model(batch(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        fp8amp.update_scaling(model)
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def test_ddp_replicas_stay_identical_and_train():
    states = run_on_ranks(train_rank, WORLD_SIZE)
    for key in ("0.weight", "0.bias", "2.weight", "2.bias", "0.input_scaling.counter"):
        assert torch.equal(states[0][key], states[1][key]), key
    # The last recorded input amax is the max over both ranks' batches, on both ranks.
    expected = max(batch(STEPS - 1, 0).abs().max(), batch(STEPS - 1, 1).abs().max())
    assert states[0]["0.input_scaling.amax_history"][0, 1] == states[1]["0.input_scaling.amax_history"][0, 1] == expected
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
    initial = make_model().state_dict()
    assert not torch.equal(states[0]["0.weight"], initial["0.weight"])  # it did train
    assert states[0]["0.input_scaling.counter"].tolist() == [STEPS]


def o2_rank(rank: int) -> dict:
    """O2 under stock DDP: one backward per rank; the all-reduced FP8 gradient and the weights after
    one step, from each rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    local = fp8amp.initialize(make_model(), None, "O2")[0]  # the same weights, no DDP
    local.load_state_dict(model.state_dict())
    local(batch(0, rank)).pow(2).mean().backward()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp(batch(0, rank)).pow(2).mean().backward()
    grad = model[0].weight.grad
    result = dict(grad_type=type(grad).__name__, grad=grad.dequantize(), local_grad=local[0].weight.grad.dequantize())
    opt.step()
    return dict(result, weight=model[0].weight.dequantize())


def test_ddp_with_o2_averages_fp8_gradients():
    """Stock DDP over initialize()'d (O2) modules: DDP copies each E4M3 gradient into its float32
    bucket (dequantized), all-reduces and averages there, and copies the mean back, which
    re-quantizes it (ScaledTensor.copy_). So the gradient is the mean of the ranks' gradients
    rounded once to E4M3 (half an ulp: 2^-4 relative, or 2^-10 of the scale below the normal range),
    and the replicas stay identical. (FP8 gradient communication, docs/distributed.md#design, is not done yet: the
    bytes on the wire are DDP's float32.)"""
    res = run_on_ranks(o2_rank, WORLD_SIZE)
    assert res[0]["grad_type"] == "ScaledTensor"
    mean = (res[0]["local_grad"] + res[1]["local_grad"]) / 2
    for r in res:
        scale = 448.0 / mean.abs().max()  # the new scale is within 2x of this
        assert ((r["grad"] - mean).abs() <= mean.abs() * 2.0 ** -4 + 2.0 ** -9 / scale).all()
    assert torch.equal(res[0]["grad"], res[1]["grad"])
    assert torch.equal(res[0]["weight"], res[1]["weight"])
