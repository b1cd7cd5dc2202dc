"""fp8amp.optim.Adam / AdamW: O1 against torch.optim, O2 against a float64 model and against O1 in a
short training run, state-dict round trips, non-finite skipping, GradScaler, errors, and
(GPU-marked) CUDA against CPU bit for bit.

Bounds, derived rather than tuned:

* O1 vs torch (foreach=False, CPU), each step from the same params (ours copied into torch's):
  optim.h performs torch's operations in torch's order, so m and v are bit-identical and the new
  params differ at most by torch's sqrt error carried through the update: 2^-20 |u| + 2 ulp(p')
  (the derivation is in test_adam_op.py's docstring).
* O2 vs float64, one step from the optimizer's own stored state: a stored m (E4M3) / v (FP16) is
  the float32 value rounded once to its format at its new scale, so within half a format ulp (at
  the scaled magnitude) of the float32 value, which is within 2^-21 of the magnitudes involved of
  float64. The float32 master p' is within 2^-21 (|p| + |u|) + 1 ulp(p').
* O2 vs O1 training: the update uses the step's full-precision m' and v'; only the stored state is
  rounded, with relative error <= 2^-4 (E4M3) and 2^-11 (FP16) per step, decaying by beta1 / beta2.
  RNE errors are unbiased, so the updates differ by a few percent on average and the loss gap stays
  a small fraction of the loss decrease; the test allows 10% of O1's decrease.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch

import fp8amp
from fp8amp.optim import Adam, AdamW

E4M3, FP16 = torch.float8_e4m3fn, torch.float16
MAN_BITS = {E4M3: 3, FP16: 10}
MIN_EXP = {E4M3: -6, FP16: -14}
TORCH = {AdamW: torch.optim.AdamW, Adam: torch.optim.Adam}


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def groups(model, **extra):
    """Two groups with different lr and weight decay: weights, and biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights, lr=3e-3, weight_decay=0.05, **extra), dict(params=biases, lr=1e-2, weight_decay=0.0)]


def batch(step, n=16):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def loss_of(model, step):
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.float().abs()
    return (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()


def half_ulp(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """Half an ulp of `dtype` at |x| * scale, in real units (float64)."""
    xs = (x.double() * scale).abs()
    e = torch.floor(torch.log2(xs.clamp_min(1e-300))).clamp_min(MIN_EXP[dtype])
    return torch.exp2(e - MAN_BITS[dtype] - 1) / scale


def real_state(state):
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype != torch.float32:
        m = m.float() * state["exp_avg_scale_inv"]
    if v.dtype != torch.float32:
        v = v.float() * state["exp_avg_sq_scale_inv"]
    return m, v


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def snapshot(model, opt):
    out = [bits(p) for p in model.parameters()]
    for p in model.parameters():
        out += [bits(v) for v in opt.state[p].values()]
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# O1 against torch.optim


@pytest.mark.parametrize("cls", [AdamW, Adam])
@pytest.mark.parametrize("maximize", [False, True])
def test_o1_matches_torch_over_ten_steps(cls, maximize):
    """Param groups of different lr / weight_decay, an lr scheduler, maximize, and a param that
    has no grad on some steps (its step count lags, as torch's does)."""
    model = mlp()
    ref = copy.deepcopy(model)
    opt = cls(groups(model), maximize=maximize, betas=(0.8, 0.99))
    ref_opt = TORCH[cls](groups(ref), maximize=maximize, betas=(0.8, 0.99), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.8**s)
    pairs = list(zip(model.parameters(), ref.parameters()))
    for t in range(10):
        opt.zero_grad()
        loss_of(model, t).backward()
        if t in (2, 5):
            model[2].bias.grad = None  # not stepped this time
        with torch.no_grad():
            for p, r in pairs:
                r.copy_(p)
                r.grad = None if p.grad is None else p.grad.clone()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        for i, ((p, r), p0) in enumerate(zip(pairs, before)):
            st, rst = opt.state[p], ref_opt.state[r]
            assert st["step"].item() == rst["step"].item(), f"param {i} step {t}"
            assert torch.equal(st["exp_avg"].view(torch.int32), rst["exp_avg"].view(torch.int32)), f"m {i} {t}"
            assert torch.equal(st["exp_avg_sq"].view(torch.int32), rst["exp_avg_sq"].view(torch.int32)), f"v {i} {t}"
            group = opt.param_groups[0 if i % 2 == 0 else 1]
            decay = 1 - group["lr"] / 0.8 * group["weight_decay"] if cls is AdamW else 1.0  # lr before sched.step
            want = r.detach().double()
            bound = 2.0**-20 * (want - p0.double() * decay).abs() + 2 * ulp(r.detach())
            err = (p.detach().double() - want).abs()
            assert (err <= bound).all(), f"param {i} step {t}: worst excess {(err - bound).max().item()}"
    assert opt.state[model[2].bias]["step"].item() == 8
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


# ------------------------------------------------------------------------------------------------
# O2


@pytest.mark.parametrize("cls", [AdamW, Adam])
def test_o2_against_float64_model(cls):
    model = mlp(1)
    opt = cls(groups(model), state_dtypes="O2", maximize=cls is Adam)
    for t in range(1, 9):
        opt.zero_grad()
        loss_of(model, t).backward()
        inputs = {}
        for group in opt.param_groups:
            for p in group["params"]:
                m, v = real_state(opt.state[p]) if opt.state[p] else (torch.zeros_like(p), torch.zeros_like(p))
                inputs[p] = (p.detach().clone(), p.grad.clone(), m, v, group)
        opt.step()
        for i, (p, (p0, g, m0, v0, group)) in enumerate(inputs.items()):
            st = opt.state[p]
            assert st["exp_avg"].dtype == E4M3 and st["exp_avg_sq"].dtype == FP16 and st["step"].item() == t
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2 = group["betas"]
            p64, g64, m64, v64 = p0.double(), g.double(), m0.double(), v0.double()
            if group["maximize"]:
                g64 = -g64
            if cls is AdamW:
                p64 = p64 * (1 - lr * wd)
            else:
                g64 = g64 + wd * p64
            m1 = b1 * m64 + (1 - b1) * g64
            v1 = b2 * v64 + (1 - b2) * g64 * g64
            u = -lr / (1 - b1**t) * m1 / (v1.sqrt() / math.sqrt(1 - b2**t) + eps)
            m_got, v_got = real_state(st)
            for name, got, want, key, fmt, slack in (
                ("exp_avg", m_got, m1, "exp_avg_scale", E4M3, 2.0**-21 * (m64.abs() + g64.abs())),
                ("exp_avg_sq", v_got, v1, "exp_avg_sq_scale", FP16, 2.0**-21 * (v64 + g64**2)),
            ):
                scale = st[key].item()
                assert scale == 2.0 ** round(math.log2(scale)) and st[key + "_inv"].item() == 1 / scale
                bound = torch.maximum(half_ulp(want, scale, fmt), half_ulp(got, scale, fmt)) + slack
                err = (got.double() - want).abs()
                assert (err <= bound).all(), f"{name} {i} step {t}: worst excess {(err - bound).max().item()}"
            want = p64 + u
            bound = 2.0**-21 * (p64.abs() + u.abs()) + ulp(p.detach())
            err = (p.detach().double() - want).abs()
            assert (err <= bound).all(), f"param {i} step {t}: worst excess {(err - bound).max().item()}"


def test_o2_training_tracks_o1():
    losses = {}
    for level in ("O1", "O2"):
        model = mlp(2)
        opt = AdamW(groups(model), state_dtypes=level)
        x, y = batch(0, n=256)
        curve = []
        for _ in range(60):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[level] = curve
    o1, o2 = losses["O1"], losses["O2"]
    decrease = o1[0] - o1[-1]
    assert decrease > 0.1 * o1[0]
    assert max(abs(a - b) for a, b in zip(o1, o2)) <= 0.1 * decrease, (o1[-1], o2[-1])


# ------------------------------------------------------------------------------------------------
# State dicts, non-finite grads, GradScaler


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("cls", [AdamW, Adam])
def test_state_dict_round_trip_is_bit_identical(cls, level):
    def train(model, opt, sched, steps):
        for t in steps:
            opt.zero_grad()
            loss_of(model, t).backward()
            opt.step()
            sched.step()

    make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    model = mlp(3)
    opt = cls(groups(model), state_dtypes=level)
    sched = make_sched(opt)
    train(model, opt, sched, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    train(model, opt, sched, range(3, 7))  # uninterrupted

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = mlp(4)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = cls(groups(resumed), state_dtypes=level)
    opt2.load_state_dict(ckpt["opt"])
    sched2 = make_sched(opt2)
    sched2.load_state_dict(ckpt["sched"])
    for p in resumed.parameters():
        st = opt2.state[p]
        assert st["exp_avg"].dtype == (E4M3 if level == "O2" else torch.float32)
        assert st["exp_avg_sq"].dtype == (FP16 if level == "O2" else torch.float32)
        assert st["step"].dtype == torch.float32 and st["step"].shape == () and st["step"].item() == 3
        assert (level == "O2") == ("exp_avg_scale" in st)
    train(resumed, opt2, sched2, range(3, 7))
    assert same(snapshot(model, opt), snapshot(resumed, opt2))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_grad_skips_the_whole_step(level, bad):
    model = mlp(5)
    opt = AdamW(groups(model), state_dtypes=level)
    for t in range(2):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    before = snapshot(model, opt)
    opt.zero_grad()
    loss_of(model, 2).backward()
    model[2].bias.grad[1] = bad  # group 1 only: group 0 must skip as well
    opt.step()
    assert same(before, snapshot(model, opt))
    assert all(opt.state[p]["step"].item() == 2 for p in model.parameters())
    # One group: the op alone skips.
    single = AdamW(model.parameters(), state_dtypes=level)
    single.step()  # initialize state (grads still hold the bad value: skipped)
    assert all(single.state[p]["step"].item() == 0 for p in model.parameters())
    assert all(torch.equal(single.state[p]["exp_avg"].float(), torch.zeros_like(p)) for p in model.parameters())


def test_grad_scaler_path():
    """GradScaler unscales (exactly: power-of-two scale) and skips inf steps itself."""
    model, ref = mlp(6), mlp(6)
    opt = AdamW(groups(model), state_dtypes="O2")
    ref_opt = AdamW(groups(ref), state_dtypes="O2")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for t in range(4):
        opt.zero_grad()
        scaler.scale(loss_of(model, t)).backward()
        scaler.step(opt)
        scaler.update()
        ref_opt.zero_grad()
        loss_of(ref, t).backward()
        ref_opt.step()
    assert same(snapshot(model, opt), snapshot(ref, ref_opt))
    before, scale = snapshot(model, opt), scaler.get_scale()
    opt.zero_grad()
    x, y = batch(9)
    x[0, 0] = float("inf")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert same(before, snapshot(model, opt)) and scaler.get_scale() == scale / 2


# ------------------------------------------------------------------------------------------------
# Errors, API


def test_errors_name_the_argument():
    params = list(mlp().parameters())
    with pytest.raises(ValueError, match=r"amsgrad=True is not supported; accepted: amsgrad=False"):
        AdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match=r"differentiable=True is not supported"):
        Adam(params, differentiable=True)
    assert AdamW(params, capturable=True).param_groups[0]["capturable"]  # always capturable: accepted
    with pytest.raises(ValueError, match=r"state_dtypes must be one of 'O1', 'O2'; got 'O3'"):
        AdamW(params, state_dtypes="O3")
    with pytest.raises(ValueError, match=r"state_dtypes must be one of"):
        AdamW([dict(params=params, state_dtypes="fp8")])
    with pytest.raises(ValueError, match=r"params must be float32, bfloat16 or float16.*torch.float64"):
        AdamW(mlp().double().parameters())
    with pytest.raises(ValueError, match=r"lr must be a Python float, got Tensor"):
        AdamW(params, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match=r"invalid betas\[1\]"):
        AdamW(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"invalid eps: 0.0 \(must be > 0: with eps = 0 .* every step is skipped"):
        AdamW(params, eps=0.0)
    with pytest.raises(ValueError, match=r"invalid weight_decay: -0.1 \(must be >= 0\)"):
        AdamW(params, weight_decay=-0.1)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"sparse grads are not supported"):
        opt.step()


def test_api():
    assert fp8amp.optim.AdamW is AdamW and isinstance(AdamW(mlp().parameters()), torch.optim.Optimizer)
    opt = AdamW(mlp().parameters(), foreach=True, fused=True)  # accepted and ignored
    assert opt.param_groups[0]["decoupled_weight_decay"] and opt.param_groups[0]["weight_decay"] == 1e-2
    assert not Adam(mlp().parameters()).param_groups[0]["decoupled_weight_decay"]
    model = mlp()
    opt = AdamW(model.parameters())
    loss = opt.step(lambda: loss_of(model, 0).backward() or loss_of(model, 0))
    assert loss is not None and all(opt.state[p]["step"].item() == 1 for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# CUDA against CPU (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_cuda_matches_cpu_bit_for_bit(level):
    cpu = mlp(7)
    gpu = copy.deepcopy(cpu).cuda()
    opt_c, opt_g = AdamW(groups(cpu), state_dtypes=level), AdamW(groups(gpu), state_dtypes=level)
    for t in range(4):
        opt_c.zero_grad()
        opt_g.zero_grad()
        loss_of(cpu, t).backward()
        for p, q in zip(cpu.parameters(), gpu.parameters()):
            q.grad = p.grad.cuda()  # same grad bytes on both sides
        opt_c.step()
        opt_g.step()
        assert same(snapshot(cpu, opt_c), snapshot(gpu, opt_g)), f"step {t}"
    # A CPU checkpoint loads onto the GPU with the state dtypes kept.
    fresh = copy.deepcopy(cpu).cuda()
    opt_f = AdamW(groups(fresh), state_dtypes=level)
    opt_f.load_state_dict(opt_c.state_dict())
    assert all(v.device.type == "cuda" for p in fresh.parameters() for v in opt_f.state[p].values())
    assert same(snapshot(cpu, opt_c), snapshot(fresh, opt_f))


def test_a_step_where_no_param_has_a_gradient_warns():
    """What an optimizer over parameters the model no longer uses does every step (built before
    fully_shard or a load with assign=True replaced them): nothing, now said."""
    layer = torch.nn.Linear(4, 4)
    optimizer = fp8amp.optim.AdamW(layer.parameters())
    with pytest.warns(UserWarning, match="none of its 2 parameter.s. has a gradient"):
        optimizer.step()
    layer(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
