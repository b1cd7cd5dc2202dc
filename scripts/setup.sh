#!/usr/bin/env bash
# Sourced by scripts/train.sh and scripts/test.sh; sets PY to the venv's python. One line a phase:
#   1. the venv: .venv, or $FP8AMP_VENV;
#   2. Python packages: what pyproject.toml lists (build requirements, dependencies, the `examples`
#      and `test` extras; the `test-no-deps` list without their own requirements) and the build
#      tools (CMake, Ninja), with pip's own progress;
#   3. fp8amp: built by CMake (through scikit-build-core) and installed into the venv.
# Phases 2 and 3 are skipped when their inputs have not changed since they last finished (stamps in
# the venv keyed on a hash of those inputs: the package lists; the sources, torch's version and the
# build options).
# FP8AMP_SETUP_FOR=test (scripts/test.sh) builds the C++ tests (GoogleTest needed) and, where nvcc is
# found, every CUDA source (for sm_90a alone where no GPU is present), in build/py; train (the
# default) builds no tests and, on a machine without a GPU, no CUDA, in build/train.
# FP8AMP_PIP_ARGS: more arguments for the fp8amp build, e.g.
# -C cmake.define.FP8AMP_GTEST_SOURCE_DIR=/path/to/googletest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/stamps.sh
VENV=${FP8AMP_VENV:-.venv}
PURPOSE=${FP8AMP_SETUP_FOR:-train}
BUILD_TOOLS=("cmake>=3.24" "ninja")
phase() { echo "== setup: $*"; }

if [ -x "$VENV/bin/python" ]; then
  phase "venv $VENV: exists"
else
  phase "venv $VENV: creating"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PATH="$(cd "$VENV/bin" && pwd):$PATH"

"$PY" -c "import tomllib" 2>/dev/null || "$PY" -c "import tomli" 2>/dev/null || "$PY" -m pip install tomli
mapfile -t REQUIREMENTS < <("$PY" scripts/requirements.py)
mapfile -t NO_DEPS < <("$PY" scripts/requirements.py --only test-no-deps)  # each without its own requirements
PACKAGES_KEY=$(printf '%s\n' "${REQUIREMENTS[@]}" "${BUILD_TOOLS[@]}" "--no-deps" "${NO_DEPS[@]}" "$("$PY" -V)" \
               | sha256sum | cut -c1-16)
PACKAGES_STAMP="$VENV/.fp8amp-packages"
if stamp_matches "$PACKAGES_STAMP" "$PACKAGES_KEY"; then
  phase "Python packages: up to date (${REQUIREMENTS[*]} ${BUILD_TOOLS[*]})"
else
  phase "Python packages: installing ${REQUIREMENTS[*]} ${BUILD_TOOLS[*]} (torch is a large download the first time)"
  "$PY" -m pip install --upgrade pip
  "$PY" -m pip install "${REQUIREMENTS[@]}" "${BUILD_TOOLS[@]}"
  "$PY" -m pip install --no-deps "${NO_DEPS[@]}"
  stamp_write "$PACKAGES_STAMP" "$PACKAGES_KEY"
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; }
ARCH_ARGS=()
if [ "$PURPOSE" = test ]; then
  TESTS=ON CUDA=AUTO BUILD_DIR=build/py  # CI compiles every CUDA source, GPU or not
  # Without a GPU the CUDA build is a compile check: one architecture compiles every source line
  # (the kernels' only architecture branch, sm_89 and up, is the same for 89, 90a and 100).
  has_gpu || ARCH_ARGS=(-C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a)
elif [ "$PURPOSE" = train ]; then
  TESTS=OFF BUILD_DIR=build/train
  if has_gpu; then CUDA=AUTO; else CUDA=OFF; fi
else
  echo "scripts/setup.sh: FP8AMP_SETUP_FOR must be train or test, got '$PURPOSE'" >&2
  exit 2
fi
TORCH_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")
SOURCES_KEY=$( (fp8amp_inputs_hash CMakeLists.txt pyproject.toml src include bindings python tests/cpp
               echo "torch $TORCH_VERSION ${FP8AMP_PIP_ARGS:-}") | sha256sum | cut -c1-16)
BUILD_STAMP="$VENV/.fp8amp-build"
# Training can use a test build of the same sources (it has all training needs); the tests need
# their own build, with its CTest tree in build/py.
if [ "$PURPOSE" = train ]; then
  ACCEPTED="$SOURCES_KEY tests=(ON|OFF) cuda=($CUDA|AUTO) .*"
else
  ACCEPTED="$SOURCES_KEY tests=ON cuda=AUTO build/py"
fi
if stamp_matches "$BUILD_STAMP" "$ACCEPTED" && { [ "$PURPOSE" = train ] || [ -f build/py/CTestTestfile.cmake ]; }; then
  phase "fp8amp: up to date ($(cat "$BUILD_STAMP" | cut -d' ' -f2-))"
else
  phase "fp8amp: building in $BUILD_DIR (C++ tests $TESTS, CUDA $CUDA; torch $TORCH_VERSION) and installing"
  # pip -v shows the build; of it, CMake's summary line and Ninja's [done/total] progress.
  LOG="$BUILD_DIR.log"
  mkdir -p "$(dirname "$LOG")"
  if ! "$PY" -m pip install -v --no-build-isolation --no-deps -C build-dir="$BUILD_DIR" \
      -C cmake.define.FP8AMP_BUILD_TESTS="$TESTS" -C cmake.define.FP8AMP_WITH_CUDA="$CUDA" "${ARCH_ARGS[@]}" ${FP8AMP_PIP_ARGS:-} . \
      2>&1 | tee "$LOG" | grep -E --line-buffered '^ *\[[0-9]+/[0-9]+\]|^ *-- fp8amp|^\*\*\*|Successfully installed'; then
    tail -n 30 "$LOG" >&2
    echo "scripts/setup.sh: the fp8amp build failed; the whole log: $LOG" >&2
    exit 1
  fi
  stamp_write "$BUILD_STAMP" "$SOURCES_KEY tests=$TESTS cuda=$CUDA $BUILD_DIR"
fi
