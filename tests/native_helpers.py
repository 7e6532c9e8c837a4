"""The compiled kernels in the tests: ``KERNELS`` (or None where they are not built) and the
``needs_kernels`` mark; a test module's code in a process of its own, its kernels capped at an
instruction set (``SPECDEC_NATIVE_ISA``: the choice is made once per process, so each cap needs
a process; a crash there is the calling test's failure, not pytest's).

    out = run_capped("test_q8_activations", "print(t.KERNELS.q8_isa)\\n", "avx2")
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import native

KERNELS = native.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="compiled kernels not built")


def run_capped(module: str, body: str, cap: str | None, timeout: int = 300,
               threads: int | None = None) -> str:
    """Run ``body`` after ``import <module> as t`` (a test module this process imported: its
    folder and this one, the helpers', on sys.path; torch at ``threads`` threads first, when
    given) with the kernels capped at ``cap`` (None: no variable, the widest this CPU has) ->
    its stdout. AssertionError with its output's tail unless it exits 0."""
    folders = [str(Path(sys.modules[module].__file__).parent), str(Path(__file__).parent)]
    code = f"import sys; sys.path[:0] = {folders!r}\n"
    if threads is not None:
        code += f"import torch; torch.set_num_threads({threads})\n"
    code += f"import {module} as t\n" + body
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_NATIVE_ISA"}
    if cap is not None:
        env["SPECDEC_NATIVE_ISA"] = cap
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (f"exit {done.returncode} after {done.stdout[-300:]!r}: "
                                  f"{done.stderr[-3000:]}")
    return done.stdout


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags")
            for f in line.split(":", 1)[1].split()}
