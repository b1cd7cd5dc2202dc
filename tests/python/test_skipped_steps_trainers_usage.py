"""Steps skipped or interrupted under Lightning's Trainer and Fabric and under Hugging Face
Accelerate, as users write them: a non-finite first batch (inputs ~1000, beyond E4M3's 448 at the
initial scale 1) whose step is skipped without ``optimizer.step()``. Each run is compared with the
same loop on the unconverted model with plain torch: the step after the skip within FP8 distance,
the same number of optimizer steps and the same lr, no inf / NaN left in any amax history."""

import copy
import warnings

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.amax_sync import delayed_states
from tiny_mlp import tiny_mlp

L = pytest.importorskip("lightning")
from fp8amp.integrations.lightning import Fp8ampFabricPrecision, Fp8ampPrecision  # noqa: E402 (needs lightning)


def _batches(n, bad):
    """``n`` regression batches of inputs ~1000, a NaN in batch ``bad``."""
    gen = torch.Generator().manual_seed(1)
    out = [(torch.randn(16, 32, generator=gen) * 1000, torch.randn(16, 16, generator=gen)) for _ in range(n)]
    out[bad][0][0, 0] = float("nan")
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _finite_histories(model: nn.Module) -> bool:
    return all(bool(s.amax_history.isfinite().all()) for s in delayed_states(model))


class _Manual(L.LightningModule):
    """Manual optimization as Lightning documents it (``zero_grad`` after the forward), skipping the
    step of a non-finite loss: before its backward (``return``), or after it."""

    def __init__(self, backward_first):
        super().__init__()
        self.net = tiny_mlp()
        self.automatic_optimization = False
        self.backward_first = backward_first
        self.outputs = []

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0]).float()
        self.outputs.append(out.detach().clone())
        loss = nn.functional.mse_loss(out, batch[1])
        if not self.backward_first and not torch.isfinite(loss):
            return None
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if torch.isfinite(loss):
            opt.step()
            self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]


def _fit(module, plugin):
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, plugins=plugin)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LitLogger|GPU available).*")
        trainer.fit(module, torch.utils.data.DataLoader(_batches(4, 0), batch_size=None))
    return trainer


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lightning_manual_optimization_skipping_its_first_step(level):
    """A ``training_step`` that calls its layers (``self.net(x)``, not ``self(x)``) never ran the
    module's forward pre-hook, and manual optimization's ``zero_grad`` comes after the forward: the
    first step skipped for a NaN loss left its NaN amaxes to the next step's casts, which took
    scale 1, and that step's output was 69 % off torch's. The plugin's ``train_step_context`` now
    stands for the module's training forward."""
    fp8 = _Manual(backward_first=False)
    plain = copy.deepcopy(fp8)
    trainers = [_fit(fp8, Fp8ampPrecision(level, autocast_dtype=None)), _fit(plain, None)]
    assert _rel(fp8.outputs[1], plain.outputs[1]) < 0.1
    assert [t.global_step for t in trainers] == [3, 3]
    assert [t.optimizers[0].param_groups[0]["lr"] for t in trainers] == [0.01 / 8] * 2
    assert _finite_histories(fp8)


def _fabric_loop(level):
    """Fabric's loop with ``zero_grad`` after the forward, a NaN loss's backward run and its step
    skipped; the outputs, the number of steps and the lr at the end."""
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level is None:
        fabric = L.Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        precision = Fp8ampFabricPrecision(level, autocast_dtype=None)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(precision.convert_optimizer(optimizer))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    outputs, steps = [], 0
    for x, y in _batches(4, 0):
        out = model(x).float()
        outputs.append(out.detach().clone())
        loss = nn.functional.mse_loss(out, y)
        optimizer.zero_grad()
        fabric.backward(loss)
        if torch.isfinite(loss):
            optimizer.step()
            scheduler.step()
            steps += 1
    return model, outputs, steps, optimizer.param_groups[0]["lr"]


def _accelerate_loop(level):
    """Accelerate's ``accumulate`` over 2 micro-batches, a NaN loss skipped before its backward
    (``continue``: no step, no ``zero_grad``, so the window runs on into the next micro-batches, as
    in torch), clipping before each step."""
    accelerate = pytest.importorskip("accelerate")
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level == "fp8":
        fp8amp.convert(model, optimizer=optimizer, policy="all")
    elif level is not None:
        model, optimizer = fp8amp.initialize(model, optimizer, level, policy="all")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    outputs, steps = [], 0
    for x, y in _batches(8, 1):
        with accelerator.accumulate(model):
            out = model(x).float()
            outputs.append(out.detach().clone())
            loss = nn.functional.mse_loss(out, y)
            if not torch.isfinite(loss):
                continue
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                steps += 1
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model), outputs, steps, optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("loop, level, after", [
    ("Lightning manual", "O1", [1]), ("Lightning manual", "O2", [1]),
    ("Fabric", "O1", [1]), ("Fabric", "O2", [1]),
    ("Accelerate", "O2", [2, 3]), ("Accelerate", "fp8", [2, 3])])
def test_a_skipped_first_step_whose_gradients_were_not_cleared_yet(loop, level, after):
    """The forward after a skipped first step ran before its gradients were cleared: ``zero_grad``
    after the forward (Lightning's manual optimization, a Fabric loop) once a NaN loss's backward
    had run, or an accumulation window that a skipped micro-batch left open (Accelerate's
    ``accumulate`` with ``continue``). The hook read the gradients left there as another
    micro-batch of the same step and kept the NaN amaxes, so those forwards took scale 1: 69 % off
    torch's, and the step taken after them trained on them. Until the model's first step (its
    scales still 1) every training forward after one with no step drops them."""
    if loop == "Lightning manual":
        fp8 = _Manual(backward_first=True)
        plain = copy.deepcopy(fp8)
        trainers = [_fit(fp8, Fp8ampPrecision(level, autocast_dtype=None)), _fit(plain, None)]
        results = [(m, m.outputs, t.global_step, t.optimizers[0].param_groups[0]["lr"])
                   for m, t in zip((fp8, plain), trainers)]
    else:
        run = _fabric_loop if loop == "Fabric" else _accelerate_loop
        results = [run(level), run(None)]
    (model, outputs, steps, lr), (_, plain_outputs, plain_steps, plain_lr) = results
    assert all(_rel(outputs[i], plain_outputs[i]) < 0.1 for i in after)
    assert (steps, lr) == (plain_steps, plain_lr)
    assert _finite_histories(model)
