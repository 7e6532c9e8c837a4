"""Model resolution and loading: bad inputs fail with errors that name what was wrong.

No test here touches the network: hub look-ups run with huggingface_hub's offline switch on, and
the real model only comes through the `smollm2_dir` fixture.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.models import aliases
from specdec.models.aliases import ALIASES, alias_folder, cache_dir, convert_gguf
from specdec.models.decoder.config import SUPPORTED_MODEL_TYPES
from specdec.models.loader import load_model, resolve_model_path

F32 = torch.float32


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def llama_copy(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny llama folder that a test may damage."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _load(folder: Path):
    return load_model(folder, F32, "cpu", 64)


def test_a_good_folder_resolves_and_loads(tiny_llama):
    assert resolve_model_path(str(tiny_llama)) == tiny_llama
    model, cfg, _ = _load(tiny_llama)
    assert cfg.model_type == "llama" and len(model.layers) == cfg.num_layers


# ---- finding the model -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-xyz", "/no/such/folder/model"])
def test_unknown_model_names_the_model(offline, name):
    with pytest.raises(ValueError, match=re.escape(repr(name))) as info:
        resolve_model_path(name)
    assert "smollm2-135m-instruct" in str(info.value)  # the aliases one could have meant


@pytest.mark.parametrize("bad", ["", None, 3])
def test_model_must_be_a_non_empty_string(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        resolve_model_path(bad)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no config\.json") as info:
        resolve_model_path(str(tmp_path))
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json"))):
        _load(tmp_path)


def test_unparsable_config_json(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(llama_copy / "config.json"))):
        _load(llama_copy)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type='gpt2'") as info:
        _load(tmp_path)
    assert all(mt in str(info.value) for mt in SUPPORTED_MODEL_TYPES)


def test_unsupported_rope_type(llama_copy):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    _edit_config(llama_copy, rope_parameters=rope, rope_scaling=rope)
    with pytest.raises(ValueError, match="rope_type='dynamic'") as info:
        _load(llama_copy)
    assert "llama3" in str(info.value) and "linear" in str(info.value)


def test_partial_rotary_is_refused(tmp_path):
    """Phi-4-mini rotates 3/4 of each head; the decoder rotates whole heads."""
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "phi3", "phi3", partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75; the decoder rotates "
                                         r"whole heads only \(1\.0\)"):
        _load(folder)


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "phi3", "phi3")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-8]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"tensor {re.escape(name)}: 56 rows, expected 64 "
                                         r"\(32 \+ 16 \+ 16\)"):
        _load(folder)


def test_unsupported_activation(llama_copy):
    _edit_config(llama_copy, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        _load(llama_copy)


def test_heads_not_a_multiple_of_kv_heads(llama_copy):
    _edit_config(llama_copy, num_attention_heads=4, num_key_value_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        _load(llama_copy)


# ---- weights files -----------------------------------------------------------------------


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize("damage", [
    _truncate,
    lambda data: data[:4],  # not even the header length
    lambda data: b"\x00" * 64,
    lambda data: b"",
], ids=["half", "4-bytes", "zeros", "empty"])
def test_corrupt_weights_file_is_named(llama_copy, damage):
    f = llama_copy / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(ValueError, match=re.escape(str(f))):
        _load(llama_copy)


def test_no_weights_file(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        _load(llama_copy)


def _rewrite(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("name", [
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.norm.weight",
    "lm_head.weight",  # the tiny llama does not tie its embeddings
    "model.embed_tokens.weight",
])
def test_missing_tensor_is_named(llama_copy, name):
    _rewrite(llama_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        _load(llama_copy)


def test_qwen2_bias_shape_mismatch_is_named(tiny_models, tmp_path):
    folder = Path(shutil.copytree(tiny_models["qwen2"], tmp_path / "qwen2"))
    name = "model.layers.0.self_attn.k_proj.bias"
    _rewrite(folder, lambda t: t.__setitem__(name, torch.zeros(15)))
    with pytest.raises(ValueError, match=re.escape(name) + r".*\(15,\)"):
        _load(folder)


def test_missing_qwen_specific_tensors_are_named(tiny_models, tmp_path):
    for arch, name in [("qwen2", "model.layers.0.self_attn.v_proj.bias"),
                       ("qwen3", "model.layers.1.self_attn.q_norm.weight")]:
        folder = Path(shutil.copytree(tiny_models[arch], tmp_path / arch))
        _rewrite(folder, lambda t, name=name: t.pop(name))
        with pytest.raises(ValueError, match=re.escape(repr(name))):
            _load(folder)


@pytest.mark.parametrize("name, shape", [
    ("model.embed_tokens.weight", (95, 32)),
    ("model.layers.0.mlp.down_proj.weight", (32, 63)),
    ("model.layers.1.input_layernorm.weight", (31,)),
    # fused at load time (q|k|v, gate|up): the error must still name the one bad tensor
    ("model.layers.0.self_attn.k_proj.weight", (17, 32)),
    ("model.layers.0.self_attn.q_proj.weight", (32, 31)),
    ("model.layers.1.mlp.up_proj.weight", (64, 30)),
])
def test_shape_mismatch_is_named(llama_copy, name, shape):
    _rewrite(llama_copy, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(ValueError, match=re.escape(name)) as info:
        _load(llama_copy)
    assert str(tuple(shape)) in str(info.value)


# ---- GGUF --------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"hello, not a gguf file" * 4, b"GGUF" + b"\x00" * 60],
                         ids=["no-magic", "bad-header"])
def test_corrupt_gguf_is_named(tmp_path, content):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(content)
    import gguf

    reader = gguf.GGUFReader
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        convert_gguf(bad, tmp_path / "out")
    assert gguf.GGUFReader is reader  # the conversion's memoized reader is gone, failed or not


def test_conversion_parses_each_gguf_file_once(tmp_path):
    import gguf
    import numpy as np

    from specdec.models.aliases import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert isinstance(first, reader)
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)


def test_corrupt_gguf_through_resolve_leaves_no_cache_entry(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    bad = tmp_path / "user" / "model.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF" + b"\x01" * 60)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        resolve_model_path(str(bad))
    gguf_entries = list((cache / "gguf").glob("*")) if (cache / "gguf").exists() else []
    assert gguf_entries == []  # a failed conversion is not cached as a good one


# ---- the cache ---------------------------------------------------------------------------


def test_cache_dir_respects_specdec_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    monkeypatch.setenv("SPECDEC_CACHE", "")
    assert cache_dir() == tmp_path / "home" / ".cache" / "specdec"
    monkeypatch.delenv("SPECDEC_CACHE")
    assert cache_dir() == tmp_path / "home" / ".cache" / "specdec"


class _Refetched(Exception):
    pass


def _forbid_fetch(monkeypatch):
    def refetch(*args, **kwargs):
        raise _Refetched

    monkeypatch.setattr(aliases, "_fetch_gguf", refetch)
    monkeypatch.setattr(aliases, "convert_gguf", refetch)


def test_incomplete_alias_cache_is_refetched(tmp_path, monkeypatch):
    """A folder without the `.complete` marker (an interrupted conversion) is not trusted."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    name = next(iter(ALIASES))
    folder = tmp_path / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    _forbid_fetch(monkeypatch)
    with pytest.raises(_Refetched):
        alias_folder(name)


@pytest.mark.slow
def test_intact_alias_cache_is_not_refetched(smollm2_dir, monkeypatch):
    name = "smollm2-135m-instruct"
    assert smollm2_dir.name == name and smollm2_dir.parent.name == "models"
    monkeypatch.setenv("SPECDEC_CACHE", str(smollm2_dir.parent.parent))
    _forbid_fetch(monkeypatch)
    assert alias_folder(name) == smollm2_dir
    assert resolve_model_path(name) == smollm2_dir


def test_a_folder_published_meanwhile_is_kept_and_an_old_one_replaced_whole(tmp_path,
                                                                             monkeypatch):
    """Two processes making the same GGUF folder at once: the later one keeps what the first
    published (it once deleted it under the first one's readers); an older layout is replaced."""
    def fake_metadata(gguf, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(aliases, "write_metadata_files", fake_metadata)
    folder = tmp_path / "cache" / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"old": 1}')
    (folder / ".complete").write_text("fp32-0 src\n")  # an older layout
    for i in range(2):
        work = tmp_path / f"tmp{i}"
        work.mkdir()
        (work / "x.gguf").write_bytes(b"GGUF")
        aliases._publish(work / "x.gguf", folder, work, "src", link=True)
        if i == 0:
            first = (folder / "config.json").stat().st_ino
            assert aliases.is_converted(folder, "src")
    assert (folder / "config.json").stat().st_ino == first  # the second kept the first's
    assert (folder / "config.json").read_text() == "{}"
