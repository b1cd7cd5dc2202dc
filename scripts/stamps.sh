# Sourced by scripts/setup.sh: a phase is skipped when the key of its inputs equals the key it
# last finished with, kept in a stamp file (in the venv, so a new venv starts afresh).

# A hash of the build's inputs: every file under the given paths, by content, except what builds
# and runs leave there (compiled extensions, bytecode).
fp8amp_inputs_hash() {
  find "$@" -type f ! -name '*.so' ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

# stamp_matches FILE PATTERN: the stamp exists and its line matches the grep -E pattern.
stamp_matches() { [ -f "$1" ] && grep -Eqx -- "$2" "$1"; }

stamp_write() { printf '%s\n' "$2" >"$1"; }
