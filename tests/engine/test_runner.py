"""ModelRunner: pack (rows, positions, logits rows), forward equals running the model directly,
early-exit runners (first N layers), bytes per page, allocation order."""

from __future__ import annotations

import pytest
import torch

from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.engine.runner import ModelRunner
from specdec.kv.block_table import BlockTable
from specdec.kv.cache import KVCache
from specdec.models.loader import load_model
from specdec.tree import DraftTree, step_mask

PAGE = 4


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama, torch.float64, "cpu", 128)[0]


def runner_for(model, num_layers=None, num_pages=16) -> ModelRunner:
    runner = ModelRunner(model, "target", "torch", PAGE, "cpu", num_layers)
    runner.allocate(num_pages)
    return runner


def tables(runner: ModelRunner, sizes: list[int]) -> list[BlockTable]:
    out = []
    for n in sizes:
        t = BlockTable()
        runner.kv.reserve(t, n)
        out.append(t)
    return out


def test_pack_rows_positions_and_logits_rows(model):
    runner = runner_for(model)
    ts = tables(runner, [3, 13])
    last = runner.pack([[5, 6, 7], [9]], [0, 12], ts, logits="last")
    assert last.input_ids.tolist() == [5, 6, 7, 9] and last.positions.tolist() == [0, 1, 2, 12]
    assert last.logits_indices.tolist() == [2, 3] and last.num_rows == 4
    assert {t.dtype for t in (last.input_ids, last.positions, last.logits_indices)} == {torch.int64}
    assert last.metadata.qo_lens() == [3, 1] and last.metadata.kv_lens() == [3, 13]
    assert runner.pack([[5, 6, 7], [9]], [0, 12], ts, "all").logits_indices.tolist() == [0, 1, 2, 3]
    assert runner.pack([[5, 6, 7], [9]], [0, 12], ts, "none").logits_indices.numel() == 0
    custom = runner.pack([[5, 6]], [4], ts[1:], positions=[[4, 4]])
    assert custom.positions.tolist() == [4, 4]


def test_forward_equals_the_model_run_directly(model):
    runner = runner_for(model)
    ts = tables(runner, [6, 4])
    feeds = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    batch = runner.pack(feeds, [0, 0], ts, logits="all")
    out = runner.forward(batch, capture_layers=(0, 1))
    cache = KVCache(2, 16, PAGE, model.cfg.num_kv_heads, model.cfg.head_dim, torch.float64, "cpu")
    backend = TorchAttentionBackend()
    backend.plan(build_metadata([t.pages for t in ts], [6, 4], [6, 4], PAGE))
    with torch.no_grad():
        ref = model(torch.tensor(feeds[0] + feeds[1]), torch.tensor([*range(6), *range(4)]),
                    backend, cache, capture_layers=(0, 1))
        ref_logits = model.compute_logits(ref.hidden)
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(out.final_hidden, ref.hidden, rtol=0, atol=0)
    assert sorted(out.hidden) == [0, 1]
    for layer in (0, 1):
        torch.testing.assert_close(out.hidden[layer], ref.layer_hidden[layer], rtol=0, atol=0)
    torch.testing.assert_close(runner.kv.cache.tensor, cache.tensor, rtol=0, atol=0)
    assert out.seconds > 0 and out.logits.dtype == torch.float64


def test_logits_rows_are_the_rows_asked_for(model):
    """'last' logits equal the matching rows of 'all' (fresh caches, same pages)."""
    feeds, starts = [[3, 4, 5], [6, 7]], [0, 0]
    outs = {}
    for mode in ("all", "last", "none"):
        runner = runner_for(model)
        ts = tables(runner, [3, 2])
        outs[mode] = runner.forward(runner.pack(feeds, starts, ts, logits=mode))
    # (2 rows and 5 rows may take different matmul paths: equal to rounding)
    torch.testing.assert_close(outs["last"].logits, outs["all"].logits[[2, 4]], rtol=0,
                               atol=1e-12)
    assert outs["none"].logits is None
    torch.testing.assert_close(outs["none"].final_hidden, outs["all"].final_hidden)


def test_tree_rows_with_a_mask_equal_causal_rows_along_their_path(model):
    """A decode row plus a tree through pack(positions, masks) gives node i the logits the
    plain sequence would give at node i's position (path [1, 2] of parents [-1, -1, 1])."""
    prompt = [11, 12, 13, 14, 15]
    tree = DraftTree(torch.tensor([20, 21, 22]), torch.tensor([-1, -1, 1]))
    runner = runner_for(model)
    (t,) = tables(runner, [8])
    runner.forward(runner.pack([prompt[:4]], [0], [t], "none"))
    rows = [prompt[4], *tree.tokens.tolist()]
    pos = [4, *tree.positions(5).tolist()]
    out = runner.forward(runner.pack([rows], [4], [t], "all", positions=[pos],
                                     masks=[step_mask(tree, 4, 5)]))
    plain = runner_for(model)
    (p,) = tables(plain, [7])
    ref = plain.forward(plain.pack([prompt + [21, 22]], [0], [p], "all")).logits
    torch.testing.assert_close(out.logits[[0, 2, 3]], ref[[4, 5, 6]], rtol=1e-10, atol=1e-10)


def test_early_exit_runner_runs_the_first_layers(model):
    full, half = runner_for(model), runner_for(model, num_layers=1)
    cfg = model.cfg
    assert full.bytes_per_page == 2 * 2 * PAGE * cfg.num_kv_heads * cfg.head_dim * 8
    assert half.bytes_per_page * 2 == full.bytes_per_page
    assert half.kv.cache.tensor.shape[0] == 1
    (t,) = tables(half, [5])
    out = half.forward(half.pack([[1, 2, 3, 4, 5]], [0], [t], "last"))
    backend = TorchAttentionBackend()
    backend.plan(build_metadata([t.pages], [5], [5], PAGE))
    cache = KVCache(1, 16, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float64, "cpu")
    with torch.no_grad():
        ref = model(torch.tensor([1, 2, 3, 4, 5]), torch.arange(5), backend, cache, num_layers=1)
    torch.testing.assert_close(out.logits, model.compute_logits(ref.hidden[-1:]), rtol=0, atol=0)


def test_allocate_once_before_forward(model):
    runner = ModelRunner(model, "drafter", "torch", PAGE, "cpu")
    assert runner.kv is None
    with pytest.raises(AssertionError, match="allocate"):
        runner.forward(None)
    runner.allocate(4)
    assert runner.kv.num_pages == 4
    with pytest.raises(AssertionError, match="already allocated"):
        runner.allocate(4)
