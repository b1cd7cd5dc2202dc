"""Which optimizer updates which model's FP8 scaling, as users combine models, optimizers and
fp8amp's calls (O1, O2, and FP8 compute with torch's AdamW): after each step every delayed state
is updated once (its history rolls once), so a run matches, bit for bit, the same run done as one
call over one model that holds them all; where nothing updates a model, a warning says so."""

import io
import warnings

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp.amax_sync import delayed_states

LEVELS = ["O1", "O2", "fp8"]
NEVER_UPDATED = r"nothing updated the model's FP8 scaling since its previous step"


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(n)]


def _real(t):
    t = t.detach()
    return t.dequantize(torch.float32) if isinstance(t, fp8amp.ScaledTensor) else t.float()


def _tensors(*models):
    return [(name, _real(t)) for m in models for name, t in [*m.named_parameters(), *m.named_buffers()]]


def _initialize(model, optimizer, level):
    """``model, optimizer = fp8amp.initialize(...)`` at O1/O2; ``convert(model, optimizer=)`` at FP8 compute."""
    if level == "fp8":
        return fp8amp.convert(model, optimizer=optimizer, policy="all"), optimizer
    return fp8amp.initialize(model, optimizer, level, policy="all")


def _without_optimizer(model, level):
    if level == "fp8":
        return fp8amp.convert(model, policy="all")
    return fp8amp.initialize(model, None, level, policy="all")[0]


def _optimizer(params, level):
    return (torch.optim.AdamW if level == "fp8" else fp8amp.optim.AdamW)(params, lr=1e-2)


def _train(model, optimizer, n):
    for x, y in _batches(n):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _combined(level, n):
    """The reference: one call over one model that holds both, one optimizer."""
    whole = nn.Sequential(_mlp(0), _mlp(1))
    whole, optimizer = _initialize(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2), level)
    _train(whole, optimizer, n)
    return _tensors(*whole)


def _in_turn(enc, dec, level, first):
    """Each model given to its own call with the optimizer over both that the previous call returned."""
    optimizer = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=1e-2)
    for model in (dec, enc) if first == "dec" else (enc, dec):
        _, optimizer = _initialize(model, optimizer, level)
    return optimizer


def _submodule_then_parent(enc, dec, level, first):
    parent = nn.Sequential(enc, dec)
    optimizer = torch.optim.AdamW(parent.parameters(), lr=1e-2)
    for model in (enc, parent) if first == "sub" else (parent, enc):
        _, optimizer = _initialize(model, optimizer, level)
    return optimizer


def _two_optimizers(enc, dec, level, order):
    """One optimizer a part of the model, both registered, both stepped every step."""
    parent = _without_optimizer(nn.Sequential(enc, dec), level)
    made = {}
    for name in order:
        optimizer = torch.optim.AdamW((enc if name == "enc" else dec).parameters(), lr=1e-2)
        if level == "fp8":
            fp8amp.register_scaling_hooks(parent, optimizer)
        else:
            optimizer = fp8amp.initialize_optimizer(parent, optimizer, level)
        made[name] = optimizer
    return _Both(made["enc"], made["dec"])


class _Both:
    def __init__(self, *optimizers):
        self.optimizers = optimizers

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self):
        for optimizer in self.optimizers:
            optimizer.zero_grad()


SETUPS = {
    "in turn, encoder first": lambda enc, dec, level: _in_turn(enc, dec, level, "enc"),
    "in turn, decoder first": lambda enc, dec, level: _in_turn(enc, dec, level, "dec"),
    "submodule, then parent": lambda enc, dec, level: _submodule_then_parent(enc, dec, level, "sub"),
    "parent, then submodule": lambda enc, dec, level: _submodule_then_parent(enc, dec, level, "parent"),
    "two optimizers": lambda enc, dec, level: _two_optimizers(enc, dec, level, ("enc", "dec")),
    "two optimizers, registered the other way": lambda enc, dec, level: _two_optimizers(enc, dec, level,
                                                                                          ("dec", "enc")),
}


def _assert_trains_as_one_call(level, enc, dec, optimizer):
    """20 steps with no warning: each state updated once a step, bit for bit one call over both."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(nn.Sequential(enc, dec), optimizer, 20)
    assert all(int(s.counter) == 16 for s in delayed_states(enc) + delayed_states(dec))
    for (name, got), (_, want) in zip(_tensors(enc, dec), _combined(level, 20)):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("level", LEVELS)
def test_models_and_optimizers_combined_in_turn_train_as_one_call(level, setup):
    """Each state updated once a step, bit for bit the run of one call over one model of both."""
    enc, dec = _mlp(0), _mlp(1)
    optimizer = SETUPS[setup](enc, dec, level)
    _assert_trains_as_one_call(level, enc, dec, optimizer)


@pytest.mark.parametrize("level", LEVELS)
def test_a_model_added_to_another_models_optimizer_without_registering_it_is_warned_about(level):
    """A second model converted without an optimizer, its parameters added to the first model's
    (registered) optimizer: nothing updated its scaling, and the watch that warns about such a model
    stayed silent, since it asked whether any scaling in the process was updated (the first model's
    was, at every step)."""
    enc, dec = _mlp(0), _mlp(1)
    enc, optimizer = _initialize(enc, torch.optim.AdamW(enc.parameters(), lr=1e-2), level)
    dec = _without_optimizer(dec, level)
    optimizer.add_param_group({"params": list(dec.parameters())})
    with pytest.warns(UserWarning, match=NEVER_UPDATED):
        _train(nn.Sequential(enc, dec), optimizer, 3)


@pytest.mark.parametrize("level", LEVELS)
def test_a_parent_converted_without_optimizer_around_a_registered_model_is_warned_about(level):
    """The same with the new layers in a parent of the registered model (``nn.Sequential(enc, dec)``
    converted without an optimizer): the watch of the parent saw enc's states updated at every step
    and took the parent as updated, dec's scales frozen."""
    enc, dec = _mlp(0), _mlp(1)
    enc, optimizer = _initialize(enc, torch.optim.AdamW(enc.parameters(), lr=1e-2), level)
    parent = _without_optimizer(nn.Sequential(enc, dec), level)
    optimizer.add_param_group({"params": list(dec.parameters())})
    with pytest.warns(UserWarning, match=NEVER_UPDATED):
        _train(parent, optimizer, 3)


@pytest.mark.parametrize("level", LEVELS)
def test_parts_of_a_model_updated_by_their_optimizers_at_their_own_rates_are_not_warned_about(level):
    """A model converted without an optimizer whose parts are registered on their own optimizers,
    the second stepped every other step: each optimizer's layers are updated at its steps."""
    enc, dec = _mlp(0), _mlp(1)
    model = _without_optimizer(nn.Sequential(enc, dec), level)
    optimizers = []
    for part in (enc, dec):
        optimizer = torch.optim.AdamW(part.parameters(), lr=1e-2)
        if level == "fp8":
            fp8amp.register_scaling_hooks(part, optimizer)
        else:
            optimizer = fp8amp.initialize_optimizer(part, optimizer, level)
        optimizers.append(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(_batches(8)):
            nn.functional.mse_loss(model(x), y).backward()
            for optimizer in optimizers[:1] if i % 2 else optimizers:
                optimizer.step()
                optimizer.zero_grad()
    assert [int(s.counter) for s in delayed_states(model)] == [8] * 4 + [4] * 4


@pytest.mark.parametrize("level", LEVELS)
def test_a_model_added_to_another_models_optimizer_and_registered_trains_as_one(level):
    enc, dec = _mlp(0), _mlp(1)
    enc, optimizer = _initialize(enc, torch.optim.AdamW(enc.parameters(), lr=1e-2), level)
    dec = _without_optimizer(dec, level)
    optimizer.add_param_group({"params": list(dec.parameters())})
    fp8amp.register_scaling_hooks(dec, optimizer)
    _assert_trains_as_one_call(level, enc, dec, optimizer)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_without_optimizer_warns_about_another_models_optimizer_holding_its_weights(level):
    """``enc, opt = initialize(enc, opt_over_both)`` then ``initialize(dec, None)``: the optimizer,
    registered for enc only, held dec's Linear weights, which dec's masters replaced: dec's Linear
    layers never trained (and their scaling was never updated), silently."""
    enc, dec = _mlp(0), _mlp(1)
    optimizer = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=1e-2)
    enc, optimizer = fp8amp.initialize(enc, optimizer, level, policy="all")
    with pytest.warns(UserWarning, match=r"registered for another model holds 2 Linear weight\(s\) that this call "
                                         rf"replaced .* fp8amp.initialize\(model, optimizer, '{level}'\)"):
        fp8amp.initialize(dec, None, level, policy="all")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialize_without_optimizer_next_to_another_models_optimizer_is_not_warned_about(level):
    enc, dec = _mlp(0), _mlp(1)
    enc, optimizer = fp8amp.initialize(enc, torch.optim.AdamW(enc.parameters(), lr=1e-2), level, policy="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8amp.initialize(dec, None, level, policy="all")


@pytest.mark.parametrize("other_watched", [False, True])
@pytest.mark.parametrize("old", ["dropped", "kept"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_new_optimizer_not_given_to_fp8amp_is_warned_about(level, old, other_watched):
    """A model trained with the optimizer fp8amp registered, then with a new one built by hand (an
    optimizer re-created for a new phase or epoch) that nobody registered: no scale moved again and
    nothing said so, whether the first optimizer was dropped or kept. Also while another model is
    watched (converted without an optimizer): the new optimizer's first step, before this model
    was watched again, fixed the models it checks, and it never warned."""
    other = fp8amp.convert(_mlp(2), policy="all") if other_watched else None  # noqa: F841 (kept alive)
    model = nn.Sequential(_mlp(0), _mlp(1))
    model, optimizer = _initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    _train(model, optimizer, 3)
    kept = [optimizer] if old == "kept" else []
    optimizer = _optimizer(model.parameters(), level)
    with pytest.warns(UserWarning, match=NEVER_UPDATED) as record:
        _train(model, optimizer, 6)
    assert sum(NEVER_UPDATED[:20] in str(w.message) for w in record) == 1  # once
    fp8amp.register_scaling_hooks(model, optimizer)  # what the warning says: each step updates again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, optimizer, 3)
    assert all(int(s.counter) == 6 for s in delayed_states(model)), kept


@pytest.mark.parametrize("level", LEVELS)
def test_a_saved_model_stepped_by_an_optimizer_not_given_to_fp8amp_is_warned_about(level, monkeypatch):
    """The same after ``torch.save(model)`` and a load in a new process, whose update count starts
    again from 0: the states' record of their last update, saved with them, must not read as updates."""
    model = nn.Sequential(_mlp(0), _mlp(1))
    model, optimizer = _initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    _train(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    monkeypatch.setattr(fp8amp.ScalingState, "updates_run", 0)  # (a new process)
    model = torch.load(buffer, weights_only=False)
    optimizer = _optimizer(model.parameters(), level)
    with pytest.warns(UserWarning, match=NEVER_UPDATED):
        _train(model, optimizer, 4)


@pytest.mark.parametrize("level", LEVELS)
def test_steps_skipped_without_optimizer_step_are_not_warned_about(level):
    """A registered optimizer whose steps are skipped now and then (GradScaler's skip, a loop that
    skips a bad batch) is not an optimizer nobody registered."""
    model = nn.Sequential(_mlp(0), _mlp(1))
    model, optimizer = _initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (x, y) in enumerate(_batches(12)):
            nn.functional.mse_loss(model(x), y).backward()
            if i % 3 == 1:  # skipped
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
    assert all(int(s.counter) == 8 for s in delayed_states(model))


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_stepping_the_optimizer_given_to_initialize_optimizer_says_to_step_the_one_it_returned(level, kept):
    """``fp8amp.initialize_optimizer(model, optimizer, level)`` and then ``optimizer.step()`` (the
    result dropped, or kept and not stepped): the returned optimizer's hooks had been put on the one
    given too, so its steps failed inside fp8amp (IndexError) once the returned one was gone, or
    updated the scaling as if that one had stepped."""
    model = fp8amp.initialize(nn.Sequential(_mlp(0), _mlp(1)), None, level, policy="all")[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    returned = [fp8amp.initialize_optimizer(model, optimizer, level)] if kept else []
    fp8amp.initialize_optimizer(model, optimizer, level) if not kept else None
    with pytest.warns(UserWarning, match=NEVER_UPDATED + r".*step the optimizer it returns"):
        _train(model, optimizer, 4)
    assert all(int(s.counter) == 0 for s in delayed_states(model)), returned


class _Wrapper(torch.optim.Optimizer):
    """An optimizer that wraps another without torch.optim.Optimizer.__init__ (as Accelerate's
    AcceleratedOptimizer does): its step runs no step hooks of its own."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


@pytest.mark.parametrize("call", ["convert", "register_scaling_hooks"])
def test_a_wrapping_optimizer_without_step_hooks_is_refused_naming_the_one_it_wraps(call):
    """``convert(model, optimizer=accelerator_prepared_optimizer)`` failed with an AttributeError
    ('AcceleratedOptimizer' object has no attribute '_optimizer_step_pre_hooks'), after convert had
    changed the model."""
    model = nn.Sequential(_mlp(0), _mlp(1))
    optimizer = _Wrapper(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if call == "register_scaling_hooks":
        model = fp8amp.convert(model, policy="all")
    with pytest.raises(TypeError, match=rf"{call}: optimizer \(_Wrapper\) wraps another optimizer .* "
                                        r"pass the optimizer it wraps \(optimizer.optimizer\)"):
        fp8amp.convert(model, optimizer=optimizer, policy="all") if call == "convert" else \
            fp8amp.register_scaling_hooks(model, optimizer)
    if call == "convert":
        assert not any(isinstance(m, fp8amp.Fp8Linear) for m in model.modules())
    fp8amp.register_scaling_hooks(model, optimizer.optimizer) if call != "convert" else \
        fp8amp.convert(model, optimizer=optimizer.optimizer, policy="all")
    _train(model, optimizer, 3)
    assert all(int(s.counter) == 3 for s in delayed_states(model))
