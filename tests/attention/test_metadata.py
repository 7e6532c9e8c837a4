"""Step metadata (specdec/attention/metadata.py) against its definition, and the packed batch.

build_metadata builds its arrays from host lists in a few calls (``host_tensor``: a buffer,
not torch.tensor) and records the lengths it was built from (``lens``); the oracle is the
slot-by-slot definition of the module docstring, on random batches of requests with and
without tree masks, pages shuffled and shared page sizes 1, 4 and 16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.attention.metadata import build_metadata, concat_metadata, host_tensor
from specdec.kv.block_table import slot_of

I32 = dict(dtype=torch.int32)


def _reference(tables, kv_lens, qo_lens, page):
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, slot_mapping) slot by slot."""
    qo_indptr, kv_indptr, pages, last, slots = [0], [0], [], [], []
    for table, kv, qo in zip(tables, kv_lens, qo_lens):
        used = table[:-(-kv // page)]
        pages += used
        qo_indptr.append(qo_indptr[-1] + qo)
        kv_indptr.append(len(pages))
        last.append(kv - (len(used) - 1) * page)
        slots += [slot_of(table, i, page) for i in range(kv - qo, kv)]
    return (torch.tensor(qo_indptr, **I32), torch.tensor(kv_indptr, **I32),
            torch.tensor(pages, **I32), torch.tensor(last, **I32), torch.tensor(slots))


@st.composite
def batches(draw, page: int | None = None):
    page = page or draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 8))
    kv = [draw(st.integers(1, 70)) for _ in range(n)]
    qo = [draw(st.integers(1, min(k, 16))) for k in kv]
    pool = draw(st.permutations(range(600)))
    tables, masks, at = [], [], 0
    for k, q in zip(kv, qo):
        spare = draw(st.integers(0, 2))  # a table may hold more pages than the step uses
        tables.append(list(pool[at:at + -(-k // page) + spare]))
        at += len(tables[-1])
        masks.append(torch.ones(q, k, dtype=torch.bool).tril(k - q)
                     if draw(st.booleans()) else None)
    return tables, kv, qo, page, masks


@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_metadata_is_its_definition(batch):
    tables, kv, qo, page, masks = batch
    md = build_metadata(tables, kv, qo, page, masks)
    got = (md.qo_indptr, md.kv_indptr, md.kv_indices, md.kv_last_page_len, md.slot_mapping)
    for have, want in zip(got, _reference(tables, kv, qo, page)):
        assert have.dtype == want.dtype and torch.equal(have, want)
    host = md.on_host()
    assert host.kv_indices is md.kv_indices  # on the CPU: the same tensors
    assert md.custom_masks == masks and md.batch_size == len(kv)
    # the recorded lengths are the ones the arrays give
    assert md.qo_lens() == qo and md.kv_lens() == kv
    md.lens = None
    assert md.qo_lens() == qo and md.kv_lens() == kv


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_concatenated_metadata_keeps_its_lengths(data):
    a = data.draw(batches())
    b = data.draw(batches(page=a[3]))
    both = concat_metadata(build_metadata(*a), build_metadata(*b))
    want = _reference(a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3])
    assert all(torch.equal(have, w) for have, w in zip(
        (both.qo_indptr, both.kv_indptr, both.kv_indices, both.kv_last_page_len,
         both.slot_mapping), want))
    assert both.qo_lens() == a[2] + b[2] and both.kv_lens() == a[1] + b[1]
    both.lens = None
    assert both.qo_lens() == a[2] + b[2] and both.kv_lens() == a[1] + b[1]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_tensor_equals_torch_tensor(dtype):
    for values in ([], [0], [5, -3, 2**31 - 1, -(2**31)], list(range(1000))):
        t = host_tensor(values, dtype)
        assert t.dtype == dtype and t.shape == (len(values),) and t.is_contiguous()
        assert torch.equal(t, torch.tensor(values, dtype=dtype))
    assert host_tensor([2**40])[0] == 2**40
    with pytest.raises(OverflowError):
        host_tensor([2**40], torch.int32)
