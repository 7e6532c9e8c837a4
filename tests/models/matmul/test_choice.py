"""Which matmul hook a model gets on a device this machine does not have (the choice is made
before any kernel runs, so it is checked here on a CPU)."""

from __future__ import annotations

import pytest
import torch

from specdec.models.matmul.choice import install_kernels
from specdec.models.matmul.linear import LinearKernels

CUDA = torch.device("cuda")


def test_float64_on_cuda_gets_a_matmul_that_takes_it():
    """The Triton row-invariant matmul refuses float64 (the GPU tests' dtype for exact argmaxes):
    float64 on CUDA goes to F.linear instead of a hook that raises at the first forward."""
    kernels = install_kernels([], "invariant", torch.float64, CUDA)
    assert isinstance(kernels, LinearKernels) and kernels.key == LinearKernels.plain().key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_dtypes_the_triton_matmul_takes_get_it(dtype):
    pytest.importorskip("triton")
    from specdec.kernels.invariant_matmul import DTYPES, InvariantLinear

    assert dtype in DTYPES
    assert isinstance(install_kernels([], "invariant", dtype, CUDA), InvariantLinear)
