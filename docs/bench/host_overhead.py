"""Host work per engine step, with only the model's run stubbed, and kernels per decoder layer.

On a GPU whatever the host does between two forwards is time the GPU waits (a SmolLM2-135M
forward is ~1-2 ms there). This measures that host work on any machine: ``engine.step()`` of
an engine set up as on CUDA -- the row-invariant attention backend (what ``auto`` picks on CUDA
in the exact mode) planning every step, CUDA graphs over every shape through
``CudaGraphRunner`` (batches padded to a graph shape by ``pad_batch``, inputs staged at the
graph's addresses) -- whose only stand-ins are the device's work: the model's run
(``ModelRunner.run_model``, which a graph replay runs; it returns fixed hidden states), the
graph capture (the stand-in records nothing and its replay does nothing) and the LM head
(fixed logits whose argmax is token 17). Batch packing, padding, staging, planning, drafting,
verification, commit and output all run as on a GPU step; plain decoding and speculation with
4-node chains (the oracle drafter, every node accepted), at batch 1 and 8, over the
SmolLM2-135M vocabulary. The rows' argmax, which a GPU computes on the device, here reads
~0.2 MB a row from memory on the host: its time is measured apart and taken out (``*_us``:
host work; ``*_with_argmax_us``: the whole step here).

``--stub forward`` is the proxy as it was before 2026-12-05 (results up to
docs/bench/results/2026-12-04-*): the whole ``runner.forward`` stubbed on the CPU engine (no
graphs, no padding, no staging, no attention plan: the part of a step that differs most between
plain and speculative steps left out), kept to compare with those figures.

It also counts the ops one decoder layer dispatches in the forward CUDA runners run
(``LlamaDecoder.layer_ops``), with a TorchDispatchMode on the CPU: views are free and not
counted; the attention kernel counts one (on the GPU it is one flashinfer kernel; the CPU's
reference computes it in many ops).

    .venv/bin/python docs/bench/host_overhead.py [--json FILE] [--steps 300] [--stub replay]

``--json`` writes ``{"plain_b1_us", "spec_b1_us", "plain_b8_us", "spec_b8_us",
"ops_per_layer", ...}`` (median host microseconds per step of each kind) and the CPU.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--steps 3 --vocab 1024``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB, HIDDEN, TOKEN, DEPTH, PROMPT = 49152, 576, 17, 4, 64


def tiny_smollm2(folder: Path, layers: int = 2, vocab: int = VOCAB) -> Path:
    """SmolLM2-135M's vocabulary and widths with 2 layers (the forward is stubbed: only the
    logits' and hidden states' shapes matter), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=1536,
                         num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_theta=100000.0, bos_token_id=0, eos_token_id=vocab - 1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def stub_forward(runner, vocab: int = VOCAB) -> None:
    """``--stub forward`` (the proxy before 2026-12-05): the runner returns logits whose argmax
    is TOKEN for every row asked for (and zero hidden states), without running anything of
    its forward (no padding, staging or attention plan)."""
    from specdec.engine.runner import ForwardResult

    logits = torch.zeros(1024, vocab)
    logits[:, TOKEN] = 1.0
    hidden = torch.zeros(1024, HIDDEN)

    def forward(batch, capture_layers=()):
        rows = batch.logits_indices.numel()
        return ForwardResult(logits[:rows] if rows else None, hidden[:batch.num_rows], {}, 0.0)

    runner.forward = forward


class _NoCapture:
    """Stands in for ``CudaCapture``: runs ``fn`` once (the stubbed model run) for its output
    buffers; the graph's replay does nothing (the device's work), so every replay "writes"
    the same fixed hidden states."""

    def __call__(self, fn):
        return self, fn()

    def replay(self) -> None:
        pass


def stub_replay(engine, vocab: int = VOCAB) -> None:
    """The target runner set up as on CUDA (the invariant attention backend, CUDA graphs of
    every shape, staging sized for them: ``ModelRunner.enable_cuda_graphs``), with the model's
    run and its LM head returning fixed hidden states and logits (argmax TOKEN)."""
    from specdec.attention import invariant_backend
    from specdec.attention.backend import AttentionSpec
    from specdec.engine.cuda_graphs import CudaGraphRunner
    from specdec.engine.staging import ALIGN, Staging
    from specdec.models.decoder.llama import ForwardOutput

    runner, c = engine.parts.runner, engine.config
    cfg = runner.cfg
    spec = AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, runner.dtype,
                         runner.device)
    check, invariant_backend.check_supported = invariant_backend.check_supported, lambda s: None
    try:  # (it refuses a CPU device: its kernel never runs here)
        runner.backend = invariant_backend.InvariantAttentionBackend(spec)
    finally:
        invariant_backend.check_supported = check
    max_rows = c.max_num_batched_tokens
    runner.graphs = CudaGraphRunner(runner, c.max_num_seqs, max_rows, engine.parts.max_model_len,
                                    capture=_NoCapture())
    b = max(s.batch_size for s in runner.graphs.shapes)  # (as enable_cuda_graphs sizes it)
    runner.staging = Staging(runner.device, 8 * max_rows + (b + 1) * (runner.graphs.max_pages + 1)
                             + 10 * ALIGN)
    logits = torch.zeros(1024, vocab)
    logits[:, TOKEN] = 1.0
    hidden = torch.zeros(max_rows, HIDDEN)

    def run_model(inputs, capture_layers):
        t = inputs["input_ids"].numel()
        return ForwardOutput(hidden[:t], {i: hidden[:t] for i in capture_layers})

    runner.run_model = run_model
    runner.model.compute_logits = lambda h: logits[:h.shape[0]]
    runner.capture_graphs()  # (as build_engine does at start-up)


def step_times(folder: Path, batch: int, speculative: bool, steps: int,
               vocab: int = VOCAB, stub: str = "replay") -> list[float]:
    """Seconds of each ``engine.step()`` that decoded (prefill steps left out)."""
    from specdec import LLM, SamplingParams
    from specdec.drafters.oracle import oracle_plugin

    prompts = [[1 + (7 * i + j) % 1000 for j in range(PROMPT)] for i in range(batch)]
    kw = {}
    if speculative:
        truth = {tuple(p): [TOKEN] * (steps * (DEPTH + 1) + 8) for p in prompts}
        kw = dict(drafter="oracle", plugins=(oracle_plugin(truth, 0.0, depth=DEPTH),),
                  controller="static", controller_args={"budget": DEPTH})
    llm = LLM(model=str(folder), device="cpu", dtype="float32", max_model_len=2048,
              max_num_seqs=max(batch, 8), enable_prefix_caching=False, **kw)
    engine = llm.engine
    if stub == "forward":
        stub_forward(engine.parts.runner, vocab)
    else:
        stub_replay(engine, vocab)
    argmax = _timed_argmax()
    params = SamplingParams(temperature=0, max_tokens=steps * (DEPTH + 1 if speculative else 1),
                            ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    times, raw, graphed = [], [], 0
    while engine.has_unfinished():
        argmax.seconds = 0.0
        t0 = time.perf_counter()
        out = engine.step()
        dt = time.perf_counter() - t0
        if not out.stats.num_prefill_tokens and out.stats.num_requests == batch:
            times.append(dt - argmax.seconds)
            raw.append(dt)
            graphed += bool(out.stats.graphed)
    argmax.restore()
    assert stub == "forward" or graphed == len(times), "a decode step ran eagerly"
    llm.close()
    return times, raw


class _timed_argmax:
    """Times the verifiers' argmax (``specdec.sampling.greedy`` as they imported it)."""

    def __init__(self) -> None:
        from specdec.verifiers import greedy as greedy_mod
        from specdec.verifiers import gumbel

        self.modules, self.original, self.seconds = (gumbel, greedy_mod), gumbel.greedy, 0.0

        def timed(logits):
            t0 = time.perf_counter()
            out = self.original(logits)
            self.seconds += time.perf_counter() - t0
            return out

        for m in self.modules:
            m.greedy = timed

    def restore(self) -> None:
        for m in self.modules:
            m.greedy = self.original


class _Ops(TorchDispatchMode):
    """Counts the non-view ops dispatched while active (``paused`` ones not)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _CountedAttention:
    """The reference backend, its attention counted as the one kernel it is on a GPU (the K/V
    write is counted as it dispatches)."""

    def __init__(self, mode: _Ops) -> None:
        from specdec.attention.torch_backend import TorchAttentionBackend

        self.mode, self.inner = mode, TorchAttentionBackend(kernels=None)

    def plan(self, md) -> None:
        self.inner.plan(md)

    def run(self, q, k, v, kv_cache, scale):
        from specdec.attention.kv_rows import write_kv

        write_kv(kv_cache, self.inner._plan.write_index, k, v)
        self.mode.ops["attention"] += 1
        self.mode.paused = True
        try:  # (the reference writes K/V again, unseen: the same values)
            return self.inner.run(q, k, v, kv_cache, scale)
        finally:
            self.mode.paused = False


def layer_ops(folder: Path) -> dict:
    """Ops of one decoder layer in the forward CUDA runners run (bf16, layer_ops on): the
    difference between a forward of 2 layers and of 1, one decode row of 5 requests."""
    from specdec.attention.metadata import build_metadata
    from specdec.kv.cache import KVCache
    from specdec.models.loader import load_model

    model = load_model(folder, torch.bfloat16, "cpu", 256)[0]
    model.layer_ops = True
    cfg = model.cfg
    kv = KVCache(cfg.num_layers, 16, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    md = build_metadata([[i] for i in range(5)], [9] * 5, [1] * 5, 16)
    counts = []
    for n in (1, 2):
        mode = _Ops()
        backend = _CountedAttention(mode)
        backend.plan(md)
        with torch.inference_mode(), mode:
            model(torch.arange(5), torch.full((5,), 8), backend, kv, num_layers=n)
        counts.append(mode.ops)
    per_layer = counts[1] - counts[0]
    return {"ops_per_layer": sum(per_layer.values()), "ops": dict(sorted(per_layer.items())),
            "ops_outside_layers": sum(counts[0].values()) - sum(per_layer.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    p.add_argument("--steps", type=int, default=300, help="decode steps per run")
    p.add_argument("--stub", choices=("replay", "forward"), default="replay",
                   help="what is stubbed: the model's run in a graphed step (default), or the "
                        "whole runner.forward (the proxy before 2026-12-05)")
    p.add_argument("--vocab", type=int, default=VOCAB,
                   help="vocabulary size (SmolLM2's by default; > 1000, the prompts' ids)")
    args = p.parse_args()
    torch.set_num_threads(1)  # host work is one thread's; the stub has no parallel work
    res: dict = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                 "steps": args.steps, "depth": DEPTH, "stub": args.stub}
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_smollm2(Path(tmp) / "model", vocab=args.vocab)
        res.update(layer_ops(folder))
        for b in (1, 8):
            for name, spec in (("plain", False), ("spec", True)):
                times, raw = step_times(folder, b, spec, args.steps, args.vocab, args.stub)
                res[f"{name}_b{b}_us"] = round(statistics.median(times) * 1e6, 1)
                res[f"{name}_b{b}_with_argmax_us"] = round(statistics.median(raw) * 1e6, 1)
    res["spec_over_plain_b1"] = round(res["spec_b1_us"] / res["plain_b1_us"], 2)
    res["plain_per_extra_request_us"] = round((res["plain_b8_us"] - res["plain_b1_us"]) / 7, 1)
    res["spec_per_extra_request_us"] = round((res["spec_b8_us"] - res["spec_b1_us"]) / 7, 1)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
