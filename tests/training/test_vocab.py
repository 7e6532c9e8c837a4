"""The draft vocabulary: frequency order over loss-masked tokens, ties, padding, d2t/t2d."""

from __future__ import annotations

import pytest
import torch

from specdec.training.vocab import coverage, d2t_t2d, draft_vocab, token_counts


def pair(ids, mask):
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)


# masked: 4 4 4 1 1 5 7 (7 once, like 5: the tie goes to 5); unmasked 9s never count
DATA = [pair([9, 4, 4, 1, 9], [0, 1, 1, 1, 0]), pair([4, 1, 5, 9, 9, 9, 7], [1, 1, 1, 0, 0, 0, 1])]


def test_counts_only_loss_masked_tokens():
    counts = token_counts(DATA, 10)
    assert counts.tolist() == [0, 2, 0, 0, 3, 1, 0, 1, 0, 0]


def test_most_frequent_ascending_with_ties_to_the_lower_id():
    used = draft_vocab(DATA, 3, 10)
    assert used.dtype == torch.int64 and used.tolist() == [1, 4, 5]


def test_pads_with_smallest_unused_ids():
    assert draft_vocab(DATA, 6, 10).tolist() == [0, 1, 2, 4, 5, 7]


def test_accepts_dataset_rows():
    rows = [{"input_ids": ids.tolist(), "loss_mask": m.tolist()} for ids, m in DATA]
    assert draft_vocab(rows, 3, 10).tolist() == [1, 4, 5]
    from datasets import Dataset

    assert draft_vocab(Dataset.from_list(rows), 3, 10).tolist() == [1, 4, 5]


def test_d2t_t2d_consistent():
    used = draft_vocab(DATA, 4, 10)
    d2t, t2d = d2t_t2d(used, 10)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (10,)
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(4) + d2t)
    assert d2t.tolist() == [1, 3, 3, 4]  # used = [1, 4, 5, 7]


def test_coverage():
    assert coverage(torch.tensor([1, 4, 5]), DATA) == pytest.approx(6 / 7)
    assert coverage(torch.arange(10), DATA) == 1.0
    with pytest.raises(ValueError, match="no loss-masked"):
        coverage(torch.tensor([1]), [pair([1, 2], [0, 0])])


def test_bad_input_errors():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab(DATA, 11, 10)
    with pytest.raises(ValueError, match="target vocabulary"):
        draft_vocab(DATA, 3, 7)  # masked token 7 is outside 0..6
    with pytest.raises(ValueError, match="same shape"):
        draft_vocab([pair([1, 2], [1])], 1, 10)
    with pytest.raises(ValueError, match="ascending"):
        d2t_t2d(torch.tensor([4, 1]), 10)
    with pytest.raises(ValueError, match="target_vocab_size"):
        d2t_t2d(torch.tensor([1, 10]), 10)
