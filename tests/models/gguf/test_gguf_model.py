"""A GGUF loaded as it is (specdec/models/gguf/model.py, file.py, specdec/models/aliases.py): tiny random
files of each architecture against HF transformers reading the same file (the oracle); the
folder the cache keeps for them (small files, a link, never a copy); bad files refused before
any weight is used, naming the file, the tensor and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from gguf_helpers import TinyShape, write_tiny_gguf
from native_helpers import needs_kernels

from specdec import LLM, SamplingParams
from specdec.models import aliases
from specdec.models.gguf.block_weight import BlockWeight
from specdec.models.gguf.file import open_gguf
from specdec.models.loader import load_model, resolve_model_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# qwen3: transformers' GGUF config keeps its class's head_dim (128); the oracle needs it so
SHAPES = {"llama": TinyShape(), "qwen2": TinyShape(),
          "qwen3": TinyShape(hidden=256, heads=2, kv_heads=1, intermediate=256),
          "phi3": TinyShape()}


def _user_file(tmp_path: Path, **kw) -> Path:
    (tmp_path / "user").mkdir(exist_ok=True)
    return write_tiny_gguf(tmp_path / "user" / "tiny.gguf", **kw)


@pytest.mark.parametrize("arch, kind, tied", [("llama", "Q4_1", True), ("qwen2", "Q8_0", False),
                                              ("qwen3", "Q4_1", False), ("phi3", "Q8_0", False),
                                              ("phi3", "Q4_1", True)])
def test_tiny_gguf_is_hf_on_the_same_file(arch, kind, tied, tmp_path, cache):
    """Matrices kept as blocks (no fp32 copy), dequantized on demand bitwise as transformers
    does (q / k rows un-permuted for llama, not for qwen or phi3, whose file holds q|k|v and
    gate|up fused), logits HF's."""
    from transformers import AutoModelForCausalLM

    path = _user_file(tmp_path, arch=arch, kind=kind, tied=tied, shape=SHAPES[arch])
    model, cfg, _ = load_model(resolve_model_path(str(path)), torch.float32, "cpu", 64,
                               blocks=True)
    assert cfg.model_type == arch and cfg.tie_word_embeddings == tied
    assert cfg.sliding_window is None
    assert all(isinstance(w, BlockWeight) for w in [model.embed, *model.matrices()])
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    assert hf.config.model_type == cfg.model_type
    sd = hf.state_dict()
    fused = {"phi3": ("qkv_proj", "gate_up_proj")}.get(arch)
    qkv = (sd[f"model.layers.1.self_attn.{fused[0]}.weight"] if fused else
           torch.cat([sd[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]))
    gate_up = (sd[f"model.layers.1.mlp.{fused[1]}.weight"] if fused else
               torch.cat([sd[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up")]))
    assert torch.equal(model.layers[1].qkv_weight.dequantize(), qkv)
    assert torch.equal(model.layers[1].gate_up_weight.dequantize(), gate_up)
    assert torch.equal(model.head_weight.dequantize(), sd["lm_head.weight"])
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.compute_logits(model.forward_dense(ids).hidden[0])
        torch.testing.assert_close(ours, hf(ids).logits[0], atol=1e-5, rtol=0)


def test_float64_and_bfloat16_dequantize_once(tmp_path, cache):
    path = _user_file(tmp_path)
    folder = resolve_model_path(str(path))
    m32 = load_model(folder, torch.float32, "cpu", 64, blocks=True)[0]
    for dtype in (torch.float64, torch.bfloat16):
        m = load_model(folder, dtype, "cpu", 64, blocks=True)[0]
        assert not any(isinstance(w, BlockWeight) for w in m.matrices())
        assert m.embed.dtype == dtype
        assert torch.equal(m.layers[0].down_weight, m32.layers[0].down_weight.to(dtype))


@needs_kernels
@pytest.mark.parametrize("arch, activations", [("llama", "float"), ("llama", "q8"),
                                               ("phi3", "float"), ("phi3", "q8")])
def test_engine_runs_the_blocks_and_gives_the_dequantized_tokens(arch, activations, tmp_path,
                                                                 cache):
    path = _user_file(tmp_path, arch=arch, kind="Q4_1")
    kw = dict(model=str(path), max_model_len=64, activations=activations)
    nat = LLM(weights="native", **kw)
    assert nat.engine.parts.weights == "native"
    assert isinstance(nat.engine.parts.model.layers[0].qkv_weight, BlockWeight)
    sp = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["hello", "abc!"]
    got = [o.token_ids for o in nat.generate(prompts, sp)]
    spec = LLM(drafter="ngram", controller="static", controller_args={"budget": 3}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == got
    if activations == "float":  # the same numbers (q8 exists only over the blocks)
        deq = LLM(weights="dequantized", **kw)
        assert not isinstance(deq.engine.parts.model.layers[0].qkv_weight, BlockWeight)
        assert [o.token_ids for o in deq.generate(prompts, sp)] == got
    assert sorted(p.name for p in (tmp_path / "user").iterdir()) == ["tiny.gguf"]


def test_a_type_the_kernels_do_not_take(tmp_path, cache):
    """F16 matrices: "native" says which tensor and what it takes; "auto" falls back to the
    dequantized weights (logged) and still computes."""
    path = _user_file(tmp_path, kind="Q8_0", kinds={"blk.1.ffn_down.weight": "F16"})
    with pytest.raises(ValueError, match=r"weights='native' cannot run here: .*blk\.1\.ffn_down"
                                         r"\.weight.* is F16; native weights take .*Q8_0"):
        LLM(model=str(path), weights="native", max_model_len=64)
    llm = LLM(model=str(path), max_model_len=64)
    assert llm.engine.parts.weights == "dequantized"
    assert not any(isinstance(w, BlockWeight) for w in llm.engine.parts.model.matrices())
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


@needs_kernels
def test_a_fused_matrix_of_two_types_runs_in_parts(tmp_path, cache):
    """q|k Q4_1 beside v Q8_0 (as a Q4_K_M file's attn_v): native weights in parts, the
    dequantized model's tokens, in the model's fused row order."""
    path = _user_file(tmp_path, kind="Q4_1", kinds={"blk.0.attn_v.weight": "Q8_0"})
    kw = dict(model=str(path), max_model_len=64, activations="float")  # as the fp32 model
    nat = LLM(weights="native", **kw)
    assert nat.engine.parts.weights == "native"
    qkv = nat.engine.parts.kernels.prepared(nat.engine.parts.model.layers[0].qkv_weight)
    assert [(p.out_features, p.fmt) for p in qkv.parts] == [(96, 3), (32, 4)]  # Q4_1, Q8_0
    sp = SamplingParams(temperature=0, max_tokens=12)
    got = [o.token_ids for o in nat.generate(["hello", "abc!"], sp)]
    deq = LLM(weights="dequantized", **kw)
    assert [o.token_ids for o in deq.generate(["hello", "abc!"], sp)] == got


def test_a_part_that_is_not_whole_panel_pairs(tmp_path, cache):
    """Parts of a fused matrix are computed into their own output columns, so every part but
    the last must be a multiple of 16 rows: q|k of 72 rows (8 heads of 8, one kv head) beside a
    v of another type cannot. "native" says which matrix and why; "auto" falls back to the
    dequantized weights and still computes."""
    shape = TinyShape(hidden=64, heads=8, kv_heads=1)
    path = _user_file(tmp_path, kind="Q4_1", shape=shape,
                      kinds={"blk.1.attn_v.weight": "Q8_0"})
    with pytest.raises(ValueError, match=r"weights='native' cannot run here: .*layers\.1\.qkv "
                                         r"\(blk\.1\.attn_q\.weight\|.*\) fuses tensors of types "
                                         r"Q4_1\+Q8_0; the kernels run such a matrix in parts, "
                                         r"one per type, each but the last a multiple of 16 "
                                         r"rows, but its Q4_1 part has 72 rows"):
        LLM(model=str(path), weights="native", max_model_len=64)
    llm = LLM(model=str(path), max_model_len=64)
    assert llm.engine.parts.weights == "dequantized"
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


# ---- the folder in the cache --------------------------------------------------------------


def test_a_users_file_is_linked_not_copied_and_its_folder_is_lean(tmp_path, cache, monkeypatch):
    path = _user_file(tmp_path)
    folder = resolve_model_path(str(path))
    assert folder.is_relative_to(cache)
    assert (folder / "model.gguf").is_symlink() and (folder / "model.gguf").resolve() == path
    assert not list(folder.glob("*.safetensors"))
    assert {"config.json", "tokenizer.json", ".complete"} <= {p.name for p in folder.iterdir()}

    def parsed(*a, **k):
        raise AssertionError("metadata parsed again")

    monkeypatch.setattr(aliases, "write_metadata_files", parsed)
    assert resolve_model_path(str(path)) == folder  # served from the cache
    write_tiny_gguf(path, seed=1)  # the file changes (size or mtime): a new folder
    with pytest.raises(AssertionError, match="parsed again"):
        resolve_model_path(str(path))


def test_an_older_or_half_written_folder_is_made_again(tmp_path, cache):
    path = _user_file(tmp_path)
    folder = resolve_model_path(str(path))
    marker = folder / ".complete"
    for text in ("", marker.read_text().replace(aliases.LAYOUT, "lean-0")):
        marker.write_text(text)
        assert not aliases.is_converted(folder)
        assert resolve_model_path(str(path)) == folder and aliases.is_converted(folder)


def test_a_folder_that_fails_is_not_kept(tmp_path, cache):
    path = _user_file(tmp_path, arch="qwen2", metadata={"qwen2.attention.head_count": 5})
    with pytest.raises(ValueError, match=re.escape(str(path))):
        resolve_model_path(str(path))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())


# ---- bad files: an error naming the file, the tensor and what is allowed -------------------


def _load(path: Path):
    return load_model(resolve_model_path(str(path)), torch.float32, "cpu", 64, blocks=True)


def test_unsupported_architecture(tmp_path, cache):
    path = _user_file(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*general\.architecture "
                       r"'gpt2' is not supported; LlamaDecoder runs 'llama', 'qwen2', 'qwen3', "
                       r"'phi3'"):
        resolve_model_path(str(path))


def _with_tensor(path: Path, name: str, value) -> None:
    """Rewrite the GGUF at ``path`` with one more F32 tensor (gguf-py's reader and writer)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(path) + ".new", r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # uint8 blocks or float32
    w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".new").replace(path)


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_file(tmp_path, cache, cut):
    path = _user_file(tmp_path)
    folder = resolve_model_path(str(path))  # made from the whole file
    data = path.read_bytes()
    f = open_gguf(path)
    last = max(f.tensors.values(), key=lambda t: t.offset)
    path.write_bytes(data[:200] if cut == "header" else data[:last.offset + 10])
    expect = (r"truncated GGUF header" if cut == "header" else
              re.escape(last.name) + r" .* runs past the end of the file .* truncated")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + expect):
        resolve_model_path(str(path))
    with pytest.raises(ValueError, match=expect):  # the folder made before it was cut
        load_model(folder, torch.float32, "cpu", 64)


@pytest.mark.parametrize("kind, at, value", [("Q8_0", 0, "nan"), ("Q4_1", 2, "inf"),
                                             ("Q4_1", 0, "-inf")])
def test_corrupt_block(tmp_path, cache, kind, at, value):
    import numpy as np

    path = _user_file(tmp_path, kind=kind)
    f = open_gguf(path)
    t = f.tensors["blk.1.ffn_up.weight"]
    data = bytearray(path.read_bytes())
    block = t.row_bytes // (t.shape[1] // 32)
    pos = t.offset + 3 * t.row_bytes + block + at  # row 3, its second block
    data[pos:pos + 2] = np.float16(value).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(path.name)) + r".*blk\.1\.ffn_up\.weight "
                       rf"\({kind}\) has a NaN or infinite fp16 scale at byte {at} .* row 3"):
        _load(path)


@pytest.mark.parametrize("key, value, tensor", [
    ("llama.feed_forward_length", 96, "blk.0.ffn_gate.weight"),
    ("llama.embedding_length", 48, "token_embd.weight"),
    ("llama.attention.head_count_kv", 4, "blk.0.attn_k.weight"),
    ("phi3.feed_forward_length", 96, "blk.0.ffn_up.weight"),
    ("phi3.attention.head_count_kv", 4, "blk.0.attn_qkv.weight"),
])
def test_metadata_that_contradicts_the_tensors(tmp_path, cache, key, value, tensor):
    arch = key.split(".")[0]
    path = _user_file(tmp_path, arch=arch, metadata={key: value})
    with pytest.raises(ValueError, match=re.escape(str(path.name)) + r": the metadata \(.*"
                       + re.escape(f"{key.removeprefix(arch + '.')} {value}") + r".*\) give tensor "
                       + re.escape(tensor) + r" the shape \[.*\]; the file stores \["):
        _load(path)


def test_layers_the_metadata_do_not_count(tmp_path, cache):
    few = _user_file(tmp_path, metadata={"llama.block_count": 1})
    with pytest.raises(ValueError, match=r"block_count 1.*say 1 layers; the file has tensor "
                                         r"blk\.1\.attn_q\.weight"):
        _load(few)
    many = _user_file(tmp_path, metadata={"llama.block_count": 3})
    with pytest.raises(ValueError, match=r"need tensor 'blk\.2\.attn_norm\.weight', which the "
                                         r"file lacks"):
        _load(many)


def test_header_reader_agrees_with_gguf_py(tmp_path):
    import numpy as np
    from gguf import GGUFReader

    path = write_tiny_gguf(tmp_path / "t.gguf", arch="qwen2", kind="Q4_1", tied=False)
    ours, ref = open_gguf(path), GGUFReader(str(path))
    assert ours.metadata["qwen2.block_count"] == 2 and ours.architecture == "qwen2"
    assert ours.metadata["general.name"] == "tiny"
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.kind == t.tensor_type.name and mine.shape == tuple(reversed(t.shape.tolist()))
        stored = np.array(t.data).view(np.uint8).reshape(-1)
        assert torch.equal(ours.rows(t.name).reshape(-1), torch.from_numpy(stored))


def test_header_arrays_are_read_on_demand_as_gguf_py_reads_them(tmp_path):
    from gguf import GGUFReader

    def more(w):
        sentencepiece_like = ["\u2581a", "caf\u00e9", ""]
        w.add_token_list(sentencepiece_like + [f"t{i}" for i in range(200)])
        w.add_token_scores([float(i) / 3 for i in range(203)])
        w.add_token_types([1, 3, 4] + [1] * 200)
        w.add_array("test.bad", [b"ok", b"\xff"])

    path = write_tiny_gguf(tmp_path / "t.gguf", tokenizer=more)
    ours, ref = open_gguf(path), GGUFReader(str(path))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert ours.metadata[key][0] == "array"  # skipped by the header, read now
        assert ours.array(key) == ref.fields[key].contents()
    assert type(ours.array("tokenizer.ggml.scores")[1]) is float
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": metadata 'test.bad': "
                       r"string 1 is not UTF-8"):
        ours.array("test.bad")
    with pytest.raises(ValueError, match=r"metadata 'general.name' is 'tiny', not an array"):
        ours.array("general.name")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    with pytest.raises(ValueError, match=re.escape(str(bad)) + r" is not a GGUF file"):
        open_gguf(bad)
