"""What the machine can do, measured here: stream bandwidth and the fp32 matmul rate, and the
limits they put on a forward (the memory-bound and compute-bound times beside a measured one).
"""

from __future__ import annotations

import time

import torch


def bandwidth_gbs() -> float:
    """Stream bandwidth (GB/s) of a 512 MB fp32 sum, all threads, best of 5."""
    big = torch.ones(128 << 20)
    big.sum()
    best = min(_time(big.sum) for _ in range(5))
    return big.numel() * 4 / best / 1e9


def fma_rate() -> float:
    """fp32 multiply-adds per second of a large square matmul, all threads, best of 3."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    return 2048 ** 3 / min(_time(lambda: a @ b) for _ in range(3))


def int8_rate() -> float:
    """int8 multiply-adds per second of a large square int8 matmul (torch's own int8 GEMM:
    AMX or VNNI where the CPU has them), all threads, best of 3."""
    a = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    b = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    torch._int_mm(a, b)
    return 2048 ** 3 / min(_time(lambda: torch._int_mm(a, b)) for _ in range(3))


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
