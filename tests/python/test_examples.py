"""examples/train_gpt.py runs as the README says: one process, and under torchrun with DDP (O2, FP8
gradient all-reduce) and FSDP2 (FP8 compute with the E4M3 all-gather; O2 with sharded masters),
here on CPU processes (gloo, FP8 emulation) for a few steps each."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def run(*args: str, processes: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    return subprocess.run(launch + [str(EXAMPLE), "--device", "cpu", "--steps", "3", "--log-every", "1", *args],
                          capture_output=True, text=True, timeout=600)


def final_losses(out: str) -> tuple[float, float]:
    match = re.search(r"final: train loss (\S+), val loss (\S+),", out)
    assert match, out
    return float(match[1]), float(match[2])


@pytest.mark.parametrize("args, processes, banner", [
    ((), 1, "O2 on cpu (CPU emulation): "),
    (("--fp8-allreduce",), 2, "O2 on cpu (CPU emulation, 2 processes (DDP)): "),
    (("--parallel", "fsdp", "--precision", "fp8"), 2, "fp8 on cpu (CPU emulation, 2 processes (FSDP2)): "),
    (("--parallel", "fsdp"), 2, "O2 on cpu (CPU emulation, 2 processes (FSDP2)): "),
])
def test_train_gpt_runs(args, processes, banner):
    result = run(*args, processes=processes)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert banner in out, out
    assert out.count("final:") == 1, out  # printed by rank 0 only
    assert len(re.findall(r"^step +\d+  loss", out, re.M)) == 3, out
    train, val = final_losses(out)
    assert math.isfinite(train) and math.isfinite(val) and val < math.log(256)  # below chance after 3 steps


def test_train_gpt_refuses_an_fp8_allreduce_without_ddp():
    result = run("--fp8-allreduce")
    assert result.returncode != 0
    assert "--fp8-allreduce is for DDP: launch with torchrun --nproc-per-node=N (N > 1)" in result.stderr
