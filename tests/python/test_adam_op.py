"""torch.ops.fp8amp.adam_step: the FP32 path against torch.optim.Adam/AdamW, the low-precision paths
against a float64 model, the non-finite policy, the step counter, errors, the Meta kernel, and
(GPU-marked) CUDA against CPU bit for bit.

Bounds, derived rather than tuned:

* FP32 path vs torch (foreach=False, CPU), one step from the same state. The op performs torch's
  operations in torch's order with the same fmas (optim.h), so m' and v', which involve no square
  root, are bit-identical. The denominators differ: torch's vectorized CPU sqrt is not correctly
  rounded (at most 1 ulp off on AVX-512: relative 2^-23) and rounds ``sqrt(v)/bc2_sqrt + eps``
  twice, ours rounds ``fma(sqrt(v), 1/sqrt(bc2), eps)`` once after a correctly rounded sqrt and a
  rounded 1/sqrt(bc2) (together < 2^-21.5 relative); with the two roundings of ``(-step * m) / den``
  the updates differ by at most ~2^-21 |u|, so the new params by at most 2^-21 |u| + one ulp of p'
  (the two sums may round to neighbours). The test uses 2^-20 |u| + 2 ulp.
* Low-precision paths vs a float64 model, one step from the op's own stored state: a stored value
  is the float32 result rounded to its format, so it is within half an ulp of the format (at the
  scaled magnitude; half the smallest subnormal below the normal range) of the float32 result,
  which is within a few float32 roundings (< 2^-21 of the magnitudes involved) of float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8amp  # noqa: F401 (loads the extension: registers torch.ops.fp8amp)
from fp8amp.ops import fast

ops = torch.ops.fp8amp
E4M3, FP16 = torch.float8_e4m3fn, torch.float16
FMAX = {E4M3: 448.0, torch.float8_e5m2: 57344.0, FP16: 65504.0}
MAN_BITS = {E4M3: 3, FP16: 10}
MIN_EXP = {E4M3: -6, FP16: -14}
OPTIONAL_LISTS = (  # the op's per-param optional lists, in its order
    "param_scales", "param_scale_invs", "grad_scale_invs", "exp_avg_scales", "exp_avg_scale_invs",
    "exp_avg_sq_scales", "exp_avg_sq_scale_invs", "weights_fp8", "weight_scales", "weight_scale_invs",
    "step_counts", "param_amaxes",
)


def adam_step(params, grads, exp_avgs, exp_avg_sqs, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
              weight_decay=0.0, adamw=True, maximize=False, step=0, step_tensor=None, found_inf=None,
              margin=0, **optional_lists):
    lists = [optional_lists.pop(name, []) for name in OPTIONAL_LISTS]
    assert not optional_lists, f"unknown lists {list(optional_lists)}"
    return ops.adam_step(params, grads, exp_avgs, exp_avg_sqs, *lists, lr=lr, beta1=betas[0], beta2=betas[1],
                         eps=eps, weight_decay=weight_decay, adamw=adamw, maximize=maximize, step=step,
                         step_tensor=step_tensor, found_inf=found_inf, margin=margin)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 ulp at |x| (float64 result)."""
    x = x.float().abs()
    return (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()


def random_like(n, gen, lo=-8, hi=4):
    return torch.randn(n, generator=gen) * torch.exp2(torch.randint(lo, hi, (n,), generator=gen).float())


# ------------------------------------------------------------------------------------------------
# FP32 path (O1) against torch.optim


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.2, 0.95)])
def test_fp32_against_torch_over_ten_steps(cls, maximize, weight_decay, betas):
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 7, 1000, 4099]
    params = [random_like(n, gen, -4, 4) for n in sizes]
    exp_avgs = [torch.zeros(n) for n in sizes]
    exp_avg_sqs = [torch.zeros(n) for n in sizes]
    lr = 3e-3
    for t in range(1, 11):
        grads = [random_like(n, gen) for n in sizes]
        # torch, one step from our current state.
        ref = [p.clone().requires_grad_(True) for p in params]
        opt = cls(ref, lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay, maximize=maximize, foreach=False)
        for r, g, m, v in zip(ref, grads, exp_avgs, exp_avg_sqs):
            r.grad = g.clone()
            opt.state[r] = {"step": torch.tensor(float(t - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        opt.step()
        before = [p.clone() for p in params]
        amax = adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=lr, betas=betas, weight_decay=weight_decay,
                         adamw=cls is torch.optim.AdamW, maximize=maximize, step=t)
        decay = 1 - lr * weight_decay if cls is torch.optim.AdamW else 1.0
        for i, (r, p, m, v, p0) in enumerate(zip(ref, params, exp_avgs, exp_avg_sqs, before)):
            st = opt.state[r]
            assert torch.equal(m.view(torch.int32), st["exp_avg"].view(torch.int32)), f"exp_avg {i} step {t}"
            assert torch.equal(v.view(torch.int32), st["exp_avg_sq"].view(torch.int32)), f"exp_avg_sq {i} step {t}"
            want = r.detach()
            update = want.double() - p0.double() * decay
            bound = 2.0**-20 * update.abs() + 2 * ulp(want)
            err = (p.double() - want.double()).abs()
            assert (err <= bound).all(), f"param {i} step {t}: worst excess {(err - bound).max().item()}"
        assert amax.shape == (len(sizes), 5)
        assert torch.equal(amax[:, 3], torch.stack([p.abs().max() for p in params]))
        assert torch.equal(amax[:, 4], amax[:, 3])  # no kept amax: pass 1 read the params
        assert torch.equal(amax[:, 0], torch.stack([g.abs().max() for g in grads]))


@pytest.mark.parametrize("cls,weight_decay", [(torch.optim.AdamW, 0.01), (torch.optim.AdamW, 0.0), (torch.optim.Adam, 0.0)])
def test_fp32_ten_step_trajectory_against_torch(cls, weight_decay):
    """Independent 10-step runs. Without an L2 term the moments never see the params, so m and v
    stay bit-identical to torch's; the param differences add up step by step: after step k at most
    sum over j <= k of (2^-20 |u_j| + 2 ulp(p_j)) (the one-step bound above, plus what the previous
    difference carries through p * decay, which does not grow it)."""
    gen = torch.Generator().manual_seed(8)
    n = 5000
    p = random_like(n, gen, -4, 4)
    ref = p.clone().requires_grad_(True)
    opt = cls([ref], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, foreach=False)
    m, v = torch.zeros(n), torch.zeros(n)
    decay = 1 - 1e-3 * weight_decay if cls is torch.optim.AdamW else 1.0
    bound = torch.zeros(n, dtype=torch.float64)
    for t in range(1, 11):
        g = random_like(n, gen)
        prev = ref.detach().clone()
        ref.grad = g.clone()
        opt.step()
        adam_step([p], [g], [m], [v], lr=1e-3, weight_decay=weight_decay, adamw=cls is torch.optim.AdamW, step=t)
        want = ref.detach()
        bound += 2.0**-20 * (want.double() - prev.double() * decay).abs() + 2 * ulp(want)
        err = (p.double() - want.double()).abs()
        assert (err <= bound).all(), f"step {t}: worst excess {(err - bound).max().item()}"
        assert torch.equal(m.view(torch.int32), opt.state[ref]["exp_avg"].view(torch.int32))
        assert torch.equal(v.view(torch.int32), opt.state[ref]["exp_avg_sq"].view(torch.int32))


# ------------------------------------------------------------------------------------------------
# Low-precision paths (O2) against a float64 model


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """Saturating RNE cast of x * scale (torch's cast rounds to nearest even; clamp saturates)."""
    fmax = FMAX[dtype]
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def pow2_scale(amax: float, fmax: float) -> float:
    q = (torch.tensor(fmax, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)).item()
    return 2.0 ** math.floor(math.log2(q))


def half_ulp(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """Half an ulp of `dtype` at |x| * scale, in real units (float64)."""
    xs = (x.double() * scale).abs()
    e = torch.floor(torch.log2(xs.clamp_min(1e-300))).clamp_min(MIN_EXP[dtype])
    return torch.exp2(e - MAN_BITS[dtype] - 1) / scale


class LowPrecisionParam:
    """An O2 parameter: FP16 master + scale, FP8 grad + scale_inv, E4M3 m, FP16 v, FP8 weight copy,
    its step count."""

    def __init__(self, n, gen, grad_dtype=E4M3, device="cpu"):
        one = lambda v=1.0: torch.tensor([v], dtype=torch.float32, device=device)  # noqa: E731
        p = random_like(n, gen, -3, 3).to(device)
        self.p_scale, self.p_scale_inv = one(2.0**11), one(2.0**-11)
        self.p = quantize(p, self.p_scale, FP16)
        self.g_scale_inv = one(2.0**-12)
        self.grad_dtype = grad_dtype
        self.g = torch.zeros(n, dtype=grad_dtype, device=device)
        self.m = torch.zeros(n, dtype=E4M3, device=device)
        self.m_scale, self.m_scale_inv = one(), one()
        self.v = torch.zeros(n, dtype=FP16, device=device)
        self.v_scale, self.v_scale_inv = one(), one()
        self.w = torch.zeros(n, dtype=E4M3, device=device)
        self.w_scale, self.w_scale_inv = one(), one()
        self.count = one(0.0)

    def set_grad(self, g):
        self.g = quantize(g, 1 / self.g_scale_inv, self.grad_dtype)

    def real(self):
        return dict(p=self.p.float() * self.p_scale_inv, g=self.g.float() * self.g_scale_inv,
                    m=self.m.float() * self.m_scale_inv, v=self.v.float() * self.v_scale_inv)

    @staticmethod
    def lists(params):
        return dict(
            param_scales=[x.p_scale for x in params], param_scale_invs=[x.p_scale_inv for x in params],
            grad_scale_invs=[x.g_scale_inv for x in params],
            exp_avg_scales=[x.m_scale for x in params], exp_avg_scale_invs=[x.m_scale_inv for x in params],
            exp_avg_sq_scales=[x.v_scale for x in params], exp_avg_sq_scale_invs=[x.v_scale_inv for x in params],
            weights_fp8=[x.w for x in params], weight_scales=[x.w_scale for x in params],
            weight_scale_invs=[x.w_scale_inv for x in params], step_counts=[x.count for x in params],
        )

    @staticmethod
    def step(params, **kw):
        return adam_step([x.p for x in params], [x.g for x in params], [x.m for x in params],
                         [x.v for x in params], **LowPrecisionParam.lists(params), **kw)

    def tensors(self):
        return [self.p, self.g, self.m, self.v, self.w, self.p_scale, self.p_scale_inv, self.m_scale,
                self.m_scale_inv, self.v_scale, self.v_scale_inv, self.w_scale, self.w_scale_inv, self.count]


def float64_adam(x, t, lr, b1, b2, eps, wd, adamw):
    p, g, m, v = (x[k].double() for k in "pgmv")
    if adamw:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = -lr / (1 - b1**t) * m / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
    return p + u, m, v, u


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("grad_dtype", [E4M3, torch.float8_e5m2])
def test_low_precision_against_float64_over_ten_steps(adamw, grad_dtype):
    gen = torch.Generator().manual_seed(5)
    params = [LowPrecisionParam(n, gen, grad_dtype) for n in (5, 333, 2048)]
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    for t in range(1, 11):
        for x in params:
            x.set_grad(random_like(x.p.numel(), gen, -10, -6))
        inputs = [x.real() for x in params]
        amax = LowPrecisionParam.step(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adamw=adamw, step=t)
        for i, (x, inp) in enumerate(zip(params, inputs)):
            p64, m64, v64, u64 = float64_adam(inp, t, lr, b1, b2, eps, wd, adamw)
            # Power-of-two scales from the new amaxes (the op's amax output), exact inverses.
            for scale, scale_inv, col, fmt in ((x.m_scale, x.m_scale_inv, 1, E4M3), (x.v_scale, x.v_scale_inv, 2, FP16),
                                               (x.p_scale, x.p_scale_inv, 3, FP16)):
                assert scale.item() == pow2_scale(amax[i, col].item(), FMAX[fmt]), f"tensor {i} step {t} col {col}"
                assert scale_inv.item() == 1 / scale.item()
            new = x.real()
            slack_m = 2.0**-21 * (inp["m"].double().abs() + inp["g"].double().abs())
            slack_v = 2.0**-21 * (inp["v"].double() + inp["g"].double() ** 2)
            slack_p = 2.0**-21 * (inp["p"].double().abs() + u64.abs())
            for name, got, want, scale, fmt, slack in (
                ("exp_avg", new["m"], m64, x.m_scale.item(), E4M3, slack_m),
                ("exp_avg_sq", new["v"], v64, x.v_scale.item(), FP16, slack_v),
                ("param", new["p"], p64, x.p_scale.item(), FP16, slack_p),
            ):
                bound = torch.maximum(half_ulp(want, scale, fmt), half_ulp(got, scale, fmt)) + slack
                err = (got.double() - want).abs()
                assert (err <= bound).all(), f"{name} {i} step {t}: worst excess {(err - bound).max().item()}"
            # The FP8 weight copy: the stored master re-cast with the scale of its amax, bit for bit.
            stored = new["p"]
            assert x.w_scale.item() == pow2_scale(stored.abs().max().item(), 448.0)
            assert torch.equal(x.w.view(torch.uint8), quantize(stored, x.w_scale, E4M3).view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# Non-finite policy, step counter


def twin_params(sizes, gen, device):
    """Two lists of E4M3-gradient LowPrecisionParams of ``sizes``, the second a copy of the first."""
    first = [LowPrecisionParam(n, gen, E4M3, device) for n in sizes]
    second = [LowPrecisionParam(n, gen, E4M3, device) for n in sizes]
    for x, y in zip(first, second):
        for a, b in zip(x.tensors(), y.tensors()):
            b.copy_(a)
    return first, second


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scales_left_out_are_derived_from_the_scale_invs(device):
    """The *_scales lists left out (empty, or None entries): three steps give the same codes,
    scale_invs and amaxes bit for bit as with them, and the scales left out are not touched."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator().manual_seed(7)
    given, derived = twin_params((4, 300, 2049), gen, device)
    for y in derived:
        for s in (y.p_scale, y.m_scale, y.v_scale, y.w_scale):
            s.fill_(float("nan"))
    for t in range(1, 4):
        g = [random_like(x.p.numel(), gen, -12, -4).to(device) for x in given]
        for xs in (given, derived):
            for x, gi in zip(xs, g):
                x.set_grad(gi)
        amax = LowPrecisionParam.step(given, step=t)
        lists = LowPrecisionParam.lists(derived)
        lists.update({"param_scales": [], "exp_avg_scales": [None] * 3})
        del lists["exp_avg_sq_scales"], lists["weight_scales"]
        amax_derived = adam_step([x.p for x in derived], [x.g for x in derived], [x.m for x in derived],
                                 [x.v for x in derived], step=t, **lists)
        assert torch.equal(amax, amax_derived)
    for x, y in zip(given, derived):
        for a, b in ((x.p, y.p), (x.m, y.m), (x.v, y.v), (x.w, y.w), (x.p_scale_inv, y.p_scale_inv),
                     (x.m_scale_inv, y.m_scale_inv), (x.v_scale_inv, y.v_scale_inv), (x.w_scale_inv, y.w_scale_inv)):
            assert bytes_equal(a, b)
        assert all(s.isnan().all() for s in (y.p_scale, y.m_scale, y.v_scale, y.w_scale))
    assert not torch.equal(given[1].m_scale_inv, torch.ones(1, device=device))  # the scales moved


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_plan_steps_as_the_op_until_one_of_its_tensors_changes(device):
    """fast.AdamPlan, the optimizer's kept call: steps over new grads with changing numbers equal
    the op's bit for bit; once a tensor of the plan has other storage (a ``.data`` swap) or another
    shape (a resize), its step does nothing and returns None; bad grads are named."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator().manual_seed(17)
    planned, direct = twin_params((5, 300, 2049), gen, device)
    lists = LowPrecisionParam.lists(planned)
    plan = fast.AdamPlan([x.p for x in planned], [x.m for x in planned], [x.v for x in planned],
                         *(lists.get(name, []) for name in OPTIONAL_LISTS if name != "grad_scale_invs"))

    def plan_step(t, lr, grads=None):
        grads = [x.g for x in planned] if grads is None else grads
        return plan.step(grads, [x.g_scale_inv for x in planned], lr, 0.9, 0.999, 1e-8, 0.01, True, False, t,
                         None, None, 0)

    for t in range(1, 4):
        g = [random_like(x.p.numel(), gen, -12, -4).to(device) for x in planned]
        for xs in (planned, direct):
            for x, gi in zip(xs, g):
                x.set_grad(gi)  # a new grad tensor every step
        amax = LowPrecisionParam.step(direct, step=t, lr=1e-3 * t, weight_decay=0.01)
        assert torch.equal(plan_step(t, 1e-3 * t), amax)
    for x, y in zip(planned, direct):
        assert all(bytes_equal(a, b) for a, b in zip(x.tensors(), y.tensors()))
        assert x.count.item() == 3  # each param's count advanced by the plan's steps

    with pytest.raises(ValueError, match=r"grads\[1\] and its param must have the same shape"):
        plan_step(4, 1e-3, [planned[0].g, planned[0].g, planned[2].g])
    with pytest.raises(ValueError, match=r"grads\[2\] and exp_avgs\[2\] must not share memory"):
        plan_step(4, 1e-3, [planned[0].g, planned[1].g, planned[2].m])
    before = [t.clone() for x in planned for t in x.tensors()]
    planned[1].v.data = planned[1].v.data.clone()  # the same tensor object, other storage
    assert plan_step(4, 1e-3) is None
    planned[2].w.resize_(100)
    assert plan_step(4, 1e-3) is None
    after = [t for x in planned for t in x.tensors()]
    assert all(bytes_equal(a, b) for a, b in zip(before[:28], after[:28]))  # the first two params' untouched
    with pytest.raises(ValueError, match=r"weights_fp8\[2\] and its param must have the same shape"):
        fast.AdamPlan([x.p for x in planned], [x.m for x in planned], [x.v for x in planned],
                      *(lists.get(name, []) for name in OPTIONAL_LISTS if name != "grad_scale_invs"))
    # a wrapper subclass, which no dispatch unwraps on the way to the plan, is refused, not read
    from fp8amp.fsdp import Fp8AllGatherWeight

    wrapped = Fp8AllGatherWeight(torch.zeros(8, device=device))
    with pytest.raises(ValueError, match=r"params\[0\] has no data of its own"):
        fast.AdamPlan([wrapped], [torch.zeros(8, device=device)], [torch.zeros(8, device=device)],
                      *([] for _ in range(11)))


def test_found_inf_and_nonfinite_grads_leave_everything_bit_identical():
    gen = torch.Generator().manual_seed(9)
    params = [LowPrecisionParam(n, gen) for n in (3, 100)]
    for x in params:
        x.set_grad(random_like(x.p.numel(), gen, -10, -6))
    LowPrecisionParam.step(params, step=1)
    step = torch.tensor([1.0])
    params[1].g[17] = torch.tensor(float("nan")).to(E4M3)  # the E4M3 NaN code
    snapshot = [t.clone() for x in params for t in x.tensors()]

    def unchanged():
        now = [t for x in params for t in x.tensors()]
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(snapshot, now))

    found = torch.ones(1)  # GradScaler found an inf
    LowPrecisionParam.step(params, step_tensor=step, found_inf=found)
    assert unchanged() and step.item() == 1.0 and found.item() == 1.0

    found = torch.zeros(1)
    amax = LowPrecisionParam.step(params, step_tensor=step, found_inf=found)
    assert unchanged() and step.item() == 1.0 and found.item() == 1.0
    assert amax[1, :4].isnan().all() and amax[1, 4] == 0 and amax[0].isfinite().all()  # no pass 2

    # Without a found_inf tensor the step is still skipped (and the amax output shows why).
    amax = LowPrecisionParam.step(params, step_tensor=step)
    assert unchanged() and step.item() == 1.0 and amax[1, 0].isnan()


def test_step_tensor_counts_like_torch_state_step():
    gen = torch.Generator().manual_seed(4)
    p = random_like(64, gen)
    a, b = p.clone(), p.clone()
    ma, va, mb, vb = (torch.zeros(64) for _ in range(4))
    step = torch.tensor([0.0])
    counts = [torch.tensor(0.0), torch.tensor([7.0])]  # torch's state["step"] form, and any count
    c, mc, vc = p.clone(), torch.zeros(64), torch.zeros(64)
    for t in range(1, 6):
        g = random_like(64, gen)
        adam_step([a], [g], [ma], [va], step=t, weight_decay=0.1)
        adam_step([b, c], [g, g], [mb, mc], [vb, vc], step_tensor=step, weight_decay=0.1, step_counts=counts)
        assert step.item() == t
        assert counts[0].item() == t and counts[1].item() == 7 + t  # each from its own value
    assert torch.equal(a, b) and torch.equal(ma, mb) and torch.equal(va, vb) and torch.equal(b, c)


# ------------------------------------------------------------------------------------------------
# Errors, Meta


def test_errors_name_the_argument():
    p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match=r"grads must hold one tensor per param \(1\), got 2"):
        adam_step([p], [g, g], [m], [v], step=1)
    with pytest.raises(ValueError, match=r"param_scales must be empty or hold one entry per param"):
        adam_step([p], [g], [m], [v], step=1, param_scales=[None, None])
    with pytest.raises(ValueError, match=r"params\[0\] must be float32, or float16 with a scale"):
        adam_step([p.bfloat16()], [g], [m], [v], step=1)
    with pytest.raises(ValueError, match=r"exp_avg_scale_invs\[0\] is required: its exp_avg is float8_e4m3fn"):
        adam_step([p], [g], [m.to(E4M3)], [v], step=1)
    with pytest.raises(ValueError, match=r"step must be >= 1"):
        adam_step([p], [g], [m], [v])
    with pytest.raises(ValueError, match=r"beta2 must be in \[0, 1\)"):
        adam_step([p], [g], [m], [v], step=1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] and its param must have the same shape"):
        adam_step([p], [g], [m], [torch.zeros(5)], step=1)


def test_meta_kernel_returns_the_amax_shape():
    meta = lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    params = [meta(3), meta(5, 2)]
    amax = adam_step(params, [meta(3), meta(5, 2)], [meta(3), meta(5, 2)], [meta(3), meta(5, 2)], step=1)
    assert amax.device.type == "meta" and amax.shape == (2, 5) and amax.dtype == torch.float32


def test_traces_under_torch_compile():
    """The mutable Tensor?[] lists functionalize: a compiled step equals the eager one, byte for byte."""
    def make():
        x = LowPrecisionParam(100, torch.Generator().manual_seed(2))
        x.set_grad(random_like(100, torch.Generator().manual_seed(3), -10, -6))
        return x, torch.zeros(1)

    def step(x, counter, lr):
        return LowPrecisionParam.step([x], lr=lr, weight_decay=0.01, step_tensor=counter)

    eager, compiled = make(), make()
    compiled_step = torch.compile(step, backend="aot_eager", fullgraph=True)
    for lr in (1e-3, 5e-4):  # an lr schedule: a new float each step
        a = step(*eager, lr)
        b = compiled_step(*compiled, lr)
        assert torch.equal(a, b)
    assert eager[1].item() == compiled[1].item() == 2
    for u, w in zip(eager[0].tensors(), compiled[0].tensors()):
        assert torch.equal(u.view(torch.uint8), w.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# CUDA against CPU, bit for bit (GPU)


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("adamw", [True, False])
def test_cuda_matches_cpu_bit_for_bit(adamw):
    """One call over many tensors of odd sizes in every format combination, three steps, on both
    devices from the same bytes: every output, state and scale byte-identical."""
    gen = torch.Generator().manual_seed(13)
    sizes = (1, 3, 31, 257, 4097, 8193, 70001)
    low = [LowPrecisionParam(n, gen, gd) for n, gd in zip(sizes, [E4M3, torch.float8_e5m2] * 4)]
    # FP32 masters with FP32 or scaled states and every grad dtype.
    grad_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    hi = []
    for i, n in enumerate(sizes):
        m = torch.zeros(n, dtype=E4M3 if i % 2 else torch.float32)
        v = torch.zeros(n, dtype=FP16 if i % 3 == 0 else torch.float32)
        hi.append(dict(p=random_like(n, gen, -3, 3), m=m, v=v, gd=grad_dtypes[i % 3], m_s=torch.ones(1),
                       m_si=torch.ones(1), v_s=torch.ones(1), v_si=torch.ones(1), count=torch.tensor(float(i))))

    def to_cuda(x):
        y = LowPrecisionParam.__new__(LowPrecisionParam)
        y.__dict__ = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.__dict__.items()}
        return y

    sides = {"cpu": (low, hi), "cuda": ([to_cuda(x) for x in low],
                                        [{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in h.items()}
                                         for h in hi])}
    step_tensors = {"cpu": torch.zeros(1), "cuda": torch.zeros(1, device="cuda")}
    for t in range(1, 4):
        # Grads made on the CPU and copied, so both sides read the same bytes.
        for x in low:
            x.set_grad(random_like(x.p.numel(), gen, -10, -6))
        lp_grads = [x.g for x in low]
        hi_grads = [random_like(n, gen).to(h["gd"]) for n, h in zip(sizes, hi)]
        amaxes = {}
        for side, (lps, his) in sides.items():
            dev = "cuda" if side == "cuda" else "cpu"
            for x, g in zip(lps, lp_grads):
                x.g = g.to(dev)
            lists = LowPrecisionParam.lists(lps)
            none = [None] * len(his)
            m_scaled = [h["m"].dtype == E4M3 for h in his]
            v_scaled = [h["v"].dtype == FP16 for h in his]
            lists = {
                "param_scales": lists["param_scales"] + none,
                "param_scale_invs": lists["param_scale_invs"] + none,
                "grad_scale_invs": lists["grad_scale_invs"] + none,
                "exp_avg_scales": lists["exp_avg_scales"] + [h["m_s"] if s else None for h, s in zip(his, m_scaled)],
                "exp_avg_scale_invs": lists["exp_avg_scale_invs"]
                + [h["m_si"] if s else None for h, s in zip(his, m_scaled)],
                "exp_avg_sq_scales": lists["exp_avg_sq_scales"] + [h["v_s"] if s else None for h, s in zip(his, v_scaled)],
                "exp_avg_sq_scale_invs": lists["exp_avg_sq_scale_invs"]
                + [h["v_si"] if s else None for h, s in zip(his, v_scaled)],
                "weights_fp8": lists["weights_fp8"] + none,
                "weight_scales": lists["weight_scales"] + none,
                "weight_scale_invs": lists["weight_scale_invs"] + none,
                "step_counts": lists["step_counts"] + [h["count"] for h in his],
            }
            amaxes[side] = adam_step(
                [x.p for x in lps] + [h["p"] for h in his],
                [x.g for x in lps] + [g.to(dev) for g in hi_grads],
                [x.m for x in lps] + [h["m"] for h in his], [x.v for x in lps] + [h["v"] for h in his],
                lr=1e-3, weight_decay=0.01, adamw=adamw, step_tensor=step_tensors[side], **lists)
        assert bytes_equal(amaxes["cpu"], amaxes["cuda"]), f"amax, step {t}"
        (lc, hc), (lg, hg) = sides["cpu"], sides["cuda"]
        for i, (x, y) in enumerate(zip(lc, lg)):
            for j, (a, b) in enumerate(zip(x.tensors(), y.tensors())):
                assert bytes_equal(a, b), f"low-precision tensor {i}, buffer {j}, step {t}"
        for i, (x, y) in enumerate(zip(hc, hg)):
            for k in ("p", "m", "v", "m_s", "m_si", "v_s", "v_si", "count"):
                assert bytes_equal(x[k], y[k]), f"fp32-master tensor {i}, {k}, step {t}"
    assert step_tensors["cpu"].item() == 3 and step_tensors["cuda"].item() == 3


@pytest.mark.gpu
def test_cuda_skips_on_nonfinite_grad_without_host_sync():
    gen = torch.Generator().manual_seed(2)
    params = [LowPrecisionParam(n, gen, device="cuda") for n in (10, 5000)]
    for x in params:
        x.set_grad(random_like(x.p.numel(), gen, -10, -6).cuda())  # any codes will do here
    params[1].g[4321] = torch.tensor(float("nan")).to(E4M3)
    before = [t.clone() for x in params for t in x.tensors()]
    step, found = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    amax = LowPrecisionParam.step(params, step_tensor=step, found_inf=found)
    after = [t for x in params for t in x.tensors()]
    assert all(bytes_equal(a.cpu(), b) for a, b in zip(before, after))
    assert found.item() == 1.0 and step.item() == 0.0 and amax[1, 0].isnan().item()
