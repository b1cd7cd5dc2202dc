"""Steps with an overflow, a NaN or an inf at O1/O2 (2026-12-07), as users meet them: GradScaler
skipping steps (an inf input, a NaN micro-batch, float16 backoff and growth), a loop that skips a
NaN loss itself, and fp8amp's own skip without a GradScaler. Each run is compared with the same
loop on the unconverted model with plain torch: the same steps skipped, the same step counts,
scaler scales and lr, weights within FP8 training's distance."""

import copy

import pytest
import torch
from torch import nn

import fp8amp
from tiny_mlp import regression_batches, tiny_mlp

LEVELS = ("O1", "O2")


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.dequantize() if isinstance(t, fp8amp.ScaledTensor) else t


def _pair(level, lr=1e-2):
    """The tiny MLP at ``level`` with its optimizer, and the same model unconverted with torch's AdamW.
    ``"fp8"``: FP8 compute (``convert``) stepped by torch's AdamW."""
    model = tiny_mlp()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if level == "fp8":
        fp8amp.convert(model, optimizer=optimizer, policy="all")
    else:
        model, optimizer = fp8amp.initialize(model, optimizer, level, policy="all")
    return (model, optimizer), (plain, torch.optim.AdamW(plain.parameters(), lr=lr))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.detach()
    return float((_real(a) - b).norm() / b.norm())


@pytest.mark.parametrize("clear", ["optimizer.zero_grad", "model.zero_grad"])
@pytest.mark.parametrize("skip", ["GradScaler", "by hand"])
@pytest.mark.parametrize("level", ("fp8",) + LEVELS)
def test_the_step_after_a_skipped_first_step_casts_with_its_own_amax(level, skip, clear):
    """An inf in the first batch (activations ~1000, beyond E4M3's 448 at scale 1) skips that step
    without ``optimizer.step()``: GradScaler's skip, or a loop that skips a non-finite loss itself.
    The next step is still in warm-up (current scaling). Its casts folded their amax into the inf
    the skipped step left in the history, and took the stored scale (1, none made yet): the
    output was 69 % off torch's, silently. The skipped step's non-finite amaxes are dropped before
    the next step's casts: at fp8amp's optimizer's ``zero_grad``, and for torch's optimizer (FP8
    compute) or gradients cleared by ``model.zero_grad()`` (the Hugging Face Trainer's way) at the
    next training forward (fp8amp.skipped_steps)."""
    fp8, plain = _pair(level)
    batches = [(x * 1000, y) for x, y in regression_batches(2)]
    results = []
    for model, optimizer in (fp8, plain):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for i, (x, y) in enumerate(batches):
            x = x.clone()
            if i == 0:
                x[0, 0] = float("inf")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x).float()
            loss = nn.functional.mse_loss(out, y)
            if i == 1:
                loss.backward()
                results.append((out.detach(), [p.grad for p in model.parameters()]))
            elif skip == "GradScaler":
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                assert scaler.get_scale() == 2.0**7  # (skipped)
            else:
                assert not loss.isfinite()
            (optimizer if clear == "optimizer.zero_grad" else model).zero_grad()
    (out, grads), (expected, expected_grads) = results
    assert _rel(out, expected) < 0.1
    assert all(_rel(g, e) < 0.2 for g, e in zip(grads, expected_grads))
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(fp8[0]))


@pytest.mark.parametrize("level", LEVELS)
def test_grad_scaler_skips_the_steps_torch_skips_over_a_run(level):
    """float16 autocast, 4 micro-batches a step, an inf input at step 3 and a NaN in one
    micro-batch at step 9, clipping after ``unscale_``, a growing scaler and an lr schedule: the
    scaler's scale, every step count and the lr equal torch's at every step, the losses and weights
    stay within FP8's distance, and no inf / NaN amax is left in any history."""
    (model, optimizer), (plain, plain_optimizer) = _pair(level)
    batches = regression_batches(4 * 14)
    runs = []
    for net, opt in ((model, optimizer), (plain, plain_optimizer)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 14)
        trace = []
        for i in range(14):
            total = 0.0
            for j, (x, y) in enumerate(batches[4 * i:4 * i + 4]):
                x = x.clone()
                if (i, j) in ((3, 0), (9, 2)):
                    x[1, 3] = float("inf") if i == 3 else float("nan")
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(net(x).float(), y) / 4
                scaler.scale(loss).backward()
                total += loss.item()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            schedule.step()
            trace.append((total, scaler.get_scale(), sorted({float(s["step"]) for s in opt.state.values()}),
                          schedule.get_last_lr()))
        runs.append(trace)
    for i, (mine, torchs) in enumerate(zip(*runs)):
        assert mine[1:] == torchs[1:], i
        if i in (3, 9):
            assert not torch.isfinite(torch.tensor([mine[0], torchs[0]])).any()
        else:
            assert abs(mine[0] - torchs[0]) < 0.02 * torchs[0], i
    assert runs[0][-1][2] == [12.0]  # (14 steps, 2 skipped)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert _rel(p, q) < 0.1
    assert all(bool(s.amax_history.isfinite().all()) for s in fp8amp.amax_sync.delayed_states(model))


def test_the_skip_watch_follows_copies_and_leaves_with_unconvert():
    """The forward pre-hook that drops a skipped step's amaxes reads its record from the module it is
    called with: a deep copy (an EMA model, ``copy.deepcopy((model, optimizer))``) carries its own,
    and dropping on the copy leaves the original's histories alone. ``unconvert`` removes both."""
    (model, optimizer), _ = _pair("O2")
    copy_model = copy.deepcopy(model)
    states = fp8amp.amax_sync.delayed_states(model)
    copy_states = fp8amp.amax_sync.delayed_states(copy_model)
    for s in states + copy_states:
        s.amax_history[:, 0] = float("inf")
    x = regression_batches(1)[0][0]
    copy_model(x)  # (first forward: nothing to drop) ...
    copy_model(x)  # ... the second, with no step between and no gradient: a new step
    assert all(bool(s.amax_history[:, 0].isfinite().all()) for s in copy_states)
    assert all(bool(s.amax_history[:, 0].isinf().all()) for s in states)
    fp8amp.unconvert(model, optimizer)
    assert not model._forward_pre_hooks and "_fp8amp_skip_watch" not in model.__dict__


def test_a_model_run_twice_before_its_backward_keeps_both_views_amaxes():
    """Two views of a batch, as self-supervised training runs them: the second forward comes with no
    step since the first and no gradient yet, as the step after a skipped one does, so the hook
    drops there too, but only non-finite amaxes: the first view's larger amax stays in the
    history at every step."""
    (model, optimizer), _ = _pair("O2")
    x = regression_batches(1)[0][0]
    first_input = fp8amp.amax_sync.delayed_states(model)[0]
    for _ in range(3):
        loss = model(x * 8).square().mean() + model(x).square().mean()
        assert float(first_input.amax_history[0, 0]) == float((x * 8).abs().max())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
