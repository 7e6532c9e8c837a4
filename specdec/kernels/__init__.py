"""Row-invariant Triton kernels for the GPU: a row's result is bitwise the same whatever else
is in the call (see DESIGN.md, "Row invariance"). Nothing imports these modules at specdec
import time; they import triton at the top, so only GPU code paths (and their tests, under
TRITON_INTERPRET=1) import them."""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether triton imports here (CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None
