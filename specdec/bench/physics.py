"""What the machine can do, measured here with the kernels the engine runs: stream bandwidth,
and the multiply-add rates of specdec's compiled linear kernels with float and with q8
activations; the limits they put on a forward (the memory-bound and compute-bound times beside a
measured one, specdec.bench.budget).

Each probe is bounded by time (repeats until ``PROBE_SECONDS``, best kept: ~0.15 s each, not
the seconds a fixed-size probe takes on a slow CPU: torch's 2048-cubed int8 GEMM ran at 0.7 G
MAC/s, ~6 s a call, on a CPU without VNNI), and the three figures are cached per machine (CPU,
threads, kernel build) under ``$SPECDEC_CACHE/physics``. The rates are of the kernels' compute
regime: 64 rows over a 1024 x 1024 weight held in cache, so the weights' bytes do not bound it.

    rates = machine_rates()   # {"bandwidth_gbs": 24.3, "fp32_macs_per_s": 6.1e10, ...}
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

PROBE_SECONDS = 0.15
ROWS, SIDE = 64, 1024  # the compute probes: x [64, 1024] @ w [1024, 1024].T (4 MB fp32 weight)


def machine_rates(use_cache: bool = True) -> dict:
    """{"bandwidth_gbs", "fp32_macs_per_s", "int8_macs_per_s", "kernels"}: from the cache, or
    measured now (~0.5 s) and cached."""
    from specdec import native
    from specdec.models.aliases import cache_dir
    from specdec.models.matmul.linear import cache_key

    kernels = native.load()
    build = f"{kernels.build} {kernels.float_isa} {kernels.q8_isa}" if kernels else "torch"
    key = f"{cache_key(torch.float32, torch.get_num_threads())} {build}"
    path = cache_dir() / "physics" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    if use_cache and path.is_file():
        return json.loads(path.read_text())
    rates = {"bandwidth_gbs": bandwidth_gbs(), "fp32_macs_per_s": fma_rate(kernels),
             "int8_macs_per_s": int8_rate(kernels), "kernels": build}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(rates, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only cache: measured again next time
        tmp.unlink(missing_ok=True)
    return rates


def bandwidth_gbs() -> float:
    """Stream bandwidth (GB/s) of a 256 MB fp32 sum, all threads, the best run."""
    big = torch.ones(64 << 20)
    return big.numel() * 4 / _best(big.sum) / 1e9


def fma_rate(kernels=None) -> float:
    """fp32 multiply-adds per second of the compiled float linear kernel (64 rows, a cached
    1024 x 1024 weight); torch's matmul where the kernels are not built."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(ROWS, SIDE, generator=g), torch.randn(SIDE, SIDE, generator=g)
    if kernels is None:
        return ROWS * SIDE * SIDE / _best(lambda: x @ w.T)
    panels = kernels.prepare(w)
    return ROWS * SIDE * SIDE / _best(lambda: kernels.linear(x, panels))


def int8_rate(kernels=None) -> float:
    """int8 multiply-adds per second of the compiled q8 linear kernel (rows rounded to int8, a
    Q8_0 weight: what ``activations="q8"`` runs; 64 rows, a cached 1024 x 1024 weight); None
    where the kernels are not built."""
    if kernels is None:
        return None
    from specdec.models.checkpoints.quantize import quantize_matrix
    from specdec.models.gguf import q8_activations

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(ROWS, SIDE, generator=g), torch.randn(SIDE, SIDE, generator=g)
    panels = q8_activations.prepare(quantize_matrix(w, "Q8_0"))
    return ROWS * SIDE * SIDE / _best(lambda: kernels.linear(x, panels))


def _best(fn) -> float:
    """The shortest of repeated calls of ``fn`` (after one warm-up) within PROBE_SECONDS."""
    fn()
    best, start = float("inf"), time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > PROBE_SECONDS:
            return best
