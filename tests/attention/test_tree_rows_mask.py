"""Every attention backend takes a TreeRowsMask (specdec/attention/metadata.py: a draft tree's
rows whose tree part is on the device, issue #53 item 1) as it takes the same mask dense on the
host: bitwise the same output, in a batch that mixes a decode row, a prefill chunk, a host-mask
tree and TreeRowsMask trees (one with fed rows before its tree); and planning and running it
reads nothing back from the device (tests/transfer_audit.py, the tree's ancestors marked as the
device's). The invariant backend runs under Triton's interpreter without a GPU; flashinfer is
its API model (tests/attention/flashinfer_api_model.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from transfer_audit import TransferAudit

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec.attention import flashinfer_backend  # noqa: E402
from specdec.attention.backend import AttentionSpec  # noqa: E402
from specdec.attention.flex_backend import FlexAttentionBackend  # noqa: E402
from specdec.attention.metadata import TreeRowsMask, build_metadata  # noqa: E402
from specdec.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specdec.tree import DraftTree, packed_masks, step_mask  # noqa: E402

H, HKV, D, PAGE, PAGES = 4, 2, 8, 4, 64
SCALE = D**-0.5
CPU = torch.device("cpu")  # a torch.device: the audit takes factories given it as the device's
pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_torch_thread")]


def _tree(rng: random.Random, n: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(n)]  # topological: parents[i] < i
    return DraftTree(torch.arange(n), torch.tensor(parents))


def _requests(seed: int):
    """(kv_len, qo_len, host mask, TreeRowsMask or None) per request: a decode row, a prefill
    chunk, a host-mask tree, a TreeRowsMask tree (q 1), a TreeRowsMask tree after 3 fed rows
    (q 3), a chain as a TreeRowsMask (node 0 sees the slot right after the prefix)."""
    rng = random.Random(seed)
    reqs = [(rng.randrange(2, 14), 1, None, None), (rng.randrange(8, 14), 5, None, None)]
    for q, n, chain in ((1, rng.randrange(2, 8), False), (1, rng.randrange(2, 8), False),
                        (3, rng.randrange(2, 8), False), (2, 4, True)):
        tree = DraftTree.chain(torch.arange(n)) if chain else _tree(rng, n)
        end = rng.randrange(q + 1, 12)
        dense = step_mask(tree, end - q, end)
        rows = TreeRowsMask(q, end, tree.ancestor_mask)
        assert torch.equal(rows.dense(), dense)  # step_mask's mask, made from the ancestors
        reqs.append((end + n, q + n, dense, rows if len(reqs) != 2 else None))
    return reqs


def _metadata(reqs, trees_on_device: bool):
    """The step's metadata, its TreeRowsMasks kept (or their host masks in their place)."""
    perm = torch.randperm(PAGES, generator=torch.Generator().manual_seed(7)).tolist()
    tables = [[perm.pop() for _ in range(-(-kv // PAGE))] for kv, *_ in reqs]
    masks = [rows if trees_on_device and rows is not None else dense
             for _, _, dense, rows in reqs]
    return build_metadata(tables, [r[0] for r in reqs], [r[1] for r in reqs], PAGE, masks)


def _inputs(reqs, dtype):
    gen = torch.Generator().manual_seed(3)
    t = sum(r[1] for r in reqs)
    q, k, v = (torch.randn(t, h, D, generator=gen).to(dtype) for h in (H, HKV, HKV))
    cache = torch.randn(PAGES, 2, PAGE, HKV, D, generator=gen).to(dtype)
    return q, k, v, cache


def _run(backend, md, inputs, staged=None):
    q, k, v, cache = inputs
    cache = cache.clone()
    backend.plan(md, staged)
    return backend.run(q, k, v, cache, SCALE), cache


def _spec(dtype) -> AttentionSpec:
    return AttentionSpec(H, HKV, D, dtype, CPU)


BACKENDS = ["torch-sdpa", "torch", "flex", "flashinfer", "invariant"]


def _make(name: str, request):
    """(a fresh backend of ``name``, the dtype it runs in)."""
    if name == "torch-sdpa":
        return TorchAttentionBackend(kernels=None), torch.float32
    if name == "torch":  # the compiled kernels when they load here
        return TorchAttentionBackend(), torch.float32
    if name == "flex":
        return FlexAttentionBackend(), torch.float32
    if name == "flashinfer":
        request.getfixturevalue("flashinfer_api_model")
        return flashinfer_backend.FlashInferAttentionBackend(
            _spec(torch.float64), workspace_bytes=8), torch.float64
    pytest.importorskip("triton")
    from specdec.attention.invariant_backend import InvariantAttentionBackend

    return InvariantAttentionBackend(_spec(torch.float32)), torch.float32


@pytest.mark.parametrize("name", BACKENDS)
def test_a_tree_rows_mask_attends_as_its_dense_host_mask(name, request):
    for seed in range(2 if name != "invariant" else 1):
        reqs = _requests(seed)
        backend, dtype = _make(name, request)
        inputs = _inputs(reqs, dtype)
        want, want_cache = _run(backend, _metadata(reqs, False), inputs)
        got, got_cache = _run(backend, _metadata(reqs, True), inputs)
        assert torch.equal(got, want), (got - want).abs().max()
        assert torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("name", ["flashinfer", "invariant"])
def test_planned_from_the_staged_arrays(name, request):
    """As the runner plans: stage_arrays widened to int64 (its one copy), their views handed
    to plan() (the invariant backend then writes the trees' bits over their placeholders)."""
    reqs = _requests(1)
    backend, dtype = _make(name, request)
    inputs = _inputs(reqs, dtype)
    want, _ = _run(backend, _metadata(reqs, False), inputs)
    md = _metadata(reqs, True)
    staged = [a.to(torch.int64).clone() for a in backend.stage_arrays(md)]
    got, _ = _run(backend, md, inputs, staged)
    assert torch.equal(got, want)


def test_flashinfer_graph_shape_takes_a_device_packed_mask(flashinfer_api_model):
    reqs = _requests(0)
    spec = _spec(torch.float64)
    backend = flashinfer_backend.FlashInferAttentionBackend(spec, workspace_bytes=8)
    inputs = _inputs(reqs, torch.float64)
    want, _ = _run(backend, _metadata(reqs, False), inputs)
    md = _metadata(reqs, True)
    t = sum(r[1] for r in reqs)
    backend.add_graph_shape(len(reqs), t, max_pages=8, page_size=PAGE, masked=True)
    staged = [a.to(torch.int64) for a in backend.stage_arrays(md)]
    got, _ = _run(backend, md, inputs, staged)
    assert backend._step.wrapper.is_cuda_graph_enabled
    assert torch.equal(got, want)


def test_device_packed_masks_are_packed_masks():
    """The device packer lays the bits out exactly as ``packed_masks`` (each request from a
    byte boundary, little-endian), causal requests and host masks included."""
    for seed in range(4):
        reqs = _requests(seed) + [(9, 9, None, None), (6, 1, None, None)]
        qo, kv = [r[1] for r in reqs], [r[0] for r in reqs]
        dense = [r[2] for r in reqs]
        mixed = [r[3] if r[3] is not None else r[2] for r in reqs]
        want, offsets = packed_masks(dense, qo, kv)
        got = flashinfer_backend.device_packed_masks(mixed, qo, kv, CPU)
        assert got.dtype == torch.uint8 and torch.equal(got, want)
        assert offsets[-1] == got.numel()


def test_invariant_rows_keep_the_prefix_as_limit():
    """row_metadata takes a TreeRowsMask's host limits and 0 bits (the device's bits go over
    them in plan); its node rows' limit is the prefix even where the dense mask's leading run
    is longer (the node sees the slot after the prefix): the same visible set for the kernel,
    slot s visible iff s < limit or bit (s - limit) of the tree word."""
    pytest.importorskip("triton")
    from specdec.kernels.invariant_attention import row_metadata

    tree = DraftTree.chain(torch.arange(3))
    rows = TreeRowsMask(2, 5, tree.ancestor_mask)
    meta = row_metadata([5], [8], [rows])
    assert meta.row_limit.tolist() == [4, 5, 5, 5, 5] and meta.row_tree.tolist() == [0] * 5
    dense = row_metadata([5], [8], [rows.dense()])
    bits = [0, 0, *rows.tree_bits().tolist()]
    for limit, tree_word, (want_limit, want_tree) in zip(
            meta.row_limit.tolist(), bits, zip(dense.row_limit.tolist(),
                                               dense.row_tree.tolist())):
        def seen(lim, word):
            return {s for s in range(8) if s < lim or (s >= lim and word >> (s - lim) & 1)}
        assert seen(limit, tree_word) == seen(want_limit, want_tree)


@pytest.mark.parametrize("name", BACKENDS)
def test_no_read_planning_and_running_a_tree_rows_mask(name, request):
    """The metadata's device arrays, the inputs, the cache and every tree's ancestors are the
    device's: planning and running the step reads nothing back (flashinfer's API model and
    Triton's interpreter stand for kernels: opaque). The step's host masks are the only
    thing sent, and flashinfer given its staged offsets sends nothing."""
    reqs = [r for r in _requests(0) if r[3] is not None or r[2] is None]  # no host-mask tree
    backend, dtype = _make(name, request)
    q, k, v, cache = _inputs(reqs, dtype)
    md = _metadata(reqs, True)
    device = [q, k, v, cache]
    for attr in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "slot_mapping"):
        # the device copies: on a CPU the host tensors themselves, so copies here
        md.__dict__[attr] = (md.slots if attr == "slot_mapping"
                             else getattr(md.host, attr)).clone()
        device.append(md.__dict__[attr])
    device += [m.ancestors for m in md.custom_masks if isinstance(m, TreeRowsMask)]
    staged = None
    if name in ("flashinfer", "invariant"):
        staged = [a.to(torch.int64).clone() for a in backend.stage_arrays(md)]
        device += staged
    opaque = ()
    if name == "flashinfer":
        from attention import flashinfer_api_model

        opaque = (flashinfer_api_model.__file__,)
    elif name == "invariant":
        import triton.runtime.interpreter as interpreter

        opaque = (interpreter.__file__,)
    with TransferAudit(opaque=opaque) as audit:
        audit.mark(*device)
        backend.plan(md, staged)
        if name != "flex":  # (flex_attention goes through dynamo, which cannot trace the
            # audit's mode: its plan, where the masks go, is audited; its run reads the plan)
            out = backend.run(q, k, v, cache, SCALE)
            assert audit.on_device(out)
    assert audit.d2h == 0, audit.sites("d2h")
    if name == "flashinfer":
        assert audit.h2d == 0, audit.sites("h2d")
