"""Imported by the kernel tests (an autouse fixture). Under Triton's interpreter (no GPU), a ``tl.dot`` is numpy's ``matmul``: the host's BLAS. Its
result for one row of a tile may depend on the tile's other rows (OpenBLAS with
``OPENBLAS_CORETYPE=Haswell`` on an AVX-512 CPU does: a row's sum changes with its place in a
16-row tile), which is a property of the host library, not of the kernel the GPU compiles.

What the kernels control is which tiles a row's result is summed from and in what order (no
split-K, K walked from 0, tile sizes from the weight alone). So here every interpreted
``tl.dot`` is replaced by one whose rows are each a fixed-order sum over K of that row alone:
bitwise the same on every host, and a kernel that let the batch choose its K order or split
would still give a row different bits alone and in a batch.
"""

from __future__ import annotations

import os

import numpy as np
import pytest


def row_by_row_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``a @ b + acc`` with each output row the in-order sum over K of its own row of ``a``
    (products and sums in ``acc``'s dtype; no BLAS). a [..., M, K], b [..., K, N], acc [..., M, N]."""
    a = a.astype(acc.dtype, copy=False)
    b = b.astype(acc.dtype, copy=False)
    total = np.zeros(np.broadcast_shapes(a.shape[:-1] + b.shape[-1:], acc.shape), acc.dtype)
    for k in range(a.shape[-1]):
        total += a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return total + acc


@pytest.fixture(autouse=True)
def host_independent_interpreter_dot(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # compiled for a GPU: its tensor cores, not this stand-in
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and b.dtype.is_floating()
                and a.dtype.primitive_bitwidth >= 16 and d.dtype.is_floating()):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        if a.dtype.is_bf16() or b.dtype.is_bf16():  # kept as uint16 bit patterns
            raise AssertionError("an interpreted tl.dot on bf16 bit patterns: upcast first")
        return interpreter.TensorHandle(row_by_row_dot(a.data, b.data, d.data), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)

