"""fp8amp.initialize (O1/O2): module swap, FP16 ScaledTensor masters, FP8 weight gradients and their
accumulation, the optimizer rebuild (param groups, hyperparameters), clip_grad_norm_,
torch.compile, errors; on the GPU, CUDA against the CPU and a small GPT within 1 % of BF16 (also
with its saved activations in FP8, fp8amp.save_activations_in_fp8, eager and with compiled blocks).
The optimizer's step, the FP8 weight copy it rewrites, state dicts and non-finite gradients are in
test_initialize_optimizer.py; the model and data in initialize_net.py.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import Fp8Linear, ScaledTensor
from fp8amp.optim import Adam, AdamW
from initialize_net import E4M3, FP16, groups, loss_of, net, real, setup


# ------------------------------------------------------------------------------------------ swap


def test_module_swap_and_masters():
    model = net()
    old = dict(model.named_parameters(remove_duplicate=False))
    opt = torch.optim.AdamW(groups(model))
    model, new_opt = fp8amp.initialize(model, opt, "O2")
    for name in ("up", "down", "shared_a", "shared_b", "frozen"):
        layer = getattr(model, name)
        assert type(layer) is Fp8Linear, name
        assert isinstance(layer.weight, ScaledTensor) and isinstance(layer.weight, nn.Parameter), name
        assert layer.weight.storage_format == FP16 and layer.weight.dtype == torch.float32
        # the master holds the old weight to FP16 precision
        w_old = old[f"{name}.weight"].detach()
        assert (real(layer.weight) - w_old).abs().max() <= w_old.abs().max() * 2.0 ** -11
    assert model.shared_a.weight is model.shared_b.weight  # still shared, one master
    assert not model.frozen.weight.requires_grad
    assert type(model.odd) is nn.Linear and type(model.odd.weight) is nn.Parameter  # 24: FP8 can't
    # the head is a Linear FP8 can take, but its weight is the embedding's: it stays plain
    assert type(model.head) is Fp8Linear and not isinstance(model.head.weight, ScaledTensor)
    assert model.head.weight is model.emb.weight
    for name in ("up.bias", "norm.weight", "emb.weight"):  # non-Linear-weight params unchanged
        assert dict(model.named_parameters())[name] is old[name]


def test_optimizer_rebuild_keeps_groups_and_hyperparameters():
    model = net()
    opt = torch.optim.AdamW(groups(model), betas=(0.8, 0.95), eps=1e-6, maximize=False)
    model, new = fp8amp.initialize(model, opt, "O1")
    assert type(new) is AdamW
    assert len(new.param_groups) == 2
    for g_old, g_new in zip(opt.param_groups, new.param_groups):
        for key in ("lr", "betas", "eps", "weight_decay", "maximize"):
            assert g_new[key] == g_old[key], key
        assert g_new["state_dtypes"] == "O1" and g_new["decoupled_weight_decay"]
    model_params = {id(p) for p in model.parameters()}
    seen = [id(p) for g in new.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)) and set(seen) <= model_params
    assert any(isinstance(p, ScaledTensor) for p in new.param_groups[0]["params"])
    # frozen params were not in the optimizer and are not now
    assert id(model.frozen.weight) not in set(seen)

    _, adam = fp8amp.initialize(net(), torch.optim.Adam(net().parameters(), weight_decay=0.01), "O2")
    assert type(adam) is Adam and not adam.param_groups[0]["decoupled_weight_decay"]


def test_without_optimizer():
    model, opt = fp8amp.initialize(net(), None, "O2")
    assert opt is None and isinstance(model.up.weight, ScaledTensor)
    later = AdamW(model.parameters(), state_dtypes="O2")
    loss_of(model, 0).backward()
    later.step()


def test_an_optimizer_built_before_the_masters_is_refused():
    """Built before initialize: it holds the float32 Linear weights the masters replaced, so it
    would train the biases and norms only (it did, silently: through initialize_optimizer before
    2026-12-06, and through a second initialize with an optimizer of part of the model)."""
    model = net()
    early = torch.optim.AdamW(model.parameters())
    model, _ = fp8amp.initialize(model, None, "O2", policy="all")
    with pytest.raises(ValueError, match=r"initialize_optimizer: param \d+ of group 0 is a Linear weight that an "
                                         r"earlier fp8amp.initialize replaced by an FP16 master"):
        fp8amp.initialize_optimizer(model, early, "O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.initialize_optimizer(model, torch.optim.AdamW(model.parameters()), "O2")

    model = net()
    first, second = torch.optim.AdamW(model.up.parameters()), torch.optim.AdamW(model.down.parameters())
    model, first = fp8amp.initialize(model, first, "O2", policy="all")
    with pytest.raises(ValueError, match=r"initialize: param \d+ of group 0 is a Linear weight that an earlier"):
        fp8amp.initialize(model, second, "O2", policy="all")


def test_initialize_optimizer_warns_of_parameters_not_the_models():
    """Not replaced by initialize, but not the model's either (e.g. built before fully_shard)."""
    model, _ = fp8amp.initialize(net(), None, "O2", policy="all")
    other = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"initialize_optimizer: 2 of the optimizer's parameters are not the model's"):
        fp8amp.initialize_optimizer(model, torch.optim.AdamW([*model.parameters(), *other.parameters()]), "O2")


@pytest.mark.parametrize("options", [dict(amsgrad=True), dict(differentiable=True), dict(lr=torch.tensor(1e-2)),
                                     dict(eps=0.0)], ids=["amsgrad", "differentiable", "tensor lr", "eps 0"])
def test_optimizer_options_are_checked_before_the_model_changes(options):
    """A refused optimizer left the model converted, with masters its old optimizer does not step."""
    model = net()
    with pytest.raises(ValueError, match=r"^initialize: fp8amp.optim.AdamW: "):
        fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), **options), "O2", policy="all")
    assert not any(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    assert not any(isinstance(p, ScaledTensor) for p in model.parameters())


def test_errors_name_the_argument():
    model = net()
    with pytest.raises(ValueError, match=r"opt_level must be one of 'O1', 'O2'.*O3"):
        fp8amp.initialize(model, None, "O3")
    with pytest.raises(ValueError, match="opt_level"):
        fp8amp.initialize(model, None, "o2")
    with pytest.raises(ValueError, match=r"optimizer must be one of torch.optim.Adam.*got torch.optim.*SGD"):
        fp8amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1")
    with pytest.raises(ValueError, match=r"weight_grad must be one of 'fp8', 'fp32'; got 'bf16'"):
        fp8amp.initialize(model, None, "O1", weight_grad="bf16")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fp8amp.initialize("model", None, "O1")
    stepped = torch.optim.AdamW(model.parameters())
    loss_of(model, 0).backward()
    stepped.step()
    with pytest.raises(ValueError, match="already taken steps"):
        fp8amp.initialize(model, stepped, "O1")
    with pytest.raises(ValueError, match="amsgrad"):
        fp8amp.initialize(net(), torch.optim.AdamW(net().parameters(), amsgrad=True), "O1")


# ------------------------------------------------------------------------------------------ grads


def test_weight_grad_is_fp8_and_poisoned_when_nonfinite():
    model, _ = setup("O1")
    loss_of(model, 0).backward()
    g = model.up.weight.grad
    assert isinstance(g, ScaledTensor) and g.storage_format == E4M3 and g.dtype == torch.float32
    assert torch.isfinite(real(g)).all() and real(g).abs().max() > 0
    # the scale is the current power-of-two one: the largest code is within a binade of 448
    codes = g._data.float().abs().max()
    assert 224 <= codes <= 448
    model.zero_grad()
    (loss_of(model, 0) * float("inf")).backward()
    assert torch.isnan(real(model.up.weight.grad)).all()  # inf cannot be an E4M3 code: NaN, not 448


@pytest.mark.parametrize("autocast", [False, True])
def test_weight_grad_gemm_writes_the_autocast_dtype(autocast, monkeypatch):
    """The wgrad GEMM's output, which current scaling then reads twice, is in the forward output's
    dtype (docs/numerics.md#numerics): bfloat16 under bf16 autocast, float32 without; the E4M3 gradient is exactly
    the current-scaled quantization of that output."""
    model, _ = setup("O2")
    calls = []
    real_gemm = fp8amp.ops.fast.gemm  # what Fp8Linear calls (its operands are fp8amp's own casts)

    def recording_gemm(a, b, *args):
        out = real_gemm(a, b, *args)
        calls.append((a.shape, b.shape, out))
        return out

    monkeypatch.setattr(fp8amp.ops.fast, "gemm", recording_gemm)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(model, 0)
    loss.backward()
    out_features, in_features = model.up.weight.shape
    grad = model.up.weight.grad
    # up's wgrad GEMM (the tied head, a plain-weight Fp8Linear of the same shape, makes another)
    wgrads = [out for a, b, out in calls if a == (out_features, 48) and b == (in_features, 48)]
    quantized = [ScaledTensor.from_tensor(out, E4M3, nan_if_nonfinite=True) for out in wgrads]
    same = [out for out, q in zip(wgrads, quantized)
            if torch.equal(grad._data.view(torch.uint8), q._data.view(torch.uint8))
            and torch.equal(grad._scale_inv, q._scale_inv)]
    assert len(same) == 1
    assert same[0].dtype == (torch.bfloat16 if autocast else torch.float32)


def test_micro_batch_accumulation_is_one_fused_requantize():
    model, _ = setup("O2")
    grads = []
    for step in (0, 1):
        model.zero_grad(set_to_none=True)
        loss_of(model, step).backward()
        grads.append(model.up.weight.grad.clone())
    model.zero_grad(set_to_none=True)
    loss_of(model, 0).backward()
    loss_of(model, 1).backward()
    acc = model.up.weight.grad
    expected = grads[0].clone()
    fp8amp.ops.scaled_accumulate(expected._data, expected._scale_inv, grads[1]._data, grads[1]._scale_inv)
    assert isinstance(acc, ScaledTensor) and acc.storage_format == E4M3
    assert torch.equal(acc._data.view(torch.uint8), expected._data.view(torch.uint8))
    assert torch.equal(acc._scale_inv, expected._scale_inv)
    # and that is the sum of the two to E4M3 precision
    total = real(grads[0]) + real(grads[1])
    assert (real(acc) - total).abs().max() <= total.abs().max() * 2.0 ** -4


def test_fp32_weight_grad_option():
    """weight_grad="fp32": plain float32 grads for the FP16 masters, summed exactly by autograd, and
    the same optimizer; the E4M3 grad of the default equals it to E4M3 precision."""
    model_fp8, _ = setup("O2")
    model = net()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(groups(model)), "O2", weight_grad="fp32")
    for step in (0, 1):
        loss_of(model, step).backward()
        loss_of(model_fp8, step).backward()
    g = model.up.weight.grad
    assert type(g) is torch.Tensor and g.dtype == torch.float32
    g8 = real(model_fp8.up.weight.grad)
    assert (g8 - g).abs().max() <= g.abs().max() * 2.0 ** -3  # two E4M3 roundings
    before = real(model.up.weight).clone()
    opt.step()
    assert isinstance(model.up.weight, ScaledTensor) and not torch.equal(real(model.up.weight), before)


def test_clip_grad_norm_on_fp8_grads():
    model, _ = setup("O2")
    loss_of(model, 0).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(real(g)) for g in grads]))
    before = real(model.up.weight.grad)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    torch.testing.assert_close(norm, expected)
    assert isinstance(model.up.weight.grad, ScaledTensor)
    torch.testing.assert_close(real(model.up.weight.grad), before * (1e-3 / (norm + 1e-6)))


# ------------------------------------------------------------------------------------------ compile


def test_compile_matches_eager():
    model, opt = setup("O1")
    eager = copy.deepcopy(model)
    opt_eager = AdamW(groups(eager), state_dtypes="O1")
    fp8amp.register_scaling_hooks(eager, opt_eager)  # (the copy's scaling updated as the model's)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for step in range(3):
        for m, o in ((compiled, opt), (eager, opt_eager)):
            o.zero_grad()
            loss_of(m, step).backward()
        assert torch.equal(real(model.up.weight.grad), real(eager.up.weight.grad))
        opt.step()
        opt_eager.step()
    assert torch.equal(real(model.up.weight), real(eager.up.weight))


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cuda_matches_cpu():
    """One step from the same weights on CPU (emulation) and CUDA. The FP8 weight gradients differ
    only by the GEMMs' summation order and fast accumulation, so they agree to the backward SQNR
    floor of test_linear.py (18.8 dB, E5M2 x E4M3). The first Adam update is lr * g / (|g| + eps),
    at most lr per element whatever the gradient, so the new masters differ by at most 2 lr (where
    a gradient's sign differs) plus each side's FP16 rounding (2^-11 |p|) and the decay term."""
    model_cpu, opt_cpu = setup("O2")
    model_gpu = net().cuda()
    model_gpu, opt_gpu = fp8amp.initialize(model_gpu, torch.optim.AdamW(groups(model_gpu)), "O2", policy="all")
    for m, o, dev in ((model_cpu, opt_cpu, "cpu"), (model_gpu, opt_gpu, "cuda")):
        loss_of(m, 0, dev).backward()
    for name in ("up", "down", "shared_a"):
        g_cpu = real(getattr(model_cpu, name).weight.grad)
        g_gpu = real(getattr(model_gpu, name).weight.grad).cpu()
        noise = (g_gpu - g_cpu).double().pow(2).sum()
        assert noise == 0 or 10 * torch.log10(g_cpu.double().pow(2).sum() / noise) > 18.8, name
    opt_cpu.step()
    opt_gpu.step()
    lr, wd = opt_cpu.param_groups[0]["lr"], opt_cpu.param_groups[0]["weight_decay"]
    for name in ("up", "down", "shared_a"):
        a, b = real(getattr(model_cpu, name).weight), real(getattr(model_gpu, name).weight).cpu()
        bound = 2 * lr + a.abs() * (2.0 ** -10 + 2 * lr * wd) + 1e-7
        assert ((a - b).abs() <= bound).all(), name


@pytest.mark.gpu
def test_module_to_device_keeps_masters():
    model, _ = setup("O2")
    model.cuda()
    assert isinstance(model.up.weight, ScaledTensor) and model.up.weight.device.type == "cuda"
    loss_of(model, 0, "cuda").backward()
    assert isinstance(model.up.weight.grad, ScaledTensor)


@functools.lru_cache(maxsize=None)
def _gpt_loss(mode: str) -> float:
    """``mode``: bf16, fp8, O1 or O2; a "-fp8act" suffix adds fp8amp.save_activations_in_fp8, and
    then "-compile" compiles each block (Inductor), where the context stores inside the graphs;
    a "-blockwise" suffix trains with the blockwise recipe (docs/tiles.md#recipes)."""
    from fp8amp.testing import GPT, GPTConfig, batches, load_text_bytes, train_step

    compiled = mode.endswith("-compile")
    recipe = "blockwise" if mode.endswith("-blockwise") else None
    level = mode.removesuffix("-blockwise").removesuffix("-compile").removesuffix("-fp8act")
    saved_tensors_hooks = fp8amp.save_activations_in_fp8() if "-fp8act" in mode else None
    data = load_text_bytes(max_bytes=4 << 20)
    cfg = GPTConfig(seq_len=256, n_layer=4, n_head=4, d_model=256)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    if level in ("O1", "O2"):
        model, opt = fp8amp.initialize(model, opt, level, policy="all", recipe=recipe)  # small layers: convert anyway
    elif level == "fp8":  # FP8 compute only: fp32 weights, torch's AdamW
        fp8amp.convert(model, optimizer=opt, policy="all")
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == (0 if level == "bf16" else 4 * cfg.n_layer)
    if compiled:
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile()
    # the usual stable recipe: linear warm-up and clipping, created after initialize
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    losses = []
    for step, (x, y) in zip(range(400), batches(data, 32, cfg.seq_len, "cuda")):
        losses.append(train_step(model, opt, x, y, scheduler=schedule, saved_tensors_hooks=saved_tensors_hooks))
    if saved_tensors_hooks is not None:
        assert saved_tensors_hooks.stored_tensors > 0
    return float(torch.stack(losses[-50:]).mean())


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["fp8", "O1", "O2", "O2-fp8act", "O2-fp8act-compile", "O2-blockwise"])
def test_small_gpt_loss_matches_bf16(level):
    bf16, fp8 = _gpt_loss("bf16"), _gpt_loss(level)
    log = os.environ.get("FP8AMP_LOSS_LOG")  # scripts/gpu_check.sh: the losses of every run, passed or not
    if log:
        with open(log, "a") as f:
            f.write(f"{level}: {fp8:.4f} against bf16 {bf16:.4f} ({(fp8 - bf16) / bf16:+.2%})\n")
    assert abs(fp8 - bf16) / bf16 < 0.01, (fp8, bf16)
