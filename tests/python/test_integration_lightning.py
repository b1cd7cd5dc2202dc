"""fp8amp's Lightning precision plugin with the real lightning package, on the CPU (FP8
emulation): Trainer(plugins=[Fp8ampPrecision("O2")]) trains with an lr scheduler, gradient
clipping and accumulation, checkpoints, and resumes bit for bit; a bad optimizer is refused."""

import pytest
import torch
from torch import nn

import fp8amp

L = pytest.importorskip("lightning")
from fp8amp.integrations.lightning import Fp8ampFabricPrecision, Fp8ampPrecision  # noqa: E402 (needs lightning)


class Regression(L.LightningModule):
    def __init__(self, optimizer: str = "adamw"):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
        self.optimizer = optimizer
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        if self.optimizer == "fp8amp":
            return fp8amp.optim.AdamW(self.parameters(), lr=1e-2, state_dtypes="O2")
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def loader():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x[:, :16] * 2))
    return torch.utils.data.DataLoader(data, batch_size=10)  # 4 batches: 2 optimizer steps an epoch


def trainer(tmp_path, epochs, **kwargs):
    kwargs.setdefault("gradient_clip_val", 1.0)
    return L.Trainer(max_epochs=epochs, plugins=[Fp8ampPrecision("O2")], accelerator="cpu", devices=1,
                     accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, **kwargs)


def snapshot(module, optimizer):
    out = {}
    for key, value in module.state_dict().items():
        out[key] = (value.codes if isinstance(value, fp8amp.ScaledTensor) else value).clone()
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            out[f"opt.{i}.{key}"] = value.clone()
    return out


def same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1 else a[k],
                    b[k].view(torch.uint8) if b[k].element_size() == 1 else b[k]) for k in a)


def test_trainer_trains_checkpoints_and_resumes_bit_for_bit(tmp_path):
    straight = Regression()
    t = trainer(tmp_path, epochs=4)
    t.fit(straight, loader())
    assert isinstance(straight.net[0], fp8amp.Fp8Linear) and isinstance(straight.net[0].weight, fp8amp.ScaledTensor)
    optimizer = t.optimizers[0]
    assert isinstance(optimizer, fp8amp.optim.AdamW) and optimizer.param_groups[0]["state_dtypes"] == "O2"
    assert t.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 2)  # 4 epochs, halved every 2
    assert float(next(iter(optimizer.state.values()))["step"]) == 8
    assert sum(straight.losses[-4:]) < 0.9 * sum(straight.losses[:4])

    first = Regression()
    t1 = trainer(tmp_path, epochs=2)
    t1.fit(first, loader())
    t1.save_checkpoint(tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)
    plain = Regression()  # the checkpoint's state_dict is the unconverted model's: loads strictly
    plain.load_state_dict(saved["state_dict"], strict=True)
    assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())
    assert "net.0.input_scaling.amax_history" in saved["fp8amp"]["scaling"]
    resumed = Regression()
    torch.manual_seed(5)
    for p in resumed.parameters():  # another start: everything must come from the checkpoint
        p.data.normal_()
    t2 = trainer(tmp_path, epochs=4)
    t2.fit(resumed, loader(), ckpt_path=tmp_path / "half.ckpt")
    assert resumed.losses == straight.losses[len(first.losses):]
    assert same(snapshot(resumed, t2.optimizers[0]), snapshot(straight, optimizer))


def test_an_fp8amp_optimizer_from_configure_optimizers_updates_the_scaling(tmp_path):
    module = Regression("fp8amp")
    trainer(tmp_path, epochs=2).fit(module, loader())  # 4 optimizer steps
    assert isinstance(module.net[0].weight, fp8amp.ScaledTensor)
    assert int(module.net[0].input_scaling.amax_history[0].count_nonzero()) == 4, module.net[0].input_scaling


class Evaluated(Regression):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x).float(), y))


def test_test_after_fit_on_the_same_trainer(tmp_path):
    """trainer.fit(m) then trainer.test(m): Lightning connects the plugin again with the fp8amp
    optimizer it made, which has stepped; it is kept (it was refused as a stepped optimizer)."""
    module = Evaluated()
    t = trainer(tmp_path, epochs=1)
    t.fit(module, loader())
    optimizer = t.optimizers[0]
    (result,) = t.test(module, loader(), verbose=False)
    assert result["test_loss"] > 0
    assert t.optimizers[0] is optimizer


def test_a_checkpoint_loads_into_a_module_converted_already(tmp_path):
    """The module just trained (converted by the plugin) and one converted in its __init__ load the
    plugin's checkpoints too: the scaling buffers, out of the state dict's keys, travel in its
    metadata (a missing-keys error before)."""
    module = Evaluated()
    t = trainer(tmp_path, epochs=1)
    t.fit(module, loader())
    t.save_checkpoint(tmp_path / "trained.ckpt")
    saved = {k: v.clone() for k, v in module.state_dict().items() if "scaling" in k}
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if "scaling" in name:
                buffer.zero_()  # so that the values must come from the checkpoint
    trainer(tmp_path, epochs=1).test(module, loader(), ckpt_path=tmp_path / "trained.ckpt", verbose=False)
    state = module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items()) and saved

    class ConvertedInInit(Regression):
        def __init__(self):
            super().__init__()
            fp8amp.convert(self.net, policy="all")

    first = ConvertedInInit()
    t = trainer(tmp_path, epochs=1)
    t.fit(first, loader())
    t.save_checkpoint(tmp_path / "own.ckpt")
    resumed = ConvertedInInit()
    trainer(tmp_path, epochs=2).fit(resumed, loader(), ckpt_path=tmp_path / "own.ckpt")
    assert len(resumed.losses) == 4  # the second epoch's steps only


def test_unsupported_optimizer_is_refused_naming_the_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"Fp8ampPrecision: optimizer must be one of torch.optim.Adam, "
                                         r"torch.optim.AdamW.*got torch.optim.sgd.SGD"):
        trainer(tmp_path, epochs=1).fit(Regression("sgd"), loader())


def test_bad_plugin_arguments():
    with pytest.raises(ValueError, match="opt_level must be one of 'O1', 'O2'; got 'O3'"):
        Fp8ampPrecision("O3")
    with pytest.raises(ValueError, match="autocast_dtype must be"):
        Fp8ampPrecision(autocast_dtype=torch.float64)


@pytest.mark.parametrize("plugin", [Fp8ampPrecision, Fp8ampFabricPrecision])
@pytest.mark.parametrize("options, error, message", [
    (dict(recipee="blockwise"), TypeError, r"unknown keyword argument\(s\) recipee; accepted: .*recipe"),
    (dict(recipe="fancy"), ValueError, "recipe must be one of"),
    (dict(policy="fast"), ValueError, "policy must be one of"),
    (dict(tokens=0), ValueError, "tokens must be >= 1"),
    (dict(weight_grad="fp16"), ValueError, "weight_grad must be one of"),
    (dict(compiled="yes"), TypeError, "compiled must be"),
    (dict(module_filter_fn=3), TypeError, "module_filter_fn must be a callable"),
])
def test_bad_initialize_options_are_refused_when_the_plugin_is_made(plugin, options, error, message):
    """The options for fp8amp.initialize are checked by the plugin's constructor, not first when
    the Trainer or Fabric converts the module (after its own set-up)."""
    with pytest.raises(error, match=f"{plugin.__name__}: .*{message}"):
        plugin(**options)


def test_fabric_plugin_refuses_fp8_allreduce():
    with pytest.raises(TypeError, match="unknown keyword argument\\(s\\) fp8_allreduce"):
        Fp8ampFabricPrecision(fp8_allreduce=True)


class ClippedByValue(Regression):
    """Records the largest gradient value after Lightning's clipping, each step."""

    def __init__(self):
        super().__init__()
        self.clipped_max = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        assert any(isinstance(g, fp8amp.ScaledTensor) for g in grads)
        self.clipped_max.append(max(float((g.dequantize() if isinstance(g, fp8amp.ScaledTensor) else g).abs().max())
                                    for g in grads))


def test_gradient_clipping_by_value_over_fp8_gradients(tmp_path):
    """gradient_clip_algorithm="value" (torch's clip_grad_value_, clamps in place) over O2's FP8
    weight gradients: it raised NotImplementedError (clamp_ of a ScaledTensor)."""
    module = ClippedByValue()
    trainer(tmp_path, epochs=2, gradient_clip_algorithm="value", gradient_clip_val=0.01).fit(module, loader())
    # every step's gradients reach the bound (within E4M3's rounding of the clamped values)
    assert len(module.clipped_max) == 4 and all(0.009 <= m <= 0.01 for m in module.clipped_max), module.clipped_max
