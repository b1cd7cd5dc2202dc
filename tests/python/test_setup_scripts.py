"""scripts/setup.sh skips what is up to date: the key of the build's inputs (scripts/stamps.sh)
changes with every source and with nothing a build or a run leaves behind, and a stamp matches only
its own key; the packages it installs are pyproject.toml's lists (scripts/requirements.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
STAMPS = ROOT / "scripts" / "stamps.sh"


def bash(script: str, cwd: Path) -> str:
    result = subprocess.run(["bash", "-c", f"set -euo pipefail; source {STAMPS}; {script}"], cwd=cwd,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def inputs_hash(tree: Path) -> str:
    return bash("fp8amp_inputs_hash src python", tree)


def test_the_inputs_hash_follows_the_sources_and_nothing_else(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src")
    shutil.copytree(ROOT / "python", tree / "python", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    first = inputs_hash(tree)
    assert len(first) == 16 and inputs_hash(tree) == first  # the same tree, the same key: no rebuild

    (tree / "python" / "fp8amp" / "_fp8amp_ops.so").write_bytes(b"built")
    (tree / "python" / "fp8amp" / "__pycache__").mkdir(exist_ok=True)
    (tree / "python" / "fp8amp" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"run")
    assert inputs_hash(tree) == first  # what a build or a run leaves does not count

    source = next((tree / "src").rglob("*.cpp"))
    source.write_text(source.read_text() + "\n// changed\n")
    changed = inputs_hash(tree)
    assert changed != first
    (tree / "src" / "new_file.h").write_text("// new\n")
    assert inputs_hash(tree) not in (first, changed)


def test_a_stamp_matches_only_its_key(tmp_path):
    stamp = tmp_path / "stamp"
    assert bash(f"stamp_matches {stamp} 'abc tests=ON' && echo fresh || echo stale", tmp_path) == "stale"
    bash(f"stamp_write {stamp} 'abc tests=ON cuda=AUTO build/py'", tmp_path)
    check = "stamp_matches {} '{}' && echo fresh || echo stale"
    assert bash(check.format(stamp, "abc tests=ON cuda=AUTO build/py"), tmp_path) == "fresh"
    assert bash(check.format(stamp, "abc tests=(ON|OFF) cuda=(OFF|AUTO) .*"), tmp_path) == "fresh"  # train's rule
    assert bash(check.format(stamp, "abd tests=ON cuda=AUTO build/py"), tmp_path) == "stale"
    assert bash(check.format(stamp, "abc tests=ON cuda=OFF build/py"), tmp_path) == "stale"


def test_setup_installs_the_lists_of_pyproject(tmp_path):
    printed = subprocess.run([sys.executable, str(ROOT / "scripts" / "requirements.py")], capture_output=True,
                             text=True, check=True).stdout.split("\n")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    expected = meta["build-system"]["requires"] + meta["project"]["dependencies"] + extras["examples"] + [
        r for r in extras["test"] if not r.startswith("fp8amp[")]
    assert [line for line in printed if line] == list(dict.fromkeys(expected))
    assert "tqdm" in meta["project"]["dependencies"] and "matplotlib" in extras["examples"]
    assert {"pytest", "pdoc"} <= set(extras["test"])
    only = subprocess.run([sys.executable, str(ROOT / "scripts" / "requirements.py"), "--only", "test-no-deps"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert only == extras["test-no-deps"] and "torchtitan==0.3.0" in only
    assert all("==" in r for r in only)  # installed without their requirements: pinned


def test_the_scripts_parse():
    for script in sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / ".ci" / "run"]:
        subprocess.run(["bash", "-n", str(script)], check=True)
