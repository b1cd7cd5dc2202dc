"""fp8amp.initialize's optimizer (O1/O2) and what it writes: one step against torch.optim within the
formats' bounds, the FP8 weight copy every write of a master keeps current, state dicts (real
values, bit-identical resume, a plain checkpoint into a converted model), and the steps it skips
(GradScaler, non-finite gradients, a poisoned FP8 gradient in a later group). The model and data
are in initialize_net.py.

Bounds, derived from the formats:

* One optimizer step from the same state, against torch.optim on the dequantized values: the
  element math is torch's (test_optim.py), so the float32 p' agrees to a few float32 ulps; the
  master stores it in FP16 at a power-of-two scale s chosen from the new amax, so the stored real
  value is within half an FP16 ulp: 2^-11 |p'| in the normal range, 2^-25 / s below it (FP16's
  subnormal spacing 2^-24, halved, in real units). Same for an FP16 v; an E4M3 m is within 2^-4 |m'|
  or 2^-10 / s (E4M3's subnormal spacing 2^-9, halved).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import ScaledTensor
from initialize_net import E4M3, Net, groups, loss_of, net, real, setup, tokens


# ------------------------------------------------------------------------------------------ optimizer


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_one_step_matches_torch_within_the_format_bounds(level):
    """Each step from the same state: torch.optim.AdamW on the dequantized params, grads and states
    against ours; ours must be torch's value rounded once to the storage format."""
    model, opt = setup(level)
    for step in range(4):
        opt.zero_grad()
        loss_of(model, step).backward()
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        ref_params = [nn.Parameter(real(p).clone()) for p in params]
        for p, r in zip(params, ref_params):
            r.grad = real(p.grad).clone()
        ref = torch.optim.AdamW(
            [dict(params=ref_params[: len(opt.param_groups[0]["params"])], **_hyper(opt.param_groups[0])),
             dict(params=ref_params[len(opt.param_groups[0]["params"]):], **_hyper(opt.param_groups[1]))],
            foreach=False)
        for p, r in zip(params, ref_params):
            s = opt.state.get(p)
            if s:  # continue from our (dequantized) state
                ref.state[r] = dict(step=s["step"].clone(), exp_avg=_state(s, "exp_avg"),
                                    exp_avg_sq=_state(s, "exp_avg_sq"))
        before = [real(p).clone() for p in params]
        ref.step()
        opt.step()
        for p, r, p0 in zip(params, ref_params, before):
            expected = r.detach()
            # Our denominator rounds differently from torch's (optim.h): 2^-20 of the update |u| =
            # |p' - p0 * decay| <= |p' - p0| + lr * wd * |p0| (test_adam_op.py derives it).
            update = (expected - p0).abs() + max(g["lr"] * g["weight_decay"] for g in opt.param_groups) * p0.abs()
            bound = 4 * torch.finfo(torch.float32).eps * expected.abs() + 2.0 ** -20 * update
            if isinstance(p, ScaledTensor):  # and half an FP16 ulp at the scaled magnitude
                bound += expected.abs() * 2.0 ** -11 + 2.0 ** -25 * p._scale_inv
            else:
                bound += 1e-12
            assert ((real(p) - expected).abs() <= bound).all(), (step, tuple(p.shape))
            s = opt.state[p]
            m_ref, v_ref = ref.state[r]["exp_avg"], ref.state[r]["exp_avg_sq"]
            if level == "O1":
                torch.testing.assert_close(s["exp_avg"], m_ref, rtol=0, atol=0)
                torch.testing.assert_close(s["exp_avg_sq"], v_ref, rtol=0, atol=0)
            else:
                m_scale, v_scale = s["exp_avg_scale"], s["exp_avg_sq_scale"]
                assert ((_state(s, "exp_avg") - m_ref).abs() <= m_ref.abs() * 2.0 ** -4 + 2.0 ** -10 / m_scale
                        + 1e-7 * m_ref.abs()).all()
                assert ((_state(s, "exp_avg_sq") - v_ref).abs() <= v_ref.abs() * 2.0 ** -11 + 2.0 ** -25 / v_scale
                        + 1e-7 * v_ref.abs()).all()


def _hyper(group):
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "maximize")}


def _state(s, key):
    t = s[key]
    return t.float() * s[f"{key}_scale_inv"] if f"{key}_scale_inv" in s else t.clone()


def assert_copy_is_current(weight):
    """The E4M3 copy equals a fresh current-scaling cast of the master's real values."""
    fresh = ScaledTensor.from_tensor(weight.dequantize(), E4M3)
    codes, scale, scale_inv = weight.fp8_copy
    assert torch.equal(codes.view(torch.uint8), fresh._data.view(torch.uint8))
    assert torch.equal(scale_inv, fresh._scale_inv) and torch.equal(scale, 1 / fresh._scale_inv)


def test_forward_reads_the_copy_every_write_keeps_current():
    model, opt = setup("O2")
    layer = model.up
    assert_copy_is_current(layer.weight)  # attached by initialize
    casts = []
    original = layer.weight_scaling.cast_transpose_current
    layer.weight_scaling.cast_transpose_current = lambda x: casts.append(1) or original(x)
    loss_of(model, 0).backward()
    opt.step()
    assert_copy_is_current(layer.weight)  # the fused step wrote it
    with torch.no_grad():
        layer.weight.copy_(layer.weight.dequantize() * 3)
    assert_copy_is_current(layer.weight)
    with torch.no_grad():
        layer.weight.mul_(0.3)
    assert_copy_is_current(layer.weight)
    model.load_state_dict(net(seed=5).state_dict(), strict=False)
    assert_copy_is_current(layer.weight)
    opt.zero_grad()
    loss_of(model, 1).backward()
    assert not casts  # the forward never cast the weight
    moved = copy.deepcopy(model)
    assert moved.up.weight.fp8_copy is not None and moved.up.weight.fp8_copy[0] is not layer.weight.fp8_copy[0]
    assert_copy_is_current(moved.up.weight)


def test_gradients_through_the_copy_equal_a_fresh_cast():
    """The forward reads the copy and the backward casts its transpose from the master's codes;
    without the copy (both layouts from one cast of the master) outputs and gradients must be
    bit-identical."""
    model, opt = setup("O2")
    loss_of(model, 0).backward()
    opt.step()
    results = []
    for drop in (False, True):
        if drop:
            model.up.weight.drop_fp8_copy()
        opt.zero_grad()
        tokens_in = tokens(1)
        h = model.emb(tokens_in[:-1]).detach().requires_grad_()
        out = model.up(h)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), h.grad, model.up.weight.grad.clone()))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert torch.equal(dw0._data.view(torch.uint8), dw1._data.view(torch.uint8))


# ------------------------------------------------------------------------------------------ state dicts


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_state_dict_round_trip_is_bit_identical(level):
    model, opt = setup(level)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())  # real values, plain tensors

    model2, opt2 = setup(level, seed=1)  # other initial weights: everything must come from ckpt
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        loss_of(m, 3).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(real(a), real(b)), name
    for a, b in zip(opt.state.values(), opt2.state.values()):
        for key in a:
            assert torch.equal(a[key].float(), b[key].float()), key

    plain = Net()
    plain.load_state_dict({k: v for k, v in ckpt["model"].items() if "scaling" not in k})
    assert torch.equal(plain.up.weight, ckpt["model"]["up.weight"])  # loaded strictly, real values
    assert torch.equal(plain.shared_b.weight, ckpt["model"]["shared_a.weight"])


def test_plain_checkpoint_loads_into_converted_model():
    source = net(seed=3)
    model, _ = setup("O2")
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected and all("scaling" in k for k in missing)
    w = source.up.weight.detach()
    assert (real(model.up.weight) - w).abs().max() <= w.abs().max() * 2.0 ** -11


# ------------------------------------------------------------------------------------------ non-finite


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grad_scaler_skips_inf_steps(level):
    model, opt = setup(level)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    before = {n: real(p).clone() for n, p in model.named_parameters()}
    states = copy.deepcopy({id(p): s for p, s in opt.state.items()})
    opt.zero_grad()
    scaler.scale(loss_of(model, 1) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 9  # backed off
    for n, p in model.named_parameters():
        assert torch.equal(real(p), before[n]), n
    for p, s in opt.state.items():
        for key, value in s.items():
            assert torch.equal(value.float(), states[id(p)][key].float()), key


def test_nonfinite_grad_without_scaler_leaves_everything():
    model, opt = setup("O2")
    loss_of(model, 0).backward()
    opt.step()
    before = {n: real(p).clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    (loss_of(model, 1) * float("nan")).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(real(p), before[n]), n


def test_a_poisoned_fp8_grad_in_a_later_group_skips_the_whole_step():
    """The FP8 gradient of a master in the second param group reads NaN (its scale_inv, as
    nan_if_nonfinite leaves it): the step's pre-check must skip the first group's call as well."""
    model = net()
    mats_last = list(reversed(groups(model)))
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(mats_last), "O2")
    loss_of(model, 0).backward()
    opt.step()
    before = {n: real(p).clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    loss_of(model, 1).backward()
    model.up.weight.grad._scale_inv.fill_(float("nan"))
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(real(p), before[n]), n  # norm and biases (the first call) included
