"""The examples a training step sees: seeded epochs of length-grouped batches, each process's
share of them, padded into tensors (training/trainer.py)."""

from __future__ import annotations

import random

import torch

from specdec.training.config import TrainConfig

GROUP_BATCHES = 16  # batches whose examples are sorted by length together (less padding)


def train_batches(dataset, config: TrainConfig, epoch: int, skip: int, device, rank: int = 0,
             processes: int = 1):
    """(example indices, padded batch) in a seeded order per epoch (so a resumed run sees the
    same batches):
    process ``rank`` of ``processes`` takes every processes-th of them from its rank on (the
    epoch's list wrapped round to a multiple of ``processes``, so all take as many steps)."""
    for batch in process_batches(epoch_batches([len(x) for x in dataset["input_ids"]],
                                               config.batch_size, config.seed * 1000 + epoch),
                                 rank, processes)[skip:]:
        yield batch, pad([dataset[i] for i in batch], device)


def process_batches(batches: list, rank: int, processes: int) -> list:
    """This process's share of an epoch's batches (see _batches)."""
    if processes == 1:
        return batches
    batches = batches + batches[:(-len(batches)) % processes]
    return batches[rank::processes]


def epoch_batches(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """One epoch's batches of example indices: a seeded shuffle, then within each window of
    GROUP_BATCHES batches the examples sorted by length (so a batch pads little), then the
    batches shuffled. Every example exactly once; the same seed gives the same batches."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * GROUP_BATCHES
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def pad(rows: list[dict], device):
    """(input_ids [B, S] int64, valid [B, S] bool, loss_mask [B, S] bool), right-padded."""
    s = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), s, dtype=torch.int64)
    valid = torch.zeros(len(rows), s, dtype=torch.bool)
    mask = torch.zeros(len(rows), s, dtype=torch.bool)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[b, :n] = torch.as_tensor(r["input_ids"])
        valid[b, :n] = True
        mask[b, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.bool)
    return ids.to(device), valid.to(device), mask.to(device)


def calibration_batches(calibration, config: TrainConfig, device):
    if calibration is None:
        return
    rows = list(range(len(calibration)))
    for start in range(0, len(rows), config.batch_size):
        yield pad([calibration[i] for i in rows[start:start + config.batch_size]], device)
