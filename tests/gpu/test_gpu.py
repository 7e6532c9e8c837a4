"""The GPU path on a GPU (skipped without CUDA): flashinfer and flex against the torch reference,
CUDA-graph replay against eager, greedy speculation against plain decoding, sampling on device.

Run by tests/gpu/run.sh, which also records what these checks measured (max relative errors,
match rates) in $SPECDEC_GPU_REPORT through ``Report``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from gpu_helpers import SHAPES, Report, make_model, random_cache, random_step, rel_error

from specdec.attention import flashinfer_available
from specdec.attention.backend import AttentionSpec
from specdec.attention.torch_backend import TorchAttentionBackend

# SPECDEC_TEST_DEVICE=cpu dry-runs the tests that need no flashinfer on the CPU (to check this
# file before spending GPU time); by default they need CUDA and are skipped without it
DEV = torch.device(os.environ.get("SPECDEC_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEV.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")
needs_flashinfer = pytest.mark.skipif(DEV.type != "cuda" or not flashinfer_available(),
                                      reason="needs flashinfer on CUDA")

PAGE, PAGES = 16, 256
H, HKV, D = 8, 2, 64  # GQA group 4; the SmolLM2 group (3) runs in the engine tests below
REPORT = Report()
MIXED = ["prefill", "chunk", "decode", "tree", "decode", "tree", "chunk", "tree"]


@pytest.mark.timeout(150)  # the process's first engine: CUDA and kernel libraries load here
@pytest.mark.parametrize("device", ["default", "indexed"])
def test_smoke_llm_starts_on_the_device_and_decodes(tmp_path, device):
    """First, because nothing else matters if it fails: ``LLM(device=...)`` builds on the
    device ("cuda" and "cuda:0"), decodes plainly and with a drafter, and a full batch's
    speculative steps replay graphs (with flashinfer)."""
    from specdec.engine.llm import LLM
    from specdec.sampling_params import SamplingParams

    folder = make_model(tmp_path / "tiny", "tiny-gpu")
    name = str(DEV) if device == "default" or DEV.type != "cuda" else f"cuda:{DEV.index or 0}"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9, 7, 8, 9, 7]]
    plain = LLM(model=str(folder), device=name, max_model_len=256, max_num_seqs=2)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(model=str(folder), device=name, max_model_len=256, max_num_seqs=2,
               drafter="ngram", controller="static", controller_args={"budget": 3})
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert all(len(w) == 12 for w in want)
    budget = spec.engine.totals.budget.get("speculative")
    REPORT.add("smoke", device=name, backend=spec.engine.parts.runner.backend.name,
               token_match=_match_rate(got, want),
               spec_graphed=budget and budget.graphed_steps,
               spec_eager=budget and budget.eager_steps)
    if spec.engine.parts.runner.graphs is not None and budget is not None:
        assert budget.eager_steps == 0, budget
    if DEV.type == "cuda":  # row-invariant by default: the Triton kernels where triton imports
        from specdec.kernels import triton_available

        want = "invariant" if triton_available() else "flashinfer"
        assert spec.engine.parts.runner.backend.name == want


def _reference(step, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend in float32 on the same inputs: (output, cache after the write)."""
    ref_cache = cache.float().clone()
    backend = TorchAttentionBackend()
    backend.plan(step.md)
    out = backend.run(step.q.float(), step.k.float(), step.v.float(), ref_cache, D**-0.5)
    return out, ref_cache


def _run(backend, step, cache) -> torch.Tensor:
    backend.plan(step.md)
    return backend.run(step.q, step.k, step.v, cache, D**-0.5)


def _flashinfer(dtype, **kwargs):
    from specdec.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(AttentionSpec(H, HKV, D, dtype, DEV), **kwargs)


KINDS = {"mixed": MIXED, "decode": ["decode"] * 5, "prefill": ["prefill", "chunk"],
         "trees": ["tree"] * 3}
CASES = [(torch.bfloat16, k) for k in KINDS] + [(torch.float16, "mixed"), (torch.float16,
                                                                            "decode")]


@needs_flashinfer
@pytest.mark.parametrize(("dtype", "kinds"), CASES, ids=[f"{d}-{k}" for d, k in CASES])
def test_flashinfer_matches_the_torch_backend(dtype, kinds):
    """(fp16 runs two cases: each dtype is its own JIT compile on the GPU machine.)"""
    kinds = KINDS[kinds]
    worst = 0.0
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        step = random_step(gen, kinds, PAGES, PAGE, (H, HKV, D), DEV, dtype)
        cache = random_cache(gen, PAGES, PAGE, HKV, D, DEV, dtype)
        want, want_cache = _reference(step, cache)
        for path in ("decode", "prefill"):
            got = _run(_flashinfer(dtype, decode_path=path), step, cache)
            assert torch.equal(cache.float(), want_cache)  # the same slots written
            err = rel_error(got, want)
            worst = max(worst, err)
            assert err < 1e-2, (kinds, seed, path, err)
    REPORT.add("flashinfer_vs_torch", dtype=str(dtype), kinds=",".join(kinds), max_rel_err=worst)


@needs_flashinfer
def test_flashinfer_chain_mask_equals_causal():
    gen = torch.Generator().manual_seed(0)
    step = random_step(gen, ["tree"] * 4, PAGES, PAGE, (H, HKV, D), DEV, torch.bfloat16,
                       chain=True)
    cache = random_cache(gen, PAGES, PAGE, HKV, D, DEV, torch.bfloat16)
    masked = _run(_flashinfer(torch.bfloat16), step, cache.clone())
    step.md.custom_masks = [None] * step.md.batch_size
    causal = _run(_flashinfer(torch.bfloat16), step, cache.clone())
    err = rel_error(masked, causal)
    REPORT.add("flashinfer_chain_vs_causal", max_rel_err=err)
    assert err < 1e-3


@needs_flashinfer
@pytest.mark.parametrize("kinds", [["decode"] * 4, ["tree", "decode", "tree", "chunk"]],
                         ids=["decode", "mixed"])
def test_flashinfer_graph_shape_replays_after_each_plan(kinds):
    """Capture run() once in a graph shape; replay it after plans of other steps of that shape
    (other lengths, pages, masks): each replay equals the eager backend."""
    dtype = torch.bfloat16
    backend = _flashinfer(dtype)
    gen = torch.Generator().manual_seed(1)
    steps = [random_step(gen, kinds, PAGES, PAGE, (H, HKV, D), DEV, dtype)]
    t = steps[0].q.shape[0]
    for _ in range(400):  # more steps with the same row count (one graph shape)
        step = random_step(gen, kinds, PAGES, PAGE, (H, HKV, D), DEV, dtype)
        if step.q.shape[0] == t:
            steps.append(step)
        if len(steps) == 4:
            break
    assert len(steps) >= 2
    backend.add_graph_shape(len(kinds), t, PAGES, PAGE)
    cache = random_cache(gen, PAGES, PAGE, HKV, D, DEV, dtype)
    q, k, v = (torch.zeros_like(x) for x in (steps[0].q, steps[0].k, steps[0].v))
    backend.plan(steps[0].md)
    backend.run(q, k, v, cache.clone(), D**-0.5)  # warm-up (JIT) outside the capture
    graph_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.run(q, k, v, graph_cache, D**-0.5)
    worst = 0.0
    for step in steps:
        graph_cache.copy_(cache)
        backend.plan(step.md)
        q.copy_(step.q), k.copy_(step.k), v.copy_(step.v)
        graph.replay()
        want = _run(_flashinfer(dtype), step, cache.clone())
        worst = max(worst, rel_error(out, want))
    REPORT.add("flashinfer_graph_vs_eager", kinds=",".join(kinds), max_rel_err=worst,
               steps=len(steps))
    assert worst < 1e-2


# eager: what the backend runs by default (its compiled form is opt-in: on the H200 inductor
# found no template for one of these steps, see specdec/attention/flex_backend.py)
def test_flex_matches_the_torch_backend_on_gpu(compile=False):
    from specdec.attention.flex_backend import FlexAttentionBackend

    worst = 0.0
    for seed in range(2):  # two step shapes: the second recompiles (dynamic shapes)
        gen = torch.Generator().manual_seed(seed)
        step = random_step(gen, MIXED, PAGES, PAGE, (H, HKV, D), DEV, torch.bfloat16)
        cache = random_cache(gen, PAGES, PAGE, HKV, D, DEV, torch.bfloat16)
        want, _ = _reference(step, cache)
        got = _run(FlexAttentionBackend(compile=compile), step, cache)
        worst = max(worst, rel_error(got, want))
    REPORT.add("flex_vs_torch", compiled=compile, max_rel_err=worst)
    assert worst < 1e-2


# ---- the engine on the GPU ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("tiny-gpu"), "tiny-gpu"))


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("smollm2"), "smollm2-135m"))


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 40, 1, 17, 64, 9, 28, 3, 100, 12]
    return [torch.randint(1, vocab - 1, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


@needs_flashinfer
def test_cuda_graph_replay_equals_eager_for_every_shape(gpu_model):
    """Every shape of a runner (batch sizes up to 8, rows up to 64): the graph's replay equals the
    same padded step run eagerly through the same kernels (bitwise), and the unpadded eager step
    within bf16 rounding."""
    from specdec.engine.cuda_graphs import choose_shape, dummy_rows
    from specdec.engine.runner import ModelRunner
    from specdec.models.loader import load_model

    model = load_model(gpu_model, torch.bfloat16, DEV, 512)[0]
    graphed = ModelRunner(model, "graphed", "flashinfer", PAGE, DEV)
    eager = ModelRunner(model, "eager", "flashinfer", PAGE, DEV)
    for r in (graphed, eager):
        r.allocate(512)
    graphed.enable_cuda_graphs(max_batch=8, max_rows=64, max_kv_len=512)
    vocab = SHAPES["tiny-gpu"]["vocab_size"]
    worst, bitwise, checked = 0.0, True, []
    for shape in graphed.graphs.shapes:
        big, rows_ = shape.batch_size, shape.num_rows
        smaller = (big - 1, big - 1) if shape.decode else (max(1, big - 1), rows_ - 3)
        for b, t in [(big, rows_), smaller]:
            decode = t == b
            if b < 1 or t < b or choose_shape(b, t, decode, graphed.graphs.shapes) != shape:
                continue
            rows = [t // b] * b
            rows[-1] += t - sum(rows)
            got, want, again = _graph_vs_eager(graphed, eager, rows, vocab)
            worst = max(worst, rel_error(got, want))
            bitwise &= torch.equal(got, again)
            checked.append((shape.batch_size, shape.num_rows, b, t, len(dummy_rows(shape, b, t))))
    REPORT.add("cuda_graphs_vs_eager", shapes=len(graphed.graphs.shapes), steps=len(checked),
               max_rel_err=worst, replay_bitwise_equal_to_same_kernels=bitwise,
               capture_seconds=graphed.graphs.capture_seconds)
    assert len(checked) >= len(graphed.graphs.shapes)
    assert bitwise and worst < 2e-2


def _graph_vs_eager(graphed, eager, rows: list[int], vocab: int):
    """One step of len(rows) requests (rows[i] new tokens after 30 cached) on both runners:
    (graphed hidden, eager hidden, the padded step eagerly through the graph's kernels)."""
    from specdec.engine.cuda_graphs import pad_batch
    from specdec.kv.block_table import BlockTable

    g = torch.Generator()
    outs = []
    for runner in (graphed, eager):
        tables = []
        for n in rows:
            t = BlockTable()
            runner.kv.reserve(t, 30 + n)
            tables.append(t)
        g.manual_seed(len(rows) * 1000 + sum(rows))  # the same tokens for both runners
        ctx = [torch.randint(1, vocab, (30,), generator=g).tolist() for _ in rows]
        feeds = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in rows]
        graphs, runner.graphs = runner.graphs, None
        runner.forward(runner.pack(ctx, [0] * len(rows), tables, logits="none"))  # eager prefill
        runner.graphs = graphs
        batch = runner.pack(feeds, [30] * len(rows), tables, logits="all")
        outs.append(runner.forward(batch).final_hidden)
        if runner is graphed:
            shape = runner.graphs.shape_for(batch)
            padded = pad_batch(batch, shape, runner.graphs.scratch)
            with torch.inference_mode():
                runner.backend.plan(padded.metadata)
                inputs = {"input_ids": padded.input_ids.to(DEV),
                          "positions": padded.positions.to(DEV)}
                again = runner.run_model(inputs, ()).hidden[:batch.num_rows]
        for t in tables:
            runner.kv.release(t)
    return outs[0], outs[1], again


def _llm(model, **kw):
    from specdec.engine.llm import LLM

    return LLM(model=model, device=str(DEV), max_model_len=512, **kw)


def _greedy(n=24):
    from specdec.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_greedy_speculation_equals_plain_torch_backend(gpu_model, dtype):
    """The torch backend on the GPU, with the oracle drafter (drafts accepted at a known rate),
    ngram and a random EAGLE-3 head: token for token in float64 (no argmax tie can flip);
    float32's match rate is reported and must be all but exact."""
    from specdec.drafters.oracle import oracle_plugin

    prompts = _prompts(6, SHAPES["tiny-gpu"]["vocab_size"])
    kw = dict(dtype=dtype, attention_backend="torch")
    plain = _llm(gpu_model, **kw)
    want = [o.token_ids for o in plain.generate(prompts, _greedy())]
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    runs = {
        "oracle": _llm(gpu_model, drafter="oracle", plugins=(oracle_plugin(truth, 0.3, depth=4),),
                       controller="static", controller_args={"budget": 4}, **kw),
        "ngram": _llm(gpu_model, drafter="ngram", controller="static", **kw),
        "eagle3": _llm(gpu_model, drafter="eagle3", controller="static",
                       controller_args={"budget": 5},
                       drafter_args={"head": _random_head(gpu_model, dtype), "depth": 3,
                                     "topk": 2}, **kw),
    }
    for name, llm in runs.items():
        got = llm.generate(prompts, _greedy())
        rate = _match_rate([o.token_ids for o in got], want)
        REPORT.add("greedy_torch_backend", dtype=dtype, drafter=name, token_match_rate=rate,
                   accepted=sum(sum(o.metrics.accepted_by_depth) for o in got))
        assert rate == 1.0 if dtype == "float64" else rate > 0.95, (name, rate)
        if name == "oracle":
            assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0
        if name == "eagle3":  # a random head on a random target: proposed, rarely accepted
            assert sum(o.metrics.draft_tokens_proposed for o in got) > 0


@pytest.mark.timeout(120)  # two engines, each compiling the gathered kernels for its shapes
def test_moe_speculation_equals_plain_with_gathered_experts(tmp_path, dtype="bfloat16"):
    """A tiny qwen3_moe target on the device with the row-invariant Triton kernels, in bf16
    (the GPU's default, where a batch-dependent sum would flip tokens soonest): its experts
    stacked and run gathered (specdec/kernels/invariant_moe.py: no host read of the routing),
    oracle speculation gives plain decoding's tokens, and each step reports the experts it
    woke. (Eager: no CUDA graph for an MoE yet.)"""
    from conftest import make_tiny_model

    from specdec.drafters.oracle import oracle_plugin
    from specdec.hookspecs import hookimpl

    folder = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=0, hidden_size=128,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             num_hidden_layers=3, num_experts=16, num_experts_per_tok=4,
                             moe_intermediate_size=64, initializer_range=0.1)
    class Steps:  # a plugin that keeps every step's stats
        def __init__(self) -> None:
            self.stats = []

        @hookimpl
        def specdec_step_end(self, stats):
            self.stats.append(stats)

    prompts, steps = _prompts(6, 96), Steps()
    kw = dict(dtype=dtype, attention_backend="torch", linear_kernels="invariant")
    plain = _llm(str(folder), **kw)
    if DEV.type == "cuda":  # (the CPU dry run computes the layers in C instead)
        assert all(layer.moe.stacked_gate_up is not None
                   for layer in plain.engine.parts.model.layers)
    want = [o.token_ids for o in plain.generate(prompts, _greedy())]
    spec = _llm(str(folder), drafter="oracle", controller="static",
                controller_args={"budget": 4},
                plugins=(oracle_plugin({tuple(p): w for p, w in zip(prompts, want)}, 0.3,
                                       depth=4), steps), **kw)
    got = spec.generate(prompts, _greedy())
    rate = _match_rate([o.token_ids for o in got], want)
    woken = [s.experts_woken for s in steps.stats if s.experts_woken]
    REPORT.add("moe_gathered", dtype=dtype, token_match_rate=rate,
               accepted=sum(sum(o.metrics.accepted_by_depth) for o in got),
               steps_with_experts=len(woken))
    assert rate == 1.0
    assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0
    assert woken and all(0 < w <= 16 for step in woken for w in step)


def test_host_tier_serves_evicted_pages_with_the_same_tokens(gpu_model):
    """Prefix caching with the host-memory tier (pinned, copies queued on the forward's stream):
    six 150-token prompts in a 32-page KV, twice; the second pass reads the evicted pages back
    and emits exactly what an engine without the cache does (float64: no tie can flip)."""
    prompts = [p * 15 for p in _prompts(6, SHAPES["tiny-gpu"]["vocab_size"], seed=3)]
    prompts = [(p + list(range(1, 151)))[:150] for p in prompts]
    kw = dict(dtype="float64", attention_backend="torch", num_pages=32)
    want = [o.token_ids for o in _llm(gpu_model, enable_prefix_caching=False,
                                      **kw).generate(prompts * 2, _greedy())]
    llm = _llm(gpu_model, kv_host_tier_bytes=64 << 20, **kw)
    got = [llm.generate(p, _greedy())[0].token_ids for p in prompts * 2]
    tier = llm.engine.parts.tier
    REPORT.add("host_tier", hits=tier.hits, stores=tier.stores)
    assert got == want
    assert tier.hits > 0 and tier.stores > 0
    assert llm.engine.kv.num_free_pages == 32


def _match_rate(got: list[list[int]], want: list[list[int]]) -> float:
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    return same / sum(len(w) for w in want)


def _random_head(folder, dtype):
    """drafter_helpers.random_head for the target at ``folder``, on the GPU in ``dtype``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
    from drafter_helpers import random_head

    from specdec.models.decoder.config import resolve_dtype
    from specdec.models.loader import load_model

    return random_head(*load_model(folder, resolve_dtype(dtype), DEV, 512))


@needs_flashinfer
def test_eagle3_head_runs_in_cuda_graphs(gpu_model):
    """bf16 + flashinfer: the EAGLE-3 head's runner replays graphs too (features padded); the
    speculative tokens against plain are reported."""
    prompts = _prompts(4, SHAPES["tiny-gpu"]["vocab_size"])
    want = [o.token_ids for o in _llm(gpu_model).generate(prompts, _greedy())]
    spec = _llm(gpu_model, drafter="eagle3", controller="static", controller_args={"budget": 5},
                drafter_args={"head": _random_head(gpu_model, "bfloat16"), "depth": 3,
                              "topk": 2})
    got = spec.generate(prompts, _greedy())
    head_runner = spec.engine.parts.drafter_runners[0]
    rate = _match_rate([o.token_ids for o in got], want)
    REPORT.add("eagle3_bf16_graphs", token_match_rate=rate,
               head_graphs=head_runner.graphs.num_graphs,
               target_graphs=spec.engine.parts.runner.graphs.num_graphs)
    assert head_runner.graphs is not None and head_runner.graphs.num_graphs > 0
    assert rate > 0.5


MODES = {  # the engine's default on CUDA (row-invariant), and flashinfer + cuBLAS
    "invariant": dict(attention_backend="invariant"),
    "fast": dict(attention_backend="flashinfer", linear_kernels="plain")}


@pytest.mark.parametrize(("mode", "graphs"), [("invariant", True), ("invariant", False),
                                              ("fast", True)])
def test_greedy_speculation_bf16_equals_plain_where_invariant(smollm2_shape, mode, graphs):
    """bf16 on the SmolLM2 shape (GQA group 3), speculative vs plain greedy tokens. The default
    (row-invariant Triton attention and matmuls): token for token. flashinfer + cuBLAS: near-ties
    between bf16 logits can flip, so its match rate is reported (and most tokens match)."""
    from specdec.drafters.oracle import oracle_plugin

    if mode == "fast" and not flashinfer_available():
        pytest.skip("needs flashinfer")
    prompts = _prompts(8, SHAPES["smollm2-135m"]["vocab_size"])
    kw = dict(cuda_graphs=graphs, **MODES[mode])
    plain = _llm(smollm2_shape, **kw)
    assert (plain.engine.parts.runner.graphs is not None) == graphs
    want = [o.token_ids for o in plain.generate(prompts, _greedy(48))]
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    spec = _llm(smollm2_shape, drafter="oracle", plugins=(oracle_plugin(truth, 0.2, depth=4),),
                controller="static", controller_args={"budget": 4}, **kw)
    got = spec.generate(prompts, _greedy(48))
    rate = _match_rate([o.token_ids for o in got], want)
    budget = spec.engine.totals.budget.get("speculative")
    REPORT.add("greedy_bf16", mode=mode, graphs=graphs, token_match_rate=rate,
               identical_requests=sum(o.token_ids == w for o, w in zip(got, want)),
               requests=len(want), mean_tau=sum(o.metrics.tau for o in got) / len(got),
               eager_steps=budget and budget.eager_steps,
               d2h_reads_per_step=budget and budget.d2h_reads / budget.steps)
    assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0
    assert rate == 1.0 if mode == "invariant" else rate > 0.5


def test_sampling_on_the_gpu_is_seeded_per_request(gpu_model):
    """Sampled requests verify on the device; a seeded request draws the same tokens alone and in
    a batch (its own generator), with speculation (ngram) too."""
    from specdec.sampling_params import SamplingParams

    prompts = _prompts(3, SHAPES["tiny-gpu"]["vocab_size"], seed=1)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=16,
                             ignore_eos=True) for i in range(3)]
    for drafter in (None, "ngram"):
        llm = _llm(gpu_model, dtype="float32", attention_backend="torch", drafter=drafter)
        batch = [o.token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
        assert batch == alone


@needs_flashinfer
def test_host_syncs_per_step_do_not_grow_with_the_batch(gpu_model):
    """On-device verification: the host syncs of a step (torch's sync debug mode counts them)
    are the same at batch 1 and batch 8, with speculation (trees verified every step)."""
    import warnings

    from specdec.drafters.oracle import oracle_plugin

    vocab = SHAPES["tiny-gpu"]["vocab_size"]
    per_step = {}
    for b in (1, 8):
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(1, vocab - 1, (16,), generator=g).tolist() for _ in range(b)]
        plain = _llm(gpu_model)
        truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts,
                                                                                 _greedy(32)))}
        spec = _llm(gpu_model, drafter="oracle", plugins=(oracle_plugin(truth, 0.3, depth=4),),
                    controller="static", controller_args={"budget": 4})
        spec.generate(prompts, _greedy(8))  # warm-up: graphs captured, kernels compiled
        steps0 = spec.engine.totals.steps
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                spec.generate(prompts, _greedy(32))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        steps = spec.engine.totals.steps - steps0
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        per_step[b] = len(syncs) / steps
    REPORT.add("host_syncs_per_step", batch1=per_step[1], batch8=per_step[8])
    assert per_step[8] <= per_step[1] * 1.25 + 1, per_step
