#!/usr/bin/env bash
# The Python tests on the CPU under the oldest torch pyproject.toml accepts (2.11, the GPU
# machine's), in a venv of its own: CI and scripts/test.sh install the newest torch, and 2.11's
# Dynamo and Inductor differ from it (docs/compile.md#four-more-torch-211-faults-worked-around).
# Installs that torch, the test tools and the integrations' packages (transformers, accelerate,
# lightning, timm, peft: the GPU machine has them beside torch 2.11; pip resolves their newest
# versions against the pinned torch in about a minute), builds fp8amp without CUDA in
# build/oldest-torch, runs pytest on two workers.
# Usage: scripts/test_oldest_torch.sh [pytest args] (e.g. -k compile).
# FP8AMP_VENV: the venv (default .venv-oldest-torch).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FP8AMP_VENV:-.venv-oldest-torch}
TORCH=$(python3 scripts/requirements.py | sed -n 's/^torch>=//p')
[ -n "$TORCH" ] || { echo "scripts/test_oldest_torch.sh: no torch>= bound in pyproject.toml" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
echo "== torch $TORCH and the test tools in $VENV"
"$PY" -m pip install -q "torch==$TORCH.*" numpy tqdm matplotlib pillow pytest pytest-xdist pdoc \
  "scikit-build-core>=0.11" "cmake>=3.24" ninja transformers accelerate lightning timm safetensors peft
echo "== fp8amp: building in build/oldest-torch (no CUDA) and installing"
"$PY" -m pip install -q --no-build-isolation --no-deps -C build-dir=build/oldest-torch \
  -C cmake.define.FP8AMP_BUILD_TESTS=OFF -C cmake.define.FP8AMP_WITH_CUDA=OFF .
echo "== Python tests (pytest) under torch $("$PY" -c 'import torch; print(torch.__version__)')"
"$PY" -m pytest tests/python -q -n 2 "$@"
