#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs all tests: C++ (CTest) and Python (pytest).
# GPU tests skip without a GPU. Usage: scripts/test.sh [extra pytest args]
source "$(dirname "$0")/setup.sh"

echo "== C++ tests (CTest) =="
ctest --test-dir build/py --output-on-failure -j2

echo "== Python tests (pytest) =="
"$PY" -m pytest tests/python -q "$@"
