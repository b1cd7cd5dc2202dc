"""The O1/O2 masters' kept amax (include/fp8amp/optim.h, "Kept master amax"): the largest magnitude
of a master's real values, which the fp8amp optimizer's fused step reads instead of the master
and writes as it stores it. It must always be exact (every write of the whole master refreshes
it) or unknown (NaN: a write of part of it), or the next step would scale the master from a
stale, too small bound and saturate it. Steps are checked against twins whose kept amax is made
unknown before every step (the step that reads the master: the reference)."""

from __future__ import annotations

import math

import pytest
import torch

import fp8amp
from test_optim import batch, bits, groups

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def o2_model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4)).to(device)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(groups(model)), "O2", policy="all")
    return model, opt


def masters(model):
    return [p for p in model.parameters() if isinstance(p, fp8amp.MasterWeight)]


def step(model, opt, t, forget=False):
    if forget:  # the reference: every master read by pass 1
        for m in masters(model):
            m.kept_amax().fill_(math.nan)
    opt.zero_grad()
    device = next(model.parameters()).device
    x, y = batch(t)
    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()


def real(m):
    return m.dequantize(torch.float32)


def check_scale_within_one_binade(ours, ref):
    """Masters scaled from the bound: the same values as the reference's but for the power-of-two
    scale, at most one binade smaller (more headroom), so equal within FP16's precision."""
    for a, b in zip(masters(ours), masters(ref)):
        ratio = (b.scale_inv / a.scale_inv).item()
        assert ratio in (1.0, 2.0), ratio
        torch.testing.assert_close(real(a), real(b), rtol=2.0 ** -10, atol=2.0 ** -24 * b.scale_inv.item())


@pytest.mark.parametrize("device", DEVICES)
def test_steps_keep_the_exact_amax_and_bound_the_master_from_it(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model, opt = o2_model(device)
    ref, ref_opt = o2_model(device)
    for m in masters(model):
        assert m.kept_amax().item() == real(m).abs().max().item()  # made with the optimizer
    for t in range(6):
        step(model, opt, t)
        step(ref, ref_opt, t, forget=True)
        for m in masters(model):
            assert m.kept_amax().item() == real(m).abs().max().item()  # the stored values' amax, exactly
        check_scale_within_one_binade(model, ref)


@pytest.mark.parametrize("write", ["mul_", "copy_", "detached copy_", "row view copy_", "load_state_dict"])
def test_every_other_write_refreshes_the_kept_amax(write):
    """A write that grows the master 1000-fold, then a step: a stale kept amax would bound the new
    master 1000 times too low and saturate it; refreshed (or unknown after a write of some rows),
    the step matches the reference, which reads the master."""
    model, opt = o2_model("cpu")
    ref, ref_opt = o2_model("cpu")
    for t in range(2):
        step(model, opt, t)
        step(ref, ref_opt, t, forget=True)
    state = {k: v * 1000 if k.endswith("weight") else v for k, v in model.state_dict().items()}
    for net in (model, ref):
        m = net[2].weight
        with torch.no_grad():
            if write == "mul_":
                m.mul_(1000.0)
            elif write == "copy_":
                m.copy_(real(m) * 1000)
            elif write == "detached copy_":
                m.detach().copy_(real(m) * 1000)
            elif write == "row view copy_":
                for rows in (m[:32], m[32:]):
                    rows.copy_(real(rows) * 1000)
            else:
                net.load_state_dict(state)
    m = model[2].weight
    kept = m.kept_amax().item()
    assert kept == real(m).abs().max().item() or (write == "row view copy_" and math.isnan(kept))
    step(model, opt, 2)
    step(ref, ref_opt, 2, forget=True)
    assert real(m).abs().max() > 100  # grown, not saturated at the old scale's limit
    check_scale_within_one_binade(model, ref)


def test_aliases_share_it_and_copies_do_not():
    model, opt = o2_model("cpu")
    step(model, opt, 0)
    m = model[2].weight
    kept = m.kept_amax()
    assert kept.isfinite().all()
    assert m.detach().kept_amax() is kept and m[:8].kept_amax() is kept
    clone = m.detach().clone()
    assert clone.kept_amax() is not kept and clone.kept_amax().equal(kept)
    with torch.no_grad():
        clone.mul_(2.0)
    assert clone.kept_amax().equal(kept * 2) and kept.equal(real(m).abs().amax().reshape(1))  # each its own


def test_pickled_and_deep_copied_masters():
    """torch.save leaves the kept amax out (weights_only loads take the master, which computes it
    when asked); a deep copy keeps the value in its own tensor (the same real values)."""
    import copy
    import io

    model, opt = o2_model("cpu")
    step(model, opt, 0)
    m = model[2].weight
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded, fp8amp.MasterWeight) and loaded.kept_amax().equal(m.kept_amax())  # computed again
    assert bits(loaded.codes).equal(bits(m.codes))
    twin = copy.deepcopy(m)
    assert twin.kept_amax() is not m.kept_amax() and twin.kept_amax().equal(m.kept_amax())


def _grow_whole(w):
    w.mul_(1000.0)


def _grow_row(w):  # (returning the view would fail in torch for a plain parameter too)
    w[1].mul_(1000.0)


COMPILED_WRITES = {"whole": _grow_whole, "row": _grow_row}


@pytest.mark.parametrize("write", sorted(COMPILED_WRITES))
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_write_in_compiled_code_never_leaves_a_stale_kept_amax(backend, write):
    """A write torch.compile traces reaches a master rebuilt from its inner tensors, not its kept
    amax; it bumps the master's version counter, by which the next step makes the kept amax current.
    (A write of a row view in compiled code crashed in the trace before.)"""
    torch._dynamo.reset()
    model, opt = o2_model("cpu")
    ref, ref_opt = o2_model("cpu")
    step(model, opt, 0)
    step(ref, ref_opt, 0, forget=True)

    grow = torch.compile(COMPILED_WRITES[write], backend=backend, fullgraph=True)
    with torch.no_grad():
        grow(model[2].weight)
        COMPILED_WRITES[write](ref[2].weight)
    assert torch.equal(real(model[2].weight), real(ref[2].weight))
    step(model, opt, 1)
    step(ref, ref_opt, 1, forget=True)
    assert real(model[2].weight).abs().max() > 100  # not saturated at the stale bound's scale
    check_scale_within_one_binade(model, ref)


def test_torch_save_keeps_a_master_and_its_alias_on_one_kept_amax():
    import io

    model, opt = o2_model("cpu")
    step(model, opt, 0)
    buf = io.BytesIO()
    torch.save({"model": model, "alias": model[2].weight.detach()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    m, alias = loaded["model"][2].weight, loaded["alias"]
    with torch.no_grad():
        alias.mul_(1000.0)
    assert m.kept_amax().item() == real(m).abs().max().item()
