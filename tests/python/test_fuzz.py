"""The public-API fuzz (docs/hardening.md): every op of fp8amp.ops, Fp8Linear, ScaledTensor,
convert and initialize over wrong dtypes, shapes and devices (meta), aliasing, empty / 0-dim /
large inputs and NaN / inf. Each case (tests/python/fuzz_cases.py) must give a result equal to
an independent reference or a clear error naming the argument. The cases run in a child process
that reports each case as it starts, so a crash (a segfault) fails this test and names the case;
the run then resumes after it."""

import collections
import json
import os
import subprocess
import sys

import pytest

CASES = os.path.join(os.path.dirname(__file__), "fuzz_cases.py")

def run_cases() -> tuple[dict, list]:
    """{case name: (outcome, detail)} and the names of the cases that crashed the child."""
    results, crashed, start, total = {}, [], 0, None
    while total is None or start < total:
        child = subprocess.run([sys.executable, CASES, str(start), str(1 << 30)], capture_output=True, text=True,
                               timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"})
        running = None
        for line in child.stdout.splitlines():
            record = json.loads(line)
            if "start" in record:
                running = record
            elif "outcome" in record:
                results[record["name"]] = (record["outcome"], record["detail"])
                running = None
            elif "total" in record:
                total = record["total"]
        if total is not None:
            break
        assert running is not None, f"the fuzz child failed before its first case:\n{child.stderr[-3000:]}"
        crashed.append(running["name"])
        results[running["name"]] = ("crash", f"exit status {child.returncode}")
        start = running["start"] + 1
    return results, crashed


@pytest.fixture(scope="module")
def fuzz():
    return run_cases()


def test_no_case_crashes(fuzz):
    _, crashed = fuzz
    assert not crashed, f"cases that crashed the process: {crashed}"


def test_every_case_is_correct_or_a_clear_error(fuzz):
    results, _ = fuzz
    counts = collections.Counter(outcome for outcome, _ in results.values())
    print("fuzz outcomes:", dict(counts))
    assert len(results) > 1500
    unclear = {n: d for n, (o, d) in results.items() if o == "unclear"}
    assert not unclear, f"{len(unclear)} unclear errors: {list(unclear.items())[:10]}"
    wrong = {n: d for n, (o, d) in results.items() if o == "wrong"}
    assert not wrong, f"{len(wrong)} silent wrong results: {list(wrong.items())[:10]}"
    assert counts["correct"] > 1500 and counts["clear"] > 150
