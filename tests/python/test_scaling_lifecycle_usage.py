"""The delayed-scaling state (amax histories, scales, warm-up counters) over a training run as users
drive it (2026-12-07), at FP8 compute, O1 and O2: validation between steps, forwards and backwards
outside training, shapes that change mid-run, resumes from mid warm-up, checkpoints of another
recipe, and a reset by hand. Each is compared with the same run without the disturbing action
(bit for bit where docs/numerics.md#delayed-scaling says the state is left alone) or with plain
torch (FP8 tolerances)."""

import copy
import io

import pytest
import torch
from torch import nn

import fp8amp

LEVELS = ("fp8", "O1", "O2")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _setup(level, seed=0, recipe=None):
    """A model at ``level`` ("fp8": convert with torch's AdamW; "O1", "O2": initialize) and its optimizer."""
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if level == "fp8":
        return fp8amp.convert(model, optimizer=optimizer, policy="all", recipe=recipe), optimizer
    return fp8amp.initialize(model, optimizer, level, policy="all", recipe=recipe)


def _batches(n, rows=8):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 32, generator=gen) * (1 + i), torch.randn(rows, 16, generator=gen)) for i in range(n)]


def _step(model, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("level", LEVELS)
def test_validation_between_steps_changes_nothing(level):
    """eval() + no_grad / inference_mode forwards, and no_grad forwards in train mode, of inputs far
    larger than the training data: the run's weights and scaling state are bit for bit those of the
    run without them."""
    batches = _batches(20)
    plain, plain_opt = _setup(level)
    validated, validated_opt = _setup(level)
    val = torch.randn(5, 32) * 1000
    for i, (x, y) in enumerate(batches):
        _step(plain, plain_opt, x, y)
        _step(validated, validated_opt, x, y)
        if i % 3 == 0:
            for training in (False, True):
                validated.train(training)
                with torch.no_grad():
                    validated(val)
                with torch.inference_mode():
                    validated(val)
            validated.train()
    _assert_same(_state(plain), _state(validated))


@pytest.mark.parametrize("level", LEVELS)
def test_backward_in_eval_mode_changes_nothing(level):
    """An input gradient taken in eval() between steps (an adversarial example, a saliency map, a
    gradient-norm metric) records nothing, as an eval() forward records nothing: its backward's
    output-gradient amaxes went into the training history and coarsened the next steps' scales."""
    batches = _batches(20)
    plain, plain_opt = _setup(level)
    attacked, attacked_opt = _setup(level)
    for x, y in batches:
        _step(plain, plain_opt, x, y)
        attacked.eval()
        x_adv = (50 * x).requires_grad_()
        torch.autograd.grad(nn.functional.mse_loss(attacked(x_adv), 100 * y), x_adv)
        attacked.train()
        _step(attacked, attacked_opt, x, y)
    _assert_same(_state(plain), _state(attacked))


def test_backward_in_eval_mode_records_when_asked():
    """``record_amax_outside_training = True`` records the output gradients of an eval() forward too."""
    model, _ = _setup("fp8")
    for layer in (model[0], model[2]):
        layer.record_amax_outside_training = True
    model.eval()
    x = torch.randn(8, 32, requires_grad=True)
    model(x).square().sum().backward()
    assert model[0].input_scaling.amax_history[0, 0] > 0
    assert model[0].grad_output_scaling.amax_history[0, 0] > 0


@pytest.mark.parametrize("level", LEVELS)
def test_changing_shapes_and_empty_batches(level):
    """Batch size and sequence length changing every step, batches of one row and empty ones: the
    weights follow plain torch's within FP8 tolerance; an empty batch records nothing (its step
    leaves every warm-up counter where it was)."""
    reference = _model()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model, optimizer = _setup(level)
    gen = torch.Generator().manual_seed(0)
    for shape in [(8,), (1,), (3, 5), (0,), (2, 7), (1, 1), (0, 4), (17,)] * 2:
        x, y = torch.randn(*shape, 32, generator=gen), torch.randn(*shape, 16, generator=gen)
        counters = [model[0].input_scaling.counter.clone(), model[2].grad_output_scaling.counter.clone()]
        for m, opt in ((reference, reference_opt), (model, optimizer)):
            opt.zero_grad()
            (m(x) - y).square().sum().backward()
            opt.step()
        if shape[0] == 0:
            assert torch.equal(model[0].input_scaling.counter, counters[0])
            assert torch.equal(model[2].grad_output_scaling.counter, counters[1])
    assert model[0].input_scaling.counter.item() == 12  # 16 steps, 4 of them empty
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert ((p.float() - q).norm() / q.norm()).item() < 0.02, name


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("at", [1, 3, 18])
def test_resume_is_bit_for_bit(level, at):
    """A checkpoint from step 1 or 3 (mid warm-up) or 18 (delayed scales in use) loaded into a fresh
    model of another seed continues bit for bit as the uninterrupted run."""
    batches = _batches(22)
    whole, whole_opt = _setup(level)
    for x, y in batches:
        _step(whole, whole_opt, x, y)
    first, first_opt = _setup(level)
    for x, y in batches[:at]:
        _step(first, first_opt, x, y)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed, resumed_opt = _setup(level, seed=5)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    for x, y in batches[at:]:
        _step(resumed, resumed_opt, x, y)
    _assert_same(_state(whole), _state(resumed))


@pytest.mark.parametrize("level", LEVELS)
def test_reset_by_hand_is_a_fresh_warm_up(level):
    """``ScalingState.reset()`` of every state mid-run (after a change of the data) continues as a
    model whose weights and optimizer state were loaded with fresh scaling."""
    batches = _batches(12)
    model, optimizer = _setup(level)
    for x, y in batches[:4]:
        _step(model, optimizer, x, y)
    weights = {k: v for k, v in _state(model).items() if "_scaling." not in k}
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    for state in model.modules():
        if isinstance(state, fp8amp.ScalingState):
            state.reset()
    assert all(s.counter.sum() == 0 and s.amax_history.sum() == 0 and torch.all(s.scale == 1)
               for s in model.modules() if isinstance(s, fp8amp.ScalingState))
    fresh, fresh_opt = _setup(level, seed=9)
    with fp8amp.fresh_scaling_if_missing():
        fresh.load_state_dict(weights)
    fresh_opt.load_state_dict(optimizer_state)
    for x, y in batches[4:]:
        _step(model, optimizer, x, y)
        _step(fresh, fresh_opt, x, y)
    _assert_same(_state(model), _state(fresh))


def _weight_grad_errors(model, reference, x, y):
    for m in (model, reference):
        m.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
    return [((p.grad.float() - q.grad).norm() / q.grad.norm()).item()
            for p, q in zip(model.parameters(), reference.parameters())]


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_of_another_grad_format(level):
    """A warmed-up checkpoint whose output gradients were E5M2 (the default) loaded into a model whose
    recipe makes them E4M3: its scales are 128x too large for E4M3's range, and the next backward
    saturated nearly every output gradient (weight gradients 98 % off plain torch's). Such a state
    restarts its warm-up (current scaling), so that step's gradients are as close as FP8 makes them."""
    batches = _batches(20)
    e5m2, e5m2_opt = _setup(level)
    for x, y in batches[:18]:
        _step(e5m2, e5m2_opt, x, y)
    saved = _state(e5m2)
    e4m3, _ = _setup(level, seed=5, recipe=fp8amp.Recipe(grad_format=fp8amp.E4M3))
    e4m3.load_state_dict(saved)
    reference = _model()
    reference.load_state_dict({k: v.float() for k, v in saved.items() if "_scaling." not in k})
    assert max(_weight_grad_errors(e4m3, reference, *batches[18])) < 0.2  # (an E5M2 resume: about 0.14)
    assert e4m3[2].grad_output_scaling.counter.item() == 0
    assert e4m3[0].input_scaling.counter.item() == 16  # (same format: kept)


@pytest.mark.parametrize("level", LEVELS)
def test_a_skipped_step_folds_into_the_next(level):
    """Gradient accumulation over 1 to 4 micro-batches, and an iteration whose optimizer.step() the
    user skips: the history rolls once per optimizer step, each column holding the max over the
    step's micro-batches (a skipped iteration's amaxes go to the next step, as its gradients do),
    and the counter counts optimizer steps."""
    model, optimizer = _setup(level)
    gen = torch.Generator().manual_seed(0)
    expected, pending = [], 0.0
    for i, micro in enumerate([1, 3, 2, 4, 1, 2]):
        if pending == 0.0:  # (after a skipped step the gradients accumulate on, as the amaxes do)
            optimizer.zero_grad()
        for j in range(micro):
            x = torch.randn(4 + j, 32, generator=gen) * (i + 1 + j)
            (nn.functional.mse_loss(model(x), torch.zeros(4 + j, 16)) / micro).backward()
            pending = max(pending, x.abs().max().item())
        if i != 2:  # iteration 2 skips its step
            optimizer.step()
            expected.append(pending)
            pending = 0.0
    state = model[0].input_scaling
    assert state.counter.item() == 5
    assert state.amax_history[0, 1:6].flip(0).tolist() == expected
