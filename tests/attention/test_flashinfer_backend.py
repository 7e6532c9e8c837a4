"""The flashinfer backend's use of flashinfer's API, on the CPU: with a model of the two wrappers
(flashinfer_api_model.py: their documented semantics and CUDA-graph buffer checks) in place of
flashinfer, the backend must attend exactly as the torch reference backend does, route each step
to the right kernel, and keep CUDA-graph shapes in their fixed buffers. The kernels themselves
are compared with the reference on a GPU (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from gpu.gpu_helpers import random_cache, random_step

from specdec.attention import flashinfer_backend
from specdec.attention.backend import AttentionSpec
from specdec.attention.torch_backend import TorchAttentionBackend

H, HKV, D, PAGE, PAGES = 6, 2, 8, 4, 160
F64 = torch.float64
KINDS = {
    "mixed": ["prefill", "chunk", "decode", "tree", "decode", "tree", "chunk"],
    "decode": ["decode"] * 5,
    "prefill": ["prefill", "chunk", "chunk"],
    "trees": ["tree"] * 3,
}


@pytest.fixture
def backend_cls(flashinfer_api_model):
    return flashinfer_backend.FlashInferAttentionBackend


def _make(cls, **kw):
    return cls(AttentionSpec(H, HKV, D, F64, torch.device("cpu")), workspace_bytes=8, **kw)


def _step(seed: int, kinds: list[str], chain: bool = False):
    gen = torch.Generator().manual_seed(seed)
    step = random_step(gen, kinds, PAGES, PAGE, (H, HKV, D), "cpu", F64, chain=chain)
    return step, random_cache(gen, PAGES, PAGE, HKV, D, "cpu", F64)


def _reference(step, cache):
    cache = cache.clone()
    backend = TorchAttentionBackend()
    backend.plan(step.md)
    return backend.run(step.q, step.k, step.v, cache, D**-0.5), cache


def _run(backend, step, cache):
    cache = cache.clone()
    backend.plan(step.md)
    return backend.run(step.q, step.k, step.v, cache, D**-0.5), cache


@pytest.mark.parametrize("kinds", list(KINDS))
@pytest.mark.parametrize("decode_path", ["decode", "prefill"])
def test_attends_as_the_reference_backend(backend_cls, kinds, decode_path):
    backend = _make(backend_cls, decode_path=decode_path)
    for seed in range(3):
        step, cache = _step(seed, KINDS[kinds])
        want, want_cache = _reference(step, cache)
        got, got_cache = _run(backend, step, cache)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert torch.equal(got_cache, want_cache)


def test_each_step_goes_to_its_kernel(backend_cls):
    backend = _make(backend_cls)
    routes = {}
    for name, kinds in KINDS.items():
        step, cache = _step(0, kinds)
        _run(backend, step, cache)
        routes[name] = backend._step.wrapper
    assert routes["decode"] is backend._decode  # plain decode rows: the decode kernel
    assert routes["prefill"] is backend._causal and backend._causal.causal
    assert routes["mixed"] is routes["trees"] is backend._masked
    assert backend._masked.mask is not None and not backend._masked.causal
    assert _make(backend_cls, decode_path="prefill")._decode.plans == 0
    with pytest.raises(ValueError, match="decode_path must be one of decode, prefill"):
        _make(backend_cls, decode_path="fast")
    with pytest.raises(ValueError, match="prefill_backend must be one of auto, fa2, fa3"):
        _make(backend_cls, prefill_backend="fa4")


def test_a_chain_mask_attends_as_causal(backend_cls):
    step, cache = _step(5, ["tree"] * 3, chain=True)
    masked, _ = _run(_make(backend_cls), step, cache)
    step.md.custom_masks = [None] * step.md.batch_size
    causal, _ = _run(_make(backend_cls), step, cache)
    torch.testing.assert_close(masked, causal, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kinds", "decode_path"), [("decode", "decode"), ("decode", "prefill"),
                                                    ("mixed", "decode")])
def test_graph_shapes_plan_into_fixed_buffers(backend_cls, kinds, decode_path):
    """Steps of a registered (B, T) shape use that shape's graph-mode wrapper and write index:
    the same objects every step (a captured graph keeps pointing at them), refilled by plan()."""
    backend = _make(backend_cls, decode_path=decode_path)
    steps = []
    for seed in range(200):
        step, cache = _step(seed, KINDS[kinds])
        if not steps or step.q.shape[0] == steps[0][0].q.shape[0]:
            steps.append((step, cache))
        if len(steps) == 3:
            break
    b, t = len(KINDS[kinds]), steps[0][0].q.shape[0]
    masked = kinds == "mixed"
    backend.add_graph_shape(b, t, max_pages=PAGES, page_size=PAGE, masked=masked)
    shape = backend._graph_shapes[(b, t, masked)]
    kind = "masked" if masked else "decode" if decode_path == "decode" else "causal"
    assert shape.wrapper.graph and shape.kind == kind
    for step, cache in steps:
        want, _ = _reference(step, cache)
        got, _ = _run(backend, step, cache)
        assert backend._step.wrapper is shape.wrapper
        assert backend._step.write_index.data_ptr() == shape.write_index.data_ptr()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert shape.wrapper.plans == len(steps)
    other, cache = _step(0, KINDS[kinds][:-1])  # another batch size: the eager wrappers
    _run(backend, other, cache)
    assert backend._step.wrapper is not shape.wrapper
