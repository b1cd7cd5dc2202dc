#!/usr/bin/env bash
# Builds the API reference: every public name of fp8amp, from its docstrings, by pdoc, as HTML in
# build/docs/ (or the directory given). Sets up the venv as scripts/train.sh does (scripts/setup.sh)
# unless PYTHON names an interpreter that already imports fp8amp and pdoc.
# Usage: scripts/docs.sh [OUT_DIR]; then open OUT_DIR/index.html.
set -euo pipefail
OUT=$(realpath -m "${1:-$(dirname "$0")/../build/docs}")
if [ -z "${PYTHON:-}" ]; then
  FP8AMP_SETUP_FOR=train source "$(dirname "$0")/setup.sh"
  PYTHON=$PY
fi
echo "== docs: pdoc fp8amp -> $OUT"
"$PYTHON" -m pdoc --docformat restructuredtext --no-show-source -o "$OUT" fp8amp
echo "API reference: $OUT/index.html"
