"""Optimizer patterns of fine-tuning frameworks (torchtune, Lightning, Hugging Face) at O1/O2:
an optimizer per parameter stepped in backward, gradients edited in hooks, lr schedulers and their
state dicts, hyperparameters changed mid-run, SWA. Each is compared with the same loop on the
unconverted model with ``torch.optim.AdamW``."""

import io
import warnings

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import SWALR, AveragedModel

import fp8amp
from fp8amp.amax_sync import delayed_states
from tiny_mlp import regression_batches, tiny_mlp

LEVELS = ["O1", "O2"]


def _real(p):
    p = p.detach()
    return p.dequantize(torch.float32) if isinstance(p, fp8amp.ScaledTensor) else p.float()


def _assert_close(model, plain, rel=0.1, atol=0.01):
    """Parameters within FP8 training's distance of the unconverted model's (in norm)."""
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        error = float(_real(p).sub(q.detach()).norm())
        assert error <= rel * float(q.detach().norm()) + atol, (name, error)


def _train(model, optimizer, batches, scheduler=None):
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _in_backward(params, make):
    """torchtune's optimizer_in_bwd: one optimizer per parameter, stepped as its gradient is ready."""
    optimizers = {p: make(p) for p in params}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    return optimizers


def _backward_only(model, batches):
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("level", LEVELS)
def test_an_optimizer_per_parameter_stepped_in_backward_trains_as_one_optimizer(level):
    """initialize(model, None), then initialize_optimizer for each parameter's optimizer: every
    parameter is stepped once a step, the scaling updated once a step (by the first registered),
    and the model ends bit for bit where one fp8amp optimizer over all of it does."""
    plain = tiny_mlp()
    _in_backward(list(plain.parameters()), lambda p: torch.optim.AdamW([p], lr=1e-2))
    _backward_only(plain, regression_batches(20))

    model, _ = fp8amp.initialize(tiny_mlp(), None, level)
    optimizers = _in_backward(list(model.parameters()),
                              lambda p: fp8amp.initialize_optimizer(model, torch.optim.AdamW([p], lr=1e-2), level))
    updates = fp8amp.ScalingState.updates_run
    _backward_only(model, regression_batches(20))
    assert fp8amp.ScalingState.updates_run - updates == 20
    assert all(float(opt.state[p]["step"]) == 20 for p, opt in optimizers.items())
    assert all(s.counter.eq(16).all() for s in delayed_states(model) if s.amax_history.gt(0).any())

    one = tiny_mlp()
    one, optimizer = fp8amp.initialize(one, torch.optim.AdamW(one.parameters(), lr=1e-2), level)
    _train(one, optimizer, regression_batches(20))
    for p, q in zip(model.parameters(), one.parameters()):
        assert torch.equal(_real(p), _real(q))
    _assert_close(model, plain)


class _WithFirst(nn.Module):
    """A first layer whose parameters get no gradient: unused (an extra embedding, a head another
    task uses) or frozen after a few steps. Their optimizers in backward then never step."""

    def __init__(self, use_first):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(32, 32)
        self.body = tiny_mlp()
        self.use_first = use_first

    def forward(self, x):
        return self.body(self.first(x) if self.use_first else x)


@pytest.mark.parametrize("how", ["unused", "frozen later"])
@pytest.mark.parametrize("level", LEVELS)
def test_the_scaling_is_updated_when_the_first_registered_optimizer_stops_stepping(level, how):
    """The first optimizer registered updates the scaling; in backward, one whose parameter got no
    gradient never stepped, so no history rolled and every delayed scale stayed in warm-up, set by
    the largest amax since the start, silently (0 updates in 20 steps). The next optimizer that
    steps twice while it does not takes its states over."""
    model, _ = fp8amp.initialize(_WithFirst(use_first=how != "unused"), None, level)
    _in_backward([p for p in model.parameters()],
                 lambda p: fp8amp.initialize_optimizer(model, torch.optim.AdamW([p], lr=1e-2), level))
    batches = regression_batches(20)
    if how == "frozen later":
        _backward_only(model, batches[:5])
        model.first.requires_grad_(False)
    updates = fp8amp.ScalingState.updates_run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backward_only(model, batches if how == "unused" else batches[5:])
    steps = 20 if how == "unused" else 15
    assert fp8amp.ScalingState.updates_run - updates == steps - 1  # (the first step shows it)
    states = delayed_states(model.body)
    assert all(s.counter.eq(16).all() for s in states if s.amax_history.gt(0).any())


@pytest.mark.parametrize("level", LEVELS)
def test_a_head_only_phase_after_a_whole_model_phase_updates_the_scaling(level):
    """A second phase that trains the head alone with a new optimizer, the first one still held (a
    Lightning module keeps it): the first registered kept every state and, no longer stepped,
    froze the scales (docs/hardening.md listed it as left). The head's optimizer takes them over."""
    model = tiny_mlp()
    model, whole = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    _train(model, whole, regression_batches(4))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    head = fp8amp.initialize_optimizer(model, torch.optim.AdamW(model[4].parameters(), lr=1e-2), level)
    updates = fp8amp.ScalingState.updates_run
    _train(model, head, regression_batches(10))
    assert fp8amp.ScalingState.updates_run - updates == 9
    assert whole is not None  # (held)


@pytest.mark.parametrize("level", LEVELS)
def test_betas_from_a_numpy_schedule_are_taken_as_torch_takes_them(level):
    """A momentum schedule computed with numpy float32 (torch's AdamW takes it) stopped the run at
    the next step ("betas must be two Python floats"), as a numpy lr did before."""
    np = pytest.importorskip("numpy")
    plain, model = tiny_mlp(), tiny_mlp()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    for i, (x, y) in enumerate(regression_batches(10)):
        for m, o in ((plain, plain_opt), (model, opt)):
            o.param_groups[0]["betas"] = (np.float32(0.85 + 0.01 * i), np.float64(0.99))
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    _assert_close(model, plain)
    with pytest.raises(ValueError, match="betas must be two real numbers"):
        opt.param_groups[0]["betas"] = (True, 0.99)
        _train(model, opt, regression_batches(1))


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_initialize_given_several_optimizers_names_the_calls_that_take_them(container):
    """A set of optimizers (one per parameter, for optimizer in backward) was refused with only
    the accepted types, which says nothing of how to give several; the model is left unchanged."""
    model = tiny_mlp()
    optimizers = [torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()]
    given = dict(enumerate(optimizers)) if container is dict else container(optimizers)
    with pytest.raises(ValueError, match=r"initialize\(model, None, 'O2'\).*initialize_optimizer\(model, optimizer, "
                                         r"'O2'\) for each"):
        fp8amp.initialize(model, given, "O2")
    assert all(type(m) in (nn.Linear, nn.GELU) for m in model)


@pytest.mark.parametrize("level", LEVELS)
def test_torch_apply_optimizer_in_backward_with_fp8amp_optimizers(level):
    """torch.distributed.optim._apply_optimizer_in_backward (no process group needed) builds the
    optimizers itself; registering each for the model's scaling trains as one optimizer does."""
    in_backward = pytest.importorskip("torch.distributed.optim")._apply_optimizer_in_backward
    model, _ = fp8amp.initialize(tiny_mlp(), None, level)
    in_backward(fp8amp.optim.AdamW, model.parameters(), {"lr": 1e-2, "state_dtypes": level})
    for p in model.parameters():
        for optimizer in p._in_backward_optimizers:
            fp8amp.register_scaling_hooks(model, optimizer)
    updates = fp8amp.ScalingState.updates_run
    _backward_only(model, regression_batches(12))
    assert fp8amp.ScalingState.updates_run - updates == 12
    one = tiny_mlp()
    one, optimizer = fp8amp.initialize(one, torch.optim.AdamW(one.parameters(), lr=1e-2), level)
    _train(one, optimizer, regression_batches(12))
    for p, q in zip(model.parameters(), one.parameters()):
        assert torch.equal(_real(p), _real(q))


def _groups(model):
    params = list(model.parameters())
    return [{"params": params[:4]}, {"params": params[4:], "lr": 5e-3, "weight_decay": 0.0}]


_SCHEDULERS = {
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 5e-3], total_steps=16),
    "CosineAnnealingWarmRestarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-4),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1 / (1 + s)]),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, 0.1, 1.0, 4), lr_scheduler.CosineAnnealingLR(o, 12)], [4]),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=1, factor=0.5),
}


def _scheduled(model, optimizer, scheduler, batches, seen):
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step(1.0) if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) else scheduler.step()
        seen.append([(g["lr"], tuple(g["betas"]), g["weight_decay"]) for g in optimizer.param_groups])


@pytest.mark.parametrize("name", list(_SCHEDULERS))
@pytest.mark.parametrize("level", LEVELS)
def test_schedulers_and_their_state_dicts_resume_as_torchs(level, name):
    """Every lr, beta (OneCycleLR cycles them) and weight decay equal torch's at each step, across
    a save of the model, the optimizer and the scheduler halfway and a load into new ones."""
    batches = regression_batches(16)
    plain = tiny_mlp()
    plain_opt = torch.optim.AdamW(_groups(plain), lr=1e-2)
    want = []
    _scheduled(plain, plain_opt, _SCHEDULERS[name](plain_opt), batches, want)

    def built():
        model = tiny_mlp()
        return fp8amp.initialize(model, torch.optim.AdamW(_groups(model), lr=1e-2), level)

    model, optimizer = built()
    scheduler, got = _SCHEDULERS[name](optimizer), []
    _scheduled(model, optimizer, scheduler, batches[:8], got)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model, optimizer = built()
    scheduler = _SCHEDULERS[name](optimizer)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    _scheduled(model, optimizer, scheduler, batches[8:], got)
    assert got == want
    assert [float(s["step"]) for s in optimizer.state.values()] == [16.0] * 6
    _assert_close(model, plain)


@pytest.mark.parametrize("level", LEVELS)
def test_hyperparameters_changed_mid_run_and_zero_grad_keeping_tensors(level):
    """betas, weight_decay, eps and maximize set in param_groups mid-run, gradients accumulated
    over four micro-batches into tensors zero_grad(set_to_none=False) keeps."""
    def run(model, optimizer):
        for i, (x, y) in enumerate(regression_batches(12)):
            for k in range(4):
                nn.functional.mse_loss(model(x[k::4]), y[k::4]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            for group in optimizer.param_groups:
                if i == 3:
                    group.update(betas=(0.5, 0.9), weight_decay=0.3, eps=1e-4)
                if i == 7:
                    group.update(betas=[0.95, 0.99], weight_decay=0.0, eps=1e-8, maximize=True)

    plain = tiny_mlp()
    run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    model = tiny_mlp()
    model, optimizer = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    run(model, optimizer)
    _assert_close(model, plain, rel=0.15)


@pytest.mark.parametrize("edit", ["post-accumulate clip", "tensor hook", "pre-hook divide", "clip per param"])
@pytest.mark.parametrize("level", LEVELS)
def test_gradients_edited_in_hooks_match_torchs(level, edit):
    """Gradients (FP8 at O1/O2) edited where users edit them, compared after the edit."""
    def clip(p):
        torch.nn.utils.clip_grad_norm_([p], 1e-3)

    def hooked(model, optimizer):
        for p in model.parameters():
            if edit == "post-accumulate clip":
                p.register_post_accumulate_grad_hook(clip)
            elif edit == "tensor hook":
                p.register_hook(lambda g: g * 0.25)
        if edit == "pre-hook divide":  # the accumulation count, divided where the step starts
            def divide(optimizer, args, kwargs):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad.div_(4)
            optimizer.register_step_pre_hook(divide)
        return model, optimizer

    def grads(model, optimizer):
        x, y = regression_batches(1)[0]
        for k in range(4):
            nn.functional.mse_loss(model(x[k::4]), y[k::4]).backward()
        if edit == "clip per param":
            for p in model.parameters():
                torch.nn.utils.clip_grad_norm_([p], 1e-3)
        optimizer.step()  # (the pre-hook's edit happens here; the grads are kept)
        return [_real(p.grad) for p in model.parameters()]

    plain = tiny_mlp()
    want = grads(*hooked(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2)))
    model = tiny_mlp()
    got = grads(*hooked(*fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)))
    for g, w in zip(got, want):
        assert float((g - w).norm()) <= 0.15 * float(w.norm()) + 1e-6


@pytest.mark.parametrize("level", LEVELS)
def test_swa_and_add_param_group_state_dict_as_torchs(level):
    """SWALR's lrs, AveragedModel's average and count; a head added by add_param_group after three
    steps: the state dict's groups, param ids, state keys and step counts are torch's."""
    def run(model, optimizer, params):
        swa = AveragedModel(model)
        for i, (x, y) in enumerate(regression_batches(12)):
            if i == 3:
                optimizer.add_param_group({"params": params[4:], "lr": 1e-3})
                swalr = SWALR(optimizer, swa_lr=1e-3, anneal_epochs=3)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if i >= 6:
                swa.update_parameters(model)
                swalr.step()
        return swa, optimizer.state_dict(), [g["lr"] for g in optimizer.param_groups]

    plain = tiny_mlp()
    params = list(plain.parameters())
    plain_swa, plain_saved, plain_lrs = run(plain, torch.optim.AdamW(params[:4], lr=1e-2), params)
    model, _ = fp8amp.initialize(tiny_mlp(), None, level)
    params = list(model.parameters())
    optimizer = fp8amp.initialize_optimizer(model, torch.optim.AdamW(params[:4], lr=1e-2), level)
    swa, saved, lrs = run(model, optimizer, params)
    assert lrs == plain_lrs
    assert int(swa.n_averaged) == int(plain_swa.n_averaged) == 6
    _assert_close(swa.module, plain_swa.module)
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in plain_saved["param_groups"]]
    assert {k: sorted(v) for k, v in saved["state"].items()} == {k: sorted(v) for k, v in plain_saved["state"].items()}
    assert [float(v["step"]) for v in saved["state"].values()] == [12.0] * 4 + [9.0] * 2


def test_unconvert_of_a_second_optimizer_says_it_takes_one():
    # The second call said "the optimizer of another model, or of a model that holds this one".
    model, _ = fp8amp.initialize(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), None, "O2")
    optimizers = [fp8amp.initialize_optimizer(model, fp8amp.optim.AdamW([p], lr=1e-3), "O2")
                  for p in model.parameters()]
    plain, _ = fp8amp.unconvert(model, optimizers[0])
    with pytest.raises(ValueError, match="made plain by an earlier unconvert, which converts one optimizer"):
        fp8amp.unconvert(plain, optimizers[2])


def _encoder_decoder():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
            nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))


def _buffers_and_params(*models):
    return [(name, _real(t)) for m in models for name, t in [*m.named_parameters(), *m.named_buffers()]]


@pytest.mark.parametrize("level", LEVELS)
def test_two_models_initialized_one_after_the_other_with_one_optimizer_train_as_one(level):
    """An encoder and a decoder initialized one after the other, the second call given the optimizer
    the first returned: the first call's optimizer was retired by the second, and with it the
    encoder's scaling updates (its scales stayed 1 and its history unrolled, the warm-up's scale
    set by the largest amax since the start, silently). The optimizer that replaces one now takes
    over the models it was registered for: the run is bit for bit one initialize of both."""
    enc, dec = _encoder_decoder()
    optimizer = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=1e-2)
    enc, optimizer = fp8amp.initialize(enc, optimizer, level, policy="all")
    dec, optimizer = fp8amp.initialize(dec, optimizer, level, policy="all")
    whole = nn.Sequential(*_encoder_decoder())
    whole, whole_optimizer = fp8amp.initialize(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2), level,
                                               policy="all")
    for x, y in regression_batches(20):
        for model, opt in ((nn.Sequential(enc, dec), optimizer), (whole, whole_optimizer)):
            nn.functional.mse_loss(model(x), y[:, :16]).backward()
            opt.step()
            opt.zero_grad()
    assert all(int(s.counter) == 16 for s in delayed_states(enc))
    for (name, got), (_, want) in zip(_buffers_and_params(enc, dec), _buffers_and_params(*whole)):
        assert torch.equal(got, want), name


def test_unconvert_of_one_model_keeps_the_other_models_scaling_updated():
    """unconvert(enc, optimizer) of an optimizer that also steps an FP8-compute decoder: the plain
    optimizer it returns takes over the decoder's scaling updates."""
    enc, dec = _encoder_decoder()
    enc, optimizer = fp8amp.initialize(enc, torch.optim.AdamW(enc.parameters(), lr=1e-2), "O2", policy="all")
    optimizer.add_param_group({"params": list(dec.parameters())})
    fp8amp.convert(dec, optimizer=optimizer, policy="all")
    enc, optimizer = fp8amp.unconvert(enc, optimizer)
    assert isinstance(optimizer, torch.optim.AdamW)
    for x, y in regression_batches(20):
        nn.functional.mse_loss(dec(enc(x)), y[:, :16]).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(int(s.counter) == 16 and float(s.scale) != 1.0 for s in delayed_states(dec))
