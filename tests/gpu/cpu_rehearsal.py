"""A pytest plugin that rehearses tests/gpu/test_gpu.py on a CPU, before GPU time is spent.

flashinfer is replaced by the model of its wrappers (tests/attention/flashinfer_api_model.py),
CUDA-graph capture by a stand-in with a graph's semantics (tests/graph_helpers.py), and the
engine behaves as on CUDA (dtype "auto" is bfloat16, backend "auto" is flashinfer, as on CUDA
without triton: tests of the row-invariant kernel name it, and it runs under Triton's
interpreter; CUDA graphs on, the decoders' one-kernel-per-step forward). What runs is the tests' own logic and the engine's GPU-path orchestration, not kernels: the
two tests that call CUDA's graph and sync-debug APIs directly are left out.

Since no kernel speed or accuracy is at stake here, the rehearsal is sized for a slow shared CPU:
one torch thread (the shapes are small: with two threads on two busy cores each op waits on an
OpenMP barrier, measured 7-10x slower), and the "smollm2-135m" shape is replaced by
``REHEARSAL_SMOLLM2``, SmolLM2's layout (GQA group 3, head_dim 64, tied embeddings) at 2 layers
and a 512-token vocabulary (30 layers and 49152 tokens in bf16 on the CPU took most of the
rehearsal's minutes, for the same code paths), and "tiny-gpu" by ``REHEARSAL_TINY``.

    SPECDEC_TEST_DEVICE=cpu PYTHONPATH=tests/gpu python -m pytest -p cpu_rehearsal tests/gpu/test_gpu.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

CUDA_ONLY = ("test_flashinfer_graph_shape_replays_after_each_plan",
             "test_host_syncs_per_step_do_not_grow_with_the_batch")
REHEARSAL_SMOLLM2 = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, vocab_size=512,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
# "tiny-gpu" at head_dim 64 and 4 layers (EAGLE-3's feature layers) but 2 heads: bf16 matmuls
# run without bf16 units on most CPUs, and at hidden 256 they took most of the rehearsal
REHEARSAL_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                      rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)


def _install() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the invariant kernel, before triton loads
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
    import gpu_helpers
    from attention import flashinfer_api_model
    from graph_helpers import RerunCapture

    import specdec.attention as attention
    from specdec.attention import flashinfer_backend
    from specdec.config import DTYPES, EngineConfig
    from specdec.engine import build, cuda_graphs, runner
    from specdec.models import weights

    sys.modules["flashinfer"] = flashinfer_api_model.module()
    flashinfer_backend.check_supported = lambda spec: None
    attention.flashinfer_available = lambda: True
    reference_resolve = attention.resolve_backend

    def resolve(name, device, dtype, invariant=False):
        # "auto" as on CUDA without triton: flashinfer's model for half dtypes (the tests that
        # are about the invariant kernel ask for it by name: Triton's interpreter is slow)
        half = dtype in (torch.bfloat16, torch.float16)
        return "flashinfer" if name == "auto" and half else reference_resolve(name, device, dtype,
                                                                              invariant)

    def enable_runner(self, max_batch, max_rows, max_kv_len):
        self.graphs = cuda_graphs.CudaGraphRunner(self, max_batch, max_rows, max_kv_len,
                                                  capture=RerunCapture())

    def layer_ops(models, device):  # the decoders' CUDA forward (torch ops on the CPU)
        for m in models:
            if hasattr(m, "layer_ops"):
                m.layer_ops = True

    def graphed_runners(config, runners):
        return [r for r in runners if r.backend.supports_cuda_graphs] if config.cuda_graphs else []

    torch.set_num_threads(1)
    gpu_helpers.SHAPES["smollm2-135m"] = REHEARSAL_SMOLLM2
    gpu_helpers.SHAPES["tiny-gpu"] = REHEARSAL_TINY
    attention.resolve_backend = resolve
    runner.ModelRunner.enable_cuda_graphs = enable_runner
    build._graphed_runners = graphed_runners
    weights.install_layer_ops = layer_ops
    EngineConfig.torch_dtype = property(
        lambda self: torch.bfloat16 if self.dtype == "auto" else DTYPES[self.dtype])


def pytest_configure(config):
    _install()


def pytest_collection_modifyitems(config, items):
    """Run everything in test_gpu.py but the CUDA-API tests and the Triton kernel's cases
    (under the interpreter they take minutes at these shapes; the invariant backend is
    rehearsed in tests/attention/test_invariant_backend.py), whatever the skip marks say."""
    keep = []
    for item in items:
        if item.path.name == "test_gpu.py" and item.originalname not in CUDA_ONLY \
                and "[invariant-" not in item.name:
            item.own_markers = [m for m in item.own_markers if m.name != "skipif"]
            keep.append(item)
    items[:] = keep
