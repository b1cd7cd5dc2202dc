"""scripts/gpu_check.sh's --shard and --only: the shards of the pytest files cover every file once,
--only takes the files named (a trailing * for every file a name begins), and bad values are
refused (run up to the build, which a stub python3 makes fail at once)."""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_check(tmp_path, *args):
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "python3").write_text("#!/bin/sh\nexit 1\n")
    (stub / "python3").chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATH=f"{stub}:{os.environ['PATH']}")
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_shards_cover_every_pytest_file_once(tmp_path):
    seen = []
    for k in (1, 2, 3):
        out = run_check(tmp_path, f"--shard={k}/3", "--gpu-only", "--no-bench")
        line = next(line for line in out.stdout.splitlines() if line.startswith(f"shard {k}/3: "))
        assert ("no CTest" in line) == (k != 1)
        seen += line.split(": ", 2)[2].split()
        assert out.returncode == 1 and "BUILD FAILED" in out.stdout  # the stub stops it there
    files = sorted(p.name for p in (ROOT / "tests" / "python").glob("test_*.py"))
    assert sorted(seen) == files


@pytest.mark.parametrize("args", [["--shard=3/2"], ["--shard=0/2"], ["--shard=x"], ["--shard=1/2", "--only=tiles"]])
def test_bad_shards_are_refused(tmp_path, args):
    out = run_check(tmp_path, *args)
    assert out.returncode == 2 and "--shard" in out.stdout


def test_only_takes_the_files_named_and_the_families_of_a_star(tmp_path):
    out = run_check(tmp_path, "--only=adam_op,cuda*", "--gpu-only", "--no-bench")
    line = next(line for line in out.stdout.splitlines() if line.startswith("only: "))
    files = line.split(": ", 2)[2].split(";")[0].split()
    family = sorted(p.name for p in (ROOT / "tests" / "python").glob("test_cuda*.py"))
    assert len(family) >= 2 and files == ["test_adam_op.py", *family]
    assert out.returncode == 1 and "BUILD FAILED" in out.stdout


@pytest.mark.parametrize("only", ["--only=no_such_tests", "--only=no_such*", "--only=cu*da", "--only=../x"])
def test_bad_only_names_are_refused(tmp_path, only):
    out = run_check(tmp_path, only)
    assert out.returncode == 2 and "--only" in out.stdout
