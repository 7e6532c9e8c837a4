"""Training-time test: the unrolled training forward is the drafting forward, and it learns."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from specdec.attention.dense import DenseAttention
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.loader import load_model
from specdec.training.ttt import TTTAttention, target_batch, ttt_loss


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("ttt"), num_hidden_layers=4, seed=5)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 256)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 48), model.embed, hf, trainable=True)
    head.reset_parameters(0.3)
    head.set_vocab(torch.arange(48))
    return model, head, cfg, hf


def test_ttt_mask():
    att = TTTAttention(torch.tensor([[True, True, False]]))
    assert att.first[0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def _dense(head, ids, feats):
    s = len(ids)
    backend = DenseAttention.causal(torch.ones(1, s, dtype=torch.bool))
    return head(torch.tensor(ids), torch.arange(s), backend, None, features=feats).hidden


def test_unrolled_steps_equal_drafting_chains(setup):
    """Step j, row p of the training forward = the head drafting the chain t_{p+2..p+1+j} after
    catching up on rows 0..p (the inference computation, run densely row by row)."""
    model, head, *_ = setup
    torch.manual_seed(1)
    ids = torch.randint(0, 48, (1, 10))
    valid = torch.ones(1, 10, dtype=torch.bool)
    tb = target_batch(model, head, ids, valid)
    steps = 3
    captured = []
    original = head.forward

    def spy(*a, **k):
        out = original(*a, **k)
        captured.append(out.hidden.detach())
        return out

    head.forward = spy
    try:
        with torch.no_grad():
            ttt_loss(head, ids, valid, valid, tb, steps)
    finally:
        del head.forward
    feats = head.fuse(tb.aux[0]).detach()
    toks = ids[0].tolist()
    for p in (0, 3, 6):
        fs = list(feats[:p + 1])
        y = _dense(head, toks[1:p + 2], torch.stack(fs))
        for j in range(steps):
            torch.testing.assert_close(captured[j][p], y[-1], atol=1e-9, rtol=1e-9)
            if p + 2 + j >= len(toks):
                break
            fs.append(y[-1])
            y = _dense(head, toks[1:p + 3 + j], torch.stack(fs))


def test_overfits_one_batch(setup):
    model, head, *_ = setup
    torch.manual_seed(2)
    ids = torch.randint(0, 48, (2, 12))
    valid = torch.ones(2, 12, dtype=torch.bool)
    tb = target_batch(model, head, ids, valid)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(60):
        res = ttt_loss(head, ids, valid, valid, tb, steps=2)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        first = first if first is not None else float(res.loss.detach())
    assert float(res.loss) < 0.8 * first
    assert res.step_acceptance[0] > 0.3 and len(res.step_top1) == 2


def test_loss_equals_its_definition(setup):
    """The soft cross-entropy, computed row by row from the full target and head logits (no row
    selection, no shortcuts), equals ttt_loss's: counted rows, teacher rows and weights."""
    model, _, cfg, hf = setup
    torch.manual_seed(3)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 20), model.embed, hf, trainable=True)
    head.reset_parameters(0.3)
    ids = torch.randint(0, 48, (2, 9))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 7:] = False
    mask = valid.clone()
    mask[:, :3] = False  # a "prompt": no loss there
    head.set_vocab(torch.arange(0, 48, 2)[:20])  # a draft vocabulary that misses tokens
    tb = target_batch(model, head, ids, valid, mask)
    with torch.no_grad():
        res = ttt_loss(head, ids, valid, mask, tb, steps=3, decay=0.5)
        full = target_batch(model, head, ids, valid)  # teacher on every row
        out = model.forward_dense(ids, valid)
        argmax = model.compute_logits(out.hidden.reshape(-1, out.hidden.shape[-1]))
        argmax = argmax.argmax(-1).view(2, 9)
        captured = []
        original = head.forward

        def spy(*a, **k):
            o = original(*a, **k)
            captured.append(o.hidden)
            return o

        head.forward = spy
        try:
            ttt_loss(head, ids, valid, mask, full, steps=3, decay=0.5)
        finally:
            del head.forward
    used = set(range(0, 48, 2)[:20])
    expected = 0.0
    for j in range(3):
        terms = []
        for bb in range(2):
            for p in range(9):
                r = p + 1 + j
                if p + 2 + j >= 9 or not (mask[bb, p + 2 + j] and valid[bb, p + 2 + j]):
                    continue
                if int(argmax[bb, r]) not in used:
                    continue
                logq = head.compute_logits(captured[j][bb * 9 + p]).log_softmax(-1)
                terms.append(-(full.teacher[bb, r] * logq).sum())
        assert res.num_rows[j] == len(terms)
        step = torch.stack(terms).mean()
        assert abs(res.step_loss[j] - float(step)) < 1e-9
        expected += 0.5**j * float(step)
    assert abs(float(res.loss) - expected) < 1e-9
