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

from fp8amp.amax_sync import delayed_states
from tiny_mlp import tiny_mlp

L = pytest.importorskip("lightning")
from fp8amp.integrations.lightning import Fp8ampPrecision  # noqa: E402 (needs lightning)


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

