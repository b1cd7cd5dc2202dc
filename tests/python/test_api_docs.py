"""scripts/docs.sh builds the API reference with pdoc, and every public name is in it: each name of
a module's __all__ on that module's page, fp8amp's and its public submodules', recursively."""

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def missing_names(module_name: str, out: Path) -> list[str]:
    page = out / (module_name.replace(".", "/") + ".html")
    if not page.is_file():
        return [f"{module_name} (no page)"]
    module, text, missing = importlib.import_module(module_name), page.read_text(), []
    for name in getattr(module, "__all__", []):
        if isinstance(getattr(module, name), types.ModuleType):
            missing += missing_names(f"{module_name}.{name}", out)
        elif f'id="{name}"' not in text:
            missing.append(f"{module_name}.{name}")
    return missing


def test_the_api_reference_names_every_public_name(tmp_path):
    out = tmp_path / "docs"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "docs.sh"), str(out)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "index.html").is_file()
    assert len(importlib.import_module("fp8amp").__all__) > 20
    assert not missing_names("fp8amp", out)
