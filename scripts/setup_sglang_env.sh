#!/usr/bin/env bash
# An environment with the real SGLang 0.5.23 and parity, on a CPU machine (no GPU needed), for
# tests/test_sglang_real.py: SGLang's own argument parser, plugin loader, embed routine, request
# normalization and logprob layout, run against parity. Without it those tests are skipped.
#
#   bash scripts/setup_sglang_env.sh [VENV]      # default VENV: ~/.cache/parity/sglang-venv
#   VENV/bin/python -m pytest -q                  # the whole suite, test_sglang_real.py included
#
# Takes about 5 minutes and ~11 GB (SGLang pins torch 2.14.1 and its CUDA wheels). The venv lives
# outside the repository: it is far too large to sit in a checkout. Remove it with `rm -rf VENV`.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${HOME}/.cache/parity/sglang-venv}"
PYTHON="${PYTHON:-python3}"

case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/" in
  "$REPO"/*) echo "error: put the venv outside the repository ($REPO)" >&2; exit 2 ;;
esac
version="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
case "$version" in
  3.11|3.12) ;;
  *) echo "error: SGLang 0.5.23 ships wheels for Python 3.11 and 3.12; $PYTHON is $version (set PYTHON=python3.11)" >&2; exit 2 ;;
esac

mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
echo "installing sglang==0.5.23 into $VENV (about 5 minutes, ~11 GB)"
"$VENV/bin/pip" install --quiet "sglang==0.5.23"
echo "installing parity (editable, with its test extra) from $REPO"
"$VENV/bin/pip" install --quiet -e "$REPO[test]"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points, version
names = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
assert "parity" in names, f"parity's plugin entry point is missing: {names}"
print(f"sglang {version('sglang')}, torch {version('torch')}, parity plugin registered")
PY
echo "done: $VENV/bin/python -m pytest -q tests/test_sglang_real.py"
