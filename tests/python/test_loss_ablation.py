"""benchmarks/loss_ablation.py's CPU smoke run (FP8 emulated: it checks that every variant trains
and fills the table, not what the losses say), so that a change that breaks the H200 run fails here first."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "loss_ablation.py")
sys.path.insert(0, os.path.dirname(BENCH))
import loss_ablation  # noqa: E402  (the refusals run in this process: no interpreter start each)


def test_loss_ablation_smoke_run_fills_its_table(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    run = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--steps", "3", "--window", "1:2"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (tmp_path / "bench_loss_ablation.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[0].strip("| ") for r in rows] == ["bf16", "fp8", "fp8-adam", "O1-fp32grad", "O1", "O2"]
    for row in rows:
        losses = [float(x) for x in row[1:-2]]
        assert all(0 < loss < 10 for loss in losses), row
    assert rows[0][-2:] == ["+0.000", "+0.000 |"]  # bf16 against itself


def refusal(argv, capsys) -> str:
    """loss_ablation's argument check, in this process: exit status 2 and what it printed."""
    with pytest.raises(SystemExit) as exit_info:
        loss_ablation.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_loss_ablation_refuses_a_window_past_the_steps(capsys):
    assert "--window" in refusal(["--device", "cpu", "--steps", "3", "--window", "1:5"], capsys)
    assert "--schedule-steps" in refusal(["--device", "cpu", "--steps", "3", "--window", "1:2", "--schedule-steps", "2"],
                                         capsys)


def test_loss_ablation_takes_a_history_len_and_the_steps_to_show(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    run = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--steps", "3", "--window", "1:2",
                          "--variants", "bf16,O2", "--history-len", "2", "--show", "2,3", "--schedule-steps", "400"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (tmp_path / "bench_loss_ablation.md").read_text()
    assert "history_len 2" in text and "cosine over 400" in text and "| variant | loss @2 | loss @3 |" in text



def test_loss_ablation_refuses_steps_to_show_past_the_run(capsys):
    assert "--show" in refusal(["--device", "cpu", "--steps", "3", "--show", "4", "--window", "1:2"], capsys)
