"""convert(policy=...): "layers" keeps nn.Linear where FP8 is measured slower (docs/benchmarks.md#targets),
"all" converts every Linear FP8 can take ("auto", which first judges the whole step and then runs
"layers", is tests/python/test_step_policy.py's). The decision logic runs on the CPU with made-up timings (an
injected timer); the real CUDA-event timer is exercised on a GPU."""

import logging

import pytest
import torch
from torch import nn

import fp8amp
from fp8amp import convert_policy
from fp8amp.convert import ConversionReport, conversion_report
from fp8amp.convert_policy import clear_timing_cache, decide
from ranks import run_on_ranks


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_timing_cache()
    yield
    clear_timing_cache()


class FakeTimer:
    """Seconds per fwd+bwd from a table {(in, out): (linear_s, fp8_s)}; counts its calls."""

    def __init__(self, table):
        self.table = table
        self.calls = []

    def __call__(self, module, tokens):
        key = (module.in_features, module.out_features)
        fp8 = isinstance(module, fp8amp.Fp8Linear)
        assert type(module) is (fp8amp.Fp8Linear if fp8 else nn.Linear)
        self.calls.append((key, fp8, tokens))
        return self.table[key][1 if fp8 else 0]


def model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256),  # FP8 faster
        nn.ReLU(),
        nn.Linear(256, 64),  # FP8 slower
        nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 32)),  # same shape as [0]; FP8 just too little faster
        nn.Linear(32, 40),  # not a multiple of 16
    )


TABLE = {(64, 256): (2.0e-3, 1.0e-3), (256, 64): (1.0e-3, 1.5e-3), (256, 32): (1.0e-3, 0.97e-3)}


def kinds(m):
    return [type(m[0]), type(m[2]), type(m[3][0]), type(m[3][1]), type(m[4])]


def test_slower_layers_stay_faster_ones_convert():
    timer = FakeTimer(TABLE)
    m = model()
    params = [p for p in m.parameters()]
    out = fp8amp.convert(m, policy="layers", timer=timer, tokens=4096)
    assert out is m
    assert kinds(m) == [fp8amp.Fp8Linear, nn.Linear, fp8amp.Fp8Linear, nn.Linear, nn.Linear]
    assert [p for p in m.parameters()] == params  # converted layers share the parameters
    report = conversion_report(m)
    assert isinstance(report, ConversionReport)
    assert (report.policy, report.tokens, report.min_speedup) == ("layers", 4096, 1.05)
    by_name = {d.name: d for d in report.decisions}
    assert list(by_name) == ["0", "2", "3.0", "3.1", "4"]
    assert [d.name for d in report.converted] == ["0", "3.0"]
    assert [d.name for d in report.skipped] == ["2", "3.1", "4"]
    assert by_name["0"].speedup == pytest.approx(2.0) and by_name["0"].linear_seconds == 2.0e-3
    assert by_name["2"].speedup == pytest.approx(2 / 3) and "kept" in by_name["2"].reason
    assert by_name["3.1"].speedup == pytest.approx(1 / 0.97) and "min_speedup" in by_name["3.1"].reason
    assert "multiples of 16" in by_name["4"].reason and by_name["4"].speedup is None
    assert by_name["0"].dtype == torch.float32 and by_name["0"].device == "cpu" and by_name["0"].bias
    text = str(report)
    assert "2 of 5 Linear layers converted" in text and "3.1" in text and "0.67x" in text
    # each distinct shape timed once, as nn.Linear and as Fp8Linear, at the given token count
    assert sorted(timer.calls) == sorted(
        [(k, fp8, 4096) for k in [(64, 256), (256, 64), (256, 32)] for fp8 in (False, True)])


def test_the_converted_model_trains():
    m = fp8amp.convert(model()[:3], policy="layers", timer=FakeTimer(TABLE))
    x = torch.randn(16, 64, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and m[0].weight.grad is not None and m[2].weight.grad is not None


def test_timings_are_cached_per_process():
    timer = FakeTimer(TABLE)
    fp8amp.convert(model(), policy="layers", timer=timer)
    assert len(timer.calls) == 6
    second = model()
    fp8amp.convert(second, policy="layers", timer=timer)
    assert len(timer.calls) == 6  # nothing timed again
    assert kinds(second) == [fp8amp.Fp8Linear, nn.Linear, fp8amp.Fp8Linear, nn.Linear, nn.Linear]
    assert conversion_report(second).decisions[0].speedup == pytest.approx(2.0)
    fp8amp.convert(model(), policy="layers", timer=timer, tokens=1024)  # another token count is another measurement
    assert len(timer.calls) == 12
    fp8amp.convert(model(), policy="layers", timer=FakeTimer(TABLE))  # another timer too
    fp8amp.convert(model(), policy="layers", timer=timer, min_speedup=1.5)  # the threshold is not part of the key
    assert len(timer.calls) == 12
    clear_timing_cache()
    fp8amp.convert(model(), policy="layers", timer=timer)
    assert len(timer.calls) == 18


def test_min_speedup_moves_the_threshold():
    m = fp8amp.convert(model(), policy="layers", timer=FakeTimer(TABLE), min_speedup=1.0)
    assert kinds(m) == [fp8amp.Fp8Linear, nn.Linear, fp8amp.Fp8Linear, fp8amp.Fp8Linear, nn.Linear]
    m = fp8amp.convert(model(), policy="layers", timer=FakeTimer(TABLE), min_speedup=3.0)
    assert kinds(m)[:4] == [nn.Linear] * 4


def test_cpu_model_converts_every_legal_linear_without_timing(monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a CPU model must not be timed")

    monkeypatch.setattr(convert_policy, "cuda_event_timer", no_timing)
    m = fp8amp.convert(model())  # policy="auto", the default, with the default timer
    assert kinds(m) == [fp8amp.Fp8Linear] * 4 + [nn.Linear]
    report = conversion_report(m)
    assert all("not timed on cpu" in d.reason for d in report.converted)
    assert all(d.speedup is None for d in report.decisions)


def test_policy_all_converts_without_timing():
    timer = FakeTimer(TABLE)
    m = fp8amp.convert(model(), policy="all", timer=timer)
    assert kinds(m) == [fp8amp.Fp8Linear] * 4 + [nn.Linear]
    assert timer.calls == []
    assert conversion_report(m).decisions[0].reason == "policy='all'"


def test_filter_is_applied_before_timing():
    timer = FakeTimer(TABLE)
    m = fp8amp.convert(model(), policy="layers", timer=timer, module_filter_fn=lambda mod, fqn: not fqn.startswith("3"))
    assert kinds(m) == [fp8amp.Fp8Linear, nn.Linear, nn.Linear, nn.Linear, nn.Linear]
    assert {k for k, _, _ in timer.calls} == {(64, 256), (256, 64)}
    assert "module_filter_fn" in {d.name: d for d in conversion_report(m).decisions}["3.0"].reason


def test_a_second_convert_reports_the_layers_an_earlier_one_converted():
    first = fp8amp.convert(model(), policy="all", module_filter_fn=lambda mod, fqn: fqn.startswith("3"))
    assert conversion_report(first).notes == []
    earlier = sum(isinstance(m, fp8amp.Fp8Linear) for m in first.modules())
    report = conversion_report(fp8amp.convert(first, policy="all"))
    assert earlier == 2 and "2 layer(s) already Fp8Linear" in str(report)
    assert len(report.decisions) == len(kinds(model())) - earlier  # this call's Linears only


def test_bare_linear_and_shared_linear():
    slow = fp8amp.convert(nn.Linear(256, 64), policy="layers", timer=FakeTimer(TABLE))
    assert type(slow) is nn.Linear and not conversion_report(slow).converted
    fast = fp8amp.convert(nn.Linear(64, 256), policy="layers", timer=FakeTimer(TABLE))
    assert type(fast) is fp8amp.Fp8Linear and conversion_report(fast).converted[0].name == ""
    shared = nn.Linear(64, 256)
    m = nn.Sequential(shared, nn.ReLU(), nn.Linear(256, 64), shared)
    fp8amp.convert(m, policy="all")
    assert m[0] is m[3] and type(m[0]) is fp8amp.Fp8Linear  # one layer, one scaling state
    assert [d.name for d in conversion_report(m).decisions] == ["0", "2"]


def test_global_rng_is_left_alone():
    m = model()
    torch.manual_seed(123)
    fp8amp.convert(m, policy="layers", timer=FakeTimer(TABLE))  # makes fresh layers to time
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(4))


def test_decisions_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="fp8amp.convert"):
        fp8amp.convert(model(), policy="layers", timer=FakeTimer(TABLE))
    text = caplog.text
    assert "2 of 5 Linear layers converted" in text
    assert "2 (256->64 +bias" in text and "kept" in text and "0.67x" in text


def test_decide_converts_nothing():
    timer = FakeTimer(TABLE)
    layer = nn.Linear(256, 64)
    decision = decide(layer, timer=timer, tokens=512)
    assert not decision.converted and decision.speedup == pytest.approx(2 / 3)
    assert decide(layer, timer=timer, tokens=512) == decision and len(timer.calls) == 2  # cached
    assert decide(nn.Linear(64, 256), timer=timer).converted
    assert not decide(nn.Linear(8, 8), timer=timer).converted
    assert decide(nn.Linear(64, 256)).reason.startswith("not timed on cpu")
    with pytest.raises(TypeError, match="linear"):
        decide(fp8amp.Fp8Linear(16, 16))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(policy="fast"), ValueError, ["policy", "'auto'", "'all'", "'fast'"]),
        (dict(policy=None), ValueError, ["policy", "'auto'", "'all'"]),
        (dict(policy="ALL"), ValueError, ["policy"]),
        (dict(tokens=0), ValueError, ["tokens"]),
        (dict(tokens=8192.0), TypeError, ["tokens"]),
        (dict(tokens=True), TypeError, ["tokens"]),
        (dict(min_speedup=0), ValueError, ["min_speedup"]),
        (dict(min_speedup=float("nan")), ValueError, ["min_speedup"]),
        (dict(min_speedup="1.1"), TypeError, ["min_speedup"]),
        (dict(timer="cuda"), TypeError, ["timer"]),
    ],
)
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        fp8amp.convert(model(), **kwargs)
    for word in words:
        assert word in str(info.value)


def _rank_decisions(rank: int) -> list:
    # Rank 1 measures FP8 as slower, rank 0 as faster: both follow rank 0.
    table = {(64, 256): (1.0, 0.5 if rank == 0 else 2.0), (256, 64): (1.0, 2.0 if rank == 0 else 0.5)}
    m = fp8amp.convert(nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)), policy="layers", timer=FakeTimer(table))
    return [type(layer).__name__ for layer in m]


def test_ranks_follow_rank_0_measurements():
    results = run_on_ranks(_rank_decisions, 2)
    assert results[0] == results[1] == ["Fp8Linear", "Linear"]


@pytest.mark.gpu
def test_cuda_event_timer_decides_on_the_gpu():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4096, 4096, device="cuda"), nn.Linear(16, 16, device="cuda")).cuda()
    state = torch.cuda.get_rng_state()
    fp8amp.convert(m, policy="layers", tokens=4096)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    report = conversion_report(m)
    if torch.cuda.get_device_capability() < (8, 9):  # no FP8 tensor cores: nothing converted
        assert not report.converted and all("compute capability" in d.reason for d in report.decisions)
        return
    for d in report.decisions:
        assert d.linear_seconds > 0 and d.fp8_seconds > 0, d
        assert d.converted == (d.speedup >= report.min_speedup), d
        assert isinstance(m[int(d.name)], fp8amp.Fp8Linear) == d.converted
    assert not report.decisions[1].converted, report  # 16 x 16: FP8 cannot win
    assert report.decisions[0].converted, report  # 4096^2 x 4096 tokens: ~1.7x less GPU time in FP8
