#!/usr/bin/env bash
# All GPU checks in one call, from the working tree, nothing to install:
#   PYTHONPATH=. bash scripts/gpu_check.sh        (results under $OUT, or gpu-check-out/)
# Then a CLI smoke run on the GPU with the default options (expects PASS, exit 0).
# parity's own runner only: the GPU machine cannot install engines. The SGLang and vLLM checks are
# commands in docs/sglang-runbook.md and docs/vllm-runbook.md, for a machine that has them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/log.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/log.txt"
python scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt"
# The noise of a correct replay on the GPU: what --logprob-tol and --localize-threshold auto must cover.
python scripts/measure_noise.py --device cuda --seeds 0 1 2 2>&1 | tee "$OUT/noise.txt" | tee -a "$OUT/log.txt"
python scripts/localization_noise.py --device cuda --dtypes float32 bfloat16 2>&1 | tee "$OUT/layer-noise.txt" | tee -a "$OUT/log.txt"
python -m parity run --device cuda --scenario all --fixture all --out "$OUT/runs/cli-all" --no-plot 2>&1 | tee -a "$OUT/log.txt"
echo "cli exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/log.txt"
tar -czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$OUT/runs"
