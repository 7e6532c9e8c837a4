"""The backend registry: names, "auto" by device and dtype, what flashinfer refuses and why
(everything here runs without a GPU; the GPU checks are in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from specdec.attention import CHOICES, create_backend, flashinfer_available, resolve_backend
from specdec.attention.backend import AttentionSpec
from specdec.attention.flashinfer_backend import check_supported
from specdec.config import EngineConfig


def spec(device="cpu", dtype=torch.float32) -> AttentionSpec:
    return AttentionSpec(4, 2, 16, dtype, torch.device(device))


def test_names_and_auto():
    from specdec.kernels import triton_available

    assert CHOICES == ("auto", "torch", "invariant", "flashinfer", "flex")
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "torch"
    assert resolve_backend("auto", "cpu", torch.bfloat16, invariant=True) == "torch"
    assert resolve_backend("auto", "cuda", torch.float32) == "torch"  # flashinfer has no fp32
    want = "flashinfer" if flashinfer_available() else "torch"
    assert resolve_backend("auto", "cuda:0", torch.bfloat16) == want
    # a row-invariant engine gets the row-invariant kernel on CUDA (in float32 too), where
    # triton imports; float64 has no Triton kernel
    invariant = "invariant" if triton_available() else want
    assert resolve_backend("auto", "cuda", torch.bfloat16, invariant=True) == invariant
    assert resolve_backend("auto", "cuda", torch.float64, invariant=True) == "torch"
    assert resolve_backend("flex", "cpu", torch.float32) == "flex"
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch"):
        resolve_backend("sdpa", "cpu", torch.float32)
    assert create_backend("auto", spec()).name == "torch"
    assert create_backend("flex", spec()).name == "flex"


def test_flashinfer_says_what_stands_in_its_way():
    with pytest.raises(ValueError, match="runs on CUDA devices only"):
        check_supported(spec("cpu", torch.bfloat16))
    with pytest.raises(ValueError, match="needs dtype bfloat16 or float16.*'torch' or 'flex'"):
        check_supported(spec("cuda", torch.float32))
    if not flashinfer_available():
        with pytest.raises(ValueError, match="needs the flashinfer-python package"):
            check_supported(spec("cuda", torch.bfloat16))


def test_engine_config_defaults_and_checks():
    cpu, cuda = EngineConfig(), EngineConfig(device="cuda")
    assert cpu.dtype == "auto" and cpu.torch_dtype == torch.float32
    assert cuda.torch_dtype == torch.bfloat16
    assert EngineConfig(device="cuda", dtype="float32").torch_dtype == torch.float32
    assert cpu.attention_backend == "auto" and cpu.cuda_graphs is True
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, "
                                         "invariant, flashinfer, flex, got 'fa3'"):
        EngineConfig(attention_backend="fa3")
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineConfig(dtype="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tiny_llama):
    from specdec.engine.llm import LLM

    with pytest.raises(ValueError, match="device 'cuda' but CUDA is not available here"):
        LLM(model=str(tiny_llama), device="cuda")


def test_flashinfer_on_the_cpu_is_a_clear_error(tiny_llama):
    from specdec.engine.llm import LLM

    with pytest.raises(ValueError, match="'flashinfer' runs on CUDA devices only"):
        LLM(model=str(tiny_llama), attention_backend="flashinfer")


@pytest.mark.parametrize(("device", "want"), [("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_the_device_is_made_current_through_torchs_own_set_device(monkeypatch, device, want):
    """The engine makes its device current with torch.cuda.set_device, run for real here: only
    CUDA's availability and the driver call under it are stubbed (the first GPU run found
    ``set_device(torch.device("cuda"))`` refused by torch, which no CPU test had called)."""
    from specdec.engine.build import _check_device

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", calls.append, raising=False)
    _check_device(torch.device(device))
    assert calls == [want]
    with pytest.raises(ValueError, match="device 'cuda:7' but this machine has 2 CUDA"):
        _check_device(torch.device("cuda:7"))
