"""EAGLE-3 checkpoints in the format vLLM and SGLang load: round trip, layout, errors, atomicity.

The expected keys, shapes and config fields below are written from the reference notes
(/work/shared/reference/learned_drafters.md A1, A2, A4, A5: SpecForge's export, vLLM's and
SGLang's llama_eagle3 loaders), not from the module under test.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file

from specdec.attention.dense import DenseAttention
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from specdec.models.heads.eagle3_io import load_eagle3, save_eagle3
from specdec.models.loader import load_model

LAYERS, AUX, DRAFT_VOCAB = 6, (2, 3, 5), 32
# Reference A2, in its order; shapes for the tiny target (H 32, 4 heads, 2 KV heads, head_dim 8,
# intermediate 64, vocab 96) with draft vocab 32.
EXPECTED_KEYS = {
    "fc.weight": (32, 3 * 32),
    "midlayer.self_attn.q_proj.weight": (32, 2 * 32),
    "midlayer.self_attn.k_proj.weight": (16, 2 * 32),
    "midlayer.self_attn.v_proj.weight": (16, 2 * 32),
    "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.mlp.gate_proj.weight": (64, 32),
    "midlayer.mlp.up_proj.weight": (64, 32),
    "midlayer.mlp.down_proj.weight": (32, 64),
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.post_attention_layernorm.weight": (32,),
    "norm.weight": (32,),
    "lm_head.weight": (DRAFT_VOCAB, 32),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (96,),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("eagle3_target") / "t",
                             num_hidden_layers=LAYERS)
    model, cfg, hf_config = load_model(folder, torch.float32, "cpu", 64)
    return model, cfg, hf_config


@pytest.fixture(scope="module")
def head(target):
    model, cfg, hf_config = target
    head = Eagle3Head(Eagle3Config.for_target(cfg, DRAFT_VOCAB, AUX), model.embed, hf_config)
    torch.manual_seed(1)
    head.reset_parameters()
    with torch.no_grad():  # random norms, so a swapped norm shows
        for p in (head.hidden_norm, head.norm_weight, head.layer.input_norm,
                  head.layer.post_attn_norm):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
    head.set_vocab(torch.randperm(cfg.vocab_size)[:DRAFT_VOCAB].sort().values)
    return head


@pytest.fixture(scope="module")
def saved(head, target, tmp_path_factory) -> Path:
    """The head saved in float32 (read-only for tests: copy before damaging)."""
    folder = tmp_path_factory.mktemp("eagle3_ckpt") / "head"
    save_eagle3(head, folder, target[2], dtype=torch.float32, extra={"val_acc": [0.5, 0.25]})
    return folder


def _forward(head, ids, features):
    valid = torch.ones(1, ids.numel(), dtype=torch.bool)
    with torch.no_grad():
        out = head(ids, torch.arange(ids.numel()), DenseAttention.causal(valid), None,
                   features=features)
        return out.hidden, head.compute_logits(out.hidden)


def _load(folder, target, cfg=None):
    model, tcfg, hf_config = target
    return load_eagle3(folder, cfg or tcfg, model.embed, hf_config)


def test_round_trip_float32_is_exact(head, saved, target):
    loaded = _load(saved, target)
    assert loaded.config == head.config
    ours, theirs = dict(head.named_parameters()), dict(loaded.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    torch.manual_seed(2)
    ids, features = torch.randint(0, 96, (7,)), torch.randn(7, 32)
    for a, b in zip(_forward(head, ids, features), _forward(loaded, ids, features)):
        assert torch.equal(a, b)


def test_default_export_is_bfloat16_in_the_documented_layout(head, target, tmp_path):
    save_eagle3(head, tmp_path / "h", target[2])
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    assert {k: tuple(t.shape) for k, t in tensors.items()} == EXPECTED_KEYS  # no embedding
    for name, t in tensors.items():
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert t.dtype == want, name
    # q|k|v and gate|up are the row blocks of our fused matrices, in that order
    qkv = torch.cat([tensors[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, head.layer.qkv_weight.detach().bfloat16())
    gate_up = torch.cat([tensors[f"midlayer.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(gate_up, head.layer.gate_up_weight.detach().bfloat16())
    loaded = _load(tmp_path / "h", target)  # bf16 values, read back into float32
    assert torch.equal(loaded.lm_head, head.lm_head.detach().bfloat16().float())


def test_config_fields(saved, target):
    c = json.loads((saved / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "vocab_size": 96,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX),
                         "use_aux_hidden_state": True},
    }
    assert {k: c.get(k) for k in expected} == expected
    assert c.get("rope_scaling") is None  # default RoPE
    assert "target_hidden_size" not in c  # only when it differs from hidden_size
    assert c["specdec"]["target_num_layers"] == LAYERS
    assert c["specdec"]["val_acc"] == [0.5, 0.25]
    assert c["specdec"]["target_model"] == str(target[2].name_or_path)


def test_d2t_is_an_offset_and_t2d_marks_exactly_the_draft_vocabulary(head, saved):
    tensors = load_file(saved / "model.safetensors")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    used = (head.d2t + torch.arange(DRAFT_VOCAB)).tolist()
    assert (torch.arange(DRAFT_VOCAB) + d2t).tolist() == used  # target_id = i + d2t[i]
    assert t2d.nonzero().flatten().tolist() == used
    assert int(t2d.sum()) == DRAFT_VOCAB and used == sorted(set(used))
    # vLLM's compute_logits: scatter draft logits to arange(V_d) + d2t in a -inf target row
    draft_logits = torch.randn(DRAFT_VOCAB)
    full = torch.full((96,), float("-inf")).index_copy(0, torch.arange(DRAFT_VOCAB) + d2t,
                                                       draft_logits)
    assert int(full.argmax()) == used[int(draft_logits.argmax())]


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", 48, ["hidden size 32", "hidden size 48"]),
    ("vocab_size", 128, ["vocabulary size 96", "vocabulary size 128"]),
    ("num_layers", 7, [f"layer count {LAYERS}", "layer count 7"]),
])
def test_wrong_target_is_named(saved, target, field, value, words):
    other = dataclasses.replace(target[1], **{field: value})
    with pytest.raises(ValueError) as e:
        _load(saved, target, other)
    for w in words:
        assert w in str(e.value)


def _damaged(saved, tmp_path, tensors=None, config=None, remove=()) -> Path:
    folder = Path(shutil.copytree(saved, tmp_path / "damaged"))
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
    return folder


def _flip_t2d(t):
    t["t2d"] = t["t2d"].clone()
    t["t2d"][int(t["t2d"].logical_not().nonzero()[0])] = True
    t["t2d"][int(t["t2d"].nonzero()[-1])] = False


@pytest.mark.parametrize("damage, words", [
    (dict(tensors=lambda t: t.pop("midlayer.hidden_norm.weight")),
     ["midlayer.hidden_norm.weight", "(32,)"]),
    (dict(tensors=lambda t: t.update({"lm_head.weight": torch.zeros(31, 32)})),
     ["lm_head.weight", "(31, 32)", f"({DRAFT_VOCAB}, 32)"]),
    (dict(tensors=lambda t: t.update({"d2t": t["d2t"].float()})), ["d2t", "float32"]),
    (dict(tensors=lambda t: t.update({"midlayer.self_attn.q_proj.bias": torch.zeros(32)})),
     ["midlayer.self_attn.q_proj.bias"]),
    (dict(tensors=_flip_t2d), ["d2t and t2d disagree"]),
    (dict(config=lambda c: c.update(architectures=["LlamaForCausalLM"])),
     ["architectures", "LlamaForCausalLM", "LlamaForCausalLMEagle3"]),
    (dict(config=lambda c: c.update(norm_before_residual=True)), ["norm_before_residual"]),
    (dict(config=lambda c: c.pop("intermediate_size")), ["intermediate_size"]),
    (dict(remove=["config.json"]), ["config.json"]),
    (dict(remove=["model.safetensors"]), ["safetensors"]),
], ids=["missing-key", "wrong-shape", "wrong-dtype", "unused-key", "d2t-t2d", "architecture",
        "variant", "missing-field", "no-config", "no-weights"])
def test_damaged_checkpoint_is_named(saved, target, tmp_path, damage, words):
    folder = _damaged(saved, tmp_path, **damage)
    with pytest.raises(ValueError) as e:
        _load(folder, target)
    for w in words:
        assert w in str(e.value)


def test_corrupt_config_json_names_the_file(saved, target, tmp_path):
    folder = Path(shutil.copytree(saved, tmp_path / "c"))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        _load(folder, target)


def test_aux_ids_at_top_level_or_absent(saved, target, tmp_path):
    def top(c):
        c["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
        del c["eagle_config"]

    assert _load(_damaged(saved, tmp_path / "a", config=top), target).config.aux_layer_ids == (
        2, 4, 5)

    def absent(c):
        # a foreign checkpoint: no ids (neither place) and no layer count either
        del c["eagle_config"], c["specdec"], c["eagle_aux_hidden_state_layer_ids"]

    loaded = _load(_damaged(saved, tmp_path / "b", config=absent), target)
    assert loaded.config.aux_layer_ids == default_aux_layer_ids(LAYERS)
    assert loaded.config.target_num_layers == LAYERS

    def disagree(c):
        c["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]

    with pytest.raises(ValueError, match="disagree"):
        _load(_damaged(saved, tmp_path / "c", config=disagree), target)


def test_rope_other_than_the_heads_is_refused(head, target, tmp_path):
    other = copy.deepcopy(target[2])
    other.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="RoPE"):
        save_eagle3(head, tmp_path / "h", other)
    assert not (tmp_path / "h").exists()


def _boom(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"half a file")
    raise OSError("disk full")


def test_failed_save_leaves_no_folder(head, target, tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors.torch, "save_file", _boom)
    with pytest.raises(OSError, match="disk full"):
        save_eagle3(head, tmp_path / "h", target[2])
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a temporary sibling


def test_existing_destination_is_kept_or_replaced_whole(head, saved, target, tmp_path,
                                                        monkeypatch):
    dest = Path(shutil.copytree(saved, tmp_path / "h"))
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(FileExistsError, match="overwrite"):
        save_eagle3(head, dest, target[2])
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", _boom)
        with pytest.raises(OSError):
            save_eagle3(head, dest, target[2], overwrite=True)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    save_eagle3(head, dest, target[2], overwrite=True)  # bf16 now
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]


def test_file_size_is_the_tensor_bytes(saved):
    """The file is an 8-byte header length, the JSON header, then the raw tensor bytes.

    SmolLM2 (H 576, 9 heads, 3 KV heads, head_dim 64, intermediate 1536, vocab 49152) with draft
    vocab 32000, bf16, from the reference table A2:
      fc 576*1728 = 995,328; q 576*1152 = 663,552; k, v 192*1152 = 221,184 each;
      o 576*576 = 331,776; gate, up, down 1536*576 = 884,736 each; 4 norms 4*576 = 2,304;
      lm_head 32000*576 = 18,432,000  -> 23,521,536 weights * 2 B = 47,043,072 B
      d2t 32000 * 8 B = 256,000; t2d 49152 * 1 B = 49,152
      -> 47,348,224 B of tensors (45.2 MiB) plus a header of about 1.5 kB.
    """
    weights = (576 * 1728 + 576 * 1152 + 2 * 192 * 1152 + 576 * 576 + 3 * 1536 * 576 + 4 * 576
               + 32000 * 576)
    assert weights == 23_521_536
    assert 2 * weights + 8 * 32000 + 49152 == 47_348_224
    # the same arithmetic on the tiny float32 file written here
    raw = (saved / "model.safetensors").read_bytes()
    header = int.from_bytes(raw[:8], "little")
    floats = sum(torch.Size(s).numel() for k, s in EXPECTED_KEYS.items() if k not in ("d2t", "t2d"))
    assert len(raw) - 8 - header == 4 * floats + 8 * DRAFT_VOCAB + 96


def test_scaled_rope_round_trips(target, tmp_path):
    """A non-default RoPE goes out as rope_theta + rope_scaling and comes back the same."""
    model, cfg, hf_config = target
    scaled = copy.deepcopy(hf_config)
    scaled.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    head = Eagle3Head(Eagle3Config.for_target(cfg, DRAFT_VOCAB, AUX), model.embed, scaled)
    torch.manual_seed(3)
    head.reset_parameters()
    head.set_vocab(torch.arange(DRAFT_VOCAB) * 3)
    save_eagle3(head, tmp_path / "h", scaled, dtype=torch.float32)
    c = json.loads((tmp_path / "h" / "config.json").read_text())
    assert c["rope_theta"] == 10000.0
    assert c["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    loaded = _load(tmp_path / "h", target)
    assert torch.equal(loaded.rope.cos, head.rope.cos)
    assert not torch.allclose(loaded.rope.cos[:64], model.rope.cos)  # not the target's unscaled
    ids, features = torch.arange(5), torch.randn(5, 32)
    assert torch.equal(_forward(head, ids, features)[1], _forward(loaded, ids, features)[1])


def test_rope_comes_from_the_checkpoint_else_the_target(head, saved, target, tmp_path):
    def other_theta(c):
        c["rope_theta"] = 500000.0

    loaded = _load(_damaged(saved, tmp_path / "a", config=other_theta), target)
    assert not torch.allclose(loaded.rope.cos, head.rope.cos)  # the checkpoint's own RoPE

    def no_rope(c):
        del c["rope_theta"], c["rope_scaling"]

    loaded = _load(_damaged(saved, tmp_path / "b", config=no_rope), target)
    assert torch.equal(loaded.rope.cos, head.rope.cos)  # the target's


def test_trainable_load(saved, target):
    model, cfg, hf_config = target
    loaded = load_eagle3(saved, cfg, model.embed, hf_config, trainable=True)
    # embed_weight is the target's embedding (registered as a parameter since it is one)
    own = {n: p for n, p in loaded.named_parameters() if n != "embed_weight"}
    assert len(own) == 10 and all(p.requires_grad for p in own.values())
    assert not _load(saved, target).fc.requires_grad
