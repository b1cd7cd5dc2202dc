#!/usr/bin/env bash
# The GPU machine's one call: build offline, run the GPU tests (CTest + pytest), then the
# benchmarks; logs go to $OUT. Usage: bash scripts/gpu_check.sh [--sanitize] [--no-bench] [--gpu-only]
#   --sanitize  also run the CUDA gtests under compute-sanitizer (memcheck, racecheck)
#   --no-bench  skip the benchmarks
#   --gpu-only  run only the GPU-labelled/marked tests (CI runs the CPU ones)
#   --no-tests  build, then only the benchmarks (to split a long check over two runs)
#   --benches=cast,gemm  only these benchmarks/bench_<name>.py (default: all); bench_comm runs on 2
#               GPUs under torchrun, and is skipped (with the reason) on a machine with fewer
#   --only=tiles,gemm_tiles  only these tests/python/test_<name>.py files, and the CTest tests whose
#               names match one of the names (case-insensitive, underscores dropped), e.g. a quick
#               check of one op family before the whole suite; a name ending in * takes every file
#               it begins (--only='cuda*': test_cuda.py, test_cuda_graph.py, ...; CTest: cuda)
#   --shard=K/N run the K-th of N parts of the pytest files (every N-th file from the K-th, in name
#               order) and CTest with K=1 only: the whole GPU suite takes longer than a 600 s run on
#               the GPU machine, e.g. --gpu-only --no-bench --shard=1/3, then 2/3 and 3/3 while warm
#               (on 2026-12-06 --shard=1/2 ran past 600 s on an H100: build 65 s, CTest 70 s, pytest)
#   --ncu-optim also profile the O2 Adam passes with Nsight Compute (speed of light, occupancy,
#               warp stalls, memory) into $OUT/ncu_adam.txt (about a minute)
# A GPU machine without a GoogleTest package builds the C++ tests from sources in .deps/googletest
# (cp -r /usr/src/googletest .deps/ on a machine that has them, and copy .deps along).
# Python packages a machine without network lacks (torchao, the float8 baseline of
# bench_linear/bench_train) are installed from wheels in .whl/ (git-ignored; fetch them with
# `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
# --platform manylinux_2_28_x86_64 --platform any -d .whl torchao==0.18.0` and copy .whl along),
# into /tmp/site and on PYTHONPATH for the benchmarks only; tests use the installed packages.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}  # the benchmarks write their tables to $OUT/bench_<name>.md
mkdir -p "$OUT"
SANITIZE=0 BENCH=1 TESTS=1 NCU=0 BENCHES="" ONLY="" SHARD="" CTEST_ARGS=() PYTEST_ARGS=()
for arg in "$@"; do
  case "$arg" in
    --sanitize) SANITIZE=1 ;;
    --no-bench) BENCH=0 ;;
    --gpu-only) CTEST_ARGS=(-L gpu) PYTEST_ARGS=(-m gpu) ;;
    --no-tests) TESTS=0 ;;
    --benches=*) BENCHES=${arg#--benches=} ;;
    --ncu-optim) NCU=1 ;;
    --only=*) ONLY=${arg#--only=} ;;
    --shard=*) SHARD=${arg#--shard=} ;;
    *) echo "unknown argument: $arg (accepted: --sanitize, --no-bench, --gpu-only, --no-tests, --benches=a,b, --only=a,b, --shard=K/N, --ncu-optim)"; exit 2 ;;
  esac
done
PYTEST_PATHS=(tests/python)
if [ -n "$ONLY" ]; then
  IFS=, read -ra names <<< "$ONLY"
  PYTEST_PATHS=() regex=""
  for name in "${names[@]}"; do
    [[ $name =~ ^[A-Za-z0-9_]+\*?$ ]] || { echo "--only: expected names of letters, digits and _ (a * at the end), got '$name'"; exit 2; }
    files=()
    for f in tests/python/test_$name.py; do [ -f "$f" ] && files+=("$f"); done  # (a name with * expands)
    [ ${#files[@]} -gt 0 ] || { echo "--only: no tests/python/test_$name.py"; exit 2; }
    PYTEST_PATHS+=("${files[@]}")
    name=${name%\*}
    word=""  # CTest's regexes have no case-insensitive flag: each letter as [xX]
    for ((i = 0; i < ${#name}; i++)); do
      c=${name:i:1}
      [ "$c" = _ ] || word+="[${c,,}${c^^}]"
    done
    regex+="${regex:+|}$word"
  done
  CTEST_ARGS+=(-R "$regex")
  echo "only: ${#PYTEST_PATHS[@]} pytest files: ${PYTEST_PATHS[*]##*/}; CTest names matching $regex"
fi
RUN_CTEST=1
if [ -n "$SHARD" ]; then
  [[ "$SHARD" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] && [ "${BASH_REMATCH[1]}" -le "${BASH_REMATCH[2]}" ] \
    || { echo "--shard: expected K/N with 1 <= K <= N, got $SHARD"; exit 2; }
  [ -z "$ONLY" ] || { echo "--shard and --only select tests two ways: give one of them"; exit 2; }
  k=${BASH_REMATCH[1]} n=${BASH_REMATCH[2]} i=0
  PYTEST_PATHS=()
  for file in tests/python/test_*.py; do  # the glob's order: by name
    [ $(( i % n )) -eq $(( k - 1 )) ] && PYTEST_PATHS+=("$file")
    i=$(( i + 1 ))
  done
  note=""
  [ "$k" = 1 ] || { RUN_CTEST=0; note=", no CTest (shard 1 runs it)"; }
  echo "shard $k/$n: ${#PYTEST_PATHS[@]} pytest files$note: ${PYTEST_PATHS[*]##*/}"
fi
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

if [ "$TESTS" = 1 ]; then
  if [ "$RUN_CTEST" = 1 ]; then
    ctest --test-dir build/py --output-on-failure "${CTEST_ARGS[@]}" > "$OUT/ctest.log" 2>&1 || status=1
    tail -8 "$OUT/ctest.log"
  fi
  if [ ${#PYTEST_PATHS[@]} -gt 0 ]; then  # (a shard past the last file has none: not the whole suite)
    # (--durations: the slowest tests, in pytest.log, for fitting the suite into the GPU machine's runs)
    FP8AMP_LOSS_LOG="$OUT/small_gpt_losses.txt" python3 -m pytest "${PYTEST_PATHS[@]}" -q -rs -p no:cacheprovider \
      --durations=25 "${PYTEST_ARGS[@]}" > "$OUT/pytest.log" 2>&1 || status=1
    tail -15 "$OUT/pytest.log"
    # the small GPT's losses against BF16, each run's (their spread sits near the test's 1 % line)
    [ -f "$OUT/small_gpt_losses.txt" ] && cat "$OUT/small_gpt_losses.txt"
  fi
fi

if [ "$SANITIZE" = 1 ]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 build/py/tests/cpp/fp8amp_gpu_tests \
      --gtest_filter='-*Exhaustive*:*Large*' >> "$OUT/sanitizer.log" 2>&1 || status=1
    echo "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  done
fi

if [ "$BENCH" = 1 ]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >> "$OUT/bench.log" 2>&1; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      echo "benchmark wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
    else
      status=1; echo "installing .whl/*.whl FAILED (see bench.log); benchmarks run without them"
    fi
  fi
  selected=()
  if [ -n "$BENCHES" ]; then
    IFS=, read -ra names <<< "$BENCHES"
    for name in "${names[@]}"; do selected+=("benchmarks/bench_$name.py"); done
  else
    selected=(benchmarks/bench_*.py)
  fi
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())") || gpus=0
  for bench in "${selected[@]}"; do
    echo "== $bench"
    launch=(python3)
    if [ "$bench" = benchmarks/bench_comm.py ]; then
      # NCCL between 2 ranks, one per GPU: under torchrun, never as one process.
      if [ "$gpus" -lt 2 ]; then
        echo "skipped: bench_comm needs 2 GPUs (NCCL between 2 ranks); $gpus visible" | tee -a "$OUT/bench.log"
        continue
      fi
      # torchrun's own entry point, run by the python3 that has fp8amp installed
      launch=(python3 -m torch.distributed.run --standalone --nproc-per-node=2)
    fi
    "${launch[@]}" "$bench" >> "$OUT/bench.log" 2>&1 || { status=1; echo "$bench FAILED"; }
  done
  cat "$OUT"/bench_*.md 2>/dev/null
fi
if [ "$NCU" = 1 ]; then
  # Two launches of each O2 pass after the warm-up steps (a 4-layer model: the same kernels).
  (cd benchmarks && ncu -k regex:"adam_(amax|store)_kernel" --launch-skip 6 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section LaunchStats python3 bench_optim.py --modes o2 --steps 3 --layers 4) > "$OUT/ncu_adam.txt" 2>&1 \
    || { status=1; echo "ncu FAILED (see ncu_adam.txt)"; }
  grep -E "adam_|Duration|Throughput|Occupancy|Registers Per|Warp Cycles Per Issued" "$OUT/ncu_adam.txt"
fi
echo "gpu_check status: $status"
exit $status
