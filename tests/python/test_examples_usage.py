"""examples/train_gpt.py as users run it, with odd arguments: each ends in one argparse error line
naming the argument and what it accepts, or in a run whose outputs agree with each other (CPU,
FP8 emulation, a few steps). test_examples.py covers the documented runs and the first bad
arguments."""

import importlib.util
import sys

import pytest

from test_examples import EXAMPLE, load_example


@pytest.fixture(scope="module")
def example():
    return load_example()


def parse_error(example, args: list[str], capsys) -> str:
    """The last line of the usage error that parse_args and resolve give for args."""
    parser = example.build_parser()
    with pytest.raises(SystemExit) as exit_:
        example.resolve(parser, parser.parse_args(args))
    assert exit_.value.code == 2, args
    err = capsys.readouterr().err
    assert err.startswith("usage: "), err
    return err.splitlines()[-1]


@pytest.mark.parametrize("seed", [str(2**63), str(-2**63 - 1), str(10**20)])
def test_a_seed_torch_cannot_take_is_an_argument_error(example, seed, capsys):
    # torch.manual_seed raised "Overflow when unpacking long long" with a traceback, after the checks
    line = parse_error(example, ["--seed", seed, "--device", "cpu"], capsys)
    assert line.endswith(f"argument --seed: must be an integer from -2**63 to 2**63 - 1, got {seed}"), line


@pytest.mark.parametrize("seed", ["-1", "0", str(2**63 - 1)])
def test_seeds_in_range_are_taken(example, seed):
    assert example.build_parser().parse_args(["--seed", seed]).seed == int(seed)


def test_an_interrupted_run_writes_the_precisions_that_finished(example, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second precision: the first one's metrics, picture and summary are
    written and the run exits with 130 (it ended in a KeyboardInterrupt traceback, writing nothing)."""
    finished = [example.RunRow("fp32", step, 5.0 - step, val_loss=4.0 if step == 2 else None, tokens_per_s=1e3)
                for step in (1, 2)]
    calls = []

    def train_one(precision, *args):
        calls.append(precision)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return finished

    text = tmp_path / "text.txt"
    text.write_text("a text long enough for training and validation windows of the tiny preset\n" * 20)
    out = tmp_path / "out"
    monkeypatch.setattr(example, "train_one", train_one)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--device", "cpu", "--precision", "bf16,O2", "--steps", "2",
                                      "--data", str(text), "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 130 and calls == ["bf16", "O2"]
    assert "interrupted: 1 of 2 precisions finished" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv", "summary.md", "train.png"]
    assert (out / "metrics.csv").read_text().splitlines()[1:] == ["fp32,1,4,,1000,", "fp32,2,3,4,1000,"]
    assert "| fp32 | 3.5000 | 4.0000 | 1,000 | 1.00× |" in (out / "summary.md").read_text()


def test_an_interrupted_run_with_nothing_finished_writes_nothing(example, tmp_path, monkeypatch, capsys):
    def train_one(*args):
        raise KeyboardInterrupt

    text = tmp_path / "text.txt"
    text.write_text("a text long enough for training and validation windows of the tiny preset\n" * 20)
    monkeypatch.setattr(example, "train_one", train_one)
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--device", "cpu", "--data", str(text),
                                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 130
    assert "interrupted: 0 of 2 precisions finished; nothing written" in capsys.readouterr().out
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("given, passed", [
    (["--out", "runs/a"], ["--out", "{caller}/runs/a"]),
    (["--ou", "runs/a"], ["--ou", "{caller}/runs/a"]),
    (["--o=runs/a"], ["--o={caller}/runs/a"]),
    (["--dat", "t.txt", "--data=u.txt", "--da=/abs/v.txt"],
     ["--dat", "{caller}/t.txt", "--data={caller}/u.txt", "--da=/abs/v.txt"]),
    (["--steps", "3", "--device", "cpu"], ["--steps", "3", "--device", "cpu"]),
])
def test_train_sh_takes_out_and_data_from_where_it_runs(given, passed, tmp_path):
    """scripts/train.sh makes --out and --data absolute before setup.sh moves to the repository's
    root; argparse also takes their unambiguous prefixes (--ou, --dat), which stayed relative, so
    the run wrote into (or read from) the repository instead. Run with a setup.sh that echoes."""
    import subprocess

    scripts = tmp_path / "repo" / "scripts"
    scripts.mkdir(parents=True)
    (scripts / "train.sh").write_text((EXAMPLE.parents[1] / "scripts" / "train.sh").read_text())
    (scripts / "setup.sh").write_text('cd "$(dirname "${BASH_SOURCE[0]}")/.."\nPY=echo\n')
    caller = tmp_path / "caller"
    caller.mkdir()
    result = subprocess.run(["bash", str(scripts / "train.sh"), *given], cwd=caller, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["examples/train_gpt.py", *(a.format(caller=caller) for a in passed)]


def test_an_empty_out_is_an_argument_error(example, tmp_path, capsys, monkeypatch):
    # --out "$DIR" with DIR unset: the run went into a new folder under runs/ instead, saying so only at the end
    monkeypatch.chdir(tmp_path)
    line = parse_error(example, ["--out", "", "--device", "cpu"], capsys)
    assert line.endswith("argument --out: empty; accepted: a directory that exists or can be created, and is "
                         "writable (leave --out out for a new folder under runs/)"), line


@pytest.mark.parametrize("example_name, module, args, message", [
    # --steps 0 ran the preset's step count (0 is falsy), a negative one crashed after the loop, and
    # --log-every 0 divided by zero at the first step; --device cuda without a GPU failed in torch
    ("timm_vit.py", "timm", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("timm_vit.py", "timm", ["--steps", "-1"], "argument --steps: must be a positive integer, got -1"),
    ("timm_vit.py", "timm", ["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    ("timm_vit.py", "timm", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    ("timm_vit.py", "timm", ["--device", "tpu"], "argument --device: accepted: cpu, cuda or cuda:N; got 'tpu'"),
    ("hf_llama.py", "transformers", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("hf_llama.py", "transformers", ["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    # a missing --data raised load_text_bytes' ValueError with a traceback, after the model was built
    ("hf_llama.py", "transformers", ["--data", "missing.txt"], "argument --data: no such file or directory: 'missing.txt'"),
    ("lightning_gpt.py", "lightning", ["--steps", "-3"], "argument --steps: must be a positive integer, got -3"),
    ("lightning_gpt.py", "lightning", ["--devices", "0"], "argument --devices: must be a positive integer, got 0"),
    # a directory was taken for a checkpoint to resume from: IsADirectoryError from torch.load
    ("lightning_gpt.py", "lightning", ["--ckpt", "."], "argument --ckpt: '.' is a directory; accepted: a checkpoint "
                                                       "file's path (resumed from if it exists, written at the end)"),
] + ([] if __import__("torch").cuda.is_available() else [
    ("timm_vit.py", "timm", ["--device", "cuda"], "argument --device: 'cuda' needs a CUDA GPU, and torch sees none "
                                                  "here; use --device cpu (FP8 emulation)")]))
def test_integration_examples_refuse_bad_arguments(example_name, module, args, message, monkeypatch, capsys):
    pytest.importorskip(module)
    spec = importlib.util.spec_from_file_location(example_name[:-3], EXAMPLE.parent / example_name)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)  # in this process: its imports (seconds each) load once
    monkeypatch.setattr(sys, "argv", [example_name, *args])
    with pytest.raises(SystemExit) as exit_:
        loaded.main()  # ends in its parse_args
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: "), err
    assert err.splitlines()[-1].endswith(message), err


@pytest.mark.parametrize("args, message", [
    # each was accepted and did nothing: no report, the E4M3 all-gather kept or never there
    (["--precision", "bf16", "--numerics-report"],
     "argument --numerics-report: it reports the FP8 precisions (fp8, O1, O2), and --precision names only bf16"),
    (["--no-fp8-all-gather"], "argument --no-fp8-all-gather: it applies to --parallel fsdp with --precision fp8"),
    (["--precision", "O2", "--no-fp8-all-gather"],
     "argument --no-fp8-all-gather: it applies to --parallel fsdp with --precision fp8"),
])
def test_options_that_would_do_nothing_are_argument_errors(example, args, message, capsys):
    line = parse_error(example, [*args, "--device", "cpu"], capsys)
    assert line.endswith(message), line
