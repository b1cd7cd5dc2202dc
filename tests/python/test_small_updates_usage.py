"""O1/O2 at the small learning rates of fine-tuning (lr 1e-6 to 5e-5, AdamW) against torch's AdamW
on the same float32 model: the FP16 master rounds each update to nearest by default, so an update
below half an FP16 unit of an element is lost. The rule, measured element by element; what it
costs over a run; initialize's warning where it freezes much of a layer (docs/o1_o2.md#limits-today);
and ``master_rounding="stochastic"``, which keeps those updates on average."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8amp
from fp8amp.initialize import FROZEN_SHARE


def real(p: torch.Tensor) -> torch.Tensor:
    """A parameter's real values in float64 (a master's through its FP16 codes, not its logical dtype)."""
    return (p.dequantize(torch.float32) if isinstance(p, fp8amp.ScaledTensor) else p.detach()).double().clone()


def half_unit(w: torch.Tensor, toward_zero: torch.Tensor) -> torch.Tensor:
    """Half an FP16 unit of each (FP16-representable, normal) value of ``w`` in the direction of its
    update: 2^(e - 11) with e = floor(log2 |w|), and 2^(e - 12) stepping toward zero from ±2^e."""
    e = torch.floor(torch.log2(w.abs()))
    at_power = w.abs() == torch.exp2(e)
    return torch.exp2(e - 11 - (at_power & toward_zero).double())


def layer(std: float | None, seed: int = 0) -> nn.Sequential:
    """One 64 x 64 Linear: weights of ``std`` (fine-tuned weights), or near 1 (``None``: a norm-like
    projection, the identity plus noise of 0.1)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64))
    with torch.no_grad():
        if std is None:
            model[0].weight.copy_(torch.eye(64) + 0.1 * torch.randn(64, 64))
        else:
            model[0].weight.normal_(0, std)
    return model


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)) for _ in range(n)]


def train(model: nn.Module, level: str | None, lr: float, steps: int, weight_decay: float = 0.0,
          warmup: int = 0, master_rounding: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         list[float]]:
    """``steps`` AdamW steps (with a linear warm-up of ``warmup`` steps): (weight before, weight
    after, which elements never changed, losses)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if level is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the warning has its own test)
            model, opt = fp8amp.initialize(model, opt, level, policy="all", master_rounding=master_rounding)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup)) if warmup else None
    w0 = real(model[0].weight)
    changed = torch.zeros_like(w0, dtype=torch.bool)
    losses = []
    for x, y in batches(steps):
        before = real(model[0].weight)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        changed |= real(model[0].weight) != before
        losses.append(loss.item())
    return w0, real(model[0].weight), ~changed, losses


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("lr", [1e-6, 2e-5])
def test_an_adam_update_is_lost_exactly_where_it_is_below_half_an_fp16_unit(level, lr):
    """One AdamW step moves each element by lr (m/sqrt(v) = ±1 at the first step) in torch; at
    O1/O2 the element keeps its value exactly where lr is below half an FP16 unit of it, whatever
    the per-tensor scale (a power of two: rounding is relative), and moves elsewhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    with torch.no_grad():  # magnitudes from 2^-12 to 2: both sides of the rule at each lr
        model[0].weight.copy_(torch.exp2(torch.empty(64, 64).uniform_(-12, 1)) * torch.randn(64, 64).sign())
    x = torch.randn(32, 64)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    ref(x).square().mean().backward()
    ref_w0 = real(ref[0].weight)
    ref_opt.step()
    assert (real(ref[0].weight) != ref_w0).all()  # torch moves every element

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), level,
                                       policy="all")
    model(x).square().mean().backward()
    w, g = real(model[0].weight), model[0].weight.grad.dequantize(torch.float32).double()
    opt.step()
    moved = real(model[0].weight) != w
    live = g != 0  # (an E4M3 gradient that underflowed to 0 moves nothing)
    predicted_lost = lr < half_unit(w, toward_zero=(w.sign() == g.sign()))
    assert torch.equal(moved[live], ~predicted_lost[live])
    assert not moved[~live].any()
    # the rule in terms of lr alone: lost wherever |w| >= 2^(floor(log2 lr) + 12), as initialize counts
    bound = 2.0 ** (math.floor(math.log2(lr)) + 12)
    away = live & (w.abs() != torch.exp2(torch.floor(torch.log2(w.abs()))))  # (not at a power of two)
    assert torch.equal(predicted_lost[away], (w.abs() >= bound)[away])
    assert 0.2 < predicted_lost[live].double().mean() < 0.9  # both sides measured


@pytest.mark.parametrize("weight_decay, warmup", [(0.0, 0), (0.01, 10)])
def test_fifty_steps_against_torch_adamw(weight_decay, warmup):
    """Over 50 steps, where torch moves every element: at O1/O2 the elements out of an lr-sized
    update's reach (initialize's count) never change, exactly so at a constant lr and more during
    a warm-up (its lrs are smaller); weight decay changes nothing in that. Weights of std 0.02 lose
    most of their movement at lr 1e-6 and none at 5e-5; weights near 1 most of theirs at 2e-5 and
    none at 1e-3. The loss, dominated by the float32 bias, stays torch's."""
    for std, lr, distance in ((0.02, 1e-6, (0.1, 0.4)), (0.02, 5e-5, (0.95, 1.05)), (None, 2e-5, (0.15, 0.4)),
                              (None, 1e-3, (0.95, 1.05))):
        ref_w0, ref_w, ref_never, ref_losses = train(layer(std), None, lr, 50, weight_decay, warmup)
        assert not ref_never.any()
        bound = 2.0 ** (math.floor(math.log2(lr)) + 12)
        for level in ("O1", "O2"):
            w0, w, never, losses = train(layer(std), level, lr, 50, weight_decay, warmup)
            share, counted = never.double().mean().item(), (w0.abs() >= bound).double().mean().item()
            if warmup:
                assert share >= counted - 0.005, (std, lr, level, share, counted)
            else:
                assert share == pytest.approx(counted, abs=0.005), (std, lr, level, share, counted)
            moved = ((w - w0).norm() / (ref_w - ref_w0).norm()).item()
            assert distance[0] < moved < distance[1], (std, lr, level, moved)
            assert losses[-1] == pytest.approx(ref_losses[-1], rel=0.02)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_warns_where_adam_updates_cannot_change_a_master(level):
    """Silent before: a layer of weights near 1 at lr 2e-5 never trained. initialize now names the
    masters with at least FROZEN_SHARE of their elements out of an lr-sized update's reach, with
    that share; weights of std 0.02 at the same lr (0.2 % out of reach), an lr of 1e-3 and an lr
    of 0 are not warned about, and an infinite lr (accepted as torch's AdamW accepts it) does not
    crash the count. initialize_optimizer (the optimizer built later) warns the same."""
    original = nn.Sequential(layer(0.02, seed=1)[0], layer(None, seed=2)[0])
    model = copy.deepcopy(original)
    expect = (model[1].weight.abs() >= 2.0 ** -4).double().mean().item()  # 2^(floor(log2 2e-5) + 12)
    assert expect > 0.5 and (model[0].weight.abs() >= 2.0 ** -4).double().mean() < FROZEN_SHARE
    with pytest.warns(UserWarning, match=r"initialize: 1 Linear master\(s\) hold weights that Adam's updates cannot "
                      rf"change: 1\.weight \({expect:.0%} of its elements at \|w\| >= 0\.0625, lr=2e-05\)\. .*To "
                      r"train them: round the masters stochastically \(initialize\(\.\.\., "
                      r"master_rounding='stochastic'\), .*keep these layers in high precision \(module_filter_fn\), "
                      r"or use FP8 compute over float32 weights \(fp8amp.convert"):
        fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=2e-5), level, policy="all")

    for lr, keep, rounding in ((1e-3, None, None), (0.0, None, None), (float("inf"), None, None),
                               (2e-5, lambda m, fqn: fqn != "1", None), (2e-5, None, "stochastic")):
        fresh = copy.deepcopy(original)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*Adam's updates cannot change")
            fp8amp.initialize(fresh, torch.optim.AdamW(fresh.parameters(), lr=lr), level, policy="all",
                              module_filter_fn=keep, master_rounding=rounding)

    fresh = copy.deepcopy(original)
    fp8amp.initialize(fresh, None, level, policy="all")
    with pytest.warns(UserWarning, match=r"initialize_optimizer: 1 Linear master\(s\).*1\.weight"):
        fp8amp.initialize_optimizer(fresh, torch.optim.AdamW(fresh.parameters(), lr=2e-5), level)


def test_a_bfloat16_llama_fine_tuned_at_2e_5():
    """What a user fine-tuning a bfloat16 Hugging Face model at lr 2e-5 gets: the Linear masters
    (FP16 codes of logical dtype bfloat16) move as torch's float32 AdamW moves its weights (init
    std 0.02: nearly all elements within reach, and no warning), where plain torch over the bfloat16
    parameters loses most updates to bfloat16's rounding."""
    pytest.importorskip("transformers")
    from hf_models import tiny_llama

    gen = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 256, (4, 17), generator=gen) for _ in range(15)]

    def run(dtype, level):
        model = tiny_llama().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
        if level is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*Adam's updates cannot change")
                model, opt = fp8amp.initialize(model, opt, level, policy="all")
        linears = [p for name, p in model.named_parameters() if name.endswith("proj.weight")]
        w0 = [real(p) for p in linears]
        changed = [torch.zeros_like(w, dtype=torch.bool) for w in w0]
        for t in data:
            before = [real(p) for p in linears]
            F.cross_entropy(model(input_ids=t[:, :-1]).logits.flatten(0, 1).float(), t[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
            for c, b, p in zip(changed, before, linears):
                c |= real(p) != b
        never = sum((~c).sum().item() for c in changed) / sum(c.numel() for c in changed)
        moved = sum(((real(p) - w).norm() ** 2).item() for p, w in zip(linears, w0)) ** 0.5
        return never, moved

    _, torch_moved = run(torch.float32, None)
    bf16_never, bf16_moved = run(torch.bfloat16, None)
    for level in ("O1", "O2"):
        never, moved = run(torch.bfloat16, level)
        assert never < 0.01 and 0.85 < moved / torch_moved < 1.1, (level, never, moved / torch_moved)
    assert bf16_never > 0.5 and bf16_moved / torch_moved < 0.6  # plain bfloat16 params: most updates lost


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_after_the_first_steps_adam_updates_are_smaller_than_lr_and_more_are_lost(level):
    """initialize counts lr-sized updates, Adam's first; once the moments hold noisy gradients the
    updates are a fraction of lr (torch's median |step| here: about 0.2 lr), and half an FP16 unit
    exceeds them on far more elements. Weights of std 0.02 at lr 2e-5 (a usual fine-tuning): no
    warning (0.2 % out of an lr-sized update's reach), yet each step from the 30th leaves about
    60 % of the elements unchanged, where torch changes nearly all; at 3e-4 about 5 %."""
    for lr, lost in ((2e-5, (0.45, 0.75)), (3e-4, (0.0, 0.1))):
        model, ref = layer(0.02), layer(0.02)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*Adam's updates cannot change")
            model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0),
                                           level, policy="all")
        unchanged, ref_steps = [], []
        for i, (x, y) in enumerate(batches(50)):
            w, ref_w = real(model[0].weight), real(ref[0].weight)
            for m, o in ((model, opt), (ref, ref_opt)):
                F.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
            if i >= 30:
                unchanged.append((real(model[0].weight) == w).double().mean().item())
                ref_steps.append(((real(ref[0].weight) - ref_w).abs() / lr).median().item())
                assert (real(ref[0].weight) != ref_w).double().mean() > 0.995  # (float32 too: m near 0)
        assert lost[0] < sum(unchanged) / len(unchanged) < lost[1], (lr, unchanged)
        assert 0.1 < sum(ref_steps) / len(ref_steps) < 0.4


def along(moved: torch.Tensor, ref_moved: torch.Tensor) -> float:
    """The coefficient of ``moved`` along ``ref_moved`` (least squares): 1 where the movement holds
    torch's, whatever noise uncorrelated with it it adds."""
    moved, ref_moved = moved.flatten(), ref_moved.flatten()
    return (moved @ ref_moved / (ref_moved @ ref_moved)).item()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_stochastic_rounding_moves_the_masters_as_torch_moves_float32_weights(level):
    """master_rounding="stochastic": where round-to-nearest kept 6-77 % of torch's movement (weights
    near 1 at lr 2e-5, std 0.02 at 1e-6 and 2e-5), the movement along torch's is torch's within 5 %
    over 50 steps (measured 0.99-1.03), and the loss stays torch's. Each rounding adds noise
    uncorrelated with it: the distance moved in all is torch's or more (1.02x at 2e-5, 1.12x for
    weights near 1, 1.65x at 1e-6, where most steps round by a whole unit or not at all)."""
    for std, lr, noise in ((None, 2e-5, 1.3), (0.02, 1e-6, 1.9), (0.02, 2e-5, 1.1)):
        ref_w0, ref_w, _, ref_losses = train(layer(std), None, lr, 50)
        w0, w, never, losses = train(layer(std), level, lr, 50, master_rounding="stochastic")
        near_w0, near_w, _, _ = train(layer(std), level, lr, 50, master_rounding="nearest")
        assert along(near_w - near_w0, ref_w - ref_w0) < 0.8, (std, lr)
        assert 0.95 < along(w - w0, ref_w - ref_w0) < 1.05, (std, lr)
        assert 0.95 < ((w - w0).norm() / (ref_w - ref_w0).norm()).item() < noise, (std, lr)
        assert losses[-1] == pytest.approx(ref_losses[-1], rel=0.02)


def test_stochastic_rounding_keeps_the_updates_smaller_than_lr_of_later_steps():
    """The updates of later steps (about 0.2 lr), which round-to-nearest loses on ~60 % of the
    elements of std-0.02 weights at lr 2e-5
    (test_after_the_first_steps_adam_updates_are_smaller_than_lr_and_more_are_lost), are kept: from
    the 30th step on, the movement along torch's is torch's within 5 %."""
    model, ref = layer(0.02), layer(0.02)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-5, weight_decay=0.0)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0), "O2",
                                   policy="all", master_rounding="stochastic")
    for i, (x, y) in enumerate(batches(60)):
        if i == 30:
            w30, ref_w30 = real(model[0].weight), real(ref[0].weight)
        for m, o in ((model, opt), (ref, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert 0.95 < along(real(model[0].weight) - w30, real(ref[0].weight) - ref_w30) < 1.05
