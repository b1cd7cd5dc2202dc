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

LEVELS = ["O1", "O2"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)) for _ in range(n)]


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
    plain = _model()
    _in_backward(list(plain.parameters()), lambda p: torch.optim.AdamW([p], lr=1e-2))
    _backward_only(plain, _batches(20))

    model, _ = fp8amp.initialize(_model(), None, level)
    optimizers = _in_backward(list(model.parameters()),
                              lambda p: fp8amp.initialize_optimizer(model, torch.optim.AdamW([p], lr=1e-2), level))
    updates = fp8amp.ScalingState.updates_run
    _backward_only(model, _batches(20))
    assert fp8amp.ScalingState.updates_run - updates == 20
    assert all(float(opt.state[p]["step"]) == 20 for p, opt in optimizers.items())
    assert all(s.counter.eq(16).all() for s in delayed_states(model) if s.amax_history.gt(0).any())

    one = _model()
    one, optimizer = fp8amp.initialize(one, torch.optim.AdamW(one.parameters(), lr=1e-2), level)
    _train(one, optimizer, _batches(20))
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
        self.body = _model()
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
    batches = _batches(20)
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
    model = _model()
    model, whole = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    _train(model, whole, _batches(4))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    head = fp8amp.initialize_optimizer(model, torch.optim.AdamW(model[4].parameters(), lr=1e-2), level)
    updates = fp8amp.ScalingState.updates_run
    _train(model, head, _batches(10))
    assert fp8amp.ScalingState.updates_run - updates == 9
    assert whole is not None  # (held)


@pytest.mark.parametrize("level", LEVELS)
def test_betas_from_a_numpy_schedule_are_taken_as_torch_takes_them(level):
    """A momentum schedule computed with numpy float32 (torch's AdamW takes it) stopped the run at
    the next step ("betas must be two Python floats"), as a numpy lr did before."""
    np = pytest.importorskip("numpy")
    plain, model = _model(), _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    model, opt = fp8amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    for i, (x, y) in enumerate(_batches(10)):
        for m, o in ((plain, plain_opt), (model, opt)):
            o.param_groups[0]["betas"] = (np.float32(0.85 + 0.01 * i), np.float64(0.99))
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    _assert_close(model, plain)
    with pytest.raises(ValueError, match="betas must be two real numbers"):
        opt.param_groups[0]["betas"] = (True, 0.99)
        _train(model, opt, _batches(1))


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_initialize_given_several_optimizers_names_the_calls_that_take_them(container):
    """A set of optimizers (one per parameter, for optimizer in backward) was refused with only
    the accepted types, which says nothing of how to give several; the model is left unchanged."""
    model = _model()
    optimizers = [torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()]
    given = dict(enumerate(optimizers)) if container is dict else container(optimizers)
    with pytest.raises(ValueError, match=r"initialize\(model, None, 'O2'\).*initialize_optimizer\(model, optimizer, "
                                         r"'O2'\) for each"):
        fp8amp.initialize(model, given, "O2")
    assert all(type(m) in (nn.Linear, nn.GELU) for m in model)
