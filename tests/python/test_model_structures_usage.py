"""Model structures that call their Linears in unusual patterns (mixtures of experts with empty or
skipped experts, one Linear called several times a forward, layers skipped or taken only in eval,
frozen parts run without grad, several losses), at FP8 compute, O1 and O2, against the same model
under plain torch."""

import copy

import pytest
import torch
from torch import nn

import fp8amp

D = 32
H = 4  # a short delayed-scaling history: the warm-up ends within a few steps
RECIPE = fp8amp.Recipe(history_len=H)


def _converted(level, model, opt):
    if level == "fp8":
        fp8amp.convert(model, optimizer=opt, policy="all", recipe=RECIPE)
        return model, opt
    return fp8amp.initialize(model, opt, level, policy="all", recipe=RECIPE)


def _real(t):
    return t.dequantize(torch.float32) if isinstance(t, fp8amp.ScaledTensor) else t.detach().float()


def _rel(a, b):
    a, b = _real(a), _real(b)
    return ((a - b).norm() / b.norm()).item()


class _MoE(nn.Module):
    """Top-1 routing by boolean masks; ``route`` forces the expert of each token."""

    def __init__(self, experts=3):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = route == i
            out[mask] = expert(x[mask])  # an empty batch when no token is routed here
        return out


def _pair(level, make, lr=1e-3):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=lr))
    return ref, ref_opt, model, opt


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_expert_given_no_tokens_during_the_warm_up_scales_from_its_first_tokens(level):
    """An expert routed no tokens for more steps than the history (empty inputs) had its warm-up
    counted out with no amax: at its first tokens it cast with scale 1, saturating inputs of 1000
    (output error 0.67) and flushing small output gradients to 0 in E5M2 (its weight gradient all 0)."""
    ref, ref_opt, model, opt = _pair(level, _MoE)
    gen = torch.Generator().manual_seed(1)
    for step in range(2 * H + 1):
        x = torch.randn(24, D, generator=gen) * 1000
        route = torch.randint(0, 2, (24,), generator=gen)  # expert 2 gets nothing ...
        if step == 2 * H:
            route[:8] = 2  # ... until now
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            y = m(x, route)
            (y * 1e-6).sum().backward()
        assert _rel(y, ref(x, route)) < 0.1
        for m, o in ((ref, ref_opt), (model, opt)):
            o.step()
    assert _rel(model.experts[2].weight.grad, ref.experts[2].weight.grad) < 0.2
    # Empty-batch steps gave zero gradients (not None), as in torch: the same steps in every state.
    steps = [float(s["step"]) for _, s in sorted(opt.state_dict()["state"].items())]
    assert steps == [float(s["step"]) for _, s in sorted(ref_opt.state_dict()["state"].items())]


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_branch_taken_only_in_eval_matches_plain_torch(level):
    """A layer that only eval runs (an early-exit or refinement head) records no amax in training:
    its warm-up ended with scale 1, and eval outputs of inputs of 1000 saturated."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.refine = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            y = self.body(x)
            return y if self.training else self.refine(y)

    ref, ref_opt, model, opt = _pair(level, Net)
    for _ in range(H + 2):
        x = torch.randn(16, D) * 1000
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    ref.eval(), model.eval()
    with torch.no_grad():
        x = torch.randn(16, D) * 1000
        assert _rel(model(x), ref(x)) < 0.1


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_frozen_backbone_run_without_grad_in_training_matches_plain_torch(level):
    """A frozen part run under torch.no_grad() in train mode records no amax either (a forward
    without grad leaves the history alone), and cast with scale 1 after the warm-up."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.head = nn.Linear(D, D), nn.Linear(D, 16)

        def forward(self, x):
            with torch.no_grad():
                feats = self.backbone(x)
            return self.head(feats)

    ref, ref_opt, model, opt = _pair(level, Net)
    for step in range(H + 2):
        x = torch.randn(16, D) * 1000
        for m, o in ((ref, ref_opt), (model, opt)):
            y = m(x)
            y.square().mean().backward()
            o.step()
            o.zero_grad()
        assert _rel(y, ref(x)) < 0.1


@pytest.mark.parametrize("level", ["fp8", "O2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_mode_ad_is_refused_naming_what_works(level, recipe):
    """Dual tensors of torch.autograd.forward_ad raised torch's "You must implement the jvp function
    for custom autograd.Function", naming neither the layer nor what works; a forward inside a dual
    level without a tangent runs as before."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 16))
    opt = torch.optim.AdamW(model.parameters())
    if level == "fp8":
        fp8amp.convert(model, optimizer=opt, policy="all", recipe=recipe)
    else:
        model, opt = fp8amp.initialize(model, opt, level, policy="all", recipe=recipe)
    x = torch.randn(4, D)
    with fwAD.dual_level():
        assert model(x).shape == (4, 16)
        with pytest.raises(NotImplementedError, match="forward-mode AD.*torch.autograd.grad.*module_filter_fn"):
            model(fwAD.make_dual(x, torch.randn(4, D)))
    model(x).sum().backward()  # and the model trains on
