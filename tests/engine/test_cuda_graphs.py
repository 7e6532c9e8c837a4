"""CUDA-graph shapes and padding, on the CPU: which shape a step goes into, what the dummies are,
and that a padded batch run eagerly gives the real rows exactly what the unpadded batch gives
(the replay itself is checked on a GPU: tests/gpu)."""

from __future__ import annotations

import itertools

import pytest
import torch
from graph_helpers import RerunCapture, graph_everything

from specdec.engine.cuda_graphs import (
    Shape,
    choose_shape,
    dummy_rows,
    graph_shapes,
    pad_batch,
)
from specdec.engine.runner import ModelRunner
from specdec.kv.block_table import BlockTable
from specdec.models.loader import load_model
from specdec.tree import DraftTree, step_mask

PAGE = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models only


def test_graph_shapes_cover_the_batch_sizes_up_to_the_limits():
    shapes = graph_shapes(max_batch=6, max_rows=32, batch_sizes=(1, 2, 4, 8, 16),
                          rows_per_request=(2, 4, 8))
    # decode shapes: 8 is the first size >= 6; any-rows shapes: a seat more, the dummy's
    assert {s.batch_size for s in shapes if s.decode} == {1, 2, 4, 8}
    assert {s.batch_size for s in shapes if not s.decode} == {2, 3, 5, 9}
    assert all(s.num_rows <= 32 for s in shapes)
    assert Shape(8, 8) in shapes and Shape(5, 32) in shapes and Shape(9, 64) not in shapes
    assert shapes == sorted(shapes, key=lambda s: (s.num_rows, s.batch_size))
    assert len(set(shapes)) == len(shapes), "a shape listed twice would be captured twice"
    assert len(set(graph_shapes(8, 512))) == len(graph_shapes(8, 512))
    # a max_batch beyond every listed size is a shape of its own
    assert max(s.batch_size for s in graph_shapes(300, 1024) if s.decode) == 300


@pytest.mark.parametrize(("b", "t", "decode", "want"), [
    (1, 1, True, Shape(1, 1)),  # exact: no dummy
    (3, 3, True, Shape(4, 4)),  # one dummy of one row
    (1, 5, False, Shape(2, 8)),  # verify of 4 nodes: a dummy takes 3 rows
    (2, 4, False, Shape(2, 4)),  # exact
    (2, 3, False, Shape(3, 4)),  # a dummy of 1 row in the dummy's seat
    (8, 9, False, Shape(9, 16)),  # a full batch (max_batch requests) still fits a graph
    (8, 16, False, Shape(9, 32)),  # ... its dummy needs a row: the next size of rows
    (1, 2, True, None),  # not a decode step's shape
    (9, 9, True, None),  # more requests than any shape
    (1, 40, False, None),  # a long prefill chunk runs eagerly
])
def test_choose_shape_examples(b, t, decode, want):
    shapes = graph_shapes(max_batch=8, max_rows=32, batch_sizes=(1, 2, 4, 8),
                          rows_per_request=(2, 4, 8))
    assert choose_shape(b, t, decode, shapes) == want


def test_choose_shape_is_the_smallest_that_holds_the_step():
    shapes = graph_shapes(max_batch=8, max_rows=64, batch_sizes=(1, 2, 4, 8),
                          rows_per_request=(2, 4, 8))

    def holds(s, b, t, decode):
        rows = dummy_rows(s, b, t)
        return (s.decode == decode and s.batch_size >= b and s.num_rows >= t
                and all(n >= 1 for n in rows) and sum(rows) == s.num_rows - t)

    for b, t in itertools.product(range(1, 10), range(1, 70)):
        for decode in (True, False):
            if t < b or decode and t != b:
                continue
            got = choose_shape(b, t, decode, shapes)
            fits = [s for s in shapes if holds(s, b, t, decode)]
            if not fits:
                assert got is None
                continue
            assert got is not None and holds(got, b, t, decode)
            assert (got.num_rows, got.batch_size) == min((s.num_rows, s.batch_size) for s in fits)


def test_dummy_rows():
    assert dummy_rows(Shape(4, 16), 1, 5) == [1, 1, 9]
    assert dummy_rows(Shape(4, 4), 3, 3) == [1]
    assert dummy_rows(Shape(2, 4), 2, 4) == []


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama, torch.float64, "cpu", 128)[0]


def _runner(model) -> ModelRunner:
    runner = ModelRunner(model, "target", "torch", PAGE, "cpu")
    runner.allocate(40)
    return runner


def _step(runner: ModelRunner):
    """Three requests: a prefill chunk, a decode row, a decode row with a 3-node tree."""
    tree = DraftTree(torch.tensor([11, 12, 13]), torch.tensor([-1, -1, 0]))
    lens = [5, 9, 7]
    tables = []
    for n, extra in zip(lens, [0, 0, tree.num_nodes]):
        t = BlockTable()
        runner.kv.reserve(t, n + extra)
        tables.append(t)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in lens]
    # fill the cache of the cached part first: request 1 and 2 have 8 and 6 cached tokens
    warm = runner.pack([prompts[1][:8], prompts[2][:6]], [0, 0], tables[1:], logits="none")
    runner.forward(warm)
    feeds = [prompts[0], prompts[1][8:], prompts[2][6:] + tree.tokens.tolist()]
    starts = [0, 8, 6]
    positions = [list(range(5)), [8], [6, *tree.positions(7).tolist()]]
    masks = [None, None, step_mask(tree, 6, 7)]
    return runner.pack(feeds, starts, tables, logits="all", positions=positions, masks=masks)


def test_padded_batch_gives_the_real_rows_what_the_unpadded_batch_gives(model):
    ref_runner, pad_runner = _runner(model), _runner(model)
    batch, same = _step(ref_runner), _step(pad_runner)
    ref = ref_runner.forward(batch, capture_layers=(0,))
    shape = Shape(8, 32)  # 10 real rows: 5 dummies share the 22 spare rows
    scratch = pad_runner.kv.pool.allocate(32 // PAGE)
    before = pad_runner.kv.cache.tensor.clone()
    padded = pad_batch(same, shape, scratch)
    assert padded.num_rows == 32 and padded.metadata.batch_size == 8
    assert padded.metadata.qo_lens()[3:] == [1, 1, 1, 1, 18]
    assert padded.logits_indices.tolist() == same.logits_indices.tolist()
    # dummies sit at position 0: a dummy of more rows than max_model_len stays in the RoPE table
    assert padded.positions[batch.num_rows:].tolist() == [0] * 22
    out = pad_runner.forward(padded, capture_layers=(0,))
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.final_hidden[:batch.num_rows], ref.final_hidden, rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(out.hidden[0][:batch.num_rows], ref.hidden[0], rtol=0, atol=1e-12)
    # the dummies wrote only into the scratch pages
    changed = (pad_runner.kv.cache.tensor != before).flatten(2).any(-1).any(0).any(-1)
    real = set(p for t in (0, 1, 2) for p in _pages(same, t))
    assert set(changed.nonzero().flatten().tolist()) <= real | set(scratch)
    ref_pages = sorted(real)
    torch.testing.assert_close(pad_runner.kv.cache.tensor[:, ref_pages],
                               ref_runner.kv.cache.tensor[:, ref_pages], rtol=0, atol=1e-12)


def test_padding_keeps_features_and_context_rows(model):
    runner = _runner(model)
    batch = _step(runner)
    t = batch.num_rows
    feats = torch.randn(t, 7, dtype=torch.float64)
    ctx = torch.zeros(t, dtype=torch.bool)
    ctx[:3] = True
    from dataclasses import replace

    padded = pad_batch(replace(batch, features=feats, context_rows=ctx), Shape(4, 16),
                       runner.kv.pool.allocate(4))
    assert padded.features.shape == (16, 7) and torch.equal(padded.features[:t], feats)
    assert not padded.features[t:].any()
    assert torch.equal(padded.context_rows[:t], ctx) and not padded.context_rows[t:].any()


def _pages(batch, b: int) -> list[int]:
    h = batch.metadata.on_host()
    return h.kv_indices[h.kv_indptr[b]:h.kv_indptr[b + 1]].tolist()


def test_cuda_graphs_are_refused_where_they_cannot_run(model):
    runner = _runner(model)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        runner.enable_cuda_graphs(8, 64, 128)
    from specdec.engine.cuda_graphs import CudaGraphRunner

    with pytest.raises(ValueError, match="attention backend 'torch' cannot run in CUDA graphs"):
        CudaGraphRunner(runner, 8, 64, 128)


# ---- the graph runner on the CPU -------------------------------------------------------------
# flashinfer replaced by a model of its wrappers (tests/attention/flashinfer_api_model.py) and
# the CUDA capture by a stand-in with a graph's semantics (graph_helpers.py): what runs here is
# the runner's own logic (shapes, padding, fixed input buffers, capture once per key, outputs
# copied out).


def test_graphed_runner_gives_what_the_eager_runner_gives(model, flashinfer_api_model):
    from specdec.engine.cuda_graphs import CudaGraphRunner

    eager, graphed = _runner(model), ModelRunner(model, "target", "flashinfer", PAGE, "cpu")
    graphed.allocate(40)
    capture = RerunCapture()
    graphed.graphs = CudaGraphRunner(graphed, 8, 32, 128, capture=capture)
    want = eager.forward(_step(eager), capture_layers=(0,))
    for _ in range(2):  # capture, then a replay of the same key
        got = graphed.forward(_step(graphed), capture_layers=(0,))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(got.hidden[0], want.hidden[0], rtol=0, atol=1e-12)
    # _step's warm-up prefill (14 rows, 2 requests) and the step (10 rows, 3 requests): two keys
    assert len(capture.graphs) == 2 and graphed.graphs.num_graphs == 2
    assert [g.replays for g in capture.graphs] == [2, 2]
    # the outputs handed out are copies: the next replay does not change them
    before = got.final_hidden.clone()
    other = _step(graphed)
    other.input_ids.add_(1)  # same shape, other tokens: the replay computes something else
    again = graphed.forward(other, capture_layers=(0,))
    assert not torch.equal(again.final_hidden, before)
    assert torch.equal(got.final_hidden, before)


@pytest.mark.parametrize(("batch", "seats"), [(1, 1), (3, 8), (8, 8)])
def test_greedy_speculation_through_graphs_equals_plain(tiny_llama, flashinfer_api_model,
                                                        batch, seats):
    """The engine with every runner graphed (the CPU stand-ins above) and the oracle drafter:
    token for token the torch backend's plain greedy output; steps really went through graphs,
    a full batch's too (``max_num_seqs`` requests: the padding dummy has a seat of its own);
    every step staged its inputs in one copy and read one result back."""
    from specdec.drafters.oracle import oracle_plugin
    from specdec.engine.llm import LLM
    from specdec.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 8, 5, 6, 9], [3, 4, 3, 4, 3], [9, 8, 7, 1, 2], [4, 4, 4, 5],
               [1, 2, 1, 2, 1], [8, 8, 9], [2, 7, 2, 7, 2, 7], [6, 5, 4]][:batch]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(tiny_llama), dtype="float64", max_num_seqs=seats,
              max_num_batched_tokens=64)
    want = [o.token_ids for o in LLM(**kw).generate(prompts, params)]
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    for drafter in (None, "oracle"):
        extra = {} if drafter is None else dict(
            drafter="oracle", plugins=(oracle_plugin(truth, 0.3, depth=4),),
            controller="static", controller_args={"budget": 4})
        llm = LLM(attention_backend="flashinfer", **kw, **extra)
        capture = graph_everything(llm.engine)
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == want
        # every step fits a shape (at most 8 requests, 64 rows): every forward was a replay
        assert sum(g.replays for g in capture.graphs) == llm.engine.totals.steps > 8
        for runner in [llm.engine.parts.runner, *llm.engine.parts.drafter_runners]:  # no page leaked
            pool = runner.kv.pool
            assert pool.num_free == pool.num_pages - len(runner.graphs.scratch)
        kind = llm.engine.totals.budget["speculative" if drafter else "plain"]
        assert kind.steps and kind.eager_steps == 0 and kind.graphed_steps == kind.steps
        assert kind.d2h_reads == kind.steps and kind.h2d_copies == kind.steps
        if drafter:
            assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0
