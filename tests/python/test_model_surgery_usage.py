"""Models changed during and between trainings (fine-tuning, growing, partial conversion, loading
pretrained weights, tying), at FP8 compute, O1 and O2, against the same changes on a plain model
under plain torch."""

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import fp8amp


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _converted(level, model, opt, recipe=None):
    if level == "fp8":
        fp8amp.convert(model, optimizer=opt, policy="all", recipe=recipe)
        return model, opt
    return fp8amp.initialize(model, opt, level, policy="all", recipe=recipe)


def _step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _real(p):
    return p.dequantize(torch.float32) if isinstance(p, fp8amp.ScaledTensor) else p.detach().float()


def _rel(a, b):
    a, b = _real(a), _real(b)
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gradual_unfreezing_trains_the_layers_plain_torch_trains(level, recipe):
    """Frozen before the conversion, unfrozen (and added as a group) after some steps."""
    ref, model = _mlp(), _mlp()
    for m in (ref, model):
        m[0].requires_grad_(False)
        m[2].bias.requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model, opt = _converted(level, model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                            lr=1e-2), recipe)
    frozen, bias = _real(model[0].weight).clone(), model[2].bias.detach().clone()
    gen = torch.Generator().manual_seed(1)
    for i in range(6):
        if i == 3:
            assert torch.equal(_real(model[0].weight), frozen)
            for m, o in ((ref, ref_opt), (model, opt)):
                m[0].requires_grad_(True)
                o.add_param_group({"params": list(m[0].parameters()), "lr": 1e-3})
        x = torch.randn(16, 32, generator=gen)
        ref_loss, loss = _step(ref, ref_opt, x), _step(model, opt, x)
    assert torch.equal(model[2].bias, bias)
    assert not torch.equal(_real(model[0].weight), frozen)
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in ref.parameters()]
    assert _rel(model[0].weight, ref[0].weight) < 0.05
    assert loss == pytest.approx(ref_loss, rel=0.15)


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_a_head_replaced_after_initialize_trains(level):
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(16, 32, generator=gen)
        _step(ref, ref_opt, x), _step(model, opt, x)
    for m in (ref, model):
        torch.manual_seed(3)
        m[4] = nn.Linear(64, 48)
    if level == "fp8":
        fp8amp.convert(model, policy="all")
    else:
        fp8amp.initialize(model, None, level, policy="all")
        assert isinstance(model[4].weight, fp8amp.MasterWeight)
    ref_opt.add_param_group({"params": list(ref[4].parameters())})
    opt.add_param_group({"params": list(model[4].parameters())})
    for _ in range(4):
        x = torch.randn(16, 32, generator=gen)
        ref_loss, loss = _step(ref, ref_opt, x), _step(model, opt, x)
    assert isinstance(model[4], fp8amp.Fp8Linear) and model(x).shape == ref(x).shape
    assert _rel(model[4].weight, ref[4].weight) < 0.1
    assert loss == pytest.approx(ref_loss, rel=0.15)
    assert model[4].input_scaling.amax_history[0, 1] > 0  # its history rolls with the others'


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_second_initialize_keeps_the_weight_grad_of_the_layers_an_earlier_one_made(level):
    """A second initialize (of a grown model) applied its weight_grad to every master: the first
    call's weight_grad="fp32" layers got FP8 gradients, silently."""
    model = _mlp()
    fp8amp.initialize(model, None, level, policy="all", weight_grad="fp32")
    model[4] = nn.Linear(64, 32)
    with pytest.warns(UserWarning, match="weight_grad='fp32'"):
        fp8amp.initialize(model, None, level, policy="all")
    model(torch.randn(8, 32)).square().mean().backward()
    assert type(model[0].weight.grad) is torch.Tensor and model[0].weight.grad.dtype == torch.float32
    assert isinstance(model[4].weight.grad, fp8amp.ScaledTensor)  # this call's layer: this call's setting
    same = _mlp()
    fp8amp.initialize(same, None, level, policy="all", weight_grad="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.initialize(same, None, level, policy="all", weight_grad="fp32")  # the same: nothing to say


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_tying_a_master_to_an_embedding_after_initialize_names_the_order(level):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.lm_head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)

        def forward(self, tokens):
            return self.lm_head(self.embed(tokens))

    model = LM()
    model, _ = fp8amp.initialize(model, torch.optim.AdamW(model.parameters()), level, policy="all")
    model.lm_head.weight = model.embed.weight
    with pytest.raises(RuntimeError, match="tie weights before fp8amp.initialize"):
        model(torch.randint(0, 64, (2, 8)))


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_moves_and_a_saved_model_continue_training(level):
    model = _mlp()
    model, opt = _converted(level, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(1)
    _step(model, opt, torch.randn(16, 32, generator=gen))
    params = list(model.parameters())
    assert model.to("cpu").cpu().float() is model and list(model.parameters()) == params
    buf = io.BytesIO()
    torch.save({"model": model, "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    copy_ = saved["model"]
    copy_opt = torch.optim.AdamW(copy_.parameters(), lr=1e-2)
    if level == "fp8":
        fp8amp.register_scaling_hooks(copy_, copy_opt)
    else:
        copy_opt = fp8amp.initialize_optimizer(copy_, copy_opt, level)
    copy_opt.load_state_dict(saved["opt"])
    for _ in range(2):
        x = torch.randn(16, 32, generator=gen)
        assert _step(model, opt, x) == _step(copy_, copy_opt, x)
    assert all(torch.equal(_real(a), _real(b)) for a, b in zip(model.parameters(), copy_.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), copy_.buffers()))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_layer_added_to_the_optimizer_before_its_initialize_is_warned_about(level):
    """A head appended, added to the optimizer, then made a master by initialize(model, None): the
    optimizer held the replaced weight, and the head never trained, silently."""
    model = _mlp()
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, policy="all")
    model.append(nn.Linear(16, 32))
    opt.add_param_group({"params": list(model[5].parameters())})
    with pytest.warns(UserWarning, match=r"holds 1 Linear weight\(s\) .*\(5\.weight\).*add_param_group"):
        fp8amp.initialize(model, None, level, policy="all")
    opt.add_param_group({"params": [model[5].weight]})  # what the warning says
    before = _real(model[5].weight).clone()
    _step(model, opt, torch.randn(16, 32))
    assert not torch.equal(_real(model[5].weight), before)


@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_an_optimizer_over_the_whole_model_after_a_head_only_phase_updates_the_scaling(level):
    """Phase 1 trains the head with one optimizer, phase 2 everything with a new one while the
    first is still held: the first, registered first, kept every scaling state, and no scale moved
    in phase 2 (inputs 40x larger saturated at the phase-1 scale)."""
    model = _mlp()
    if level == "fp8":
        fp8amp.convert(model, policy="all")
    else:
        fp8amp.initialize(model, None, level, policy="all")
    phases = []
    for params in (model[4].parameters(), model.parameters()):
        opt = torch.optim.AdamW(params, lr=1e-3)
        if level == "fp8":
            fp8amp.register_scaling_hooks(model, opt)
        else:
            opt = fp8amp.initialize_optimizer(model, opt, level)
        phases.append(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(18):  # past the warm-up (history_len 16): delayed scales
        _step(model, phases[0], torch.randn(16, 32, generator=gen))
    x = 40 * torch.randn(16, 32, generator=gen)
    for _ in range(3):
        _step(model, phases[1], x)
    assert model[0].input_scaling.amax_history[0, 1].item() == pytest.approx(x.abs().max().item())
    plain = fp8amp.unconvert(copy.deepcopy(model))
    with torch.no_grad():
        assert _rel(model[0](x), plain[0](x)) < 0.1
