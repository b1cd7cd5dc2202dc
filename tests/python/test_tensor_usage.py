"""What users do with the tensors fp8amp puts in their hands (CPU): the O1/O2 masters, the FP8
weight gradients (ScaledTensor; BlockScaledTensor under recipe="blockwise") and their views,
each compared with the same on its dequantized values (docs/hardening.md)."""

import functools

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.block_scaled_tensor import BlockScaledTensor
from fp8amp.dequantized_view import DequantizedView
from fp8amp.scaled_tensor import ScaledTensor


def _trained(level="O2", recipe=None, features=32):
    """A model after initialize and two steps, then one more backward (its grads kept)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, features * 2), nn.GELU(), nn.Linear(features * 2, 16))
    kwargs = {} if recipe is None else {"recipe": recipe}
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, **kwargs)
    x = torch.randn(8, features)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    model(x).square().mean().backward()
    return model, optimizer


@functools.lru_cache(maxsize=1)
def _tensors():
    """name -> a master, an FP8 gradient, a block-scaled gradient (shared: for tests that only read them)."""
    model, _ = _trained()
    blockwise, _ = _trained(recipe="blockwise", features=256)
    tensors = {"master": model[0].weight, "grad": model[0].weight.grad, "block_grad": blockwise[0].weight.grad}
    assert [type(t) for t in tensors.values()] == [fp8amp.MasterWeight, ScaledTensor, BlockScaledTensor]
    return tensors


TENSORS = ["master", "grad", "block_grad"]


def _real(t):
    return t.dequantize() if isinstance(t, (ScaledTensor, BlockScaledTensor)) else t


# ------------------------------------------------------------------ printing


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("index", [(0, 0), (-1, 3)], ids=["first", "last_row"])
@pytest.mark.parametrize("view", ["plain", "transposed"])
def test_format_of_an_element_formats_its_value(name, index, view):
    """f"{w[0, 0]:.4f}" formats the element's value, as for a plain tensor; torch formats a 0-d
    tensor's value only when its type is exactly Tensor, so a master's or an FP8 gradient's
    element (a 0-d ScaledTensor or DequantizedView) raised "unsupported format string"."""
    t = _tensors()[name]
    with torch.no_grad():
        element = (t if view == "plain" else t.T)[index]
        want = (_real(t) if view == "plain" else _real(t).T)[index]
        assert isinstance(element, (ScaledTensor, DequantizedView))
        for spec in (".4f", ".3e", "", "+.6g", ">12.5f"):
            assert f"{element:{spec}}" == f"{want:{spec}}", spec
    whole = ScaledTensor.from_tensor(torch.tensor(-3.25), fp8amp.E4M3)
    assert f"{whole:.2f}" == "-3.25"
    assert format(t, "") == str(t)  # a tensor of several elements: its str, as torch gives it
    with pytest.raises(TypeError, match="unsupported format string"):
        format(t, ".2f")


# ------------------------------------------------------------------ reads, serialization, autograd (kept working)

READS = {
    "eq": lambda t: t == t.abs(), "allclose": lambda t: torch.tensor(torch.allclose(t, t * 1)),
    "equal": lambda t: torch.tensor(torch.equal(t, t)), "sum": lambda t: t.sum(), "sum(0)": lambda t: t.sum(0),
    "norm": lambda t: t.norm(), "norm(1)": lambda t: t.norm(p=1), "abs().max()": lambda t: t.abs().max(),
    "isfinite().all()": lambda t: torch.isfinite(t).all(), "where": lambda t: torch.where(t > 0, t, 0.0),
    "stack": lambda t: torch.stack([t, t]), "cat": lambda t: torch.cat([t, t]), "float": lambda t: t.float(),
    "to(bfloat16)": lambda t: t.to(torch.bfloat16), "clone": lambda t: t.clone(), "detach": lambda t: t.detach(),
    "contiguous": lambda t: t.contiguous(), "tolist": lambda t: torch.tensor(t.tolist()),
    "numpy": lambda t: torch.from_numpy(t.detach().numpy()), "[0]": lambda t: t[0], "[:, 1:3]": lambda t: t[:, 1:3],
    "[mask]": lambda t: t[t > 0], ".T": lambda t: t.T, "view(-1)": lambda t: t.view(-1),
    "flatten": lambda t: t.flatten(), "item": lambda t: torch.tensor(t[1, 2].item()),
}


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("read", READS, ids=list(READS))
def test_reads_equal_those_of_the_dequantized_tensor(name, read):
    t = _tensors()[name]
    with torch.no_grad():
        got, want = READS[read](t), READS[read](_real(t).clone())
    got = got.values() if isinstance(got, DequantizedView) else _real(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    if read.startswith("norm"):  # from the codes: the float32 sums' rounding (block sums for a block grad)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_hooks_autograd_grad_and_identity(level):
    model, optimizer = _trained(level)
    weight = model[0].weight
    ids = [id(p) for p in model.parameters()]
    seen = []
    weight.register_hook(lambda g: seen.append(("hook", type(g))))
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(("post", p is weight, type(p.grad))))
    optimizer.zero_grad()
    x = torch.randn(8, 32)
    model(x).square().mean().backward()
    assert seen == [("hook", ScaledTensor), ("post", True, ScaledTensor)]
    (grad,) = torch.autograd.grad(model(x).square().mean(), weight)
    assert type(grad) is ScaledTensor and torch.equal(grad.dequantize(), weight.grad.dequantize())
    weight.requires_grad_(False)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    assert weight.grad is None
    weight.requires_grad_(True)
    model(x).square().mean().backward()
    before = weight.dequantize().clone()
    optimizer.step()
    assert not torch.equal(weight.dequantize(), before)
    assert [id(p) for p in model.parameters()] == ids and type(weight) is fp8amp.MasterWeight
    assert all(p in optimizer.state for p in model.parameters())


def test_serialization_round_trips():
    import copy
    import io
    import pickle
    model, _ = _trained()
    weight, grad = model[0].weight, model[0].weight.grad
    state = model.state_dict()
    for protocol in (2, 5):
        for t in (weight, grad):
            loaded = pickle.loads(pickle.dumps(t, protocol=protocol))
            assert type(loaded) is type(t) and torch.equal(loaded.dequantize(), t.dequantize())
    for new_format in (True, False):
        buffer = io.BytesIO()
        torch.save({"state": state, "weight": weight, "grad": grad}, buffer, _use_new_zipfile_serialization=new_format)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert all(torch.equal(loaded["state"][k], v) for k, v in state.items())
        assert type(loaded["weight"]) is fp8amp.MasterWeight and torch.equal(loaded["weight"].dequantize(),
                                                                            weight.dequantize())
    shallow = copy.copy(grad)  # shares the codes and the scale, as a plain tensor's shallow copy shares storage
    shallow.mul_(2)
    assert torch.equal(shallow.dequantize(), grad.dequantize())
    safetensors = pytest.importorskip("safetensors.torch")
    loaded = safetensors.load(safetensors.save(state))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


# ------------------------------------------------------------------ the optimizer's states


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("how", ["zero_", "fill_", "assign", "delete"])
def test_a_step_count_reset_by_hand_steps_that_param_as_torch_does(level, how):
    """Resetting one param's Adam state by hand (a re-initialized layer): torch's AdamW takes each
    param's own step count for its bias corrections. fp8amp's fused step takes one count per call
    (its params' counts are equal) and read that count again only for a state it had not seen, so
    a count written from outside (``zero_``, ``fill_``, a new tensor) stepped that param with the
    others' count: the count read right, the update was wrong. Compared with torch's AdamW (O1),
    and bit for bit with one fp8amp optimizer per param, whose single count is its own (O1, O2)."""
    torch.manual_seed(0)
    start = [torch.randn(16, 16) for _ in range(3)]
    runs = []  # (params, their optimizers)
    for kind in ("torch", "together", "apart"):
        params = [p.clone().requires_grad_() for p in start]
        if kind == "torch":
            optimizers = [torch.optim.AdamW(params, lr=1e-2, foreach=False)] * 3
        elif kind == "together":
            optimizers = [fp8amp.optim.AdamW(params, lr=1e-2, state_dtypes=level)] * 3
        else:
            optimizers = [fp8amp.optim.AdamW([p], lr=1e-2, state_dtypes=level) for p in params]
        runs.append((params, optimizers))
    gen = torch.Generator().manual_seed(1)

    def step():
        grads = [torch.randn(16, 16, generator=gen) for _ in start]
        for params, optimizers in runs:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            for opt in dict.fromkeys(optimizers):
                opt.step()

    for _ in range(4):
        step()
    for params, optimizers in runs:
        opt, p = optimizers[1], params[1]
        if how == "zero_":
            opt.state[p]["step"].zero_()
        elif how == "fill_":
            opt.state[p]["step"].fill_(1.0)
        elif how == "assign":
            opt.state[p]["step"] = torch.tensor(0.0)
        else:
            del opt.state[p]
    for _ in range(3):
        step()
    (ref, ref_opts), (ours, our_opts), (apart, apart_opts) = runs
    counts = [[o.state[p]["step"].item() for p, o in zip(params, opts)] for params, opts in runs]
    assert counts[0] == counts[1] == counts[2] and counts[0][0] != counts[0][1]
    for p, q in zip(ours, apart):
        assert torch.equal(p, q)
    if level == "O1":  # torch's math to ~2^-21 of an update
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("grad_of", ["new_zeros", "fp16_scaled"])
def test_a_grad_with_float16_codes_steps_as_its_values(level, grad_of):
    """``p.grad = p.new_zeros(p.shape)`` before backward (grads allocated up front) makes a
    master's grad a master (new_zeros keeps the type, for FSDP2), with FP16 codes, as does a
    ``ScaledTensor.from_tensor(g, torch.float16)`` set as a grad; the fused step takes FP8 or plain
    grads only, and raised "adam_step: grad_scale_invs[0] must be None: its grad is not float8".
    Such a grad steps as its real values do, bit for bit."""
    model, optimizer = _trained(level)
    weight = model[0].weight
    if grad_of == "new_zeros":
        new = weight.new_zeros(weight.shape)
        new.add_(weight.grad)  # autograd's accumulation into a grad set before backward
        weight.grad = new
    else:
        weight.grad = ScaledTensor.from_tensor(weight.grad.dequantize(), fp8amp.FP16)
    assert isinstance(weight.grad, ScaledTensor) and weight.grad.codes.dtype == torch.float16
    reference_model, reference = _trained(level)
    reference_model[0].weight.grad = weight.grad.dequantize()
    optimizer.step()
    reference.step()
    assert torch.equal(weight.dequantize(), reference_model[0].weight.dequantize())


# ------------------------------------------------------------------ what reads a tensor's storage

_STORAGE_CHILD = """
import torch, fp8amp
from torch import nn
from fp8amp.dequantized_view import DequantizedView
torch.manual_seed(0)
model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(256, 256)), None, "O2", recipe={recipe!r}, policy="all")
model(torch.randn(16, 256)).square().mean().backward()
weight = model[0].weight
kinds = {{"master": lambda: weight.detach(), "grad": lambda: weight.grad, "row": lambda: weight.grad[2:5],
          "transposed": lambda: weight.grad.T}}
for kind, make in kinds.items():
    t = make()
    real = lambda: (t.values() if isinstance(t, DequantizedView) else t.dequantize()).float()
    want = real().clone()
    want.apply_(lambda v: v * 2 - 1)
    returned = t.apply_(lambda v: v * 2 - 1)
    err = ((real() - want).abs().max() / want.abs().max()).item()
    print(kind, "apply_", returned is t, err < 2 ** -3)
    try:
        make().share_memory_()
        print(kind, "share_memory_ returned")
    except RuntimeError as e:
        print(kind, "share_memory_ refused:", "share_memory_() is not supported" in str(e))
try:
    weight.apply_(lambda v: v)
except RuntimeError as e:
    print("requires grad:", e)
"""


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_apply_and_share_memory_never_crash(recipe):
    """``Tensor.apply_`` (a Python callable on each value) reads the storage, which a master, an
    FP8 gradient or a view of one does not have: it crashed the process (SIGSEGV), as did
    ``share_memory_`` of a BlockScaledTensor or a transposed view (ScaledTensor refused it). apply_
    now runs on the real values and writes them back as any in-place op does; share_memory_ is
    refused. Run in a child, so that a crash fails the test."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _STORAGE_CHILD.format(recipe=recipe)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    for kind in ("master", "grad", "row", "transposed"):
        assert f"{kind} apply_ True True" in lines, out.stdout
        assert f"{kind} share_memory_ refused: True" in lines, out.stdout
    assert "requires grad: Can't call apply_() on Variable that requires grad. Use var.detach().apply_() instead." \
        in lines, out.stdout


@pytest.mark.parametrize("name", TENSORS + ["row", "transposed"])
def test_dlpack_export_gives_the_real_values(name):
    """``numpy.from_dlpack(t)`` / ``torch.from_dlpack(t)`` (how array libraries take a tensor)
    call ``t.__dlpack__``: torch's exported the wrapper's storage, which it does not have, and
    numpy read garbage (values like -3.9e15 for a weight of 0.1) or the process crashed. The
    export is now the real values, a copy, as ``numpy()`` gives them; a consumer asking for no copy
    is told why there is one, and a tensor that requires grad is refused as torch refuses it."""
    import numpy as np
    tensors = _tensors()
    if name == "row":
        t = tensors["grad"][2:5]
    elif name == "transposed":
        t = tensors["grad"].T
    else:
        t = tensors[name].detach()
    want = t.values() if isinstance(t, DequantizedView) else t.dequantize()
    assert np.array_equal(np.from_dlpack(t), want.numpy())
    assert torch.equal(torch.from_dlpack(t), want)
    with pytest.raises(BufferError, match="copy"):
        t.__dlpack__(copy=False)
    with pytest.raises(RuntimeError, match="require gradient"):
        tensors["master"].__dlpack__()
