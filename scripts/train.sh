#!/usr/bin/env bash
# Sets up what training needs (scripts/setup.sh: no C++ tests; no CUDA on a machine without a GPU)
# and compares precisions on a GPT trained on the built-in data: by default bf16 and O2, on a GPU at
# a size where FP8 pays, on a CPU-only machine a tiny model in FP8 emulation. The metrics, a picture
# and a summary land in runs/<date>-<precisions>/ (or --out DIR).
# Usage: scripts/train.sh [examples/train_gpt.py arguments, e.g. --precision bf16,O1,O2 --steps 200]
FP8AMP_SETUP_FOR=train source "$(dirname "$0")/setup.sh"
exec "$PY" examples/train_gpt.py "$@"
