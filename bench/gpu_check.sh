#!/usr/bin/env bash
# One-GPU check of the Triton kernels, under 5 minutes on one H200:
#   1. pytest tests/kernels with TRITON_INTERPRET=0 (the `cuda` cases run compiled kernels),
#   2. decode attention timings (Llama-3-8B heads, bf16) against a device-to-device copy and SDPA,
#   3. KV write timings.
# Results: bench/results/gpu_check_<gpu>_<time>.json. Exit status 1 if a test failed.
#   bench/gpu_check.sh                 # PYTHON=/path/to/python to choose the interpreter
#   bench/gpu_check.sh --skip-tests    # timings only
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PYTHON=.venv/bin/python
  elif python3 -c "import torch" 2>/dev/null || [[ ! -x .venv/bin/python ]]; then
    PYTHON=python3
  else
    PYTHON=.venv/bin/python
  fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
echo "gpu_check: $PYTHON, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
exec timeout 290 "$PYTHON" bench/gpu_check.py "$@"
