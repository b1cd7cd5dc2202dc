"""examples/train_gpt.py runs as the README says: one process, and under torchrun with DDP (O2, FP8
gradient all-reduce) and FSDP2 (FP8 compute with the E4M3 all-gather; O2 with sharded masters, on
two processes and on one), here on CPU processes (gloo, FP8 emulation) for a few steps each; a
comparison of precisions leaves its CSV, picture and summary; --compile trains; every bad argument
is one line and exit code 2."""

import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*args: str, processes: int = 1, torchrun: bool = False, timeout: int = 600) -> subprocess.CompletedProcess:
    """The example in one process, or under torchrun (always with more than one process)."""
    launch = [sys.executable]
    if processes > 1 or torchrun:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    # One thread a process: CI's two cores are shared, and torch's threads would only contend.
    return subprocess.run(launch + [str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def final_losses(out: str, label: str) -> tuple[float, float]:
    match = re.search(rf"final {label}: train loss (\S+), val loss (\S+),", out)
    assert match, out
    return float(match[1]), float(match[2])


@pytest.mark.parametrize("args, processes, banner", [
    (("--precision", "O2"), 1, "O2 on cpu (CPU emulation): "),
    (("--precision", "O2", "--fp8-allreduce"), 2, "O2 on cpu (CPU emulation, 2 processes (DDP)): "),
    (("--parallel", "fsdp", "--precision", "fp8"), 2, "fp8 on cpu (CPU emulation, 2 processes (FSDP2)): "),
    (("--parallel", "fsdp", "--precision", "O2"), 2, "O2 on cpu (CPU emulation, 2 processes (FSDP2)): "),
    (("--parallel", "fsdp", "--precision", "O2"), 1, "O2 on cpu (CPU emulation, 1 process (FSDP2)): "),
])
def test_train_gpt_runs(args, processes, banner, tmp_path):
    result = run("--device", "cpu", "--steps", "3", "--log-every", "1", "--out", str(tmp_path), *args,
                 processes=processes, torchrun="fsdp" in args)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert banner in out, out
    label = banner.split()[0]
    assert out.count("final ") == 1, out  # printed by rank 0 only
    assert len(re.findall(rf"^ *{label} step +\d+/3  loss", out, re.M)) == 3, out
    train, val = final_losses(out, label)
    assert math.isfinite(train) and math.isfinite(val) and val < math.log(256)  # below chance after 3 steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "summary.md", "train.png"]


def test_compare_precisions_leaves_csv_picture_and_summary(tmp_path):
    """bf16 (fp32 on a CPU), O1 and O2 from the same weights on the same batches: all three in the
    CSV with falling losses, a real PNG, and the ratios to the baseline in summary.md."""
    result = run("--precision", "bf16,O1,O2", "--device", "cpu", "--steps", "40", "--batch", "1",
                 "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fp32 on cpu (CPU, float32) (bf16 requested" in result.stdout, result.stdout  # the label says what runs
    assert str(tmp_path / "train.png") in result.stdout  # the run says where its outputs are

    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = {}
    for row in rows:
        losses.setdefault(row["precision"], []).append(float(row["loss"]))
    assert list(losses) == ["fp32", "O1", "O2"]
    for precision, curve in losses.items():
        assert len(curve) == 40, precision
        assert sum(curve[-5:]) / 5 < curve[0] - 1.0, (precision, curve)  # learnt more than a nat a byte
    # The same weights and first batch: O1 and O2 share the FP8 forward, fp32's differs by FP8 rounding.
    assert losses["O1"][0] == losses["O2"][0] and abs(losses["fp32"][0] - losses["O1"][0]) < 0.01, losses
    assert all(row["val_loss"] for row in rows if row["step"] == "40")
    assert all(float(row["tokens_per_s"]) > 0 for row in rows if row["step"] in ("20", "40"))

    png = (tmp_path / "train.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(tmp_path / "train.png") as image:
        image.verify()
        assert image.size[0] > 800 and image.size[1] > 250

    summary = (tmp_path / "summary.md").read_text()
    for precision in ("fp32", "O1", "O2"):
        assert re.search(rf"^\| {precision} \| [\d.]+ \| [\d.]+ \| [\d,]+ \| [\d.]+× \|", summary, re.M), summary
    assert re.search(r"^\| fp32 \| .* \| 1\.00× \|", summary, re.M), summary
    assert "Ratios are to fp32" in summary


def test_each_recipe_trains_under_its_own_label(tmp_path):
    """--recipe: every FP8 precision trains once a recipe, from the same weights on the same
    batches: the blockwise curve is its own, within FP8 rounding of tensorwise's at the start."""
    result = run("--precision", "bf16,O2", "--recipe", "tensorwise,blockwise", "--device", "cpu", "--steps", "3",
                 "--log-every", "1", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = {}
    for row in rows:
        losses.setdefault(row["precision"], []).append(float(row["loss"]))
    assert list(losses) == ["fp32", "O2", "O2-blockwise"], losses
    assert all(len(curve) == 3 and all(map(math.isfinite, curve)) for curve in losses.values()), losses
    assert losses["O2"] != losses["O2-blockwise"], losses  # a different recipe ran
    assert abs(losses["O2"][0] - losses["O2-blockwise"][0]) < 0.01, losses
    assert "O2-blockwise on cpu (CPU emulation): " in result.stdout, result.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert re.search(r"^\| O2-blockwise \| [\d.]+ \| [\d.]+ \|", summary, re.M), summary


def test_compile_trains(tmp_path):
    result = run("--precision", "O2", "--device", "cpu", "--steps", "2", "--batch", "2", "--compile",
                 "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    train, _ = final_losses(result.stdout, "O2")
    assert math.isfinite(train)


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def bad_argument_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    text = tmp_path / "text.txt"
    text.write_text("a text long enough for training and validation windows of the tiny preset\n" * 20)
    short = tmp_path / "short.txt"
    short.write_text("too short to hold one sequence of 128 bytes\n" * 3)
    out = ["--out", str(tmp_path / "out")]
    cases = [
        (["--steps", "-5"], "argument --steps: must be a positive integer, got -5"),
        (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
        (["--eval-every", "0"], "argument --eval-every: must be a positive integer, got 0"),
        (["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
        (["--lr", "0"], "argument --lr: must be a positive finite number, got 0"),
        (["--lr", "fast"], "argument --lr: must be a positive number, got 'fast'"),
        (["--precision", "bf16,fp4"], "argument --precision: accepted: one or more of bf16, fp8, O1, O2"),
        (["--precision", "O2,O2"], "argument --precision: names a precision twice"),
        (["--recipe", "tilewise"], "argument --recipe: accepted: one or more of tensorwise, rowwise, blockwise, mxfp8"),
        (["--recipe", "rowwise,rowwise"], "argument --recipe: names a recipe twice"),
        (["--precision", "bf16", "--recipe", "blockwise", *out],
         "argument --recipe: it applies to the FP8 precisions (fp8, O1, O2), and --precision names only bf16"),
        (["--fp8-allreduce", *out], "argument --fp8-allreduce: it is for DDP: launch with torchrun"),
        (["--parallel", "fsdp", *out], "argument --parallel: fsdp runs under torchrun: launch with torchrun"),
        (["--data", str(tmp_path / "missing.txt"), *out], "argument --data: no such file or directory"),
        (["--data", str(short), *out], f"argument --data: '{short}' holds 132 bytes of text, fewer than the 260 "
                                       "that the tiny preset (seq_len 128) needs"),
        (["--device", "tpu", *out], "argument --device: accepted: cpu, cuda or cuda:N; got 'tpu'"),
        (["--data", str(text), "--out", str(a_file)], "argument --out: cannot write into"),
        (["--data", str(text), "--out", str(a_file / "sub")], "argument --out: cannot write into"),
    ]
    if not __import__("torch").cuda.is_available():
        cases.append((["--device", "cuda", *out], "argument --device: 'cuda' needs a CUDA GPU"))
    return [(args if "--device" in args else [*args, "--device", "cpu"], message) for args, message in cases]


def test_bad_arguments_are_one_line_and_exit_code_2(tmp_path, capsys):
    example = load_example()
    for args, message in bad_argument_cases(tmp_path):
        parser = example.build_parser()
        with pytest.raises(SystemExit) as exit_:
            example.resolve(parser, parser.parse_args(args))
        assert exit_.value.code == 2, args
        err = capsys.readouterr().err
        assert err.startswith("usage: ") and message in err.splitlines()[-1], (args, err)
    assert not (tmp_path / "out").exists()  # nothing was created for a run that cannot start


def test_a_bad_argument_ends_the_program_without_a_traceback():
    result = run("--steps", "-5", timeout=120)
    assert result.returncode == 2
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith("argument --steps: must be a positive integer, got -5")


def test_every_option_has_help_with_its_default():
    parser = load_example().build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 18
    missing = [a.option_strings[0] for a in options if not a.help or "(default: " not in a.help]
    assert not missing, missing
