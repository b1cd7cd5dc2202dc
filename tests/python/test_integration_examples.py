"""The integration examples run as their docstrings say, briefly, on CPU processes (FP8
emulation): examples/hf_llama.py (Accelerate with 2 gloo processes, then save_pretrained),
examples/timm_vit.py, examples/lightning_gpt.py (with a checkpoint). Each is one subprocess
start (the imports of transformers and lightning take seconds): the in-process tests
(test_integration_*.py) cover the rest, resume included."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(example: str, *args: str, processes: int = 1) -> str:
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    result = subprocess.run(launch + [str(EXAMPLES / example), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def losses(out: str) -> list[float]:
    found = [float(x) for x in re.findall(r"^step +\d+  loss (\S+)", out, re.M)]
    assert found and all(math.isfinite(x) for x in found), out
    return found


def test_hf_llama_with_accelerate_on_two_processes(tmp_path):
    processes = 2
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    out = run("hf_llama.py", "--cpu", "--steps", "4", "--log-every", "1", "--save", str(tmp_path), processes=processes)
    assert "O2 on cpu" in out and f"({processes} process(es))" in out, out
    found = losses(out)
    assert len(found) == 4 and found[-1] < found[0] < math.log(256) + 0.5, out
    _, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_timm_vit_fp16_gradscaler():
    pytest.importorskip("timm")
    out = run("timm_vit.py", "--device", "cpu", "--steps", "6", "--log-every", "1")
    assert "O2 + FP16 autocast + GradScaler on cpu, batch 13" in out, out
    found = losses(out)
    assert len(found) == 6 and found[-1] < found[0], out


def test_lightning_gpt_trains_and_saves(tmp_path):
    pytest.importorskip("lightning")
    ckpt = tmp_path / "run.ckpt"
    out = run("lightning_gpt.py", "--cpu", "--steps", "3", "--log-every", "1", "--ckpt", str(ckpt))
    assert "after 3 steps" in out and ckpt.exists(), out
    assert len(losses(out)) == 3, out
