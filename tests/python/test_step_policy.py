"""policy="auto"'s whole-step stage (fp8amp.convert_policy.decide_step): below the FP8 crossover
measured on whole GPT steps the model stays in BF16 compute, and conversion_report says so. Runs
on the CPU: an injected timer stands for a GPU (the stage then judges as on one), or the stage is
switched on for a CPU model where initialize takes no timer."""

import importlib
import math

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import convert_policy
from fp8amp.convert import conversion_report
from fp8amp.convert_policy import STEP_CROSSOVER, STEP_MIN_SPEEDUP, _gpt_shapes, decide_step

TABLE = ((768, 16384, None, 0.75), (2048, 16384, 1.40, 1.38))


class CountingTimer:
    """FP8 twice as fast for every shape; counts the layers it timed."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module, tokens):
        self.calls += 1
        return 1e-3 if isinstance(module, fp8amp.Fp8Linear) else 2e-3


@pytest.fixture(autouse=True)
def fresh_cache():
    convert_policy.clear_timing_cache()
    yield
    convert_policy.clear_timing_cache()


def gpt_blocks(d: int, n: int = 2, device="meta") -> nn.Module:
    """n blocks of fp8amp.testing.GPT's Linears (meta: big widths cost no memory)."""
    return nn.Sequential(*(nn.Sequential(*(nn.Linear(i, o, device=device) for i, o in _gpt_shapes(d)))
                           for _ in range(n)))


def test_the_measured_points_are_reproduced():
    small = decide_step(_gpt_shapes(768) * 12, 16384, table=TABLE)
    assert small.speedup == pytest.approx(0.75) and not small.fp8
    assert small.gpt_width == pytest.approx(768)
    large = decide_step(_gpt_shapes(2048) * 20, 16384, table=TABLE)
    assert large.speedup == pytest.approx(1.38) and large.fp8  # the lower of eager 1.40 and compiled 1.38


def test_the_default_table_reproduces_every_measured_step():
    # The one axis (the step's GEMM size) must not fold two rows onto one point, or a measured
    # width would get another's speed.
    for d, tokens, eager, compiled in STEP_CROSSOVER:
        for how, measured in ((False, eager), (True, compiled), (None, min(eager, compiled))):
            step = decide_step(_gpt_shapes(d), tokens, compiled=how)
            assert step.speedup == pytest.approx(measured), (d, tokens, how)
            assert step.fp8 == (measured >= STEP_MIN_SPEEDUP)


def test_the_depth_does_not_matter_the_gemm_sizes_do():
    assert decide_step(_gpt_shapes(1024) * 2, 16384) == decide_step(_gpt_shapes(1024) * 24, 16384)
    # 4x the tokens at half the width: the same GEMM size, the same estimate
    assert decide_step(_gpt_shapes(1024), 4096).speedup == pytest.approx(decide_step(_gpt_shapes(512), 16384).speedup)


def test_interpolation_in_log_gemm_size_and_flat_beyond_the_ends():
    # halfway between the points in log(tokens x d^2): d = sqrt(768 * 2048) at 16384 tokens
    middle = decide_step(_gpt_shapes(round(math.sqrt(768 * 2048))), 16384, table=TABLE)
    assert middle.speedup == pytest.approx((0.75 + 1.38) / 2, abs=2e-3)
    assert decide_step(_gpt_shapes(64), 256, table=TABLE).speedup == pytest.approx(0.75)
    # the eager column has one point: flat everywhere, so the compiled column decides at both ends
    assert decide_step(_gpt_shapes(8192), 65536, table=TABLE).speedup == pytest.approx(1.38)
    assert decide_step(_gpt_shapes(8192), 65536, table=((768, 16384, 1.2, None),)).speedup == pytest.approx(1.2)


def test_the_crossover_threshold():
    at_one = ((512, 8192, None, 0.5), (4096, 8192, None, 1.5))
    below = decide_step(_gpt_shapes(1024), 8192, table=at_one)
    above = decide_step(_gpt_shapes(2048), 8192, table=at_one)
    assert below.speedup < STEP_MIN_SPEEDUP <= above.speedup and not below.fp8 and above.fp8


def test_the_default_table_is_well_formed():
    assert STEP_CROSSOVER and all(len(row) == 4 and row[0] > 0 and row[1] > 0 for row in STEP_CROSSOVER)
    assert all(v is None or v > 0 for row in STEP_CROSSOVER for v in row[2:])


def test_decide_step_bad_arguments():
    with pytest.raises(ValueError, match="shapes"):
        decide_step([], 8192)
    with pytest.raises(ValueError, match="decide_step: tokens"):
        decide_step(_gpt_shapes(512), 0)
    with pytest.raises(TypeError, match="decide_step: tokens"):
        decide_step(_gpt_shapes(512), 8192.0)
    with pytest.raises(ValueError, match="no measured speed"):
        decide_step(_gpt_shapes(512), 8192, table=((768, 16384, None, None),))


def test_compiled_says_which_column_decides():
    split = ((1024, 16384, 1.16, 0.74),)  # the H200's width 1024: faster eager, slower compiled
    eager = decide_step(_gpt_shapes(1024), 16384, compiled=False, table=split)
    compiled = decide_step(_gpt_shapes(1024), 16384, compiled=True, table=split)
    unknown = decide_step(_gpt_shapes(1024), 16384, table=split)
    assert (eager.speedup, eager.fp8) == (pytest.approx(1.16), True)
    assert (compiled.speedup, compiled.fp8) == (pytest.approx(0.74), False)
    assert unknown == decide_step(_gpt_shapes(1024), 16384, compiled=None, table=split)
    assert (unknown.speedup, unknown.fp8) == (pytest.approx(0.74), False)  # the lower: neither way slower
    assert "(eager)" in str(eager) and "(compiled)" in str(compiled) and "(eager or compiled)" in str(unknown)
    with pytest.raises(ValueError, match="every compiled entry is None"):
        decide_step(_gpt_shapes(1024), 16384, compiled=True, table=((1024, 16384, 1.16, None),))
    for bad in ("yes", 1, 0.0):
        with pytest.raises(TypeError, match=r"decide_step: compiled must be True \(torch.compile\), False"):
            decide_step(_gpt_shapes(1024), 16384, compiled=bad)


def test_convert_and_initialize_pass_compiled_to_the_step(monkeypatch):
    monkeypatch.setattr(convert_policy, "STEP_CROSSOVER", ((1024, 16384, 1.16, 0.74),))
    eager = fp8amp.convert(gpt_blocks(1024), timer=CountingTimer(), tokens=16384, compiled=False)
    compiled = fp8amp.convert(gpt_blocks(1024), timer=CountingTimer(), tokens=16384, compiled=True)
    assert conversion_report(eager).step.fp8 and not conversion_report(compiled).step.fp8
    assert "compiled=True" in str(conversion_report(compiled))
    assert "compiled=" not in str(conversion_report(fp8amp.convert(gpt_blocks(1024), timer=CountingTimer())))
    with pytest.raises(TypeError, match="convert: compiled must be"):
        fp8amp.convert(gpt_blocks(64), compiled="eager")
    monkeypatch.setattr(importlib.import_module("fp8amp.convert"), "step_rule_applies", lambda linears, timer: True)
    model, _ = fp8amp.initialize(gpt_blocks(1024, n=1, device="cpu"), None, "O2", tokens=16384, compiled=False,
                                 policy="auto")
    assert conversion_report(model).step.fp8 and conversion_report(model).compiled is False


def test_a_small_model_stays_in_bf16_and_the_report_says_why():
    timer = CountingTimer()
    m = fp8amp.convert(gpt_blocks(256, device="cpu"), timer=timer, tokens=8192)
    assert not any(isinstance(x, fp8amp.Fp8Linear) for x in m.modules())
    assert timer.calls == 0  # no layer timed: the step decided
    report = conversion_report(m)
    assert report.step is not None and not report.step.fp8 and report.step.tokens == 8192
    text = str(report)
    assert "0 of 8 Linear layers converted" in text
    assert "whole step: kept in BF16 compute: the step is below the measured FP8 crossover" in text
    assert "8,192 tokens a step" in text and "policy='all' converts anyway" in text
    assert all(d.reason.startswith("kept in BF16 compute") for d in report.decisions)


def test_a_large_model_goes_on_to_the_per_layer_timing():
    timer = CountingTimer()
    m = fp8amp.convert(gpt_blocks(4096), timer=timer, tokens=16384)
    report = conversion_report(m)
    assert report.step.fp8 and "FP8: the step is above the measured FP8 crossover" in str(report)
    assert timer.calls == 2 * 4  # each of the 4 distinct shapes as nn.Linear and as Fp8Linear
    assert len(report.converted) == 8


def test_the_token_count_moves_the_decision():
    assert conversion_report(fp8amp.convert(gpt_blocks(2048), timer=CountingTimer(), tokens=16384)).step.fp8
    assert not conversion_report(fp8amp.convert(gpt_blocks(2048), timer=CountingTimer(), tokens=1024)).step.fp8


def test_explicit_policies_override_the_step():
    m = fp8amp.convert(gpt_blocks(256, device="cpu"), policy="all", timer=CountingTimer())
    assert conversion_report(m).step is None and len(conversion_report(m).converted) == 8
    timer = CountingTimer()
    m = fp8amp.convert(gpt_blocks(256, device="cpu"), policy="layers", timer=timer)
    assert conversion_report(m).step is None and len(conversion_report(m).converted) == 8 and timer.calls == 8


def test_a_cpu_model_without_a_timer_is_not_judged():
    m = fp8amp.convert(gpt_blocks(256, device="cpu"))
    report = conversion_report(m)
    assert report.step is None and len(report.converted) == 8


def test_initialize_below_the_crossover_keeps_bf16_compute_and_the_o2_states(monkeypatch):
    # initialize takes no timer: the stage is switched on as on a GPU
    monkeypatch.setattr(importlib.import_module("fp8amp.convert"), "step_rule_applies", lambda linears, timer: True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fp8amp.initialize(model, optimizer, "O2")
    assert [type(layer) for layer in model] == [nn.Linear, nn.GELU, nn.Linear]
    assert model[0].weight.dtype == torch.float32 and not isinstance(model[0].weight, fp8amp.ScaledTensor)
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    state = optimizer.state[model[0].weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_sq"].dtype == torch.float16
    text = str(conversion_report(model))
    assert "kept in BF16 compute: the step is below the measured FP8 crossover" in text
    assert "O2: the optimizer states of every parameter still take the level's formats (exp_avg float8_e4m3fn, " \
           "exp_avg_sq float16)" in text


def test_initialize_above_the_crossover_adds_no_note(monkeypatch):
    monkeypatch.setattr(importlib.import_module("fp8amp.convert"), "step_rule_applies", lambda linears, timer: True)
    with torch.device("meta"):
        model = gpt_blocks(4096, n=1, device="meta")
    model, _ = fp8amp.initialize(model, None, "O2", tokens=16384)
    report = conversion_report(model)
    assert report.step.fp8 and report.notes == [] and len(report.converted) == 4
    assert all(isinstance(layer.weight, fp8amp.MasterWeight) for layer in model[0])


@pytest.mark.gpu
def test_on_the_gpu_a_small_gpt_stays_in_bf16_and_a_wide_one_is_judged_per_layer():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or newer")
    from fp8amp.testing import GPT, GPTConfig

    torch.manual_seed(0)
    small = GPT(GPTConfig(seq_len=256, n_layer=2, n_head=4, d_model=256)).cuda()
    small, optimizer = fp8amp.initialize(small, torch.optim.AdamW(small.parameters()), "O2", tokens=8192)
    report = conversion_report(small)
    assert report.step is not None and not report.step.fp8 and not report.converted, report
    assert "O2: the optimizer states of every parameter still take the level's formats" in str(report)
    wide = fp8amp.convert(gpt_blocks(4096, n=1, device="cuda"), tokens=16384)
    report = conversion_report(wide)
    assert report.step.fp8, report
    assert all(d.linear_seconds is not None for d in report.decisions), report  # the per-layer stage timed them
