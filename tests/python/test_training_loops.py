"""Training-loop features combined with ``fp8amp.initialize`` (and fp8amp's optimizer built
directly): param groups changed mid-run, GradScaler, clipping, accumulation, frozen and unused
parameters, resume. Each case is compared with the same loop on the unconverted model."""

import copy

import pytest
import torch
from torch import nn

import fp8amp


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)) for _ in range(n)]


def _assert_close(model, plain, rel=0.05):
    """Parameters within FP8 training's distance of the unconverted model's (relative norm)."""
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        p, q = p.detach(), q.detach()
        error = float((p.dequantize() if isinstance(p, fp8amp.ScaledTensor) else p).sub(q).norm())
        assert error <= rel * float(q.norm()), (name, error / float(q.norm()))


def _train(model, optimizer, batches):
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("how", ["add_param_group", "constructor"])
def test_a_weight_replaced_by_its_master_is_refused_by_the_optimizer(how):
    """Parameters collected before initialize (progressive unfreezing: the head's, to add later)
    hold the Linear weights that the FP16 masters replaced: stepping them trains nothing. They were
    taken silently, and the head never trained."""
    model = _model()
    head = list(model[4].parameters())
    optimizer = torch.optim.AdamW(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-2)
    model, optimizer = fp8amp.initialize(model, optimizer, "O2")
    with pytest.raises(ValueError, match="param 0 of group 1 is a Linear weight that fp8amp.initialize replaced"):
        if how == "add_param_group":
            optimizer.add_param_group({"params": head, "lr": 1e-3})
        else:
            fp8amp.optim.AdamW([{"params": list(model[0].parameters())}, {"params": head}], state_dtypes="O2")
    assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": list(model[4].parameters()), "lr": 1e-3})  # the model's own: trains
    before = model[4].weight.dequantize()
    _train(model, optimizer, _batches(2))
    assert not torch.equal(before, model[4].weight.dequantize())


@pytest.mark.parametrize("group", [{"params": [nn.Parameter(torch.ones(4, dtype=torch.float64))]},
                                   {"params": [nn.Parameter(torch.ones(4))], "amsgrad": True},
                                   {"params": [nn.Parameter(torch.ones(4))], "lr": torch.tensor(0.1)}])
def test_a_refused_param_group_is_not_added(group):
    """add_param_group raised, but kept the group: every later step then failed inside an op
    (``fp8amp.multi_amax: xs[0] has unsupported dtype Double``), or stepped a group with options
    the optimizer refuses."""
    model = _model()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")
    with pytest.raises(ValueError, match="fp8amp.optim.AdamW"):
        optimizer.add_param_group(group)
    assert len(optimizer.param_groups) == 1
    for p in group["params"]:
        p.grad = torch.ones_like(p)
    before = model[0].weight.dequantize()
    _train(model, optimizer, _batches(1))
    assert not torch.equal(before, model[0].weight.dequantize())


def test_numpy_hyperparameters_step_as_with_torch():
    """An lr schedule precomputed with numpy (LambdaLR over a float32 array) sets numpy float32
    lrs, which torch's AdamW steps with; fp8amp's refused them at the first step ("lr must be a
    Python float, got float32"), and initialize refused such an lr."""
    np = pytest.importorskip("numpy")
    schedule = np.cos(np.linspace(0, np.pi / 2, 4, dtype=np.float32))
    model = _model()
    plain = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=np.float32(1e-3))
                  for m in (model, plain)]
    model, optimizers[0] = fp8amp.initialize(model, optimizers[0], "O2")
    for m, optimizer in zip((model, plain), optimizers):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: schedule[i])
        for batch in _batches(3):
            _train(m, optimizer, [batch])
            scheduler.step()
    assert optimizers[0].param_groups[0]["lr"] == optimizers[1].param_groups[0]["lr"]
    assert isinstance(optimizers[0].param_groups[0]["lr"], np.float32)
    _assert_close(model, plain)


# ------------------------------------------------------------------------------------------ Lightning


def _lightning_loader():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2)), batch_size=10)


def _fit(module, plugins, **kwargs):
    L = pytest.importorskip("lightning")
    trainer = L.Trainer(max_epochs=2, plugins=plugins, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs)
    trainer.fit(module, _lightning_loader())
    return trainer


def _lightning_module(configure_optimizers, training_step=None):
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
            self.lrs, self.losses = [], []

        def training_step(self, batch, batch_idx):
            if training_step is not None:
                return training_step(self, batch)
            self.lrs.append([g["lr"] for o in self.trainer.optimizers for g in o.param_groups])
            loss = nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return configure_optimizers(self)

    return Module()


@pytest.mark.parametrize("kind", ["SequentialLR", "ChainedScheduler"])
def test_lightning_schedulers_made_of_schedulers_drive_the_fp8amp_optimizer(kind):
    """The plugin pointed the scheduler configure_optimizers returned at fp8amp's optimizer, but not
    the schedulers a SequentialLR / ChainedScheduler holds and steps: they went on changing the lr of
    the torch optimizer the plugin had replaced, and the lr that trained stayed at its first value."""
    from fp8amp.integrations.lightning import Fp8ampPrecision
    sched = torch.optim.lr_scheduler

    def configure_optimizers(module):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        warmup, decay = sched.LinearLR(optimizer, 0.1, total_iters=2), sched.ExponentialLR(optimizer, 0.8)
        scheduler = (sched.SequentialLR(optimizer, [warmup, decay], milestones=[2]) if kind == "SequentialLR"
                     else sched.ChainedScheduler([warmup, decay], optimizer))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    fp8, plain = _lightning_module(configure_optimizers), _lightning_module(configure_optimizers)
    _fit(fp8, [Fp8ampPrecision("O2")])
    _fit(plain, None)
    assert len(fp8.lrs) == 8 and fp8.lrs == plain.lrs
