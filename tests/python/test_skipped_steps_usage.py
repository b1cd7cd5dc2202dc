"""The skipped-step hook (fp8amp/skipped_steps.py) as users meet it: a step skipped without
``optimizer.step()`` must not leave its inf / NaN amaxes to the next step's casts, whatever the
model went through after its registration, and a normal step must not pay for the hook. Each run is
compared with the same loop on the unconverted model with plain torch."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode

import fp8amp
from tiny_mlp import regression_batches, tiny_mlp


def _converted(level):
    """The tiny MLP at ``level`` (``"fp8"``: ``convert`` with torch's AdamW) and a plain copy, each
    with its optimizer."""
    model = tiny_mlp()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level == "fp8":
        fp8amp.convert(model, optimizer=optimizer, policy="all")
    else:
        model, optimizer = fp8amp.initialize(model, optimizer, level, policy="all")
    return (model, optimizer), (plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.dequantize() if isinstance(a, fp8amp.ScaledTensor) else a.detach()
    return float((a - b.detach()).norm() / b.detach().norm())


def _output_after_a_skipped_first_step(model, optimizer, call=nn.Module.__call__):
    """An inf in the first batch (activations ~1000) skips that step through GradScaler; gradients
    cleared with ``model.zero_grad()`` (the Hugging Face Trainer's way). The second step's output
    (each forward: ``call(model, x)``)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    (x0, y0), (x1, _) = regression_batches(2)
    x0 = x0 * 1000
    x0[0, 0] = float("inf")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(call(model, x0).float(), y0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**7  # (skipped)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return call(model, x1 * 1000).float()


class _Times1(nn.Module):
    def forward(self, weight):
        return weight * 1


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_a_skipped_step_is_dropped_after_the_first_layer_is_parametrized(level):
    """A parametrization added to the first layer's weight after the registration (weight norm,
    spectral norm) moves the parameter the hook reads to ``parametrizations.weight.original``: the
    hook found no parameter by its old name and never dropped again, and the step after a skipped
    one came out 69 % off torch's, silently. It looks the model's first trained parameter up again."""
    (model, optimizer), (plain, plain_optimizer) = _converted(level)
    for net in (model, plain):
        parametrize.register_parametrization(net[0], "weight", _Times1())
    out = _output_after_a_skipped_first_step(model, optimizer)
    assert _rel(out, _output_after_a_skipped_first_step(plain, plain_optimizer)) < 0.1
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(model))


class _Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_freezing_the_first_parameter_after_registration_adds_no_work_to_a_step(level):
    """Freezing the first layer after the registration (embeddings frozen for fine-tuning, PEFT over a
    registered model) left the hook reading a gradient that stays None: every micro-batch after the
    first of each step read as a new step after a skipped one and ran the drop (its launches in
    every normal step). It reads the first parameter still trained instead; a skipped step is
    still dropped. (The micro-batches of the model's first step drop whatever the gradients:
    test_skipped_steps_trainers_usage.py.)"""
    (model, optimizer), _ = _converted(level)
    model[0].weight.requires_grad_(False)
    batches = regression_batches(3)
    for step in range(3):
        with _Launches() as launches:
            for x, y in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(model(x).float(), y) / 3
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert launches.ops.count(torch.ops.aten.nan_to_num_.default) == (2 if step == 0 else 0)
    _output_after_a_skipped_first_step(model, optimizer)
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(model))


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_a_skipped_step_is_dropped_under_reentrant_checkpointing_of_the_whole_model(level):
    """``checkpoint(model, x, use_reentrant=True)`` runs the model's forward under ``no_grad`` and
    again in backward, so the hook saw no training forward and never dropped: the step after a
    skipped one recomputed its forward with the stored scale and its gradients came out 78 % off
    torch's (19 % without the skip, as without checkpointing). The recomputed forward of a
    reentrant checkpoint now counts as the training forward."""
    (model, optimizer), (plain, plain_optimizer) = _converted(level)
    grads = []
    for net, opt in ((model, optimizer), (plain, plain_optimizer)):
        def ckpt(m, x):
            return torch.utils.checkpoint.checkpoint(m, x.requires_grad_(), use_reentrant=True)
        out = _output_after_a_skipped_first_step(net, opt, ckpt)
        nn.functional.mse_loss(out, regression_batches(2)[1][1]).backward()
        grads.append([p.grad for p in net.parameters()])
    assert all(_rel(g, e) < 0.3 for g, e in zip(*grads))
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(model))


def test_a_copy_made_inside_a_training_step_runs_the_check():
    """A deep copy made inside ``fp8amp.skipped_steps.training_step`` (an EMA copy in a Lightning
    ``training_step``) is not inside a step: its own forwards still drop a skipped step's amaxes."""
    (model, _), _ = _converted("O2")
    with fp8amp.skipped_steps.training_step(model):
        ema = copy.deepcopy(model)
    states = fp8amp.amax_sync.delayed_states(ema)
    x = regression_batches(1)[0][0]
    ema(x)  # (the first training forward: nothing to drop)
    for s in states:
        s.amax_history[:, 0] = float("inf")
    ema(x)  # no step since, no gradient: the check drops, then the casts record
    assert all(bool(s.amax_history[:, 0].isfinite().all()) for s in states)
