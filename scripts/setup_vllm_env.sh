#!/usr/bin/env bash
# An environment with a real vLLM release parity supports (0.33.0 or 0.34.0) and parity, on a CPU
# machine (no GPU needed), for the tests marked real_vllm: vLLM's own argument parser and config,
# plugin loader, Qwen3-VL DeepStack methods and CUDA-graph dispatcher, and real `vllm serve` servers
# on the CPU (through parity's stand-ins, docs/engines/vllm-cpu.md), with VLLM_TARGET_DEVICE=cpu.
#
#   bash scripts/setup_vllm_env.sh [--version 0.34.0] [VENV]
#   VLLM_TARGET_DEVICE=cpu VENV/bin/python -m pytest -q -m real_vllm
#
# --version defaults to the newest release parity supports (SUPPORTED below, newest last); VENV to
# $PARITY_VLLM_VENV, else ~/.cache/parity/vllm-<version>-torch-2.14.1: keyed on the versions, outside
# the repository. An existing VENV with exactly these versions is reused (seconds); anything else is
# rebuilt. Either way parity is then (re)installed into it editable from this checkout, so its plugin
# entry point is this checkout's (.ci/run's vLLM stage relies on it). Adding a release: README,
# "Following a new engine release".
#
# vllm 0.33.0 and 0.34.0 pin torch==2.14.0, torchvision==0.29.0 and torchaudio==2.11.0 with CUDA wheels
# (several GB). This script does NOT install those pins: it installs torch 2.14.1 and torchvision
# 0.29.1 (found in this machine's local package index), then vllm with --no-deps, then the
# requirements the wheel's METADATA lists, less torch/torchvision/torchaudio and the GPU-only
# kernel packages (flashinfer, tilelang, cutlass, nvidia-*, ...), all under a constraint that keeps
# torch at 2.14.1. `pip check` therefore reports the torch pins and the GPU packages as missing;
# that is expected. About 7 minutes and 7.3 GB (measured on a 2-core machine). The venv lives outside the repository; remove it
# with `rm -rf VENV`. It never touches any other environment.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SUPPORTED=(0.33.0 0.34.0)  # parity/engines/vllm/versions.py, oldest first
VLLM_VERSION="${SUPPORTED[-1]}"
TORCH_VERSION="2.14.1"
TORCHVISION_VERSION="0.29.1"
if [ "${1:-}" = "--version" ]; then
  VLLM_VERSION="${2:?--version needs a vLLM version, one of ${SUPPORTED[*]}}"
  shift 2
fi
case " ${SUPPORTED[*]} " in
  *" $VLLM_VERSION "*) ;;
  *) echo "error: parity supports vLLM ${SUPPORTED[*]}, not $VLLM_VERSION (README: Following a new engine release)" >&2; exit 2 ;;
esac
VENV="${1:-${PARITY_VLLM_VENV:-${HOME}/.cache/parity/vllm-${VLLM_VERSION}-torch-${TORCH_VERSION}}}"

case "$(mkdir -p "$(dirname "$VENV")" && cd "$(dirname "$VENV")" && pwd)/" in
  "$REPO"/*) echo "error: put the venv outside the repository ($REPO)" >&2; exit 2 ;;
esac
version="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
case "$version" in
  3.11|3.12|3.13|3.14) ;;
  *) echo "error: vllm $VLLM_VERSION needs Python 3.11-3.14 (its Requires-Python); $PYTHON is $version (set PYTHON=python3.11)" >&2; exit 2 ;;
esac

PIP=("$VENV/bin/pip" install --quiet)
constraints="$VENV/parity-constraints.txt"
start=$SECONDS

has_pins() {
  [ -x "$VENV/bin/python" ] && [ -f "$constraints" ] && "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if (version("vllm"), version("torch"), version("pytest") != "") == (sys.argv[1], sys.argv[2], True) else 1)
PY
}

if has_pins; then
  echo "reusing $VENV (vllm $VLLM_VERSION, torch $TORCH_VERSION)"
else
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$constraints"

echo "[1/4] torch $TORCH_VERSION and torchvision $TORCHVISION_VERSION (not vllm's pin torch==2.14.0, see above)"
"${PIP[@]}" --upgrade pip packaging
"${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

echo "[2/4] vllm==$VLLM_VERSION without its dependencies"
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"

echo "[3/4] vllm's CPU-usable requirements, from its wheel METADATA"
requirements="$VENV/parity-vllm-requirements.txt"
"$VENV/bin/python" - "$requirements" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

# Pinned torch stack (kept at the local versions) and packages that only build or run CUDA kernels.
SKIP = {"torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
        "apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "quack-kernels",
        "tokenspeed-mla", "humming-kernels", "fastsafetensors", "instanttensor"}
keep, skipped = [], []
for line in requires("vllm") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform
    name = req.name.lower().replace("_", "-")
    (skipped if name in SKIP or name.startswith("nvidia-") else keep).append(req)
with open(sys.argv[1], "w") as out:
    out.writelines(f"{str(r).split(';')[0].strip()}\n" for r in keep)
print(f"  {len(keep)} requirements; left out: {', '.join(sorted(r.name for r in skipped))}")
PY
# --no-warn-conflicts: the missing pins and GPU packages above are left out on purpose.
"${PIP[@]}" --no-warn-conflicts -c "$constraints" -r "$requirements"

echo "[4/4] parity's test requirements"
"${PIP[@]}" --no-warn-conflicts -c "$constraints" -e "$REPO[test]"
fi
# Video requests: parity writes each video with PyAV (also in [test]; here for environments built before).
"${PIP[@]}" --no-warn-conflicts -c "$constraints" "av>=12"
# This checkout's parity, whatever was installed before (entry point and package data follow it).
"${PIP[@]}" --no-warn-conflicts --no-deps -e "$REPO"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points, version
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "parity" in names, f"parity's plugin entry point is missing: {names}"
assert version("torch") == "2.14.1", f"torch changed to {version('torch')}"
print(f"vllm {version('vllm')}, torch {version('torch')}, parity plugin registered")
PY
echo "done in $((SECONDS - start)) s: VLLM_TARGET_DEVICE=cpu $VENV/bin/python -m pytest -q -m real_vllm tests/engines/test_vllm_real.py"
