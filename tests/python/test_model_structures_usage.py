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


class _TopKMoE(nn.Module):
    """Top-2 of 4 experts by index_select / index_add; expert 3 is not called on even steps."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 4, bias=False)  # (4 outputs: kept in high precision)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x, step):
        top_w, top_i = self.gate(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            if i == 3 and step % 2 == 0:
                continue
            idx = (top_i == i).any(-1).nonzero().squeeze(-1)
            weight = torch.where(top_i[idx] == i, top_w[idx], 0).sum(-1, keepdim=True)
            out = out.index_add(0, idx, expert(x.index_select(0, idx)) * weight)
        return out


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_top_k_moe_trains_as_torch_eager_and_compiled(level):
    """Experts skipped in some steps (no gradient: AdamW skips them, as torch's) and experts given
    no tokens (empty batches), eager and under torch.compile (aot_eager, bit for bit as eager)."""
    ref, ref_opt, model, opt = _pair(level, _TopKMoE, lr=1e-2)
    *_, twin, twin_opt = _pair(level, _TopKMoE, lr=1e-2)
    compiled = torch.compile(twin, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(20, D, generator=gen)
        if step == 4:
            x[:, :] = x[:1]  # every token routed alike: two experts get none
        for m, o in ((ref, ref_opt), (model, opt), (compiled, twin_opt)):
            o.zero_grad()
            (m(x, step) - 1).square().mean().backward()
            o.step()
    for p, q, r in zip(model.parameters(), twin.parameters(), ref.parameters()):
        assert torch.equal(_real(p), _real(q))
        assert _rel(p, r) < 0.1
    assert model.experts[3].weight.grad is None and ref.experts[3].weight.grad is None
    steps = {k: int(s["step"]) for k, s in opt.state_dict()["state"].items()}
    assert steps == {k: int(s["step"]) for k, s in ref_opt.state_dict()["state"].items()}


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_one_linear_called_several_times_a_forward(level):
    """The same module at several places (ALBERT's sharing) and in an unrolled loop, on batches of
    other sizes and dtypes: gradients summed over the calls as in torch, and the recorded amax the
    max over every call's input."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.Linear(D, D)
            self.layers = nn.ModuleList([layer] * 3)
            self.out = nn.Linear(D, 16)

        def forward(self, x):
            h = x
            for layer in self.layers:
                h = torch.tanh(layer(h)) + x
            with torch.autocast("cpu", dtype=torch.bfloat16):
                side = self.layers[0](x[:3] * 4)  # 3 rows, another dtype
            return self.out(h).square().mean() + side.float().square().mean()

    ref, ref_opt, model, opt = _pair(level, Shared, lr=1e-2)
    assert model.layers[0] is model.layers[2] and len(list(model.parameters())) == 4
    seen = []
    model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].abs().max().float()))
    for step in range(4):
        x = torch.randn(8, D)
        seen.clear()
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).backward()
        assert len(seen) == 4
        assert model.layers[0].input_scaling.amax_history[0, 0] == max(seen)
        assert _rel(model.layers[0].weight.grad, ref.layers[0].weight.grad) < 0.15
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    assert _rel(model.layers[0].weight, ref.layers[0].weight) < 0.1


@pytest.mark.parametrize("level", ["fp8", "O2"])
def test_two_losses_detached_and_unused_outputs_match_torch(level):
    """Two losses backpropagated separately (retain_graph) and a second micro-batch, a head on a
    detached trunk, a Linear whose output the loss ignores and a layer dropped on every third step:
    which params get gradients and optimizer state, and their step counts, are torch's."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk, self.drop = nn.Linear(D, D), nn.Linear(D, D)
            self.h1, self.h2, self.unused = nn.Linear(D, 16), nn.Linear(D, 16), nn.Linear(D, 16)

        def forward(self, x, step):
            t = torch.relu(self.trunk(x))
            if step % 3:
                t = t + self.drop(t)
            self.unused(t)
            return self.h1(t), self.h2(t.detach())

    ref, ref_opt, model, opt = _pair(level, Net, lr=1e-2)
    for step in range(6):
        x = torch.randn(16, D)
        for m, o in ((ref, ref_opt), (model, opt)):
            a, b = m(x, step)
            a.square().mean().backward(retain_graph=True)
            (b - 1).square().mean().backward()
            sum(y.square().mean() for y in m(x / 2, step)).backward()
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        assert _rel(p, r) < 0.1 if name.split(".")[0] != "unused" else _rel(p, r) < 1e-3, name
    steps = {k: int(s["step"]) for k, s in opt.state_dict()["state"].items()}
    assert steps == {k: int(s["step"]) for k, s in ref_opt.state_dict()["state"].items()}
    assert 8 not in steps and 9 not in steps  # the unused Linear's: no state, as in torch
