"""The C++ kernels' build cache survives a builder killed mid-build."""

from __future__ import annotations

import pathlib
import subprocess
import sys


from kernels import cpu_extension

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_a_lock_left_by_a_killed_builder_does_not_block_the_next_load():
    # the C++ toolchain is part of the test setup (`make test` builds the kernels first): none is a failure
    assert cpu_extension.load("paged_decode.cpp") is not None, "the C++ kernels do not build here"
    from torch.utils import cpp_extension

    name = cpu_extension._module_name(cpu_extension.CSRC / "paged_decode.cpp", cpu_extension.BASE_FLAGS)
    build = pathlib.Path(cpp_extension._get_build_directory(name, verbose=False))
    lock = build / "lock"
    lock.touch()  # what torch's file baton leaves when its builder is killed: later loads wait on it forever
    code = "from kernels import cpu_extension; print(cpu_extension.load('paged_decode.cpp') is not None)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "True", done.stdout[-2000:] + done.stderr[-2000:]
    assert not lock.exists()
    assert "cpu_kernels.stale_lock_removed" in done.stdout + done.stderr
