"""The C++ CPU kernels under kernels/csrc, each compiled on first use and cached per machine.

torch.utils.cpp_extension.load builds a source with the compiler torch was built against
(-O3 -march=native, OpenMP for at::parallel_for) into torch's extension folder. The module's
name holds a hash of the source, the flags, the torch version and the CPU's flags, so a new
machine or a changed source builds its own and a cached one is loaded in a second, from any
checkout (the sources are staged in the build folder). Where a
source cannot build (no compiler, no ninja) or PAGEDSERVE_CPU_KERNELS=torch, `load` returns
None, logs one warning, and the callers take their torch path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import pathlib
import shutil

import structlog
import torch

CSRC = pathlib.Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")  # the last: min/max and compares vectorize
_log = structlog.get_logger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _module_name(source: pathlib.Path, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    headers = sorted(CSRC.glob("*.h"))  # what the sources include
    # torch's own folder too: its headers' path is in the build's command line, so two virtual environments
    # sharing one build folder would each see the other's build as stale and rebuild it, by turns
    for part in (source.read_bytes(), *(h.read_bytes() for h in headers), " ".join(flags).encode(),
                 torch.__version__.encode(), " ".join(sorted(cpu_flags())).encode(),
                 os.path.dirname(os.path.realpath(torch.__file__)).encode()):
        digest.update(part)
    return f"pagedserve_{source.stem}_{digest.hexdigest()[:16]}"


def enabled() -> bool:
    """Whether the C++ kernels may be used at all (PAGEDSERVE_CPU_KERNELS=torch turns them off)."""
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "native") != "torch"


@functools.cache
def load(source_name: str, extra_flags: tuple[str, ...] = ()):
    """The compiled module of kernels/csrc/`source_name`, or None where it cannot be had (logged once)."""
    if not enabled():
        return None
    source = CSRC / source_name
    flags = BASE_FLAGS + tuple(extra_flags)
    try:
        from torch.utils import cpp_extension

        name = _module_name(source, flags)
        build = pathlib.Path(cpp_extension._get_build_directory(name, verbose=False))
        # the sources are copied beside the build: another checkout of the same code finds it built
        # (ninja would rebuild for a source at a new path), and a build is never half-visible
        staged = build / "src"
        if not (staged / source.name).is_file():
            tmp = build / f"src.{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            for path in (source, *CSRC.glob("*.h")):
                shutil.copy(path, tmp / path.name)
            try:
                tmp.rename(staged)
            except OSError:  # another process staged it first: the same bytes
                shutil.rmtree(tmp, ignore_errors=True)
        _log.info("cpu_kernels.loading", source=source.name, build=str(build))
        # torch guards a build with a lock file that a builder killed mid-build leaves behind, and every
        # later load then waits on it forever. An flock is dropped by the kernel when its holder dies
        # (kill -9 included): whoever holds it is the only builder, so a lock file found then is stale
        with open(build / "build.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = build / "lock"
            if stale.exists():
                _log.warning("cpu_kernels.stale_lock_removed", source=source.name, lock=str(stale))
                stale.unlink()
            module = cpp_extension.load(name=name, sources=[str(staged / source.name)], extra_cflags=list(flags),
                                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path serves
        _log.warning("cpu_kernels.unavailable", source=source.name, error=str(exc)[:500], fallback="torch")
        return None
    _log.info("cpu_kernels.ready", source=source.name, module=module.__name__)
    return module
