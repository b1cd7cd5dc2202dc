#!/usr/bin/env bash
# Sourced by scripts/train.sh and scripts/test.sh: creates .venv (or $FP8AMP_VENV), installs torch
# and the build tools from PyPI, and builds + installs fp8amp into it (one CMake tree in build/py,
# which also builds the C++ tests). Sets PY to the venv's python.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${FP8AMP_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch>=2.11" numpy pytest "scikit-build-core>=0.10" "cmake>=3.24" ninja
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
"$PY" -m pip install --no-build-isolation --no-deps -q -C cmake.define.FP8AMP_BUILD_TESTS=ON ${FP8AMP_PIP_ARGS:-} .
