"""Lightning's Trainer as users drive it with fp8amp's precision plugin, on the CPU (FP8
emulation): the Tuner, callbacks that change the optimizer or the weights, and resumes, each
compared with the same LightningModule trained without the plugin. Each test names what was
wrong before its fix."""

import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint  # noqa: E402 (needs lightning)

from fp8amp.integrations.lightning import Fp8ampPrecision  # noqa: E402 (needs lightning)


class Finetuned(L.LightningModule):
    """A backbone frozen before training, unfrozen into a second param group at epoch 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.head = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 16))

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.head(self.backbone(batch[0])).float(), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class UnfreezeBackbone(BaseFinetuning):
    def __init__(self, **group):
        super().__init__()
        self.group = group  # more keys of the backbone's param group

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=1e-3)
            optimizer.param_groups[-1].update(self.group)


def loader():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2)), batch_size=10)


def trainer(level, epochs, **kwargs):
    return L.Trainer(max_epochs=epochs, plugins=[Fp8ampPrecision(level)] if level else [], accelerator="cpu",
                     devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


@pytest.mark.parametrize("saved_by, resumed_at", [("O2", "O1"), ("O1", "O2"), (None, "O2")])
def test_finetuning_resume_keeps_the_plugins_level(tmp_path, saved_by, resumed_at):
    # BaseFinetuning puts back the param groups of the run that saved the checkpoint (in
    # on_fit_start, before the optimizer's state loads), "state_dtypes" included: an O2 checkpoint
    # resumed at O1 kept E4M3 moments (O1 resumed at O2: float32 ones), and a checkpoint of a run
    # without the plugin failed with a KeyError 'state_dtypes'.
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer(saved_by, 2, callbacks=[UnfreezeBackbone(), checkpoints]).fit(Finetuned(), loader())
    module, resumed = Finetuned(), trainer(resumed_at, 3, callbacks=[UnfreezeBackbone()], enable_checkpointing=False)
    resumed.fit(module, loader(), ckpt_path=tmp_path / "epoch=1-step=8.ckpt")
    optimizer = resumed.optimizers[0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [4, 4]
    assert [g["state_dtypes"] for g in optimizer.param_groups] == [resumed_at] * 2
    m_dtype = torch.float8_e4m3fn if resumed_at == "O2" else torch.float32
    assert {optimizer.state[p]["exp_avg"].dtype for p in module.parameters()} == {m_dtype}


def test_finetuning_resume_keeps_a_groups_own_level(tmp_path):
    # (the fix above sets the plugin's level on the groups at the saving run's level only)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer("O2", 2, callbacks=[UnfreezeBackbone(state_dtypes="O1"), checkpoints]).fit(Finetuned(), loader())
    module, resumed = Finetuned(), trainer("O2", 3, callbacks=[UnfreezeBackbone()], enable_checkpointing=False)
    resumed.fit(module, loader(), ckpt_path=tmp_path / "epoch=1-step=8.ckpt")
    optimizer = resumed.optimizers[0]
    assert [g["state_dtypes"] for g in optimizer.param_groups] == ["O2", "O1"]
    assert optimizer.state[module.backbone[0].weight]["exp_avg"].dtype == torch.float32
    assert optimizer.state[module.head[1].weight]["exp_avg"].dtype == torch.float8_e4m3fn


class SkipsABatch(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
        return None if batch_idx == 1 else loss  # Lightning's way to skip a batch

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_skipped_batch_steps_nothing_without_a_warning():
    # A training_step that returns None makes Lightning's closure return None and step no grads:
    # fp8amp's step warned that fully_shard or load_state_dict(assign=True) had replaced the
    # parameters, as for an optimizer that holds tensors the model no longer uses.
    module = SkipsABatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer("O2", 1, enable_checkpointing=False).fit(module, loader())
    assert not [w for w in caught if "has a gradient" in str(w.message)]
