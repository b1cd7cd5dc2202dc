"""fp8amp's tensors under ``torch.inference_mode``: a detach or view of a master, an FP8 tensor or
a blockwise weight there is a normal tensor (as torch makes a view of a normal tensor), reads the
same values as outside, and a write through it lands in its base. Before, every such view raised
"Cannot set version_counter for inference tensor" (evaluation code that detaches weights)."""

from __future__ import annotations

import pytest
import torch

import fp8amp
from fp8amp.dequantized_view import DequantizedView

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

VIEWS = {
    "detach": lambda t: t.detach(),
    "row": lambda t: t[1],
    "rows": lambda t: t[2:5],
    "view": lambda t: t.view(-1),
    "t": lambda t: t.t(),
}


def o2_model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16)).to(device)
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", policy="all")


def scaled_tensors(device):
    torch.manual_seed(1)
    x = torch.randn(128, 256, device=device)
    return {"scaled": fp8amp.ScaledTensor.from_tensor(x, fp8amp.E4M3),
            "blockwise": fp8amp.BlockScaledTensor.from_tensor(x)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("kind", ["master", "scaled", "blockwise"])
def test_views_read_the_same_values(device, view, kind):
    tensor = o2_model(device)[0][0].weight if kind == "master" else scaled_tensors(device)[kind]
    expected = VIEWS[view](tensor.dequantize())
    with torch.inference_mode():
        got = VIEWS[view](tensor)
        assert not got.is_inference()  # a view of a normal tensor, as torch makes it
        values = got.dequantize() if isinstance(got, fp8amp.ScaledTensor) else (
            got.values() if isinstance(got, DequantizedView) else got)
        assert torch.equal(values, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_through_a_view_lands_in_the_master(device):
    model, opt = o2_model(device)
    weight = model[0].weight
    expected = weight.dequantize().clone()
    expected[3] = 0.5
    with torch.inference_mode():
        weight[3].fill_(0.5)
        weight.detach()[0].mul_(1.0)
    assert torch.equal(weight.dequantize(), expected)
    kept = weight.kept_amax()
    assert torch.isnan(kept).all() or torch.equal(kept, expected.abs().max().reshape(1))


@pytest.mark.parametrize("device", DEVICES)
def test_evaluate_then_train(device):
    """A model evaluated under inference_mode (forward, weights detached) trains on as before."""
    model, opt = o2_model(device)
    twin, twin_opt = o2_model(device)
    x = torch.randn(8, 32, device=device)
    with torch.inference_mode():
        model(x)
        norms = [p.detach().dequantize().norm() for p in model.parameters() if isinstance(p, fp8amp.MasterWeight)]
    assert all(torch.isfinite(n) for n in norms)
    for m, o in ((model, opt), (twin, twin_opt)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        a = a.dequantize() if isinstance(a, fp8amp.ScaledTensor) else a
        b = b.dequantize() if isinstance(b, fp8amp.ScaledTensor) else b
        assert torch.equal(a, b)
