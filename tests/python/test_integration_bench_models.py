"""benchmarks/bench_models.py --tiny: the HF Llama and timm ViT benchmark's whole path (build from a
config, AMP, fp8amp O1/O2, FP8 saved activations, the tables in $OUT/bench_models.md) on tiny
models on the CPU, so that a change that breaks the H200 run shows here first."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_models.py"


def test_bench_models_tiny_writes_both_tables(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    env = dict(os.environ, OUT=str(tmp_path))
    result = subprocess.run([sys.executable, str(BENCH), "--tiny", "--modes", "amp,o2,o2-fp8act,torchao"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "bench_models.md").read_text()
    assert text.strip() in result.stdout, result.stdout
    assert "HF LlamaForCausalLM" in text and "timm VisionTransformer" in text, text
    for amp, unit in (("BF16 autocast", "tokens"), ("FP16 AMP", "images")):
        for label in (amp, "fp8amp O2", "fp8amp O2 + FP8 activations"):
            row = re.search(rf"^\| {re.escape(label)} \| ([\d.]+) \| ([\d,]+) \|.*\| ([\d.]+) \| \d+ \|", text, re.M)
            assert row and float(row[1]) > 0 and float(row[3]) > 0, (label, text)
        assert f"{unit}/s" in text
    assert re.search(r"fp8amp O2 \|.*\| 15 of 15 Linears in FP8", text), text  # Llama: every Linear
    assert "| torchao float8 |" in text  # a row, measured or saying why not


def test_bad_arguments_are_refused():
    result = subprocess.run([sys.executable, str(BENCH), "--tiny", "--modes", "o3"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "takes a comma-separated subset of amp, amp-compile" in result.stderr
