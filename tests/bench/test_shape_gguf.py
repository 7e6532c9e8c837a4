"""docs/bench/shape_gguf.py: a GGUF of another model's shape with random weights, written from the
shipped SmolLM2-135M GGUF, here at a tiny shape (2 layers, hidden 64, 4 heads over 2 kv heads).

Oracles: the file's metadata is the 135M file's with the shape keys changed, its tensors have
the 135M file's types per role; HF transformers reads the file (config, tokenizer, weights of
the asked scale); specdec loads the file as it is (``LLM(model=file)``, on its own blocks), its
logits are finite and transformers' on the same file, and its greedy tokens are transformers'.
A ``--ftype q4_k_m`` file of a small shape, whose last layer's q|k|v fuses Q4_K q|k with a Q6_K
v (llama.cpp's mix), runs on its own blocks in parts, with float and with 8-bit activations,
and gives the dequantized model's greedy tokens.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams, native

pytestmark = [pytest.mark.slow,  # needs the real SmolLM2 GGUF
              pytest.mark.xdist_group("shape_gguf")]  # one worker builds the module's fixtures

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "shape_gguf.py"
spec = importlib.util.spec_from_file_location("shape_gguf", SCRIPT)
shape_gguf = sys.modules["shape_gguf"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shape_gguf)

TINY = shape_gguf.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2,
                        rope_theta=130000.0, context=4096)
SHAPE_KEYS = {"llama.block_count": 2, "llama.embedding_length": 64,
              "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
              "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
              "llama.rope.freq_base": 130000.0, "llama.context_length": 4096}


@pytest.fixture(scope="module", autouse=True)
def _each_file_parsed_once():
    """gguf-py's reader of each file made once for the module and shared: the 135M file's
    (``write_shape`` here and in a test, ``readers``) and the tiny file's (``readers``, and
    transformers twice for ``hf``: config, weights); each parses a 49k-token vocabulary in
    Python, ~4 s. And gguf-py's tensor-name map, which transformers builds per submodule. A
    read-only memory map and a pure function: the same values (the alias conversion does the
    same, ``_gguf_parsed_once``)."""
    from specdec.models.aliases import _gguf_parsed_once

    with _gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def source(smollm2_dir) -> Path:
    return smollm2_dir / "model.gguf"


@pytest.fixture(scope="module")
def tiny(source, tmp_path_factory) -> Path:
    # std 0.1: at hidden 64 the default 0.02 gives near-uniform logits (greedy ties)
    return shape_gguf.write_shape(tmp_path_factory.mktemp("shape") / "tiny.gguf", TINY, seed=3,
                                  std=0.1, source=source, log=None)


def _reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


@pytest.fixture(scope="module")
def readers(source, tiny):
    """(the 135M file's reader, the tiny file's): gguf-py's, shared (``_each_file_parsed_once``)."""
    return _reader(source), _reader(tiny)


def _role(name: str) -> str:
    return re.sub(r"blk\.\d+\.", "blk.N.", name)


def test_metadata_is_the_sources_with_the_shape_changed(tiny, readers):
    src, new = readers
    assert set(new.fields) == set(src.fields)
    for key, field in new.fields.items():
        if key in SHAPE_KEYS:
            assert field.contents() == pytest.approx(SHAPE_KEYS[key]), key
        elif key not in ("general.name", "general.size_label", "GGUF.tensor_count"):
            assert field.types == src.fields[key].types, key
            assert field.contents() == src.fields[key].contents(), key
    assert new.fields["general.size_label"].contents() == "3M"
    assert sum(int(t.n_elements) for t in new.tensors) == 3219776
    assert sorted(p.name for p in tiny.parent.iterdir()) == ["tiny.gguf"]  # the file alone


def test_tensors_have_the_sources_types_and_the_shape(readers):
    src = {_role(t.name): t.tensor_type.name for t in readers[0].tensors}
    assert src == {"token_embd.weight": "Q8_0", "output_norm.weight": "F32",
                   **{f"blk.N.{r}.weight": "Q4_1" for r in
                      ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                       "ffn_down")},
                   "blk.N.attn_norm.weight": "F32", "blk.N.ffn_norm.weight": "F32"}
    tensors = readers[1].tensors
    assert len(tensors) == 2 + 9 * TINY.layers
    for t in tensors:
        assert t.tensor_type.name == src[_role(t.name)], t.name
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in tensors}  # GGUF order: (in, out)
    assert shapes["token_embd.weight"] == (64, 49152)
    assert shapes["blk.1.attn_q.weight"] == (64, 64)
    assert shapes["blk.1.attn_k.weight"] == (64, 32)
    assert shapes["blk.0.ffn_down.weight"] == (128, 64)
    assert shapes["blk.0.ffn_up.weight"] == (64, 128)


@pytest.fixture(scope="module")
def hf(tiny):
    """transformers reading the very file (no folder in between)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny.parent, gguf_file=tiny.name,
                                                dtype=torch.float32).eval()


def test_transformers_reads_the_shape_and_the_asked_scale(hf):
    c = hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (2, 64, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (4, 2, 49152)
    assert c.rope_parameters["rope_theta"] == 130000.0 and c.tie_word_embeddings
    sd = hf.state_dict()
    # the scale asked for: mean ~0, std ~0.1 (Q4_1's per-block scales are rounded to fp16)
    w = sd["model.layers.0.mlp.gate_proj.weight"]
    assert abs(w.mean()) < 0.01 and 0.09 < w.std() < 0.11
    assert torch.equal(sd["model.norm.weight"], torch.ones(64))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model=str(tiny), max_model_len=256, activations="float")  # HF's fp32 numbers


def test_specdec_loads_the_file_on_its_blocks_and_its_logits_are_hfs(llm, hf):
    from specdec.kv.block_table import BlockTable

    if native.load() is not None:
        assert llm.engine.parts.weights == "native"
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    runner = llm.engine.parts.runner
    table = BlockTable()
    assert runner.kv.try_reserve(table, len(ids))
    try:
        logits = runner.forward(runner.pack([ids], [0], [table], logits="all")).logits
    finally:
        runner.kv.release(table)
    assert logits.shape == (len(ids), 49152) and torch.isfinite(logits).all()
    assert 0.1 < logits.std() < 10
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_are_hfs(llm, hf):
    prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        ref = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
    assert len(set(outs[0].token_ids)) > 2  # not one token repeated: the layers matter


def test_the_17b_plan_and_bad_shapes(source, readers, tmp_path):
    shape = shape_gguf.SHAPES["smollm2-1.7b"]
    tensors = shape_gguf.plan(readers[0], shape, 49152)
    assert len(tensors) == 2 + 9 * 24
    params = sum(int(torch.tensor(t[3]).prod()) for t in tensors)
    assert params == 1_711_376_384  # SmolLM2-1.7B's parameter count (tied embedding)
    with pytest.raises(ValueError, match="heads"):
        shape_gguf.write_shape(tmp_path, shape_gguf.Shape(2, 64, 128, 5, 5), source=source)
    with pytest.raises(ValueError, match="multiples of 32"):
        shape_gguf.write_shape(tmp_path, shape_gguf.Shape(2, 48, 128, 3, 1), source=source)
    with pytest.raises(SystemExit):
        shape_gguf.main(["--out", str(tmp_path), "--shape", "smollm2-1.7b", "--layers", "2"])
    with pytest.raises(SystemExit):
        shape_gguf.main(["--out", str(tmp_path), "--layers", "2"])
    assert not any(tmp_path.iterdir())


Q4_K_M_SHAPE = shape_gguf.Shape(layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=8)


@pytest.mark.skipif(native.load() is None, reason="compiled kernels not built")
def test_a_q4_k_m_file_runs_on_its_blocks_in_parts(source, tmp_path):
    """~8 s: a 26 MB file (its Q6_K tied embedding of 49,152 rows is most of it)."""
    from specdec.models.gguf import blocks as gb
    from specdec.models.gguf import q8_activations as qa
    from specdec.native import PanelParts

    # std 0.1: at 0.02 the tied embedding dominates and greedy repeats the prompt's last token
    path = shape_gguf.write_shape(tmp_path / "q4_k_m.gguf", Q4_K_M_SHAPE, seed=0, std=0.1,
                                  source=source, log=None, ftype="q4_k_m")
    prompts = ["The capital of France is", "def fib(n):"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(model=str(path), max_model_len=128)
    deq = LLM(weights="dequantized", **kw)
    want = [o.token_ids for o in deq.generate(prompts, sp)]
    assert len(set(want[0])) > 2  # the layers matter
    for activations, codes in (("float", gb.FORMATS), ("q8", qa.FORMATS)):
        llm = LLM(weights="native", activations=activations, **kw)
        assert llm.engine.parts.weights == "native" and llm.engine.parts.model.fused is not None
        layers = llm.engine.parts.model.layers  # use_more_bits: layer 1 of 2 has a Q6_K attn_v
        qkv = llm.engine.parts.kernels.prepared(layers[1].qkv_weight)
        assert isinstance(qkv, PanelParts)
        assert [(p.out_features, p.fmt) for p in qkv.parts] == [
            (1024, codes[gb.KERNEL_FORMAT["Q4_K"]]), (512, codes[gb.KERNEL_FORMAT["Q6_K"]])]
        assert not isinstance(llm.engine.parts.kernels.prepared(layers[0].qkv_weight), PanelParts)
        # float: bitwise the dequantized logits; q8: llama.cpp's numbers, the same greedy
        # tokens on this file
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want, activations
    assert LLM(**kw).engine.parts.weights == "native"  # "auto" no longer falls back to fp32


# --- mixtures of experts -----------------------------------------------------------------------

# qwen3moe as Qwen3-30B-A3B: heads of 64 whose q (512) is wider than hidden (256)
MOE_TINY = {arch: shape_gguf.Shape(layers=2, hidden=256, intermediate=256,
                                   heads=8 if arch == "qwen3moe" else 4, kv_heads=2,
                                   head_size=64 if arch == "qwen3moe" else None, experts=4,
                                   experts_used=2, arch=arch, tied=False)
            for arch in ("llama", "qwen3moe")}


def test_moe_shapes_by_name_and_their_plans(readers, capsys):
    with pytest.raises(SystemExit):
        shape_gguf.main(["--help"])
    text = capsys.readouterr().out
    assert "mixture-of-experts shapes:" in text
    for name in ("olmoe-1b-7b", "qwen3-30b-a3b-8l"):
        assert re.search(rf"^  {name} +\w+: \d+ layers", text, re.M), name
    v, h = 49152, 2048
    olmoe = shape_gguf.plan(readers[0], shape_gguf.SHAPES["olmoe-1b-7b"], v, "q4_k_m")
    per_layer = 4 * h * h + 64 * h + 3 * 64 * 1024 * h + 2 * h
    assert sum(int(np.prod(t[3])) for t in olmoe) == 16 * per_layer + 2 * v * h + h
    kinds = {(t[2], t[1]): t[4].name for t in olmoe}
    # llama-quantize's Q4_K_M: Q4_K experts, Q6_K ffn_down_exps / attn_v where use_more_bits
    # (layers 0, 1, 4, 7, 10, 13, 14, 15 of 16), routers F32, output Q6_K
    more = [i for i in range(16) if kinds[(i, "ffn_down_exps")] == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(16) if kinds[(i, "attn_v")] == "Q6_K"] == more
    assert {kinds[(i, r)] for i in range(16) for r in ("ffn_gate_exps", "ffn_up_exps")} == {"Q4_K"}
    assert {kinds[(i, "ffn_gate_inp")] for i in range(16)} == {"F32"}
    assert kinds[(None, "output")] == "Q6_K" and kinds[(None, "token_embd")] == "Q4_K"
    qwen = shape_gguf.plan(readers[0], shape_gguf.SHAPES["qwen3-30b-a3b-8l"], v, "q4_k_m")
    shapes = {(t[2], t[1]): t[3] for t in qwen}
    assert shapes[(0, "attn_q")] == (4096, h) and shapes[(0, "attn_output")] == (h, 4096)
    assert shapes[(0, "ffn_down_exps")] == (128, h, 768)
    assert shapes[(0, "attn_q_norm")] == (128,)
    size = sum(shape_gguf.tensor_bytes(t[3], t[4]) for t in qwen)
    assert 2.0e9 < size < 4.0e9  # fits a 24 GiB machine beside llama-bench


@pytest.fixture(scope="module")
def moe_files(source, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {arch: shape_gguf.write_shape(root / f"{arch}.gguf", shape, seed=1, std=0.1,
                                         source=source, log=None, ftype="q4_k_m")
            for arch, shape in MOE_TINY.items()}


@pytest.mark.parametrize("arch", MOE_TINY)
def test_a_moe_file_has_llama_cpps_keys_and_types(moe_files, arch):
    from gguf import GGUFReader

    r = GGUFReader(str(moe_files[arch]))
    assert r.fields["general.architecture"].contents() == arch
    keys = {k: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")}
    assert (keys[f"{arch}.expert_count"], keys[f"{arch}.expert_used_count"]) == (4, 2)
    assert keys[f"{arch}.block_count"] == 2 and keys[f"{arch}.embedding_length"] == 256
    if arch == "qwen3moe":
        assert not any(k.startswith("llama.") for k in r.fields)
        assert keys["qwen3moe.expert_feed_forward_length"] == 256
        assert keys["qwen3moe.attention.key_length"] == 64
    types = {t.name: t.tensor_type.name for t in r.tensors}
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (256, 256, 4)  # GGUF order: in, out, E
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"  # the last eighth: more bits
    assert types["blk.0.ffn_up_exps.weight"] == "Q4_K"
    assert ("blk.0.attn_q_norm.weight" in types) == (arch == "qwen3moe")


@pytest.mark.skipif(native.load() is None, reason="compiled kernels not built")
@pytest.mark.parametrize("arch", MOE_TINY)
def test_a_moe_file_runs_on_its_blocks(moe_files, arch):
    """specdec loads the file natively (llama with experts as mixtral), bitwise the dequantized
    model's greedy tokens in float; with q8 activations ngram speculation equals plain."""
    from specdec.models.gguf.block_weight import BlockWeight

    prompts = ["The capital of France is", "def fib(n): return fib(n - 1) + fib(n - 2)"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=str(moe_files[arch]), max_model_len=128)
    want = [o.token_ids for o in LLM(weights="dequantized", **kw).generate(prompts, sp)]
    assert len(set(want[0])) > 2
    nat = LLM(weights="native", activations="float", **kw)
    model = nat.engine.parts.model
    assert model.cfg.model_type == {"llama": "mixtral", "qwen3moe": "qwen3_moe"}[arch]
    assert isinstance(model.layers[1].moe.experts[3].down_weight, BlockWeight)
    assert [o.token_ids for o in nat.generate(prompts, sp)] == want
    q8 = LLM(weights="native", activations="q8", **kw)
    plain = [o.token_ids for o in q8.generate(prompts, sp)]
    spec = LLM(weights="native", activations="q8", drafter="ngram",
               drafter_args={"min_ngram": 1}, controller="static",
               controller_args={"budget": 3}, **kw)
    assert [o.token_ids for o in spec.generate(prompts, sp)] == plain
