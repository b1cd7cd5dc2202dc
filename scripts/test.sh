#!/usr/bin/env bash
# Sets up everything and runs all tests: C++ (CTest) and Python (pytest).
# On a fresh machine it creates .venv, installs torch and the build tools from PyPI, builds the
# core, its tests and the torch extension in one CMake tree (build/py), then runs both suites.
# GPU tests skip without a GPU. Usage: scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${FP8AMP_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch>=2.11" numpy pytest "scikit-build-core>=0.10" "cmake>=3.24" ninja
export PATH="$(cd "$VENV/bin" && pwd):$PATH"

# One build: the package's CMake tree also builds the C++ tests, which CTest then runs.
"$PY" -m pip install --no-build-isolation --no-deps -q \
  -C cmake.define.FP8AMP_BUILD_TESTS=ON \
  ${FP8AMP_PIP_ARGS:-} .

echo "== C++ tests (CTest) =="
ctest --test-dir build/py --output-on-failure -j2

echo "== Python tests (pytest) =="
"$PY" -m pytest tests/python -q "$@"
