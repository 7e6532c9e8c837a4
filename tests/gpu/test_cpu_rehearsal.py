"""The GPU tests rehearsed on the CPU (cpu_rehearsal.py: flashinfer's API model, graph stand-ins,
the engine as on CUDA), in CI: the test code GPU time is spent on must at least run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# two halves, each its own process (on two workers at once; each well under 30 s on a slow CPU)
KERNELS = "flashinfer or flex or cuda_graph_replay"


@pytest.mark.parametrize("part", [KERNELS, f"not ({KERNELS})"], ids=["kernels", "engine"])
def test_gpu_tests_rehearse_on_the_cpu(part):
    here = Path(__file__).parent
    env = {**os.environ, "SPECDEC_TEST_DEVICE": "cpu", "SPECDEC_GPU_REPORT": "",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "cpu_rehearsal", str(here / "test_gpu.py"), "-q",
         "-p", "no:cacheprovider", "-W", "ignore", "-k", part],
        capture_output=True, text=True, timeout=600, env=env, cwd=here.parents[1])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
