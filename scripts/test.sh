#!/usr/bin/env bash
# Sets up what the tests need (scripts/setup.sh: the C++ tests, GoogleTest required, and every
# CUDA source where nvcc is found) and runs all tests: C++ (CTest), then Python (pytest). Without a
# GPU the GPU tests are compiled but not run, and both say so, and pytest runs on two worker
# processes. Usage: scripts/test.sh [pytest args] (-n 0: one process)
FP8AMP_SETUP_FOR=test source "$(dirname "$0")/setup.sh"

echo "== C++ tests (CTest) =="
if has_gpu; then
  ctest --test-dir build/py --output-on-failure -j2
else
  ctest --test-dir build/py --output-on-failure -j2 -LE gpu
  GPU_TESTS=$(ctest --test-dir build/py -N -L gpu | sed -n 's/^Total Tests: //p')
  echo "C++ GPU tests: ${GPU_TESTS:-0} compiled, skipped: no GPU on this machine (nvidia-smi lists none)"
fi

echo "== Python tests (pytest) =="
# Without a GPU, on two worker processes (pytest-xdist): the slow tests are compilation and
# multi-process runs, one core each; GPU tests run in one process, which has the GPU to itself.
WORKERS=()
has_gpu || WORKERS=(-n 2)
# The slowest tests are listed at the end, so that what makes CI long (a 30-minute budget) shows in its log.
"$PY" -m pytest tests/python -q --durations=25 "${WORKERS[@]}" "$@"
