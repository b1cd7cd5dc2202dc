"""Lightning (Trainer and Fabric) and Accelerate as users drive them with fp8amp, on the CPU (FP8
emulation): what a second Trainer, a refit, callbacks and checkpoints do to the module fp8amp
trains. Each test names what was wrong before its fix."""

import pytest
import torch
from torch import nn

import fp8amp

L = pytest.importorskip("lightning")
from fp8amp.integrations.lightning import Fp8ampPrecision  # noqa: E402 (needs lightning)


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]).float(), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2)), batch_size=10)


def trainer(epochs, **kwargs):
    return L.Trainer(max_epochs=epochs, plugins=[Fp8ampPrecision("O2")], accelerator="cpu", devices=1,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, **kwargs)


def test_a_second_trainer_on_a_trained_module_updates_its_scaling():
    """Stage 2 of a run (a new Trainer, say with another lr, fitting the module the first one
    trained): the first fit's fp8amp optimizer, alive while anything held the first Trainer, stayed
    first in line for the module's scaling, so the second fit's optimizer updated none of it and
    the scales stayed where the first fit left them."""
    module = Regression()
    first = trainer(epochs=1)
    first.fit(module, loader())  # 4 steps
    assert int(module.net[0].input_scaling.counter) == 4
    second = trainer(epochs=2)
    second.fit(module, loader())  # 8 more
    assert second.optimizers[0] is not first.optimizers[0]
    assert int(module.net[0].input_scaling.counter) == 12
    # the same Trainer fitting again (a new optimizer from configure_optimizers) takes it over too
    second.fit_loop.max_epochs = 3
    second.fit(module, loader())
    assert int(module.net[0].input_scaling.counter) == 16
    # the first Trainer still tests with the optimizer it made (it raised as a stepped optimizer)
    first.test(module, loader(), verbose=False)
    assert int(module.net[0].input_scaling.counter) == 16
