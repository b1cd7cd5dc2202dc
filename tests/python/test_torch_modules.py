"""torch's own modules and utilities over converted models (FP8 compute, O1, O2): the Transformer
layers, AveragedModel, activation checkpointing, tied weights, parameters_to_vector, nn.init, and
the reparametrizations (torch.nn.utils.prune, weight_norm, spectral_norm, parametrize) before and
after convert / initialize, each against the same thing done on the unconverted model."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils import prune
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint

import fp8amp
from fp8amp.linear import Fp8Linear

LEVELS = ["fp8", "O1", "O2"]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _convert(model, level, lr=1e-2):
    """(model, optimizer) at ``level``: FP8 compute with torch's AdamW, or initialize's O1/O2."""
    if level == "fp8":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        return fp8amp.convert(model, optimizer=optimizer, policy="all"), optimizer
    return fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), level, policy="all")


def _real(t):
    return t.dequantize(torch.float32) if isinstance(t, fp8amp.ScaledTensor) else t.detach().float()


def _rel(a, b):
    return ((_real(a) - _real(b)).norm() / _real(b).norm()).item()


def _train(pairs, steps=20, seed=1):
    """Trains each (model, optimizer) on the same batches; returns each one's losses."""
    gen = torch.Generator().manual_seed(seed)
    losses = [[] for _ in pairs]
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        for (model, optimizer), out in zip(pairs, losses):
            loss = (model(x) - x.flip(1)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
    return losses


def _close_curves(got, ref, rtol=0.1):
    assert got[0] == pytest.approx(ref[0], rel=0.02) and got[-1] == pytest.approx(ref[-1], rel=rtol), (got, ref)


# ------------------------------------------------------------------ reparametrized weights

_HOOKS = {  # each computes the Linear's `weight` from other parameters in a forward pre-hook
    "prune": lambda lin: prune.l1_unstructured(lin, "weight", amount=0.5),
    "weight_norm": lambda lin: torch.nn.utils.weight_norm(lin),
    "spectral_norm": lambda lin: torch.nn.utils.spectral_norm(lin),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("hook", sorted(_HOOKS))
def test_a_linear_whose_weight_a_hook_computes_is_kept_as_it_is(level, hook):
    """convert made such a Linear an Fp8Linear holding the hook's last computed weight as a plain
    attribute: weight_orig / weight_g / weight_v and the hook were dropped, so the layer trained
    nothing (and spectral_norm's output was another function)."""
    ref, model = _mlp(), _mlp()
    torch.manual_seed(3)
    _HOOKS[hook](ref[0])
    torch.manual_seed(3)
    _HOOKS[hook](model[0])
    model, optimizer = _convert(model, level)
    assert type(model[0]) is nn.Linear and isinstance(model[2], Fp8Linear)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    decision = fp8amp.conversion_report(model).decisions[0]
    assert decision.name == "0" and not decision.converted and "forward pre-hook" in decision.reason
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    got, expected = _train([(model, optimizer), (ref, ref_optimizer)])
    _close_curves(got, expected)


def test_from_linear_refuses_a_weight_that_is_not_a_parameter():
    linear = nn.Linear(32, 32)
    prune.random_unstructured(linear, "weight", amount=0.5)
    with pytest.raises(ValueError, match="Fp8Linear.from_linear: .*not a parameter.*forward pre-hook"):
        Fp8Linear.from_linear(linear)


class _Half(nn.Module):
    def forward(self, weight):
        return weight * 0.5


_AFTER = {
    "prune": lambda lin: prune.l1_unstructured(lin, "weight", amount=0.5),
    "spectral_norm": lambda lin: torch.nn.utils.spectral_norm(lin),
    "parametrize": lambda lin: parametrize.register_parametrization(lin, "weight", _Half()),
    "parametrizations.spectral_norm": lambda lin: torch.nn.utils.parametrizations.spectral_norm(lin),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("how", sorted(_AFTER))
def test_a_reparametrization_of_a_converted_weight_trains(level, how):
    """Applied after convert / initialize, the master (O1/O2) is the parameter the hook or the
    parametrization reads: the optimizer steps it and the layer computes in FP8 from the weight
    made from it. At O1/O2 the forward raised, saying the master had been replaced."""
    ref, model = _mlp(), _mlp()
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, optimizer = _convert(model, level)
    for m in (ref, model):
        torch.manual_seed(3)
        _AFTER[how](m[0])
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    source = next(p for n, p in model[0].named_parameters() if n != "bias")
    before = _real(source).clone()
    got, expected = _train([(model, optimizer), (ref, ref_optimizer)])
    _close_curves(got, expected)
    assert not torch.equal(_real(source), before)  # the optimizer steps what the weight is made from


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_replaced_master_is_still_refused(level):
    model, _ = _convert(_mlp(), level)
    model.load_state_dict(model.state_dict(), assign=True)
    with pytest.raises(RuntimeError, match="FP16 master .* replaced the parameter"):
        model(torch.randn(4, 32))


# ------------------------------------------------------------------ dtype changes


def test_a_float64_model_at_fp8_compute_says_what_works():
    """model.double() after convert: the forward named an internal op ("fp8amp.cast_transpose: x
    has unsupported dtype Double")."""
    model = fp8amp.convert(_mlp(), policy="all").double()
    for x in (torch.randn(4, 32), torch.randn(4, 32, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"Fp8Linear: the weight is torch.float64, .*unconvert"):
            model(x)


@pytest.mark.parametrize("to", ["half", "bfloat16", "float"])
def test_a_16_bit_model_at_fp8_compute_matches_torch(to):
    ref = getattr(_mlp(), to)()
    model = getattr(fp8amp.convert(_mlp(), policy="all"), to)()
    x = torch.randn(16, 32).to(ref[0].weight.dtype)
    y = model(x)
    assert y.dtype == ref(x).dtype and model[0].input_scaling.scale.dtype == torch.float32
    assert _rel(y, ref(x)) < 0.1
    y.float().square().mean().backward()
    assert model[0].weight.grad.dtype == ref[0].weight.dtype


# ------------------------------------------------------------------ Transformer layers


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_trains_and_evaluates_as_torch_does(level, batch_first):
    torch.manual_seed(0)
    ref = nn.Transformer(64, 4, 1, 1, 128, dropout=0.0, batch_first=batch_first)
    model = copy.deepcopy(ref)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, optimizer = _convert(model, level, lr=1e-3)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert set(ref.state_dict()) <= set(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    src, tgt = torch.randn(4, 16, 64, generator=gen), torch.randn(4, 12, 64, generator=gen)
    if not batch_first:
        src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
    mask = nn.Transformer.generate_square_subsequent_mask(12)
    losses = [[], []]
    for _ in range(10):
        for (m, opt), out in zip(((model, optimizer), (ref, ref_optimizer)), losses):
            loss = (m(src, tgt, tgt_mask=mask, tgt_is_causal=True) - tgt).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
    _close_curves(*losses)
    model.eval()
    ref.eval()
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            assert _rel(model(src, tgt, tgt_mask=mask), ref(src, tgt, tgt_mask=mask)) < 0.1


# ------------------------------------------------------------------ AveragedModel, copies


@pytest.mark.parametrize("level", LEVELS)
def test_ema_of_a_converted_model_averages_its_real_values(level):
    model, optimizer = _convert(_mlp(), level)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    expected = None  # the same average of the model's real values, in float32
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        model(torch.randn(16, 32, generator=gen)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
        now = {n: _real(p).clone() for n, p in model.named_parameters()}
        expected = now if expected is None else {n: expected[n].lerp(now[n], 0.1) for n in now}
    for name, param in ema.module.named_parameters():
        assert _rel(param, expected[name]) < (1e-6 if level == "fp8" else 1e-3), name
    if level != "fp8":  # the averaged master's E4M3 copy is current
        master = ema.module[0].weight
        fresh = fp8amp.MasterWeight.from_tensor(master.dequantize()).fp8_copy[0]
        assert torch.equal(master.fp8_copy[0].view(torch.uint8), fresh.view(torch.uint8))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_deepcopy_edited_leaves_the_original(level):
    model, optimizer = _convert(_mlp(), level)
    copied = copy.deepcopy(model)
    before = _real(model[0].weight).clone()
    with torch.no_grad():
        copied[0].weight.mul_(2)
        copied[0].weight[0].zero_()
        nn.init.normal_(copied[2].weight)
    assert torch.equal(_real(model[0].weight), before)
    for m in (copied, model):
        master = m[0].weight
        fresh = fp8amp.MasterWeight.from_tensor(master.dequantize()).fp8_copy[0]
        assert torch.equal(master.fp8_copy[0].view(torch.uint8), fresh.view(torch.uint8))


# ------------------------------------------------------------------ utilities


@pytest.mark.parametrize("level", LEVELS)
def test_parameters_to_vector_and_back(level):
    ref = _mlp()
    model, _ = _convert(_mlp(), level)
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    expected = torch.nn.utils.parameters_to_vector(ref.parameters())
    assert vector.shape == expected.shape and _rel(vector, expected) < 1e-3
    torch.nn.utils.vector_to_parameters(expected * 2, model.parameters())
    assert _rel(torch.nn.utils.parameters_to_vector(model.parameters()), expected * 2) < 1e-3


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_module_apply_init_writes_the_masters(level):
    ref = _mlp()
    model, _ = _convert(_mlp(), level)

    def init(module):
        if isinstance(module, nn.Linear):
            torch.manual_seed(5)
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)

    model.apply(init)
    ref.apply(init)
    assert _rel(model[0].weight, ref[0].weight) < 1e-3
    master = model[0].weight
    fresh = fp8amp.MasterWeight.from_tensor(master.dequantize()).fp8_copy[0]
    assert torch.equal(master.fp8_copy[0].view(torch.uint8), fresh.view(torch.uint8))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(32, 16), "b": nn.Linear(32, 16)})
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.heads["a"](x) + self.heads["b"](x)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_train_as_without_checkpointing(level, reentrant):
    plain, _ = _convert(_Net(None), level)
    checkpointed, _ = _convert(_Net(reentrant), level)
    plain.train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 32, generator=gen, requires_grad=reentrant)
    for m in (plain, checkpointed):
        m(x).square().mean().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.equal(_real(p.grad), _real(q.grad)), name
    state = (plain.blocks[0].fc1.input_scaling, checkpointed.blocks[0].fc1.input_scaling)
    assert torch.equal(state[0].amax_history, state[1].amax_history)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("level", LEVELS)
def test_tied_linear_weights_stay_one_parameter(level):
    ref = _Tied()
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, optimizer = _convert(_Tied(), level)
    assert model.b.weight is model.a.weight
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    got, expected = _train([(model, optimizer), (ref, ref_optimizer)])
    _close_curves(got, expected)
    assert model.b.weight is model.a.weight


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("how", ["prune", "parametrize"])
def test_unconvert_refuses_a_reparametrized_layer_before_changing_the_model(level, how):
    """unconvert made such a layer an nn.Linear holding the computed weight as a plain attribute:
    weight_orig / parametrizations.weight.original and the hook were dropped, so the layer trained
    nothing, silently. Removed first, the layer unconverts."""
    model, optimizer = _convert(_mlp(), level)
    _AFTER[how](model[0])
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=r"unconvert: layer 0's weight is computed .*prune.remove"):
        fp8amp.unconvert(model, optimizer)
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2], Fp8Linear)
    assert [n for n, _ in model.named_parameters()] == names
    if how == "prune":
        prune.remove(model[0], "weight")
    else:
        parametrize.remove_parametrizations(model[0], "weight")
    model, optimizer = fp8amp.unconvert(model, optimizer)
    assert type(model[0]) is nn.Linear and [n for n, _ in model.named_parameters()] == [
        n for n, _ in _mlp().named_parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_removing_a_parametrization_of_a_master_says_how(level):
    """remove_parametrizations(leave_parametrized=True) swaps the master for a plain tensor (torch's
    swap_tensors, for a wrapper subclass): the forward's error named assign=True loads, to_empty and
    functional_call only. What it says works: leave_parametrized=False, then the weight copied in."""
    model, optimizer = _convert(_mlp(), level)
    parametrize.register_parametrization(model[0], "weight", _Half())
    x = torch.randn(16, 32)
    parametrized = model(x).detach()
    with torch.no_grad():
        weight = model[0].weight.clone()
    parametrize.remove_parametrizations(model[0], "weight")
    with pytest.raises(RuntimeError, match=r"remove_parametrizations\(\.\.\., leave_parametrized=True\).*"
                                           r"leave_parametrized=False"):
        model(x)

    model, optimizer = _convert(_mlp(), level)
    parametrize.register_parametrization(model[0], "weight", _Half())
    with torch.no_grad():
        weight = model[0].weight.clone()
    parametrize.remove_parametrizations(model[0], "weight", leave_parametrized=False)
    with torch.no_grad():
        model[0].weight.copy_(weight)
    assert isinstance(model[0].weight, fp8amp.MasterWeight)
    assert _rel(model(x), parametrized) < 1e-6
    _train([(model, optimizer)], steps=2)
