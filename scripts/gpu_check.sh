#!/usr/bin/env bash
# The GPU machine's one call: build offline, run the GPU tests (CTest + pytest), then the
# benchmarks; logs go to $OUT. Usage: bash scripts/gpu_check.sh [--sanitize] [--no-bench] [--gpu-only]
#   --sanitize  also run the CUDA gtests under compute-sanitizer (memcheck, racecheck)
#   --no-bench  skip the benchmarks
#   --gpu-only  run only the GPU-labelled/marked tests (CI runs the CPU ones)
# The GPU machine has no GoogleTest package: carry its sources as .deps/googletest
# (cp -r /usr/src/googletest .deps/) and name .deps in the device call's carry list.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
SANITIZE=0 BENCH=1 CTEST_ARGS=() PYTEST_ARGS=()
for arg in "$@"; do
  case "$arg" in
    --sanitize) SANITIZE=1 ;;
    --no-bench) BENCH=0 ;;
    --gpu-only) CTEST_ARGS=(-L gpu) PYTEST_ARGS=(-m gpu) ;;
    *) echo "unknown argument: $arg (accepted: --sanitize, --no-bench, --gpu-only)"; exit 2 ;;
  esac
done
# Keep NVLink multicast off on shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16} PYTHONUNBUFFERED=1
status=0

{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} > "$OUT/build.log" 2>&1

GTEST_ARG=()
[ -d .deps/googletest ] && GTEST_ARG=(-C "cmake.define.FP8AMP_GTEST_SOURCE_DIR=$PWD/.deps/googletest")
start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps --no-index -v \
    -C cmake.define.FP8AMP_BUILD_TESTS=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a \
    "${GTEST_ARG[@]}" . >> "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"

ctest --test-dir build/py --output-on-failure "${CTEST_ARGS[@]}" > "$OUT/ctest.log" 2>&1 || status=1
tail -8 "$OUT/ctest.log"
python3 -m pytest tests/python -q -rs -p no:cacheprovider "${PYTEST_ARGS[@]}" > "$OUT/pytest.log" 2>&1 || status=1
tail -15 "$OUT/pytest.log"

if [ "$SANITIZE" = 1 ]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 build/py/tests/cpp/fp8amp_gpu_tests \
      --gtest_filter='-*Exhaustive*:*Large*' >> "$OUT/sanitizer.log" 2>&1 || status=1
    echo "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  done
fi

if [ "$BENCH" = 1 ]; then
  for bench in benchmarks/bench_*.py; do
    echo "== $bench"
    python3 "$bench" >> "$OUT/bench.log" 2>&1 || { status=1; echo "$bench FAILED"; }
  done
  cat "$OUT"/bench_*.md 2>/dev/null
fi
echo "gpu_check status: $status"
exit $status
