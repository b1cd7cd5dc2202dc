#!/usr/bin/env bash
# Sets up what training needs (scripts/setup.sh: no C++ tests; no CUDA on a machine without a GPU)
# and compares precisions on a GPT trained on the built-in data: by default bf16 and O2, on a GPU at
# a size where FP8 pays, on a CPU-only machine a tiny model in FP8 emulation. The metrics, a picture
# and a summary land in runs/<date>-<precisions>/ (or --out DIR).
# Usage: scripts/train.sh [examples/train_gpt.py arguments, e.g. --precision bf16,O1,O2 --steps 200]
# --data and --out name paths from where it is run; setup.sh works from the repository's root.
CALLER_DIR=$PWD
absolute() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s' "$CALLER_DIR/$1" ;; esac; }
ARGS=()
path_next=0
for arg in "$@"; do
  if [ "$path_next" = 1 ]; then ARGS+=("$(absolute "$arg")"); path_next=0; continue; fi
  case "$arg" in
    # with the prefixes argparse takes for them (--d alone is ambiguous: --device)
    --da|--dat|--data|--o|--ou|--out) ARGS+=("$arg"); path_next=1 ;;
    --da=*|--dat=*|--data=*|--o=*|--ou=*|--out=*) ARGS+=("${arg%%=*}=$(absolute "${arg#*=}")") ;;
    *) ARGS+=("$arg") ;;
  esac
done
FP8AMP_SETUP_FOR=train source "$(dirname "$0")/setup.sh"
exec "$PY" examples/train_gpt.py "${ARGS[@]}"
