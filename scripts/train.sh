#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and trains a GPT with FP8 on the built-in data: the real
# thing on a GPU, a tiny model in FP8 emulation on a CPU-only machine.
# Usage: scripts/train.sh [examples/train_gpt.py args, e.g. --precision bf16 --steps 200]
source "$(dirname "$0")/setup.sh"
exec "$PY" examples/train_gpt.py "$@"
