"""Scale rules and delayed scaling against a plain-Python model of docs/numerics.md#numerics, bit for bit;
ScalingRecipe / ScalingState behaviour and checkpointing."""

import copy
import io
import math

import numpy as np
import pytest
import torch

import fp8amp
from cast_reference import assert_bits_equal, assert_quantized, assert_same_float, scaled

F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)
F32_MIN_NORMAL = F32(np.finfo(np.float32).tiny)


# ---------------------------------------------------------------------------------------------
# The model. All arithmetic in IEEE float32, as the core does it.


def model_scale(amax, fmax, margin, pow2, previous):
    """(scale, scale_inv) from amax (docs/numerics.md#numerics); previous pair if amax is 0 or not finite.

    pow2: 2^(floor(log2(fmax / amax)) - margin), with fmax / amax a float32 quotient and the
    exponent kept within [-126, 126] so that scale and scale_inv are both normal floats.
    TE: fmax / amax / 2^margin, within [FLT_MIN, FLT_MAX] (normal floats); scale_inv = 1 / scale.
    """
    amax = F32(amax)
    if not (amax > 0) or not np.isfinite(amax):
        return previous
    with np.errstate(over="ignore"):
        q = F32(fmax) / amax
    if pow2:
        e = (128 if np.isinf(q) else math.frexp(float(q))[1] - 1) - margin
        e = max(-126, min(126, e))
        return F32(2.0**e), F32(2.0**-e)
    scale = q * F32(2.0 ** -min(margin, 126))
    if not np.isfinite(scale):
        scale = F32_MAX
    if not scale >= F32_MIN_NORMAL:
        scale = F32_MIN_NORMAL
    return scale, F32(1) / scale


def model_amax(x: torch.Tensor) -> np.float32:
    x = x.float()
    if x.isnan().any():
        return F32("nan")
    return F32(x.abs().max().item()) if x.numel() else F32(0)


class DelayedScalingModel:
    """n tensors with amax histories of length H, per docs/numerics.md#numerics (see scaling.h for the order)."""

    def __init__(self, n, history_len, fmax, margin, pow2):
        self.h, self.fmax, self.margin, self.pow2 = history_len, fmax, margin, pow2
        self.history = [[F32(0)] * history_len for _ in range(n)]
        self.scale = [F32(1)] * n
        self.scale_inv = [F32(1)] * n
        self.counter = [0] * n

    def quantize_scale(self, i, x):
        """Records x's amax for tensor i; returns the (scale, scale_inv) x is quantized with."""
        a, slot = model_amax(x), self.history[i][0]
        self.history[i][0] = F32("nan") if np.isnan(a) or np.isnan(slot) else max(slot, a)
        given = (self.scale[i], F32(1) / self.scale[i])
        if self.counter[i] < self.h:  # warm-up: current scaling
            return model_scale(self.history[i][0], self.fmax, self.margin, self.pow2, given)
        return given

    def update(self):
        for i, row in enumerate(self.history):
            bad = not np.isfinite(row[0])
            recorded = row[0] > 0  # an amax of 0 (nothing recorded this step) leaves the warm-up
            if bad:
                row[0] = F32(0)
            self.scale[i], self.scale_inv[i] = model_scale(
                max(row), self.fmax, self.margin, self.pow2, (self.scale[i], self.scale_inv[i])
            )
            self.history[i] = [F32(0)] + row[:-1]
            self.counter[i] = 0 if bad else min(self.counter[i] + int(recorded), self.h)

    def assert_matches(self, state: fp8amp.ScalingState):
        assert_same_float(state.amax_history, torch.tensor(np.array(self.history, dtype=np.float32)))
        assert_bits_equal(state.scale, torch.tensor(np.array(self.scale, dtype=np.float32)))
        assert_bits_equal(state.scale_inv, torch.tensor(np.array(self.scale_inv, dtype=np.float32)))
        assert torch.equal(state.counter, torch.tensor(self.counter, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# compute_scale


def test_design_examples():
    scale, scale_inv = torch.ones(2), torch.ones(2)
    fp8amp.ops.compute_scale(torch.tensor([10.0, 1e4]), scale, scale_inv, fp8amp.E4M3_MAX)
    assert scale.tolist() == [32.0, 1 / 32] and scale_inv.tolist() == [1 / 32, 32.0]


AMAXES = [10.0, 1e4, 448.0, 447.9, 449.0, 1.0, 3e38, 1e-30, 1e-40, 1e-45, 0.0, -0.0, -3.0,
          float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("dtype", [fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("margin", [0, 1, 5, 126])
def test_compute_scale_matches_model(dtype, pow2, margin):
    fmax = fp8amp.format_max(dtype)
    g = torch.Generator().manual_seed(margin)
    amax = torch.cat([torch.tensor(AMAXES), torch.rand(50, generator=g) * torch.exp2(torch.randint(-60, 60, (50,), generator=g).float())])
    n = amax.numel()
    previous = (torch.full((n,), 3.0), torch.full((n,), 1 / 3))
    scale, scale_inv = previous[0].clone(), previous[1].clone()
    history = torch.stack([amax, torch.full((n,), 1e6)], dim=1)  # [n, 2]: column 0 counts
    fp8amp.ops.compute_scale(history, scale, scale_inv, fmax, margin=margin, pow2_scale=pow2)
    expected = [model_scale(a, fmax, margin, pow2, (F32(3.0), F32(1 / 3))) for a in amax.tolist()]
    assert_bits_equal(scale, torch.tensor(np.array([e[0] for e in expected], dtype=np.float32)))
    assert_bits_equal(scale_inv, torch.tensor(np.array([e[1] for e in expected], dtype=np.float32)))


# ---------------------------------------------------------------------------------------------
# Delayed scaling over 20 steps

# Per step, magnitudes of the tensors quantized into rows 0 and 1 of one ScalingState: normal
# steps, a step with two quantizes of row 0 (micro-batches), zero steps, a NaN and an inf
# (counter reset, warm-up again), a spike that stays in the window for H steps, then leaves.
NAN, INF = float("nan"), float("inf")
ROW0 = [[1.0], [2.0], [0.5], [3.0, 40.0], [0.0], [4.0], [1.0], [NAN], [1.0], [2.0],
        [1.0], [0.0], [1e4], [1.0], [1.0], [1.0], [0.75], [1.0], [INF], [1.0]]
ROW1 = [[300.0], [0.01], [7.0], [0.0], [0.0], [2e3], [9.0], [9.0], [1.0], [1e-3],
        [INF], [5.0], [5.0], [5.0], [0.02], [5.0], [5.0], [5.0], [5.0], [NAN]]


def step_input(magnitude, step, row, shape=(6, 10)):
    """A tensor whose amax is exactly `magnitude` (NaN / inf planted in one element)."""
    g = torch.Generator().manual_seed(1000 * row + step)
    x = torch.rand(shape, generator=g) * 2 - 1
    x = x / x.abs().max()
    if math.isfinite(magnitude):
        x = x * magnitude
    else:
        x[1, 2] = magnitude
    return x


def run_sequence(state, steps=20, check=None, x_dtype=torch.float32):
    """Runs ROW0 through state.quantize(index 0) and ROW1 through state.cast_transpose(index 1),
    calling state.update() after each step; calls check(step, row, x, outputs) per quantize."""
    for step in range(steps):
        for row, plan in ((0, ROW0), (1, ROW1)):
            for k, magnitude in enumerate(plan[step]):
                x = step_input(magnitude, step * 10 + k, row).to(x_dtype)
                outputs = state.quantize(x, 0) if row == 0 else state.cast_transpose(x, 1)
                if check is not None:
                    check(step, row, x, outputs)
        state.update()
        if check is not None:
            check(step, None, None, None)


RECIPES = [
    (fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=4)),
    (fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=4)),
    (fp8amp.E4M3, fp8amp.ScalingRecipe()),  # H = 16: warm-up covers most of the run
    (fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=5, margin=2)),
    (fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=4, pow2_scale=False)),
    (fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=3, margin=1, pow2_scale=False)),
    (fp8amp.FP16, fp8amp.ScalingRecipe(history_len=4)),
]


@pytest.mark.parametrize("dtype,recipe", RECIPES)
def test_delayed_scaling_matches_model(dtype, recipe):
    state = fp8amp.ScalingState(2, dtype, recipe)
    model = DelayedScalingModel(2, recipe.history_len, fp8amp.format_max(dtype), recipe.margin, recipe.pow2_scale)
    seen = {"delayed": 0, "warm-up": 0}

    def check(step, row, x, outputs):
        if row is None:  # after update()
            model.update()
            model.assert_matches(state)
            return
        seen["warm-up" if model.counter[row] < recipe.history_len else "delayed"] += 1
        scale, scale_inv = model.quantize_scale(row, x)
        out, out_t, got_scale_inv = (outputs[0], None, outputs[1]) if row == 0 else outputs
        assert_bits_equal(got_scale_inv, torch.tensor([scale_inv]))
        assert_quantized(out, scaled(x, torch.tensor([scale])), dtype)
        if out_t is not None:
            assert_bits_equal(out_t, out.t().contiguous())
        model.assert_matches(state)

    run_sequence(state, check=check)
    assert seen["warm-up"] > 0
    if recipe.history_len < 16:
        assert seen["delayed"] > 0


def test_spike_leaves_the_window_after_h_steps():
    h = 4
    state = fp8amp.ScalingState(1, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=h))
    scales = []
    for step in range(12):
        state.quantize(torch.tensor([1e4 if step == 5 else 1.0]))
        state.update()
        scales.append(state.scale.item())
    assert scales[4] == 256.0  # floor(log2(448)) = 8
    assert scales[5:9] == [1 / 32] * h  # the spike's scale while it is in the window
    assert scales[9:] == [256.0] * 3


def test_non_finite_amax_restarts_warm_up():
    state = fp8amp.ScalingState(1, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=3))
    for _ in range(5):
        state.quantize(torch.ones(3))
        state.update()
    assert state.counter.tolist() == [3]
    state.quantize(torch.tensor([1.0, NAN]))
    state.update()
    assert state.counter.tolist() == [0] and state.amax_history.tolist() == [[0.0, 0.0, 1.0]]
    out, scale_inv = state.quantize(torch.tensor([0.5]))  # current scaling again: 2^floor(log2(896))
    assert scale_inv.tolist() == [2.0**-9]


# ---------------------------------------------------------------------------------------------
# ScalingRecipe and ScalingState


def test_recipe_defaults_and_frozen():
    recipe = fp8amp.ScalingRecipe()
    assert (recipe.history_len, recipe.margin, recipe.pow2_scale) == (16, 0, True)
    with pytest.raises(AttributeError):
        recipe.margin = 1


def test_state_buffers_initial_values():
    state = fp8amp.ScalingState(3, fp8amp.E5M2, fp8amp.ScalingRecipe(history_len=5))
    assert state.amax_history.dtype == torch.float32 and state.amax_history.shape == (3, 5)
    assert state.amax_history.count_nonzero() == 0
    assert state.scale.tolist() == [1.0] * 3 and state.scale.dtype == torch.float32
    assert state.scale_inv.tolist() == [1.0] * 3 and state.scale_inv.dtype == torch.float32
    assert state.counter.tolist() == [0] * 3 and state.counter.dtype == torch.int32
    assert state.dtype == fp8amp.E5M2 and state.fmax == 57344.0
    assert state.state_dict().keys() == {"amax_history", "scale", "scale_inv", "counter"}
    assert "num_tensors=3" in repr(state) and "float8_e5m2" in repr(state) and "history_len=5" in repr(state)


def test_state_views_record_in_place():
    state = fp8amp.ScalingState(3, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
    state.quantize(torch.tensor([5.0]), index=2)
    state.cast_transpose(torch.tensor([[-6.0]]), index=1)
    assert state.amax_history.tolist() == [[0.0, 0.0], [6.0, 0.0], [5.0, 0.0]]


def test_reset():
    state = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
    run_sequence(state, steps=6)
    state.reset()
    fresh = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
    for name, buffer in fresh.named_buffers():
        assert torch.equal(getattr(state, name), buffer), name


def test_state_keeps_dtypes_under_module_casts():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.scaling = fp8amp.ScalingState(2)
    model.scaling.update()
    model.to(torch.bfloat16)
    model.half()
    model.to("cpu", torch.float64)
    assert model[0].weight.dtype == torch.float64
    for name in ("amax_history", "scale", "scale_inv"):
        assert getattr(model.scaling, name).dtype == torch.float32
    assert model.scaling.counter.dtype == torch.int32


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 4)
        self.scaling = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=8))


def continue_run(state, first_step, last_step):
    """Steps first_step..last_step - 1 of the ROW0/ROW1 plan; returns every output tensor."""
    outputs = []
    for step in range(first_step, last_step):
        for row, plan in ((0, ROW0), (1, ROW1)):
            x = step_input(plan[step][0], step * 10, row)
            outputs += state.quantize(x, 0) if row == 0 else state.cast_transpose(x, 1)
        state.update()
    return outputs


def test_state_dict_round_trip_resumes_warm_up_and_history():
    model = TinyModel()
    run_sequence(model.scaling, steps=5)
    assert model.scaling.counter.tolist() == [4, 3]  # still warming up (H = 8; steps of amax 0 do not count)
    keys = set(model.state_dict())
    assert {"scaling.amax_history", "scaling.scale", "scaling.scale_inv", "scaling.counter"} <= keys

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    resumed = TinyModel()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for name, value in model.scaling.named_buffers():
        assert_bits_equal(getattr(resumed.scaling, name), value)

    # The resumed run continues exactly like the original; a restarted warm-up would not.
    original = continue_run(model.scaling, 5, 14)
    for a, b in zip(original, continue_run(resumed.scaling, 5, 14)):
        assert_bits_equal(a, b)
    for name, value in model.scaling.named_buffers():
        assert_bits_equal(getattr(resumed.scaling, name), value)
    restarted = continue_run(TinyModel().scaling, 5, 14)
    assert any(not torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(original, restarted)
               if a.element_size() == 1)


def test_deepcopy_is_independent():
    state = fp8amp.ScalingState(1)
    copied = copy.deepcopy(state)
    state.quantize(torch.tensor([3.0]))
    assert copied.amax_history.count_nonzero() == 0


# ---------------------------------------------------------------------------------------------
# The eager hot path (cached views of the buffers, ops called directly) against the traced path
# (views sliced per call, through the checked wrappers) that torch.compile takes.


def traced_path(monkeypatch):
    """Makes ScalingState take its torch.compile path in eager mode."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


def all_methods_sequence(state, steps=20):
    """quantize (index 0), cast_transpose (last index) and cast_transpose_current (index 0)
    over the ROW0 / ROW1 plan with updates; returns every output and the final buffers."""
    outputs = []
    last = state.num_tensors - 1
    for step in range(steps):
        for row, plan in ((0, ROW0), (1, ROW1)):
            for k, magnitude in enumerate(plan[step]):
                x = step_input(magnitude, step * 10 + k, row).to(torch.bfloat16)
                outputs += state.quantize(x, 0) if row == 0 else state.cast_transpose(x, last)
        outputs += state.cast_transpose_current(step_input(ROW1[step][0], step, 7), 0)
        state.update()
    return outputs + [buffer.clone() for buffer in state.buffers()]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [fp8amp.E4M3, fp8amp.E5M2, fp8amp.FP16])
def test_eager_fast_path_equals_traced_path(n, dtype, monkeypatch):
    recipe = fp8amp.ScalingRecipe(history_len=4, margin=1, pow2_scale=dtype != fp8amp.E5M2)
    fast = all_methods_sequence(fp8amp.ScalingState(n, dtype, recipe))
    traced_path(monkeypatch)
    traced = all_methods_sequence(fp8amp.ScalingState(n, dtype, recipe))
    assert len(fast) == len(traced)
    for a, b in zip(fast, traced):
        assert_bits_equal(a, b)


def test_cached_views_follow_replaced_buffers():
    for n in (1, 3):
        state = fp8amp.ScalingState(n, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
        state.quantize(torch.tensor([1.0]), n - 1)  # the views are made
        old = state.amax_history
        state._apply(lambda t: t.clone())  # what .to(device) does: new buffer objects
        state.quantize(torch.tensor([2.0]), n - 1)
        assert state.amax_history[n - 1, 0] == 2.0 and old[n - 1, 0] == 1.0
        # load_state_dict(assign=True) and plain assignment replace buffers too
        state.load_state_dict({k: v.clone() for k, v in state.state_dict().items()}, assign=True)
        state.cast_transpose(torch.tensor([[3.0]]), n - 1)
        assert state.amax_history[n - 1, 0] == 3.0
        state.amax_history = torch.zeros(n, 2)
        state.cast_transpose_current(torch.tensor([[5.0]]), 0)
        assert state.amax_history[0, 0] == 5.0
        # a plain load_state_dict writes in place: the views stay valid
        state.load_state_dict({k: v.clone() for k, v in state.state_dict().items()})
        state.quantize(torch.tensor([6.0]), 0)
        assert state.amax_history[0, 0] == 6.0


def test_used_state_copies_and_pickles_independently():
    state = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
    state.quantize(torch.tensor([1.0]), 1)
    copied = copy.deepcopy(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other, value in ((copied, 7.0), (loaded, 9.0)):
        other.quantize(torch.tensor([value]), 1)
        assert other.amax_history[1, 0] == value
    assert state.amax_history[1, 0] == 1.0
    state.quantize(torch.tensor([4.0]), 0)
    assert copied.amax_history[0, 0] == 0.0 and loaded.amax_history[0, 0] == 0.0


def test_inference_mode_then_training():
    state = fp8amp.ScalingState(2, fp8amp.E4M3, fp8amp.ScalingRecipe(history_len=2))
    with torch.inference_mode():
        state.cast_transpose_current(torch.ones(2, 2), 0)
        state.quantize(torch.ones(2), 1)
    state.cast_transpose_current(torch.full((2, 2), 3.0), 0)
    state.quantize(torch.full((2,), 2.0), 1)
    state.update()
    assert state.amax_history[:, 1].tolist() == [3.0, 2.0]


def _random_states(seed: int) -> list:
    """Eight states: E4M3 and E5M2, 1 to 3 tensors, histories of 1 to 8, two recipes, amaxes and
    counters of every kind (a NaN and an inf among them)."""
    g = torch.Generator().manual_seed(seed)
    states = []
    for i in range(8):
        recipe = fp8amp.ScalingRecipe(history_len=1 + i, margin=i % 2)
        st = fp8amp.ScalingState(1 + i % 3, fp8amp.E4M3 if i % 2 else fp8amp.E5M2, recipe)
        with torch.no_grad():
            st.amax_history.copy_(torch.rand(st.amax_history.shape, generator=g) * 10.0 ** (i - 4))
            st.counter.copy_(torch.randint(0, 9, st.counter.shape, generator=g, dtype=torch.int32))
        states.append(st)
    with torch.no_grad():
        states[3].amax_history[0, 0] = float("nan")
        states[6].amax_history[-1, 0] = float("inf")
    return states


def test_update_states_equals_each_update():
    """fp8amp.scaling.update_states (what update_scaling runs: one launch per device, format and
    recipe) leaves every buffer as ScalingState.update() of each state in turn would, over steps."""
    from fp8amp.scaling import update_states

    batched, single = _random_states(0), _random_states(0)
    for _ in range(3):
        update_states(batched + [batched[0]])  # a state listed twice is updated once
        for st in single:
            st.update()
        for a, b in zip(batched, single):
            for name in ("amax_history", "scale", "scale_inv", "counter"):
                assert_bits_equal(getattr(a, name), getattr(b, name))


def test_multi_update_delayed_scaling_refuses_overlaps_and_mismatched_lists():
    states = _random_states(1)[::3]  # one tensor each
    h = [s.amax_history for s in states]
    sc = [s.scale for s in states]
    si = [s.scale_inv for s in states]
    c = [s.counter for s in states]
    with pytest.raises(ValueError, match="as many tensors each"):
        fp8amp.ops.multi_update_delayed_scaling(h, sc, si, c[:2], 448.0)
    with pytest.raises(ValueError, match="must not share memory"):
        fp8amp.ops.multi_update_delayed_scaling(h, sc, [si[0], si[1], si[1]], c, 448.0)
    with pytest.raises(TypeError, match="scales"):
        fp8amp.ops.multi_update_delayed_scaling(h, sc[0], si, c, 448.0)
    fp8amp.ops.multi_update_delayed_scaling([], [], [], [], 448.0)  # nothing to do
