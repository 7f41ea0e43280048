"""Build every C++ kernel the suite loads, as many compilers at once as there are cores, before it starts.

    .venv/bin/python -m tests.kernels.prebuild      (what `make test` runs first)

Each source the server builds (kernels.prepare_cpu_kernels, and the native decode step), and each test-only build
of grouped_matmul.cpp (the plain one, and the vector builds of test_grouped_matmul.OTHER_BUILDS), compiles in a
process of its own, the longest first. One after another, the serving ones here and the test builds inside the
tests (~2.5 of the suite's ~13 minutes), they took ~5 minutes on a fresh 2-core machine. Each lands in the per-machine cache (kernels/cpu_extension.py),
so the suite then loads it in a second. A build that fails here logs its compiler's message
(cpu_extension.unavailable) and fails again in the test that needs it; a process that dies is named here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.kernels.test_grouped_matmul import OTHER_BUILDS

REPO = Path(__file__).resolve().parents[2]
GROUPED = "from kernels import cpu_extension; cpu_extension.load('grouped_matmul.cpp', {flags!r})"
# one process a source and build, the longest (grouped_matmul.cpp's, ~50 s each on 2 cores) first
BUILDS = {"grouped_matmul": "from kernels import grouped_matmul; grouped_matmul.available()",
          "grouped_matmul, plain": "from kernels import grouped_matmul; grouped_matmul._extension(portable=True)",
          **{f"grouped_matmul, {name}": GROUPED.format(flags=flags) for name, flags in OTHER_BUILDS.items()},
          "quant_matmul": "from kernels import quant_matmul; quant_matmul.available()",
          "weight_unpack": "from kernels import weight_unpack; weight_unpack.available()",
          "fused_ops": "import torch; from kernels import fused_ops; fused_ops.native_for(torch.zeros(1))",
          "paged_decode": "from kernels import cpu_attention; cpu_attention.available()",
          "decode_step": "from kernels import decode_step; decode_step.available()",  # loads the others: after them
          "every serving kernel loads": "import kernels; print('C++ CPU kernels:', kernels.prepare_cpu_kernels())"}


def main() -> int:
    started = time.monotonic()
    slots = max(1, os.cpu_count() or 1)
    waiting, running, failed = list(BUILDS.items()), {}, []
    while waiting or running:
        while waiting and len(running) < slots:
            name, code = waiting.pop(0)
            running[name] = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
            print(f"[{time.monotonic() - started:6.1f}s] building: {name}", flush=True)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                print(f"[{time.monotonic() - started:6.1f}s] {'built' if proc.returncode == 0 else 'FAILED'}: {name}",
                      flush=True)
                if proc.returncode != 0:
                    failed.append(name)
        time.sleep(0.2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
