"""docs/bench/shape_gguf.py's K-quant files (--ftype), fast: from a tiny llama GGUF written here
(a 64-token vocabulary, the 135M file's tensor order and types) instead of the shipped 135M
one (tests/bench/test_shape_gguf.py, slow, checks a file made from that one).

Oracles: gguf-py's reader parses the file; each tensor has the type llama.cpp's
``llama_tensor_get_type`` gives it (the expected types written out here by hand); gguf-py's
``dequantize`` reads every tensor to finite values of the asked standard deviation; the shape
keys and ``general.file_type`` are the asked ones; one file is written (--gguf-only is a
no-op); a disk too full
is refused before anything is written.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize

from specdec.bench.random_blocks import random_blocks

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "shape_gguf.py"
spec = importlib.util.spec_from_file_location("shape_gguf", SCRIPT)
shape_gguf = sys.modules["shape_gguf"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shape_gguf)

VOCAB = 64
LAYER_ORDER = ("attn_norm", "ffn_down", "ffn_gate", "ffn_up", "ffn_norm", "attn_k",
               "attn_output", "attn_q", "attn_v")  # the 135M file's order in a layer
# 8 layers: use_more_bits is true at layers 0, 3, 6, 7
TINY = shape_gguf.Shape(layers=8, hidden=256, intermediate=512, heads=4, kv_heads=2,
                        rope_theta=10000.0, context=1024)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A 2-layer llama GGUF like the 135M file: its metadata keys, token_embd Q8_0, matrices
    Q4_1, norms F32, no output (tied)."""
    path = tmp_path_factory.mktemp("source") / "source.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny source")
    w.add_size_label("1M")
    w.add_file_type(3)  # MOSTLY_Q4_1
    w.add_block_count(2)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(32)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    shape = shape_gguf.Shape(2, 64, 128, 2, 2)
    tensors = [("token_embd", None, Q.Q8_0)]
    tensors += [(r, i, Q.F32 if r.endswith("norm") else Q.Q4_1)
                for i in range(2) for r in LAYER_ORDER]
    tensors += [("output_norm", None, Q.F32)]
    for role, layer, kind in tensors:
        shp = shape_gguf.role_shape(role, shape, VOCAB)
        name = f"{role}.weight" if layer is None else f"blk.{layer}.{role}.weight"
        if kind == Q.F32:
            w.add_tensor(name, np.ones(shp, dtype=np.float32))
        else:
            w.add_tensor(name, random_blocks(rng, kind, *shp, 0.02), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write(tmp_path: Path, source: Path, shape=TINY, ftype="q4_k_m", std=0.02) -> GGUFReader:
    out = shape_gguf.write_shape(tmp_path / f"{ftype}.gguf", shape, seed=1, std=std,
                                 source=source, log=None, ftype=ftype)
    return GGUFReader(str(out))


def _types(reader: GGUFReader) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in reader.tensors}


def _expected_q4_k_m(layers: int, more_bits: set[int], tied: bool) -> dict[str, str]:
    want = {"token_embd.weight": "Q6_K" if tied else "Q4_K", "output_norm.weight": "F32"}
    if not tied:
        want["output.weight"] = "Q6_K"
    for i in range(layers):
        for role in LAYER_ORDER:
            kind = ("F32" if role.endswith("norm") else
                    "Q6_K" if role in ("attn_v", "ffn_down") and i in more_bits else "Q4_K")
            want[f"blk.{i}.{role}.weight"] = kind
    return want


def test_q4_k_m_types_are_llama_cpps(tmp_path, source):
    reader = _write(tmp_path, source)
    assert _types(reader) == _expected_q4_k_m(8, {0, 3, 6, 7}, tied=True)
    names = [t.name for t in reader.tensors]
    assert names[:3] == ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.ffn_down.weight"]
    assert names[-1] == "output_norm.weight"


def test_q4_k_m_dequantizes_to_the_asked_scale(tmp_path, source):
    reader = _write(tmp_path, source, std=0.05)
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists (in, out)
        assert w.reshape(-1).size == int(np.prod(shape)), t.name
        assert np.isfinite(w).all(), t.name
        if t.name.endswith("norm.weight"):
            assert (w == 1).all(), t.name
        else:
            assert 0.045 < w.std() < 0.055 and abs(w.mean()) < 0.005, (t.name, w.std())
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert tuple(int(n) for n in embd.shape) == (256, VOCAB)


def test_metadata_has_the_shape_and_file_type(tmp_path, source):
    reader = _write(tmp_path, source)
    f = {k: v.contents() for k, v in reader.fields.items()}
    assert f["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert f["llama.block_count"] == 8 and f["llama.embedding_length"] == 256
    assert f["llama.feed_forward_length"] == 512 and f["llama.attention.head_count_kv"] == 2
    assert f["llama.rope.dimension_count"] == 64 and f["llama.context_length"] == 1024
    assert f["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert f["general.name"] == "SmolLM2 shape 5M Q4_K_M random weights (seed 1)"
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)  # copied
    assert len(f["tokenizer.ggml.tokens"]) == VOCAB


def test_untied_output_and_fallbacks(tmp_path, source):
    """An untied Llama-3-like shape gets output Q6_K and token_embd Q4_K; hidden 160 (not a
    multiple of 256) falls back: Q4_K -> Q5_0, Q6_K -> Q8_0, the output Q8_0."""
    untied = shape_gguf.Shape(2, 256, 512, 4, 1, tied=False)
    assert _types(_write(tmp_path, source, untied)) == _expected_q4_k_m(2, {1}, tied=False)
    odd = shape_gguf.Shape(2, 160, 256, 5, 5, tied=False)
    types = _types(_write(tmp_path, source, odd))
    assert types["token_embd.weight"] == "Q5_0" and types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.1.attn_v.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q4_K"  # its rows are 256 long
    assert types["blk.1.ffn_down.weight"] == "Q6_K"


def test_q8_0_and_the_sources_mix(tmp_path, source):
    small = shape_gguf.Shape(2, 256, 512, 4, 2)
    assert set(_types(_write(tmp_path, source, small, "q8_0")).values()) == {"Q8_0", "F32"}
    reader = _write(tmp_path, source, small, "q4_1")
    assert set(_types(reader).values()) == {"Q8_0", "Q4_1", "F32"}
    assert reader.fields["general.file_type"].contents() == 3  # the source's, unchanged


def test_one_file_is_written_and_gguf_only_changes_nothing(tmp_path, source):
    """The .gguf alone, with or without the old ``--gguf-only`` (accepted for old command
    lines): the same bytes; ``--out`` naming anything but a .gguf file is refused."""
    args = ["--layers", "2", "--hidden", "256", "--intermediate", "512", "--heads", "4",
            "--kv-heads", "2", "--ftype", "q4_k_m", "--source", str(source)]
    shape_gguf.main(["--out", str(tmp_path / "m.gguf"), *args])
    shape_gguf.main(["--out", str(tmp_path / "old.gguf"), "--gguf-only", *args])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "old.gguf"]
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "old.gguf").read_bytes()
    for out in (tmp_path / "dir", tmp_path / "m.gguf.d"):
        with pytest.raises(ValueError, match="--out must name a .gguf file"):
            shape_gguf.write_shape(out, TINY, source=source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "old.gguf"]


def test_a_full_disk_is_refused_before_writing(tmp_path, source, monkeypatch):
    class Usage:
        free = 1.5e9

    monkeypatch.setattr(shape_gguf.shutil, "disk_usage", lambda path: Usage)
    shape = shape_gguf.Shape(2, 2048, 8192, 32, 32)  # 0.14 GB of Q8_0 blocks (8 layers: 0.57)
    shape_gguf.write_shape(tmp_path / "fits.gguf", shape, source=source, log=None,
                           ftype="q8_0")
    with pytest.raises(ValueError, match=r"a 537M q8_0 GGUF needs 0\.57 GB and 1\.1 GB kept free, "
                                         r".* has 1\.50 GB free"):
        shape_gguf.write_shape(tmp_path / "big.gguf", shape_gguf.Shape(8, 2048, 8192, 32, 32),
                               source=source, log=None, ftype="q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fits.gguf"]
    with pytest.raises(SystemExit, match="shape_gguf: .* needs"):
        shape_gguf.main(["--out", str(tmp_path / "8b.gguf"), "--shape", "llama3-8b",
                         "--ftype", "q4_k_m", "--source", str(source)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fits.gguf"]


def test_an_interrupted_write_leaves_no_gguf(tmp_path, source, monkeypatch):
    """A crash (here: the fifth tensor's blocks raise) leaves neither the .gguf nor its partial
    file: a script that reuses a file it finds never finds a torn one."""
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return random_blocks(*args)

    monkeypatch.setattr(shape_gguf, "random_blocks", failing)
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, source)
    assert len(calls) == 5 and list(tmp_path.iterdir()) == []


def test_the_presets_plans(source):
    """Parameter counts and file sizes of the presets (SmolLM2's vocabulary of 49,152)."""
    reader = GGUFReader(str(source))
    sizes = {}
    for name, ftype in (("smollm2-1.7b", "q4_k_m"), ("smollm2-1.7b", "q8_0"),
                        ("llama3-8b", "q4_k_m")):
        shape = shape_gguf.SHAPES[name]
        tensors = shape_gguf.plan(reader, shape, 49152, ftype)
        params = sum(int(np.prod(t[3])) for t in tensors)
        sizes[name, ftype] = sum(shape_gguf.tensor_bytes(t[3], t[4]) for t in tensors)
        if name == "smollm2-1.7b":
            assert params == 1_711_376_384 and len(tensors) == 2 + 9 * 24
        else:  # Llama-3-8B's 8,030,261,248 less (128256 - 49152) * 4096 * 2 of vocabulary
            assert params == 8_030_261_248 - (128256 - 49152) * 4096 * 2
            assert len(tensors) == 3 + 9 * 32 and tensors[-1][1] == "output"
    assert 0.95e9 < sizes["smollm2-1.7b", "q4_k_m"] < 1.1e9
    assert 1.8e9 < sizes["smollm2-1.7b", "q8_0"] < 1.85e9
    assert 4.4e9 < sizes["llama3-8b", "q4_k_m"] < 4.5e9  # 4.92 GB less the vocabulary
