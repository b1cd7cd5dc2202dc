"""fp8amp's Fabric precision plugin with the real lightning package, on the CPU (FP8 emulation):
Fabric(plugins=[Fp8ampFabricPrecision("O2")]) converts the module at setup_module and the optimizer
through convert_optimizer, trains (loss falls), and fabric.save / fabric.load resume bit for bit;
an optimizer that skipped convert_optimizer is refused at its first step, with the fix."""

import pytest
import torch
from torch import nn

import fp8amp

L = pytest.importorskip("lightning")
from fp8amp.integrations.lightning import Fp8ampFabricPrecision  # noqa: E402 (needs lightning)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))


def batches(n):
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(16, 32, generator=gen)
        yield x, torch.tanh(x[:, :16] * 2)


def set_up(precision):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model = fabric.setup_module(build())
    optimizer = precision.convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return fabric, model, fabric.setup_optimizers(optimizer), scheduler


def train(fabric, model, optimizer, scheduler, data):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        with fabric.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_fabric_converts_trains_and_resumes_bit_for_bit(tmp_path):
    fabric, model, optimizer, scheduler = set_up(Fp8ampFabricPrecision("O2", autocast_dtype=None))
    layer = model.module[0]
    assert isinstance(layer, fp8amp.Fp8Linear) and isinstance(layer.weight, fp8amp.ScaledTensor)
    assert isinstance(optimizer.optimizer, fp8amp.optim.AdamW)
    assert optimizer.param_groups[0]["state_dtypes"] == "O2" and layer.weight in optimizer.param_groups[0]["params"]
    straight = train(fabric, model, optimizer, scheduler, batches(12))
    assert sum(straight[-3:]) < 0.7 * sum(straight[:3]), straight
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 4)
    assert int(layer.input_scaling.amax_history[0].count_nonzero()) == 12  # updated after each step: 12 amaxes
    end = {k: v.clone() for k, v in model.state_dict().items()}

    fabric, model, optimizer, scheduler = set_up(Fp8ampFabricPrecision("O2", autocast_dtype=None))
    data = batches(12)
    first = train(fabric, model, optimizer, scheduler, (next(data) for _ in range(6)))
    fabric.save(tmp_path / "half.ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})

    fabric, model, optimizer, scheduler = set_up(Fp8ampFabricPrecision("O2", autocast_dtype=None))
    with torch.no_grad():
        for p in model.parameters():  # another start: everything must come from the checkpoint
            p.zero_()
    fabric.load(tmp_path / "half.ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    assert next(iter(optimizer.state.values()))["exp_avg"].dtype == torch.float8_e4m3fn  # O2's m, loaded
    resumed = train(fabric, model, optimizer, scheduler, data)
    assert first + resumed == straight
    for key, value in model.state_dict().items():
        assert torch.equal(value, end[key]), key


def test_bf16_autocast_and_a_model_initialized_before_setup():
    torch.manual_seed(0)
    model = build()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[Fp8ampFabricPrecision("O1")])
    model, optimizer = fabric.setup(model, optimizer)  # already converted: taken as it is
    assert fabric._precision.precision == "bf16-mixed"
    losses = []
    for x, y in batches(10):
        optimizer.zero_grad()
        with fabric.autocast():
            out = model(x)
            assert out.dtype == torch.bfloat16
            loss = nn.functional.mse_loss(out.float(), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_an_optimizer_not_converted_is_refused_at_its_first_step():
    precision = Fp8ampFabricPrecision("O2", autocast_dtype=None)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model = build()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    x, y = next(batches(1))
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    with pytest.raises(RuntimeError, match=r"Fp8ampFabricPrecision: the optimizer is torch.optim.adamw.AdamW.*"
                                           r"precision.convert_optimizer\(optimizer\)"):
        optimizer.step()
    other = nn.Linear(4, 4)  # an optimizer of another module's parameters steps as usual
    other_optimizer = fabric.setup_optimizers(torch.optim.SGD(other.parameters(), lr=0.1))
    other(torch.ones(2, 4)).sum().backward()
    before = other.weight.detach().clone()
    other_optimizer.step()
    assert not torch.equal(other.weight, before)
    with pytest.raises(ValueError, match="Fp8ampFabricPrecision: optimizer must be one of torch.optim.Adam"):
        precision.convert_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="module must be set up first"):
        Fp8ampFabricPrecision().convert_optimizer(torch.optim.AdamW(build().parameters()))
