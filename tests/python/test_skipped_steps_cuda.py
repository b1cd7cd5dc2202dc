"""Skipped steps and evaluation on the GPU (2026-12-07): the CPU tests of test_overflow_steps_usage.py
and test_eval_usage.py run their paths through the CPU kernels; these run the CUDA ones, where the
dropped non-finite amaxes, the weight cast's ``record`` and the inference-tensor checks meet the
CUDA casts and GEMMs. Compared with plain torch on the same GPU (FP8 tolerances) or with the same
model without the evaluation (bit for bit)."""

import copy

import pytest
import torch
from torch import nn

import fp8amp
from tiny_mlp import regression_batches, tiny_mlp

pytestmark = pytest.mark.gpu
LEVELS = ("fp8", "O1", "O2")


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.dequantize() if isinstance(t, fp8amp.ScaledTensor) else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _real(a).float(), _real(b).float()
    return float((a - b).norm() / b.norm())


def _converted(level, recipe="tensorwise"):
    model = tiny_mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level == "fp8":
        return fp8amp.convert(model, optimizer=optimizer, recipe=recipe, policy="all"), optimizer
    return fp8amp.initialize(model, optimizer, level, recipe=recipe, policy="all")


@pytest.mark.parametrize("clear", ["optimizer.zero_grad", "model.zero_grad"])
@pytest.mark.parametrize("level", LEVELS)
def test_the_step_after_a_skipped_first_step_on_cuda(level, clear):
    """GradScaler skips a first step whose batch holds an inf; the next step's output and gradients
    match plain torch's on the same GPU, and no history keeps a non-finite amax."""
    model, optimizer = _converted(level)
    plain = tiny_mlp().cuda()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    results = []
    for net, opt in ((model, optimizer), (plain, plain_optimizer)):
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
        for i, (x, y) in enumerate(regression_batches(2)):
            x, y = x.cuda() * 1000, y.cuda()
            if i == 0:
                x[0, 0] = float("inf")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net(x).float()
            loss = nn.functional.mse_loss(out, y)
            if i == 1:
                loss.backward()
                results.append((out.detach(), [p.grad for p in net.parameters()]))
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                assert scaler.get_scale() == 2.0**7
            (opt if clear == "optimizer.zero_grad" else net).zero_grad()
    (out, grads), (expected, expected_grads) = results
    assert _rel(out, expected) < 0.1
    assert all(_rel(g, e) < 0.2 for g, e in zip(grads, expected_grads))
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(model))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("level", LEVELS)
def test_eval_and_inference_mode_copies_on_cuda(level, recipe):
    """After training steps: eval forwards (no_grad, inference_mode) leave every buffer bit for bit;
    a copy made inside inference_mode gives the model's outputs there and under no_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level == "fp8":
        fp8amp.convert(model, optimizer=optimizer, recipe=recipe, policy="all")
    else:
        model, optimizer = fp8amp.initialize(model, optimizer, level, recipe=recipe, policy="all")
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(torch.randn(64, 128, device="cuda")).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    before = {name: b.clone() for name, b in model.named_buffers()}
    x = torch.randn(48, 128, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = model(x)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(model(x), expected)
        served = copy.deepcopy(model)
        assert torch.equal(served(x), expected)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(served(x), expected)
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())
