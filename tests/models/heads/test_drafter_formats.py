"""MTP (Medusa format, as vLLM's MedusaModel loads it) and block-diffusion (DFlash layout)
checkpoints: round trip, documented keys and fields, errors naming what is wrong, atomic saves.

The Medusa keys and fields are written from the reference notes (learned_drafters.md, D: vLLM's
medusa.py — blocks.{h}.layers.{l}.weight, lm_heads.{h}.weight, token_map, truncated_vocab_size,
original_lm_head), not from the module under test.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file

from specdec.attention.dense import DenseAttention
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.heads.block_diffusion_io import load_block_diffusion, save_block_diffusion
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.models.heads.mtp_io import load_mtp, save_mtp
from specdec.models.loader import load_model

VD = 32


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("fmt") / "t", num_hidden_layers=4)
    return load_model(folder, torch.float32, "cpu", 64)


def _used(cfg):
    torch.manual_seed(0)
    return torch.randperm(cfg.vocab_size)[:VD].sort().values


@pytest.fixture(scope="module")
def mtp(target):
    model, cfg, hf = target
    heads = MTPHeads(MTPConfig.for_target(cfg, VD, num_heads=3, num_layers=2), torch.float32)
    heads.init_from_target(model.head_weight, _used(cfg))
    with torch.no_grad():
        heads.blocks.normal_(0, 0.1)
    return heads


@pytest.fixture(scope="module")
def bd(target):
    model, cfg, hf = target
    c = BlockDiffusionConfig.for_target(cfg, VD, num_layers=2, block_size=4,
                                        target_layer_ids=(0, 2, 3))
    m = BlockDiffusionModel(c, model.embed, hf)
    m.init_from_target(model, _used(cfg))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


RATES_MTP = [[0.5, 0.1], [0.3, 0.2], [0.2, 0.1]]
RATES_BD = [[0.5, 0.1], [0.3, 0.2], [0.2, 0.1]]


def _save(kind, obj, target, folder, **kw):
    hf = target[2]
    extra = {"rank_acceptance": RATES_MTP if kind == "mtp" else RATES_BD}
    if kind == "mtp":
        save_mtp(obj, folder, hf, dtype=torch.float32, extra=extra, **kw)
    else:
        save_block_diffusion(obj, folder, hf, dtype=torch.float32, extra=extra, **kw)


def _load(kind, folder, target, cfg=None):
    model, tcfg, hf = target
    if kind == "mtp":
        return load_mtp(folder, cfg or tcfg, torch.float32)
    return load_block_diffusion(folder, cfg or tcfg, model.embed, hf)


@pytest.fixture(params=["mtp", "block_diffusion"])
def saved(request, mtp, bd, target, tmp_path):
    kind = request.param
    folder = tmp_path / kind
    _save(kind, mtp if kind == "mtp" else bd, target, folder)
    return kind, folder


def test_mtp_round_trip_and_medusa_layout(mtp, target, tmp_path):
    _save("mtp", mtp, target, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["architectures"] == ["MedusaModel"] and raw["model_type"] == "medusa"
    assert (raw["num_heads"], raw["num_hidden_layers"], raw["truncated_vocab_size"]) == (3, 2, VD)
    assert raw["original_lm_head"] is True and raw["vocab_size"] == 96
    keys = {k: tuple(v.shape) for k, v in load_file(tmp_path / "m" / "model.safetensors").items()}
    want = {f"blocks.{h}.layers.{j}.weight": (32, 32) for h in range(3) for j in range(2)}
    want.update({"lm_heads.0.weight": (VD, 32), "token_map": (VD,)})
    assert keys == want
    back = _load("mtp", tmp_path / "m", target)
    assert torch.equal(back.blocks, mtp.blocks) and torch.equal(back.lm_head, mtp.lm_head)
    assert torch.equal(back.token_map, mtp.token_map) and back.rank_acceptance == RATES_MTP
    x = torch.randn(5, 32)
    torch.testing.assert_close(back.compute_logits(back(x)), mtp.compute_logits(mtp(x)))


def test_mtp_prefixed_keys_load(mtp, target, tmp_path):
    _save("mtp", mtp, target, tmp_path / "m")
    t = load_file(tmp_path / "m" / "model.safetensors")
    save_file({("medusa_heads." + k if k != "token_map" else k): v for k, v in t.items()},
              tmp_path / "m" / "model.safetensors")
    assert torch.equal(_load("mtp", tmp_path / "m", target).blocks, mtp.blocks)


def test_block_diffusion_round_trip_is_exact(bd, target, tmp_path):
    _save("block_diffusion", bd, target, tmp_path / "b")
    raw = json.loads((tmp_path / "b" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"]["target_layer_ids"] == [0, 2, 3]
    back = _load("block_diffusion", tmp_path / "b", target)
    for (name, a), (_, b) in zip(bd.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name
    ids = torch.tensor([3, 96, 97, 98])  # the block: a token and MASK_1..3
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    with torch.no_grad():
        a = bd(ids, torch.arange(4), DenseAttention(mask), None).hidden
        b = back(ids, torch.arange(4), DenseAttention(mask), None).hidden
    assert torch.equal(a, b)
    assert back.rank_acceptance == RATES_BD


def test_default_export_is_bfloat16(mtp, bd, target, tmp_path):
    save_mtp(mtp, tmp_path / "m", target[2])
    save_block_diffusion(bd, tmp_path / "b", target[2])
    for f in ("m", "b"):
        t = load_file(tmp_path / f / "model.safetensors")
        assert t["token_map"].dtype == torch.int64
        assert {v.dtype for k, v in t.items() if k != "token_map"} == {torch.bfloat16}


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", 48, ["hidden size 32", "hidden size 48"]),
    ("vocab_size", 128, ["vocabulary size 96", "vocabulary size 128"]),
    ("num_layers", 7, ["layer count 4", "layer count 7"]),
])
def test_wrong_target_is_named(saved, target, field, value, words):
    kind, folder = saved
    other = dataclasses.replace(target[1], **{field: value})
    with pytest.raises(ValueError) as e:
        _load(kind, folder, target, other)
    for w in words:
        assert w in str(e.value)


def _damage(folder: Path, tensors=None, config=None, remove=()):
    if tensors:
        t = load_file(folder / "model.safetensors")
        tensors(t)
        save_file(t, folder / "model.safetensors")
    if config:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))
    for name in remove:
        (folder / name).unlink()


def _unsorted_map(t):
    t["token_map"] = t["token_map"].flip(0).contiguous()


DAMAGE = {
    "mtp": [
        (dict(tensors=lambda t: t.pop("blocks.1.layers.0.weight")), ["blocks.1.layers.0.weight"]),
        (dict(tensors=lambda t: t.update({"lm_heads.0.weight": torch.zeros(31, 32)})),
         ["lm_heads.0.weight", "(31, 32)"]),
        (dict(tensors=lambda t: t.update({"lm_heads.1.weight": torch.zeros(VD, 32)})),
         ["lm_heads.1.weight"]),
        (dict(tensors=_unsorted_map), ["token_map", "ascending"]),
        (dict(config=lambda c: c.update(original_lm_head=False)), ["original_lm_head"]),
        (dict(config=lambda c: c.update(medusa_fc_bias=True)), ["medusa_fc_bias"]),
        (dict(config=lambda c: c.pop("num_heads")), ["num_heads"]),
        (dict(config=lambda c: c["specdec"].update(rank_acceptance=[[2.0]])), ["rank_acceptance"]),
        (dict(config=lambda c: c.update(architectures=["LlamaForCausalLM"])), ["MedusaModel"]),
        (dict(remove=["config.json"]), ["config.json"]),
    ],
    "block_diffusion": [
        (dict(tensors=lambda t: t.pop("mask_embedding")), ["mask_embedding", "(3, 32)"]),
        (dict(config=lambda c: c["dflash_config"].pop("anchor_state")), ["anchor_state"]),
        (dict(tensors=lambda t: t.update({"fc.weight": torch.zeros(32, 64)})),
         ["fc.weight", "(32, 64)", "(32, 96)"]),
        (dict(tensors=lambda t: t.update({"layers.0.self_attn.q_norm.weight": torch.ones(8)})),
         ["q_norm"]),
        (dict(tensors=lambda t: t.update({"token_map": t["token_map"].float()})),
         ["token_map", "float32"]),
        (dict(config=lambda c: c["dflash_config"].update(mask_token_id=5)), ["mask_token_id"]),
        (dict(config=lambda c: c["dflash_config"].update(target_layer_ids=[0, 9])),
         ["target_layer_ids", "[0, 9]"]),
        (dict(config=lambda c: c.pop("block_size")), ["block_size"]),
        (dict(config=lambda c: c["specdec"].update(rank_acceptance=[[0.5]])), ["rank_acceptance"]),
        (dict(remove=["model.safetensors"]), ["safetensors"]),
    ],
}


@pytest.mark.parametrize("kind, case", [(k, i) for k, cases in DAMAGE.items()
                                        for i in range(len(cases))])
def test_damaged_checkpoint_is_named(kind, case, mtp, bd, target, tmp_path):
    damage, words = DAMAGE[kind][case]
    folder = tmp_path / "d"
    _save(kind, mtp if kind == "mtp" else bd, target, folder)
    _damage(folder, **damage)
    with pytest.raises(ValueError) as e:
        _load(kind, folder, target)
    for w in words:
        assert w in str(e.value), (str(e.value), w)


def test_failed_save_leaves_no_folder_and_existing_is_kept(mtp, target, tmp_path, monkeypatch):
    import specdec.models.heads.checkpoint as ck

    _save("mtp", mtp, target, tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck.safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        _save("mtp", mtp, target, tmp_path / "n")
    with pytest.raises(OSError):
        _save("mtp", mtp, target, tmp_path / "m", overwrite=True)
    assert not (tmp_path / "n").exists()
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary left behind
    with pytest.raises(FileExistsError):
        save_mtp(mtp, tmp_path / "m", target[2])
    shutil.rmtree(tmp_path / "m")


def test_conditional_calibration_is_preferred(mtp, target, tmp_path):
    cond = [[0.5, 0.1], [0.6, 0.2], [0.7, 0.1]]  # given the heads above were right
    extra = {"rank_acceptance": RATES_MTP, "rank_acceptance_conditional": cond}
    save_mtp(mtp, tmp_path / "c", target[2], dtype=torch.float32, extra=extra)
    assert _load("mtp", tmp_path / "c", target).rank_acceptance == cond
    bad = {"rank_acceptance": RATES_MTP, "rank_acceptance_conditional": [[1.5]]}
    save_mtp(mtp, tmp_path / "b", target[2], dtype=torch.float32, extra=bad)
    with pytest.raises(ValueError, match="specdec.rank_acceptance_conditional must list"):
        _load("mtp", tmp_path / "b", target)
