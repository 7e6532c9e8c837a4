"""ms per linear call of every kernel format the GGUF types run in (gguf_blocks.KERNEL_FORMAT),
float and 8-bit activations, at 1 and 8 rows, for a 2048x2048 and an 8192x2048 matrix of random
blocks; and each format's bytes per weight against the file's.

    .venv/bin/python docs/bench/gguf_type_kernels.py [--threads 1] [--repeats 7] [--kinds ...]

One process, every configuration timed in turn, ``--repeats`` rounds interleaved, the fastest
and the median of each (a round: a call after a warm-up call; on a busy machine the median
catches the scheduler's slices, the fastest does not). Ratios only mean something within one
run: say which CPU and how busy it was. Run from the checkout's root with ``PYTHONPATH=.``
where another checkout is installed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specdec import native
from specdec.bench.random_blocks import random_blocks as blocks_of
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa

# one GGUF type per kernel format (Q4_0 runs Q4_1's, Q5_0 Q8_0's; Q5_1 runs Q5_F)
KINDS = ["Q4_1", "Q8_0", "Q4_K", "Q5_1", "Q5_K", "Q6_K"]


def random_blocks(kind: str, out: int, inp: int) -> gb.Blocks:
    """Random ``kind`` blocks of weights with std 0.02 (specdec.bench.random_blocks)."""
    from gguf import GGMLQuantizationType

    rows = blocks_of(np.random.default_rng(0), GGMLQuantizationType[kind], out, inp, 0.02)
    return gb.Blocks(kind, torch.from_numpy(rows), inp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kinds", default=",".join(KINDS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    k = native.load()
    cases = {}
    for kind in a.kinds.split(","):
        for out, inp in ((2048, 2048), (8192, 2048)):
            b = random_blocks(kind, out, inp)
            for mode, make in (("float", gb.prepare), ("q8", qa.prepare)):
                p = make(b)
                for rows in (1, 8):
                    cases[(kind, out, inp, mode, rows)] = (p, torch.randn(rows, inp), b.nbytes)
    times = {c: [] for c in cases}
    for _ in range(a.repeats):
        for c, (p, x, _) in cases.items():
            k.linear(x, p)
            t0 = time.perf_counter()
            k.linear(x, p)
            times[c].append(time.perf_counter() - t0)
    print(f"threads {a.threads}, q8 isa {k.q8_isa}, fastest / median of {a.repeats}")
    print("type  kernel   matrix     mode  rows  ms fastest  median  B/weight kernel  file")
    for c, (p, _, file_bytes) in cases.items():
        kind, out, inp, mode, rows = c
        fast, med = 1e3 * min(times[c]), 1e3 * statistics.median(times[c])
        print(f"{kind:5} {gb.KERNEL_FORMAT[kind]:8} {out}x{inp:<5} {mode:5} {rows:4} "
              f"{fast:8.3f} {med:8.3f}  {p.nbytes / (out * inp):.4f}  "
              f"{file_bytes / (out * inp):.4f}")


if __name__ == "__main__":
    main()
