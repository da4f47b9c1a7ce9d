#!/usr/bin/env bash
# All GPU checks in one call, from the working tree, nothing to install (the GPU machine's own Python:
# torch, transformers, pytest and pytest-xdist; no network, no PyAV):
#   PYTHONPATH=. bash scripts/gpu_check.sh [--device cpu] [--budget SECONDS] [--only STEP,...]   (PYTHON=... picks the interpreter)
# Results under $OUT (or gpu-check-out/): summary.md (the one page to read), summary.json, log.txt,
# runs.tar.gz (results and reports only, capped), written again after every step (scripts/gpu_check.py).
# The steps, in order of value, each planned inside the budget (8 minutes; give the call 9): the
# default command on the GPU and on the host's CPU; --scenario all --fixture all per DeepStack preset
# and dtype; pytest -m gpu; the whole suite (beside the steps after it); the verdict matrix; the
# replay check's departure table; the shape presets (Qwen3-VL-8B and -30B-A3B sizes: build, capture
# and slot memory, replay vs eager per bucket 16 ... 8192, a correct replay's bf16 noise, the four
# arms). A second call: --only shape-checkpoint,noise --budget 240 (the 8B saved and run as a
# checkpoint folder; the tiny presets' noise).
# `--device cpu` is its dry run on a machine without a GPU. The SGLang and vLLM checks are commands
# in docs/sglang-runbook.md and docs/vllm-runbook.md, for a machine that has the engines.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
