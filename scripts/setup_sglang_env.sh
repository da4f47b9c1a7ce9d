#!/usr/bin/env bash
# An environment with the real SGLang 0.5.23 and parity, on a CPU machine (no GPU needed), for the
# tests marked real_sglang: SGLang's own argument parser, plugin loader and request handling
# (tests/engines/test_sglang_real.py), and real SGLang servers on the CPU (tests/engines/test_sglang_real_server.py).
#
#   bash scripts/setup_sglang_env.sh [VENV]
#   VENV/bin/python -m pytest -q -m real_sglang
#
# VENV defaults to $PARITY_SGLANG_VENV, else ~/.cache/parity/sglang-0.5.23-torch-2.14.1: keyed on
# the pinned versions, outside the repository (it is ~11 GB). An existing VENV that has exactly
# these versions is reused (seconds); anything else is rebuilt (about 6-11 minutes). Either way
# parity is then (re)installed into it editable from this checkout without dependencies, so its
# plugin entry point and package data are this checkout's. Remove it with `rm -rf VENV`.
set -euo pipefail

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1  # what sglang 0.5.23 pins
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${PARITY_SGLANG_VENV:-${HOME}/.cache/parity/sglang-${SGLANG_VERSION}-torch-${TORCH_VERSION}}}"
PYTHON="${PYTHON:-python3}"

case "$(mkdir -p "$(dirname "$VENV")" && cd "$(dirname "$VENV")" && pwd)/" in
  "$REPO"/*) echo "error: put the venv outside the repository ($REPO)" >&2; exit 2 ;;
esac

has_pins() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$SGLANG_VERSION" "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if (version("sglang"), version("torch"), version("pytest") != "") == (sys.argv[1], sys.argv[2], True) else 1)
PY
}

if has_pins; then
  echo "reusing $VENV (sglang $SGLANG_VERSION, torch $TORCH_VERSION)"
else
  version="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  case "$version" in
    3.11|3.12) ;;
    *) echo "error: SGLang $SGLANG_VERSION ships wheels for Python 3.11 and 3.12; $PYTHON is $version (set PYTHON=python3.11)" >&2; exit 2 ;;
  esac
  echo "building $VENV: sglang==$SGLANG_VERSION torch==$TORCH_VERSION (about 6-11 minutes, ~11 GB)"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "sglang==$SGLANG_VERSION" "torch==$TORCH_VERSION"
  "$VENV/bin/pip" install --quiet -e "$REPO[test]"
fi
# Video requests on the CPU: SGLang's decoder falls back to decord (parity's CPU patches choose it,
# as torchcodec needs FFmpeg's shared libraries), and parity writes each video with PyAV.
"$VENV/bin/pip" install --quiet "decord==0.6.0" "av>=12"
# This checkout's parity, whatever was installed before (entry point and package data follow it).
"$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
"$VENV/bin/python" - "$REPO" <<'PY'
import sys
from importlib.metadata import entry_points, version
from pathlib import Path
import parity
names = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
assert "parity" in names, f"parity's plugin entry point is missing: {names}"
assert Path(parity.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), parity.__file__
print(f"sglang {version('sglang')}, torch {version('torch')}, parity from {sys.argv[1]}, plugin registered")
PY
