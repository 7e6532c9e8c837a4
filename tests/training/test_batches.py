"""A step's examples (training/batches.py): seeded, length-grouped epochs, and each
process's share of them."""

from __future__ import annotations

import random

from specdec.training.batches import epoch_batches, process_batches


def test_epoch_batches_group_lengths_and_cover_every_example():
    rng = random.Random(1)
    lengths = [rng.randint(10, 400) for _ in range(300)]
    batches = epoch_batches(lengths, 8, seed=3)
    assert batches == epoch_batches(lengths, 8, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert len(batches) == -(-300 // 8)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    shuffled = list(range(300))
    random.Random(3).shuffle(shuffled)
    plain = sum(len(shuffled[i:i + 8]) * max(lengths[j] for j in shuffled[i:i + 8])
                for i in range(0, 300, 8))
    assert padded < 0.8 * plain, (padded, plain)


def test_process_batches_split_an_epoch_evenly():
    batches = [[i] for i in range(5)]
    shares = [process_batches(batches, r, 2) for r in range(2)]
    assert shares == [[[0], [2], [4]], [[1], [3], [0]]]  # wrapped round: 3 steps each
    assert process_batches(batches, 0, 1) == batches
