"""scripts/gpu_check.sh's --shard: its parts of the pytest files cover every file once, and bad
values are refused (run up to the build, which a stub python3 makes fail at once)."""

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
