"""The drafter folders specdec exports, fed to replays of vLLM's and SGLang's own loaders.

``loader_replays`` replays each engine's config reads (with its defaults), renames, shard and
shape checks and silent drops, from the loader sources it pins. A pair loads when the replay
neither crashes nor drops a tensor nor leaves a parameter at its init value, reads the config
values the drafter was built with, captures the target layers it was trained on, maps the draft
vocabulary to the same target ids, and ends with specdec's weights in every parameter.
README.md's "who loads what" table is parsed and checked against these replays and against the
exporter's errors.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from loader_replays import (
    LoaderCrash,
    sglang_dflash,
    sglang_eagle3,
    vllm_dflash,
    vllm_eagle3,
    vllm_medusa,
)
from safetensors.torch import load_file, save_file

from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.heads.block_diffusion_io import save_block_diffusion
from specdec.models.heads.checkpoint import rope_json
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.heads.eagle3_io import save_eagle3, vocab_ids
from specdec.models.heads.export_formats import check_formats
from specdec.models.heads.export_formats import loads as format_loads
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.models.heads.mtp_io import save_mtp
from specdec.models.loader import load_model

README = Path(__file__).resolve().parents[2] / "README.md"
LAYERS, VD, CUSTOM_AUX = 8, 32, (3, 5, 6)  # default aux ids for 8 layers: (2, 4, 5)
ENGINES = {"vLLM": "vllm", "SGLang": "sglang"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # eps, theta and positions unlike transformers' defaults, so a dropped field shows
    folder = make_tiny_model(tmp_path_factory.mktemp("exp") / "t", num_hidden_layers=LAYERS,
                             rms_norm_eps=1e-5, rope_theta=50000.0)
    return load_model(folder, torch.float32, "cpu", 64)


def _used(cfg):
    torch.manual_seed(0)
    return torch.randperm(cfg.vocab_size)[:VD].sort().values


def _noisy(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


def _eagle3(target, aux=None):
    model, cfg, hf = target
    head = Eagle3Head(Eagle3Config.for_target(cfg, VD, aux), model.embed, hf)
    head.reset_parameters()
    head.set_vocab(_used(cfg))
    return _noisy(head)


@pytest.fixture(scope="module")
def drafters(target):
    model, cfg, hf = target
    mtp = MTPHeads(MTPConfig.for_target(cfg, VD, num_heads=3, num_layers=2), torch.float32)
    mtp.init_from_target(model.head_weight, _used(cfg))
    bd = BlockDiffusionModel(BlockDiffusionConfig.for_target(cfg, VD, 1, 4, (1, 4, 6)),
                             model.embed, hf)
    bd.init_from_target(model, _used(cfg))
    return {"eagle3": _eagle3(target), "mtp": _noisy(mtp), "block_diffusion": _noisy(bd),
            "eagle3_custom_aux": _eagle3(target, CUSTOM_AUX)}


SAVE = {"eagle3": save_eagle3, "mtp": save_mtp, "block_diffusion": save_block_diffusion}


def _export(kind, drafter, target, folder, formats=()):
    SAVE[kind](drafter, folder, target[2], dtype=torch.float32, formats=formats)
    return folder


# ------------------------------------------------------------------------ what "loads" means

def _eagle3_expect(head, target, names) -> dict:
    """Engine parameter name -> specdec's value; ``names``: (layer prefix, fc, norm prefix)."""
    layer, p = head.layer, names
    return {p[0] + "self_attn.qkv_proj.weight": layer.qkv_weight,
            p[0] + "self_attn.o_proj.weight": layer.o_weight,
            p[0] + "mlp.gate_up_proj.weight": layer.gate_up_weight,
            p[0] + "mlp.down_proj.weight": layer.down_weight,
            p[0] + "input_layernorm.weight": layer.input_norm,
            p[0] + "post_attention_layernorm.weight": layer.post_attn_norm,
            p[0] + "hidden_norm.weight": head.hidden_norm,
            "model.fc.weight": head.fc, "model.norm.weight": head.norm_weight,
            "lm_head.weight": head.lm_head}


def _eagle3_config(head, target) -> dict:
    c, hf = head.config, target[2]
    return {"hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size, **rope_json(hf), "max_position_embeddings": c.max_position_embeddings,
            "hidden_act": "silu", "num_hidden_layers": 1, "use_aux_hidden_state": True,
            "norm_before_residual": False, "attention_bias": False, "mlp_bias": False}


def _eagle3_problems(engine, folder, head, target, pr25454=True) -> list[str]:
    if engine == "vllm":
        got = vllm_eagle3(folder, LAYERS)
        expect = _eagle3_expect(head, target, ("model.layers.0.",))
    else:
        got = sglang_eagle3(folder, LAYERS, pr25454)
        expect = _eagle3_expect(head, target, ("model.midlayer.",))
    out = _common(got, expect, _eagle3_config(head, target))
    if got.captured != tuple(head.config.aux_layer_ids):
        out.append(f"captures target layers {got.captured}, trained on "
                   f"{tuple(head.config.aux_layer_ids)}")
    out += _vocab(got, vocab_ids(head.d2t, head.t2d))
    return out


def _mtp_problems(folder, heads) -> list[str]:
    c = heads.config
    got = vllm_medusa(folder)
    expect = {f"blocks.{i}.layers.{j}.weight": heads.blocks[i, j]
              for i in range(c.num_heads) for j in range(c.num_layers)}
    expect["lm_head.weight"] = heads.lm_head
    config = {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
              "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "truncated_vocab_size": c.draft_vocab_size, "medusa_fc_bias": False,
              "original_lm_head": True, "logit_scale": 1.0}
    return _common(got, expect, config) + _vocab(got, heads.token_map)


def _common(got, expect: dict, config: dict) -> list[str]:
    out = []
    if got.unloaded:
        out.append(f"{got.engine} leaves {got.unloaded} at their init values")
    if got.dropped:
        out.append(f"{got.engine} drops {got.dropped}")
    for k, v in config.items():
        if got.read.get(k) != v:
            out.append(f"{got.engine} reads {k}={got.read.get(k)!r}, the drafter has {v!r}")
    for name, value in expect.items():
        have = got.values.get(name)
        if have is None or not torch.equal(have, value.detach().double()):
            out.append(f"{got.engine} parameter {name} is not specdec's value")
    return out


def _vocab(got, ids: torch.Tensor) -> list[str]:
    if got.draft_to_target is None or not torch.equal(got.draft_to_target, ids.cpu()):
        return [f"{got.engine} maps the draft vocabulary to other target ids"]
    return []


def problems(kind, engine, folder, drafter, target) -> list[str]:
    """What goes wrong when ``engine`` loads the export of ``kind``: [] = it loads faithfully."""
    try:
        if kind == "eagle3":
            return _eagle3_problems(engine, folder, drafter, target)
        if kind == "mtp" and engine == "vllm":
            return _mtp_problems(folder, drafter)
        if kind == "block_diffusion":
            got = (vllm_dflash(folder, target[1].vocab_size) if engine == "vllm"
                   else sglang_dflash(folder))
            return _common(got, {}, {"mask_token_id": None}) or ["(no replay objection)"]
    except LoaderCrash as e:
        return [f"{engine} crashes: {e}"]
    return [f"{engine} has no loader for {kind}"]


# ------------------------------------------------------------------------------ the README

def readme_table() -> dict[tuple[str, str], str]:
    """(kind, engine) -> the README's cell for it, from the "who loads what" table."""
    text = README.read_text()
    start = text.index("| drafter | vLLM | SGLang |")
    cells = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        kind = re.fullmatch(r"`(\w+)`.*", row[0]).group(1)
        for engine, cell in zip(ENGINES.values(), row[1:]):
            cells[(kind, engine)] = cell
    return cells


def test_readme_table_names_every_kind_and_engine():
    cells = readme_table()
    assert {k for k, _ in cells} == {"eagle3", "mtp", "block_diffusion"}
    for (kind, engine), cell in cells.items():
        assert cell.startswith(("loads", "no")), (kind, engine, cell)
        assert cell.startswith("loads") == format_loads(kind, engine), (kind, engine)


@pytest.mark.parametrize("kind,engine", [(k, e) for k in ("eagle3", "mtp", "block_diffusion")
                                         for e in ("vllm", "sglang")])
def test_readme_claim_holds_against_the_loader(kind, engine, drafters, target, tmp_path):
    cell, drafter = readme_table()[(kind, engine)], drafters[kind]
    if cell.startswith("loads"):
        folder = _export(kind, drafter, target, tmp_path / "d", formats=(engine,))
        assert problems(kind, engine, folder, drafter, target) == []
        return
    with pytest.raises(ValueError, match=rf"(?i){kind}.*{engine}"):
        _export(kind, drafter, target, tmp_path / "refused", formats=(engine,))
    assert not (tmp_path / "refused").exists()
    folder = _export(kind, drafter, target, tmp_path / "own")  # specdec's own format
    assert problems(kind, engine, folder, drafter, target) != []


def test_block_diffusion_replays_show_why_it_stays_specdec_only(drafters, target, tmp_path):
    folder = _export("block_diffusion", drafters["block_diffusion"], target, tmp_path / "bd")
    with pytest.raises(LoaderCrash, match="token_map"):
        vllm_dflash(folder, target[1].vocab_size)
    got = sglang_dflash(folder)
    assert {"lm_head.weight", "token_map", "mask_embedding"} <= set(got.dropped)
    assert any("q_norm" in n for n in got.unloaded) and got.read["mask_token_id"] is None


# ------------------------------------------------------------------------------ aux layers

def test_eagle3_aux_layer_ids_reach_both_engines(drafters, target, tmp_path):
    head = drafters["eagle3_custom_aux"]
    folder = _export("eagle3", head, target, tmp_path / "h", formats=("vllm", "sglang"))
    assert vllm_eagle3(folder, LAYERS).captured == CUSTOM_AUX  # top-level ids
    assert sglang_eagle3(folder, LAYERS).captured == CUSTOM_AUX  # eagle_config's
    assert problems("eagle3", "vllm", folder, head, target) == []
    assert problems("eagle3", "sglang", folder, head, target) == []
    # SGLang before sglang#25454 adds 1 to every id: the README's table says so
    assert sglang_eagle3(folder, LAYERS, pr25454=False).captured == (4, 6, 7)
    assert "25454" in readme_table()[("eagle3", "sglang")]


# ------------------------------------------------------------------------------ mutations

def _mutated(src: Path, dst: Path, rename: str | None = None, drop_field: str | None = None,
             rename_field: tuple[str, str] | None = None) -> Path:
    shutil.copytree(src, dst)
    if rename is not None:
        t = load_file(dst / "model.safetensors")
        t[rename.upper()] = t.pop(rename)
        save_file(t, dst / "model.safetensors")
    raw = json.loads((dst / "config.json").read_text())
    if drop_field is not None:
        del raw[drop_field]
    if rename_field is not None:
        raw[rename_field[1]] = raw.pop(rename_field[0])
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


# config fields each loader reads whose loss changes what it builds (the rest equal its default)
READ_FIELDS = {
    ("eagle3", "vllm"): ("architectures", "model_type", "hidden_size", "num_attention_heads",
                         "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                         "vocab_size", "draft_vocab_size", "rope_theta",
                         "max_position_embeddings", "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", "sglang"): ("architectures", "model_type", "hidden_size", "num_attention_heads",
                           "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                           "vocab_size", "draft_vocab_size", "rope_theta",
                           "max_position_embeddings", "eagle_config"),
    ("mtp", "vllm"): ("model_type", "hidden_size", "vocab_size", "num_heads",
                      "num_hidden_layers", "truncated_vocab_size", "original_lm_head"),
}


@pytest.mark.parametrize("kind,engine", sorted(READ_FIELDS))
def test_renaming_any_key_or_dropping_a_read_field_fails(kind, engine, drafters, target,
                                                         tmp_path):
    drafter = drafters["eagle3_custom_aux" if kind == "eagle3" else kind]
    src = _export(kind, drafter, target, tmp_path / "src", formats=(engine,))
    assert problems(kind, engine, src, drafter, target) == []
    for i, key in enumerate(load_file(src / "model.safetensors")):
        bad = _mutated(src, tmp_path / f"k{i}", rename=key)
        assert problems(kind, engine, bad, drafter, target), f"renamed {key} still loads"
    for name in READ_FIELDS[(kind, engine)]:
        bad = _mutated(src, tmp_path / f"f_{name}", drop_field=name)
        assert problems(kind, engine, bad, drafter, target), f"without {name} still loads"


def test_medusa_config_renames_num_fields_as_vllm_does(drafters, target, tmp_path):
    """MedusaConfig.from_pretrained maps "num…heads" keys to num_heads: the replay follows."""
    src = _export("mtp", drafters["mtp"], target, tmp_path / "src", formats=("vllm",))
    ok = _mutated(src, tmp_path / "ok", rename_field=("num_heads", "num_medusa_heads"))
    assert problems("mtp", "vllm", ok, drafters["mtp"], target) == []
    bad = _mutated(src, tmp_path / "bad", rename_field=("num_heads", "n_heads"))
    assert problems("mtp", "vllm", bad, drafters["mtp"], target)


# ------------------------------------------------------------------------------ bad input

def test_export_format_errors_name_the_drafter_and_the_format():
    assert check_formats("eagle3", ["vllm", "sglang", "vllm"]) == ("specdec", "vllm", "sglang")
    for kind, fmt in (("mtp", "sglang"), ("block_diffusion", "vllm"),
                      ("block_diffusion", "sglang"), ("eagle3", "tgi")):
        with pytest.raises(ValueError, match=rf"{kind}.*{fmt}"):
            check_formats(kind, [fmt])
    with pytest.raises(TypeError, match="string"):
        check_formats("eagle3", "vllm")


def test_train_config_refuses_an_export_its_kind_cannot_make(tmp_path):
    from specdec.training.config import TrainConfig

    base = {"data": ["x.jsonl"], "out": str(tmp_path / "o")}
    assert TrainConfig(kind="eagle3", export_for=["vllm", "sglang"], **base).export_for
    with pytest.raises(ValueError, match="export_for.*block_diffusion.*vllm"):
        TrainConfig(kind="block_diffusion", export_for=["vllm"], **base)
    with pytest.raises(ValueError, match="export_for"):
        TrainConfig(kind="mtp", export_for="vllm", **base)
