"""A GGUF starts with no fp32 copy of its matrices: the resident memory an engine start adds
is about the file's blocks (as panels), well under its fp32 matrices (a start that kept them
would be over the bound). Measured in a subprocess (VmRSS, VmHWM), after the imports a start
makes (transformers' config and tokenizer classes, the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gguf_helpers import TinyShape, write_tiny_gguf
from memory_helpers import START
from native_helpers import needs_kernels

SHAPE = TinyShape(layers=4, hidden=1024, intermediate=2048, heads=16, kv_heads=4)


def _start(path: Path, weights: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", START, str(path), weights], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_kernels
def test_a_gguf_start_keeps_no_fp32_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", kind="Q8_0", shape=SHAPE, quantize=False)
    size = path.stat().st_size  # ~37 MB of blocks; ~140 MB as fp32
    native = _start(path, "native")
    fp32 = native["matrices"]
    assert native["weights"] == "native" and fp32 > 3.5 * size
    # measured (2-core Xeon): +76 MB, peak +110 MB for 143 MB of fp32 matrices and 37 MB
    # of blocks; a dequantized start holds +430 MB
    assert native["grew"] < 0.65 * fp32, native
    assert native["peak"] < 0.9 * fp32, native
