"""examples/train_gpt.py as users run it, with odd arguments: each ends in one argparse error line
naming the argument and what it accepts, or in a run whose outputs agree with each other (CPU,
FP8 emulation, a few steps). test_examples.py covers the documented runs and the first bad
arguments."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


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
