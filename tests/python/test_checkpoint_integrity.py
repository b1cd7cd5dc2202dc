"""Checkpoints that are damaged, foreign or half-made (2026-12-06): scaling buffers no run saves
(a NaN, inf, 0 or negative scale, a counter out of range, a negative amax, a history of another
length), loaded at every level and recipe. Each must load to a correct run or be refused at load,
naming the key and what works; never trained on silently."""

import copy

import pytest
import torch
from torch import nn

import fp8amp


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))


def _setup(level, recipe="tensorwise", seed=0):
    """A model at ``level`` ("fp8": convert with torch's AdamW; "O1", "O2": initialize) and its optimizer."""
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if level == "fp8":
        fp8amp.convert(model, optimizer=optimizer, policy="all", recipe=recipe)
        return model, optimizer
    return fp8amp.initialize(model, optimizer, level, policy="all", recipe=recipe)


def _train(model, optimizer, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        optimizer.zero_grad()
        loss = model(3 * torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _saved(level, recipe="tensorwise"):
    model, optimizer = _setup(level, recipe)
    _train(model, optimizer, 20)  # past the warm-up: the delayed scales are in use
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


@pytest.mark.parametrize("key, value, what", [
    ("input_scaling.scale", float("nan"), "a scale is a finite positive number"),
    ("input_scaling.scale", float("inf"), "a scale is a finite positive number"),
    ("grad_output_scaling.scale", 0.0, "a scale is a finite positive number"),
    ("input_scaling.scale", -1.0, "a scale is a finite positive number"),
    ("weight_scaling.scale_inv", float("nan"), "a scale is a finite positive number"),
    ("input_scaling.scale_inv", 0.0, "a scale is a finite positive number"),
    ("input_scaling.counter", -1, r"a warm-up counter is in \[0, 16\] \(the history_len\)"),
    ("grad_output_scaling.counter", 17, r"a warm-up counter is in \[0, 16\] \(the history_len\)"),
    ("input_scaling.amax_history", -1.0, "an amax is not negative"),
], ids=["scale_nan", "scale_inf", "scale_zero", "scale_negative", "scale_inv_nan", "scale_inv_zero",
        "counter_negative", "counter_too_large", "amax_negative"])
@pytest.mark.parametrize("level, recipe", [("fp8", "tensorwise"), ("fp8", "rowwise"), ("O1", "tensorwise"),
                                           ("O2", "tensorwise"), ("O2", "rowwise")])
def test_scaling_buffers_no_run_saves_are_refused_at_load_naming_the_key(level, recipe, key, value, what):
    """A NaN, inf or 0 delayed scale loaded silently: the first forward after it gave NaN, which at
    FP8 compute (torch's AdamW) went into every weight (the model was NaN for good), at O1/O2
    skipped a step; in eval, where nothing updates the scale, every output stayed NaN. fp8amp never
    saves such values (a scale is a finite positive float, a counter in [0, history_len], an amax
    not negative), so they are a corrupt checkpoint: refused before the state loads, naming the key
    and how to restart the state's warm-up instead. (The tiled recipes keep the states too, and a
    state dict loads across recipes.)"""
    state, _ = _saved(level, recipe)
    state[f"2.{key}"].fill_(value)
    model, _ = _setup(level, recipe, seed=1)
    refused = model[2].get_submodule(key.split(".")[0])
    before = copy.deepcopy(refused.state_dict())
    with pytest.raises(ValueError, match=rf"ScalingState.load_state_dict: 2\.{key} holds .*; {what}.*"
                                         r"fresh_scaling_if_missing\(\)"):
        model.load_state_dict(state)
    after = refused.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the refused state is as it was


def test_a_refused_scaling_state_restarts_its_warm_up_as_the_error_says():
    """What the refusal says works: the corrupt state's keys left out, loaded inside
    fresh_scaling_if_missing(), that state restarts its warm-up and the run trains as the
    uninterrupted one within FP8 rounding; every other key loads."""
    state, optimizer_state = _saved("fp8")
    reference, reference_optimizer = _setup("fp8", seed=1)
    reference.load_state_dict(copy.deepcopy(state))
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    state["2.input_scaling.scale"].fill_(float("nan"))
    model, optimizer = _setup("fp8", seed=1)
    with pytest.raises(ValueError, match="fresh_scaling_if_missing"):
        model.load_state_dict(state)
    with fp8amp.fresh_scaling_if_missing():
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith("2.input_scaling.")})
    optimizer.load_state_dict(optimizer_state)
    assert int(model[2].input_scaling.counter) == 0
    losses, reference_losses = _train(model, optimizer, 5, 20), _train(reference, reference_optimizer, 5, 20)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses == pytest.approx(reference_losses, rel=0.05)


@pytest.mark.parametrize("column", [0, 5])
def test_a_non_finite_amax_loads_only_where_a_run_leaves_one(column):
    """This step's amax (column 0) is inf or NaN in a live state after a forward that met one, until
    the next update, or fp8amp's optimizer's zero_grad after a step GradScaler skipped (which runs
    no update) drops it: such a checkpoint loads and recovers as the live run would, the loop's
    first zero_grad dropping the inf, so the warm-up goes on. An older column never holds one (the
    update replaces it by 0 before the roll): refused."""
    state, optimizer_state = _saved("O2")
    state["2.input_scaling.amax_history"][0, column] = float("inf")
    model, optimizer = _setup("O2", seed=1)
    if column:
        with pytest.raises(ValueError, match=r"2\.input_scaling\.amax_history holds inf or NaN in column 5; .*"
                                             "only column 0"):
            model.load_state_dict(state)
        return
    model.load_state_dict(state)
    optimizer.load_state_dict(optimizer_state)
    counter = int(model[2].input_scaling.counter)
    _train(model, optimizer, 3, 20)
    assert int(model[2].input_scaling.counter) == min(counter + 3, 16)  # not reset: the inf was dropped
    assert torch.isfinite(model[2].input_scaling.amax_history).all()
    assert all(torch.isfinite(p.detach().float()).all() for p in model.parameters())


@pytest.mark.parametrize("strict", [True, False])
def test_a_history_of_another_length_names_history_len(strict):
    """A checkpoint saved with another history_len: torch's size mismatch named the shapes, not the
    recipe setting that makes them; the error says which history_len the checkpoint has."""
    state, _ = _saved("O2")
    model, _ = _setup("O2", fp8amp.Recipe("tensorwise", history_len=8), seed=1)
    with pytest.raises(ValueError, match=r"0\.input_scaling\.amax_history has a history of 16 steps, this state's "
                                         r"recipe 8 \(history_len\): convert with the checkpoint's history_len"):
        model.load_state_dict(state, strict=strict)


def test_scaling_buffers_carried_in_metadata_are_checked_too():
    """A state dict whose scaling buffers travel in its metadata (carry_in_metadata, the Lightning
    plugin's checkpoints) is checked as one holding them in its keys."""
    state, _ = _saved("O1")
    scaling = {k: state.pop(k) for k in list(state) if "_scaling." in k}
    scaling["2.input_scaling.scale"].fill_(0.0)
    fp8amp.scaling.carry_in_metadata(state, scaling)
    model, _ = _setup("O1", seed=1)
    with pytest.raises(ValueError, match=r"2\.input_scaling\.scale holds 0 or a negative value"):
        model.load_state_dict(state)


def _optimizer_case(level, edit):
    """An optimizer state dict saved at ``level`` after 5 steps, edited by ``edit(state of param
    0)`` in its stored form (O2 moments as codes with their scale entries, the older form), and a
    fresh model loaded with the model state dict and its optimizer."""
    from fp8amp.optim_state import moments_as_codes

    model, optimizer = _setup(level)
    _train(model, optimizer, 5)
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"] = {pid: moments_as_codes(state) for pid, state in saved["state"].items()}
    edit(saved["state"][0])
    fresh, fresh_optimizer = _setup(level, seed=1)
    fresh.load_state_dict(model.state_dict())
    return fresh, fresh_optimizer, saved


def _moments(optimizer):
    return [(k, v.clone()) for state in optimizer.state.values() for k, v in sorted(state.items())]


@pytest.mark.parametrize("key", ["step", "exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_saved_state_without_a_moment_or_its_step_is_refused_naming_it(level, key):
    """A param's saved state without one of Adam's entries (hand-edited, or renamed by a state dict
    of another version or optimizer): it loaded, and the next step failed with KeyError: 'exp_avg'
    (torch's AdamW fails the same way). Refused at load, naming the param and the missing entry."""
    model, optimizer, saved = _optimizer_case(level, lambda state: state.__setitem__("m", state.pop(key)))
    with pytest.raises(ValueError, match=rf"param 0 of group 0: the saved state has no '{key}' \(it has .*'m'.*\); "
                                         "Adam's state of a param holds 'step', 'exp_avg' and 'exp_avg_sq'"):
        optimizer.load_state_dict(saved)
    assert not optimizer.state


@pytest.mark.parametrize("step, what", [(float("nan"), "inf or NaN"), (-3.0, "a negative count"),
                                        (2.5, "a fraction"), ([5.0, 5.0], "2 values")],
                         ids=["nan", "negative", "fraction", "two_values"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_step_count_no_optimizer_saves_is_refused(level, step, what):
    """A NaN step count loaded and stayed NaN for good (every later checkpoint kept it, and each
    step's bias correction came from it); a negative one gave bias corrections of the wrong sign
    and then a division by 0 (1 - beta^0) as it passed 0; one of two values failed with "shape '[]'
    is invalid for input of size 2". A count is one whole number >= 0."""
    model, optimizer, saved = _optimizer_case(level, lambda state: state.__setitem__("step", torch.tensor(step)))
    with pytest.raises(ValueError, match=rf"param 0 of group 0: state 'step' holds {what}; a step count is one "
                                         "whole number >= 0"):
        optimizer.load_state_dict(saved)
    assert not optimizer.state


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_moment_that_is_not_floating_point_is_refused(level, dtype):
    """An integer or bool moment loaded at O1 as its float32 cast (silently: the moment's values
    were lost), and at O2 failed naming fp8amp.quantize_current's argument x."""
    def edit(state):
        state["exp_avg"] = torch.zeros(state["exp_avg"].shape, dtype=dtype)
        state.pop("exp_avg_scale", None)
        state.pop("exp_avg_scale_inv", None)

    model, optimizer, saved = _optimizer_case(level, edit)
    with pytest.raises(ValueError, match=rf"param 0 of group 0: state 'exp_avg' is {dtype}; a moment is a "
                                         "floating-point tensor"):
        optimizer.load_state_dict(saved)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_float64_moment_loads_as_plain_torch_loads_it(level):
    """A float64 moment (a state dict of a float64 run, or one converted by a tool): torch's AdamW
    casts it to its param's dtype; fp8amp's refused it at O2 naming fp8amp.quantize_current's x.
    It loads to the same state as the same real values in float32 do."""
    def real_moment(dtype):
        def edit(state):
            moment = state["exp_avg"]
            if "exp_avg_scale_inv" in state:
                moment = fp8amp.ops.dequantize(moment, state.pop("exp_avg_scale_inv"), torch.float32)
                state.pop("exp_avg_scale")
            state["exp_avg"] = moment.to(dtype)
        return edit

    _, optimizer, saved = _optimizer_case(level, real_moment(torch.float64))
    optimizer.load_state_dict(saved)
    _, reference_optimizer, saved = _optimizer_case(level, real_moment(torch.float32))
    reference_optimizer.load_state_dict(saved)
    moments, reference = _moments(optimizer), _moments(reference_optimizer)
    assert [(k, v.dtype) for k, v in moments] == [(k, v.dtype) for k, v in reference]
    assert all(torch.equal(a.float(), b.float()) for (_, a), (_, b) in zip(moments, reference))


@pytest.mark.parametrize("edit, message", [
    (lambda state: [state.pop(k) for k in ("exp_avg_scale", "exp_avg_scale_inv")],
     r"state 'exp_avg' is torch.float8_e4m3fn codes without 'exp_avg_scale_inv'"),
    (lambda state: [state.pop(k) for k in ("exp_avg_sq_scale", "exp_avg_sq_scale_inv")],
     r"state 'exp_avg_sq' is torch.float16 codes without 'exp_avg_sq_scale_inv'"),
    (lambda state: state["exp_avg_sq_scale_inv"].fill_(-1.0),
     r"state 'exp_avg_sq_scale_inv' must be one finite positive value, got \[-1.0\]"),
    (lambda state: state.__setitem__("exp_avg_scale_inv", torch.ones(2)),
     r"state 'exp_avg_scale_inv' must be one finite positive value, got \[1.0, 1.0\]"),
], ids=["fp8_codes_without_scale", "fp16_codes_without_scale", "negative_scale_inv", "two_scale_invs"])
def test_o2_codes_without_a_valid_scale_are_refused(edit, message):
    """An O2 state in its older stored form (codes beside *_scale / *_scale_inv entries) with a
    scale entry removed or damaged: E4M3 codes without their scale failed naming
    fp8amp.quantize_current's x, FP16 codes without theirs loaded as if the codes were the real
    values (every second moment off by its scale), and a negative second-moment scale made every
    later step of the param skipped (its square root is NaN), silently."""
    model, optimizer, saved = _optimizer_case("O2", edit)
    with pytest.raises(ValueError, match=r"param 0 of group 0: " + message):
        optimizer.load_state_dict(saved)
    assert not optimizer.state


def test_a_lightning_checkpoint_with_a_corrupt_scale_is_refused_at_resume(tmp_path):
    """The Lightning plugin restores the scaling buffers from checkpoint["fp8amp"] itself, by copy_:
    a NaN scale there resumed silently (and its next forward gave NaN). The plugin checks them as
    a state dict's are."""
    L = pytest.importorskip("lightning")
    from fp8amp.integrations.lightning import Fp8ampPrecision

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(epochs, ckpt_path=None):
        data = torch.utils.data.TensorDataset(torch.randn(40, 32, generator=torch.Generator().manual_seed(1)))
        trainer = L.Trainer(max_epochs=epochs, plugins=[Fp8ampPrecision("O2")], accelerator="cpu", devices=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=10), ckpt_path=ckpt_path)
        return trainer

    fit(1).save_checkpoint(tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=False)
    checkpoint["fp8amp"]["scaling"]["net.2.input_scaling.scale"].fill_(float("nan"))
    torch.save(checkpoint, tmp_path / "corrupt.ckpt")
    with pytest.raises(ValueError, match=r"net\.2\.input_scaling\.scale holds inf or NaN; a scale is a finite "
                                         "positive number"):
        fit(2, tmp_path / "corrupt.ckpt")


@pytest.mark.parametrize("buffer", ["amax_history", "scale", "counter"])
@pytest.mark.parametrize("level", ["fp8", "O1", "O2"])
def test_a_strict_false_load_of_some_of_a_states_buffers_restarts_its_warm_up(level, buffer):
    """A state dict holding some of a state's buffers (one renamed by hand or by another version),
    loaded with strict=False: the state mixed the checkpoint's buffers with its own (a warmed-up
    counter beside an empty history, or beside scale 1, with which the next forward cast: E5M2
    gradients of 1e-4 underflowed), and trained apart from either. The missing keys are reported
    and such a state restarts its warm-up, so the run trains bit for bit as one loaded inside
    fresh_scaling_if_missing() from the state dict without any scaling keys."""
    state, optimizer_state = _saved(level)
    renamed = {k[:-len(buffer)] + "old_" + buffer if k.endswith(f"scaling.{buffer}") else k: v
               for k, v in state.items()}
    model, optimizer = _setup(level, seed=1)
    result = model.load_state_dict(renamed, strict=False)
    assert sorted(result.missing_keys) == sorted(k for k in state if k.endswith(f"scaling.{buffer}"))
    assert sorted(result.unexpected_keys) == sorted(k for k in renamed if k not in state)
    optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    reference, reference_optimizer = _setup(level, seed=1)
    with fp8amp.fresh_scaling_if_missing():
        reference.load_state_dict({k: v for k, v in state.items() if "_scaling." not in k})
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    assert _train(model, optimizer, 20, 20) == _train(reference, reference_optimizer, 20, 20)


def _requantized(key, dtype):
    """An edit that stores param 0's O2 moment ``key`` as codes of ``dtype`` with their own scale."""
    def edit(state):
        real = fp8amp.ops.dequantize(state[key], state[f"{key}_scale_inv"], torch.float32)
        codes, scale_inv, _ = fp8amp.ops.quantize_current(real, dtype)
        state[key], state[f"{key}_scale_inv"], state[f"{key}_scale"] = codes, scale_inv, scale_inv.reciprocal()
    return edit


def _as_real(key, edit):
    """``edit``, then the moment as float32 real values without scale entries (torch's form)."""
    def real(state):
        edit(state)
        state[key] = fp8amp.ops.dequantize(state[key], state.pop(f"{key}_scale_inv"), torch.float32)
        state.pop(f"{key}_scale")
    return real


@pytest.mark.parametrize("key, dtype", [("exp_avg", torch.float16), ("exp_avg", torch.float8_e5m2),
                                        ("exp_avg_sq", torch.float8_e4m3fn)])
def test_scaled_moments_in_another_format_load_as_their_real_values(key, dtype):
    """An O2 moment stored as codes of another format than the optimizer keeps it in (FP16 or E5M2
    codes for exp_avg, E4M3 for exp_avg_sq: another version's or tool's choice): it loaded and the
    next step failed inside fp8amp.adam_step ("exp_avgs[0] must be float32 or float8_e4m3fn"), or
    the load failed with torch's '"lt_cpu" not implemented for Float8_e4m3fn'. It loads as its real
    values do, into the optimizer's formats."""
    _, optimizer, saved = _optimizer_case("O2", _requantized(key, dtype))
    optimizer.load_state_dict(saved)
    _, reference_optimizer, saved = _optimizer_case("O2", _as_real(key, _requantized(key, dtype)))
    reference_optimizer.load_state_dict(saved)
    moments, reference = _moments(optimizer), _moments(reference_optimizer)
    assert [(k, v.dtype) for k, v in moments] == [(k, v.dtype) for k, v in reference]
    assert all(torch.equal(a.float(), b.float()) for (_, a), (_, b) in zip(moments, reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_moment_beside_a_scale_that_is_no_codes_is_refused(dtype):
    """A float32 or bfloat16 moment beside a scale entry (codes or real values? a hand edit): it
    loaded and the next step failed inside fp8amp.adam_step."""
    def edit(state):
        state["exp_avg"] = fp8amp.ops.dequantize(state["exp_avg"], state["exp_avg_scale_inv"], torch.float32).to(dtype)

    _, optimizer, saved = _optimizer_case("O2", edit)
    with pytest.raises(ValueError, match=rf"param 0 of group 0: state 'exp_avg' is {dtype} beside 'exp_avg_scale_inv'; "
                                         "scaled moments are E4M3, E5M2 or FP16 codes"):
        optimizer.load_state_dict(saved)
    assert not optimizer.state
