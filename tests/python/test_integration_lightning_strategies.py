"""fp8amp's Lightning plugin under Lightning's distributed strategies, 2 CPU processes with gloo
(one ``torch.distributed.run`` of tests/python/lightning_strategies.py for all three: Lightning
takes the processes torchrun made): the Trainer under DDP with fp8amp's FP8 gradient all-reduce as
the comm hook (``Fp8ampPrecision(fp8_allreduce=True)``), the Trainer under FSDP2 through
ModelParallelStrategy, and Fabric under DDP with ``Fp8ampFabricPrecision``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
SCRIPT = Path(__file__).resolve().parent / "lightning_strategies.py"


@pytest.fixture(scope="module")
def results() -> dict:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT)]
    result = subprocess.run(launch, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            _, run, text = line.split(" ", 2)
            found[run] = json.loads(text)
    assert found.keys() == {"ddp", "fsdp", "fabric-ddp"}, result.stdout + result.stderr
    return found


def test_ddp_strategy_with_the_fp8_allreduce_comm_hook(results):
    out = results["ddp"]
    assert out["world"] == 2 and out["comm_hook"] == "fp8_allreduce_hook", out
    assert out["optimizer"] == "AdamW" and out["state_dtypes"] == "O2" and out["fp8_layer"], out
    assert out["ranks_agree"], out  # every rank stepped with the same averaged FP8 gradients
    # Lightning steps with a closure: each of the 8 steps' amaxes is in the history (all were 0
    # before the scaling hooks reduced after the closure)
    assert out["input_amaxes"] == 8, out
    losses = out["losses"]
    assert len(losses) == 8 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_model_parallel_strategy_shards_the_o2_masters(results):
    out = results["fsdp"]
    assert out["world"] == 2 and out["fp8_layer"] and out["optimizer"] == "AdamW", out
    assert out["weight"] == "DTensor" and out["local"] == "MasterWeight" and out["local_rows"] == 32, out
    assert out["state_dtypes"] == "O2" and out["m_dtype"] == "torch.float8_e4m3fn", out
    losses = out["losses"]
    assert len(losses) == 8 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


def test_fabric_ddp_strategy_with_the_fabric_plugin(results):
    out = results["fabric-ddp"]
    assert out["world"] == 2 and out["ddp"] == "DistributedDataParallel" and out["fp8_layer"], out
    assert out["optimizer"] == "AdamW" and out["ranks_agree"], out
    losses = out["losses"]
    assert len(losses) == 8 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
