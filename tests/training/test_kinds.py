"""`specdec train mtp` and `specdec train block_diffusion`: the same pipeline as eagle3 with a
loss per kind. Smoke runs on a tiny chat model lower the loss, store a calibration and give
tau > 1.5 on their own training prompts; the losses match their row-by-row definitions."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model

from specdec import LLM, SamplingParams
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.models.loader import load_model
from specdec.training.block_loss import _labels, block_forward, block_loss
from specdec.training.config import TrainConfig
from specdec.training.mtp_loss import mtp_loss
from specdec.training.target import target_batch
from specdec.training.trainer import train

KIND_ARGS = {"mtp": dict(num_heads=3, learning_rate=1e-2, epochs=30),
             "block_diffusion": dict(block_size=4, num_anchors=8, target_layer_ids=[0, 1],
                                     learning_rate=3e-3, epochs=30)}


@pytest.mark.parametrize("kind", ["mtp", "block_diffusion"])
def test_smoke_run_lowers_loss_and_drafts_well(kind, chat_target, prompts_file, tmp_path):
    out = tmp_path / kind
    config = TrainConfig(kind=kind, target=chat_target, data=[str(prompts_file)], out=str(out),
                         regenerate=True, regen_max_tokens=24, draft_vocab_size=24,
                         regen_batch_size=4,  # (the KV zeroed at start: test_trainer._config)
                         max_length=64, batch_size=4, warmup_ratio=0.0, max_grad_norm=1.0,
                         holdout=2, eval_max_tokens=16, eval_budget=4, checkpoint_every=500,
                         calibration_examples=4, **KIND_ARGS[kind])
    report = train(config)
    assert report["greedy_match_rate"] == 1.0
    drafter = out / "drafter"
    meta = json.loads((drafter / "config.json").read_text())["specdec"]
    depth = 3
    assert len(meta["rank_acceptance"]) == depth and all(len(r) == 8 for r in
                                                          meta["rank_acceptance"])
    assert meta["rank_acceptance"][0][0] > 0.3  # calibrated on held-out sequences
    cond = meta["rank_acceptance_conditional"]  # given the depths above were right
    assert cond[0] == meta["rank_acceptance"][0] and len(cond) == depth
    assert meta["calibration_rows_conditional"][0] == meta["calibration_rows"][0]
    m = meta["train"]
    if kind == "mtp":  # soft cross-entropy: bounded below by the teacher's entropy
        assert m["loss"] < m["first_loss"] - 0.2 and m["top1_0"] > 0.8
    else:  # hard cross-entropy against the data tokens
        assert m["loss"] < 0.7 * m["first_loss"] and m["tau_chain"] > 1.5
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    prompts = [[m for m in r["messages"] if m["role"] == "user"][:1] for r in rows[:8]]
    llm = LLM(model=chat_target, drafter=kind, drafter_args={"path": str(drafter)},
              controller="static", controller_args={"budget": 6})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    taus = [o.metrics.tau for o in outs if o.metrics.tau is not None]
    assert sum(taus) / len(taus) > 1.5, taus


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("k"), num_hidden_layers=3, seed=2)
    return load_model(folder, torch.float64, "cpu", 64)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:] = False
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 4:] = True
    return ids, valid, mask & valid


def test_mtp_loss_is_its_row_by_row_definition(tiny):
    model, cfg, hf = tiny
    heads = MTPHeads(MTPConfig.for_target(cfg, 40, num_heads=2), torch.float64)
    heads.init_from_target(model.head_weight, torch.arange(0, 80, 2))
    with torch.no_grad():
        heads.blocks.normal_(0, 0.2)
    ids, valid, mask = _batch()
    tb = target_batch(model, (), heads.token_map, ids, valid, mask)
    loss, _ = mtp_loss(heads, tb, valid, mask, decay=0.5)
    want = 0.0
    for i in range(2):
        terms = []
        for b in range(2):
            for p in range(12 - 2 - i):
                t = p + 2 + i  # the token head i predicts from row p
                if not (mask[b, t] and valid[b, t]):
                    continue
                with torch.no_grad():
                    full = model.compute_logits(model.forward_dense(ids[b:b + 1, :t])
                                                .hidden[0, t - 1])
                if int(full.argmax()) % 2 or int(full.argmax()) >= 80:
                    continue  # the target's greedy token is not in the draft vocabulary
                teacher = full[heads.token_map].softmax(-1)
                x = tb.final[b, p]
                logq = heads.compute_logits(heads.head(i, x)).log_softmax(-1)
                terms.append(-(teacher * logq).sum())
        if terms:
            want += 0.5**i * torch.stack(terms).mean()
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype))


def test_block_loss_labels_and_weights(tiny, monkeypatch):
    model, cfg, hf = tiny
    c = BlockDiffusionConfig.for_target(cfg, 48, num_layers=1, block_size=4,
                                        target_layer_ids=(0, 2))
    bd = BlockDiffusionModel(c, model.embed, hf)
    bd.init_from_target(model, torch.arange(48))
    ids, valid, mask = _batch(1)
    anchors = torch.tensor([[3, 7], [5, 6]])
    ok = torch.tensor([[True, True], [True, False]])
    labels = _labels(ids, valid, mask, anchors, ok, 4)
    # sequence 1 is padding from 9 on: anchor 6's labels are cut there (and it is not ok)
    assert labels[0, 0].tolist() == ids[0, 4:7].tolist()
    assert labels[1, 0].tolist() == [ids[1, 6].item(), ids[1, 7].item(), ids[1, 8].item()]
    assert labels[1, 1].tolist() == [-1, -1, -1]
    assert labels[0, 1].tolist() == [ids[0, 8].item(), ids[0, 9].item(), ids[0, 10].item()]
    import specdec.training.block_loss as bl

    monkeypatch.setattr(bl, "sample_anchors", lambda v, m, n: (anchors, ok))
    tb = target_batch(model, c.target_layer_ids, bd.token_map, ids, valid, mask, teacher=False)
    loss, metrics = block_loss(bd, tb, ids, valid, mask, num_anchors=2, gamma=2.0)
    hidden = block_forward(bd, tb, ids, anchors)
    want = 0.0
    for k in range(1, 4):
        terms = []
        for b in range(2):
            for a in range(2):
                label = int(labels[b, a, k - 1])
                if 0 <= label < 48:
                    logits = bd.compute_logits(hidden[b, a, k][None])
                    terms.append(F.cross_entropy(logits, torch.tensor([label])))
        if terms:
            want += math.exp(-(k - 1) / 2.0) * torch.stack(terms).mean()
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype))
    assert 1.0 <= metrics["tau_chain"] <= 4.0


def test_settings_are_checked():
    base = dict(data=["x"], out="y")
    for bad, words in (({"kind": "medusa"}, "kind must be one of"),
                       ({"block_size": 1}, "block_size"), ({"num_heads": 0}, "num_heads"),
                       ({"head_decay": 0.0}, "head_decay"), ({"loss_gamma": -1}, "loss_gamma"),
                       ({"target_layer_ids": [1, -2]}, "target_layer_ids"),
                       ({"num_layers": 0}, "num_layers"),
                       ({"max_steps": 0}, "max_steps must be an int >= 1"),
                       ({"regen_activations": "int4"}, "regen_activations must be 'float' or")):
        with pytest.raises(ValueError, match=words):
            TrainConfig(**base, **bad)
    assert TrainConfig(**base, max_steps=0, init_from="d").max_steps == 0  # recalibrate only
    with pytest.raises(ValueError, match="max_steps must be an int >= 0"):
        TrainConfig(**base, max_steps=-1, init_from="d")


def test_calibration_is_stored_only_with_rows_at_every_depth():
    from specdec.training.kinds import calibration

    hits = torch.tensor([[3, 1], [1, 0]])
    assert calibration(hits, torch.tensor([4, 2])) == {
        "rank_acceptance": [[0.75, 0.25], [0.5, 0.0]], "calibration_rows": [4, 2]}
    assert calibration(hits, torch.tensor([4, 0])) == {}  # the drafter keeps its default shape
    # conditional rates; a depth whose condition never held keeps its unconditional ones
    got = calibration(hits, torch.tensor([4, 2]), torch.tensor([[3, 1], [0, 0]]),
                      torch.tensor([4, 0]))
    assert got["rank_acceptance_conditional"] == [[0.75, 0.25], [0.5, 0.0]]
    assert got["calibration_rows_conditional"] == [4, 0]


def test_conditional_rank_hits_against_brute_force():
    from specdec.training.target import conditional_rank_hits, label_ranks

    gen = torch.Generator().manual_seed(0)
    depth, n, k = 4, 300, 3
    ranks = torch.randint(-1, k, (depth, n), generator=gen)
    ranks[1] = torch.where(ranks[0] == 0, 0, ranks[1])  # heads err together
    kept = torch.rand(depth, n, generator=gen) < 0.9
    hits, rows, cond_hits, cond_rows = conditional_rank_hits(ranks, kept, k)
    for d in range(depth):
        given = [j for j in range(n) if kept[d, j] and all(ranks[e, j] >= 0 for e in range(d))]
        assert int(rows[d]) == int(kept[d].sum()) and int(cond_rows[d]) == len(given)
        for r in range(k):
            assert int(hits[d, r]) == sum(1 for j in range(n) if kept[d, j] and ranks[d, j] == r)
            assert int(cond_hits[d, r]) == sum(1 for j in given if ranks[d, j] == r)
    assert cond_hits[1, 0] / cond_rows[1] > hits[1, 0] / rows[1]  # correlation shows
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert label_ranks(logits, torch.tensor([2, 3]), 2).tolist() == [1, -1]
    assert label_ranks(logits, torch.tensor([-1, 0]), 2).tolist() == [-1, 0]
