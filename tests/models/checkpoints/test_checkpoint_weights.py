"""A bf16 / fp16 safetensors checkpoint on its own bytes, and quantized at load (q8_0, q4_k).

Own bytes: the engine's numbers are bitwise those of the float32 checkpoint made by upcasting
the same weights (the upcast is exact; the kernels multiply the bf16 / fp16 values), the
panels are 2 bytes a weight, and the result is close to HF transformers' float32 forward.
Quantized: bitwise the float32 model whose matrices are the blocks dequantized. Every mode:
speculation (ngram) gives plain decoding's tokens, in float and (quantized) q8 activations.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_model
from native_helpers import needs_kernels
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.models.checkpoints.quantize import kind_for, quantize_matrix
from specdec.models.checkpoints.weights import matrix_names
from specdec.models.decoder.config import model_config_from_hf
from specdec.models.gguf import blocks as gb
from specdec.models.gguf.block_weight import BlockWeight
from specdec.models.loader import load_hf_config

# hidden and intermediate multiples of 256: every matrix can be Q4_K
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 9, 5, 9, 5, 9, 5]]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cast(src: Path, dst: Path, dtype: torch.dtype, then: torch.dtype | None = None) -> Path:
    """A copy of the checkpoint folder with every tensor in ``dtype`` (then in ``then``)."""
    shutil.copytree(src, dst)
    w = load_file(src / "model.safetensors")
    w = {k: v.to(dtype) if then is None else v.to(dtype).to(then) for k, v in w.items()}
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{"bf16", "fp16" (llama), "wide-bf16" (qwen2: hidden 256, tied embeddings, biases),
    "qwen3-bf16" (q / k norms), and each name + "-up": the same weights upcast to float32}."""
    root = tmp_path_factory.mktemp("checkpoints")
    base = make_tiny_model(root / "fp32", "llama", seed=3)
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out[name] = _cast(base, root / name, dt)
        out[name + "-up"] = _cast(base, root / (name + "-up"), dt, torch.float32)
    wide = make_tiny_model(root / "wide32", "qwen2", seed=4, tie_word_embeddings=True, **WIDE)
    out["wide-bf16"] = _cast(wide, root / "wide-bf16", torch.bfloat16)
    out["wide-bf16-up"] = _cast(wide, root / "wide-bf16-up", torch.bfloat16, torch.float32)
    qwen3 = make_tiny_model(root / "qwen3", "qwen3", seed=5)  # q / k norms
    out["qwen3-bf16"] = _cast(qwen3, root / "qwen3-bf16", torch.bfloat16)
    out["qwen3-bf16-up"] = _cast(qwen3, root / "qwen3-bf16-up", torch.bfloat16, torch.float32)
    return out


def _run(llm: LLM, logprobs: int | None = 2):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=logprobs)
    return llm.generate(PROMPTS, sp)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _logprobs(outputs) -> list[list[float]]:
    return [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs]


@needs_kernels
@pytest.mark.parametrize("half", ["bf16", "fp16", "wide-bf16", "qwen3-bf16"])
def test_own_bytes_are_bitwise_the_upcast_model(checkpoints, half):
    kw = dict(max_model_len=64, num_pages=16)
    own = LLM(model=str(checkpoints[half]), **kw)
    assert own.engine.parts.weights == "native"
    model = own.engine.parts.model
    dtype = torch.float16 if half == "fp16" else torch.bfloat16
    assert all(isinstance(w, BlockWeight) for w in model.matrices())
    assert isinstance(model.embed, BlockWeight)  # rows upcast on lookup, no copy
    panels = own.engine.parts.kernels._panels.values()
    assert {p.data.dtype for p in panels} == {dtype}  # 2 bytes a weight streamed
    # the fp32 checkpoint through the loader's copying path (load_weights), as before
    up = LLM(model=str(checkpoints[half + "-up"]), weights="dequantized", **kw)
    assert up.engine.parts.weights == "dequantized"
    assert own.engine.parts.kernels.weight_bytes * 2 == up.engine.parts.kernels.weight_bytes
    a, b = _run(own), _run(up)
    assert _tokens(a) == _tokens(b)
    assert _logprobs(a) == _logprobs(b)  # bitwise


@needs_kernels
@pytest.mark.parametrize("name", ["bf16", "wide-bf16", "qwen3-bf16"])
def test_own_bytes_are_close_to_transformers(checkpoints, name):
    from transformers import AutoModelForCausalLM

    folder = checkpoints[name]
    got = _run(LLM(model=str(folder), max_model_len=64, num_pages=16))
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, got):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1:-1].double()
        want = logits.log_softmax(-1)
        assert torch.equal(want.argmax(-1), torch.tensor(out.outputs[0].token_ids))
        ours = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs], dtype=torch.float64)
        picked = want.gather(1, ids[0, len(prompt):, None])[:, 0]
        assert torch.allclose(ours, picked, atol=1e-4), (ours - picked).abs().max()


def _dequantized_checkpoint(src: Path, dst: Path, quantize: str) -> Path:
    """The float32 checkpoint whose matrices are ``src``'s quantized under ``quantize`` and
    dequantized (what the engine's quantized model is): the oracle."""
    shutil.copytree(src, dst)
    cfg = model_config_from_hf(load_hf_config(src))
    w = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    for name, parts in matrix_names(cfg).items():
        if name == "embed" and not cfg.tie_word_embeddings:
            continue  # an untied embedding stays in the file's dtype
        for n, shape in parts:
            w[n] = gb.dequantize(quantize_matrix(w[n], kind_for(quantize, shape[1])))
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@needs_kernels
@pytest.mark.parametrize("quantize", ["q8_0", "q4_k"])
@pytest.mark.parametrize("name", ["bf16", "wide-bf16"])
def test_quantized_is_bitwise_the_dequantized_model(checkpoints, tmp_path, quantize, name):
    kw = dict(max_model_len=64, num_pages=16, activations="float")  # the fp32 numbers
    q = LLM(model=str(checkpoints[name]), quantize=quantize, **kw)
    assert q.engine.parts.weights == quantize
    model = q.engine.parts.model
    kinds = {k for w in model.matrices() for k in w.kinds}
    want = {"Q8_0"} if name == "bf16" or quantize == "q8_0" else {"Q4_K"}
    assert kinds == want
    oracle = LLM(model=str(_dequantized_checkpoint(checkpoints[name], tmp_path / "deq",
                                                   quantize)), weights="dequantized", **kw)
    a, b = _run(q), _run(oracle)
    assert _tokens(a) == _tokens(b)
    assert _logprobs(a) == _logprobs(b)
    assert q.engine.parts.kernels.weight_bytes < 0.6 * oracle.engine.parts.kernels.weight_bytes / 2


@needs_kernels
@pytest.mark.parametrize("quantize,activations", [
    (None, "float"), ("q8_0", "float"), ("q8_0", "q8"), ("q4_k", "float"), ("q4_k", "q8")])
def test_speculation_is_plain_decoding(checkpoints, quantize, activations):
    kw = dict(model=str(checkpoints["wide-bf16"]), max_model_len=128, num_pages=32,
              quantize=quantize, activations=activations)
    sp = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=3 + i, max_tokens=24, ignore_eos=True)
        for i in range(2)]
    prompts = PROMPTS * 2
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp)]
    spec = LLM(**kw, drafter="ngram", controller="static", controller_args={"budget": 4})
    got = spec.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == want
    assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0  # not vacuous
    assert np.unique(np.concatenate(want)).size > 2


@needs_kernels
def test_without_the_kernels_a_checkpoint_is_copied_into_float32(checkpoints):
    """linear_kernels="tuned": no panels to run the bytes; the matrices become float32
    parameters (the same numbers), said in the log."""
    kw = dict(max_model_len=64, num_pages=16)
    tuned = LLM(model=str(checkpoints["bf16"]), linear_kernels="tuned", **kw)
    assert tuned.engine.parts.weights == "dequantized"
    assert not any(isinstance(w, BlockWeight) for w in tuned.engine.parts.model.matrices())
    assert not isinstance(tuned.engine.parts.model.embed, BlockWeight)
    want = LLM(model=str(checkpoints["bf16-up"]), linear_kernels="tuned", **kw)
    assert _tokens(_run(tuned, None)) == _tokens(_run(want, None))
    dq = LLM(model=str(checkpoints["bf16"]), weights="dequantized", **kw)
    assert dq.engine.parts.weights == "dequantized"
    assert not any(isinstance(w, BlockWeight) for w in dq.engine.parts.model.matrices())


def test_quantize_option_is_checked(checkpoints):
    folder = str(checkpoints["bf16"])
    with pytest.raises(ValueError, match=r"quantize must be None or one of q8_0, q4_k, got "
                                         r"'q4_0'"):
        LLM(model=folder, quantize="q4_0")
    with pytest.raises(ValueError, match="quantize='q8_0' computes with the blocks it makes: "
                                         "it needs weights='native' or 'auto'"):
        LLM(model=folder, quantize="q8_0", weights="dequantized")
    with pytest.raises(ValueError, match="quantize='q4_k' cannot run here: they need the "
                                         "compiled CPU kernels"):
        LLM(model=folder, quantize="q4_k", linear_kernels="plain")
    with pytest.raises(ValueError, match="quantize='q8_0' cannot run here: they compute in "
                                         "float32, not bfloat16"):
        LLM(model=folder, quantize="q8_0", dtype="bfloat16")


@needs_kernels
def test_q8_activations_need_blocks(checkpoints):
    with pytest.raises(ValueError, match=r"activations='q8' cannot run here: .*\(quantize="):
        LLM(model=str(checkpoints["bf16"]), activations="q8", max_model_len=64)


@needs_kernels
def test_quantize_on_a_gguf_is_an_error(tmp_path):
    from gguf_helpers import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", kind="Q8_0")
    with pytest.raises(ValueError, match=r"quantize='q4_k' quantizes a safetensors checkpoint; "
                                         r".* holds a GGUF"):
        LLM(model=str(path), quantize="q4_k", max_model_len=64)


@needs_kernels
def test_a_non_finite_weight_is_named(checkpoints, tmp_path):
    folder = shutil.copytree(checkpoints["bf16"], tmp_path / "nan")
    w = load_file(folder / "model.safetensors")
    w["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight in "
                                         r".*: cannot quantize to Q8_0: rows 0\.\.63 hold a NaN"):
        LLM(model=str(folder), quantize="q8_0", max_model_len=64)


@needs_kernels
def test_quantized_blocks_are_cached(checkpoints, tmp_path, monkeypatch):
    """The first start quantizes and caches (in SPECDEC_CACHE, not beside the checkpoint); the
    next reads the blocks back (no quantizing: the same numbers); a changed checkpoint is
    quantized again, its earlier blocks removed (one file per checkpoint and mode); a cache
    that cannot be written only costs the quantizing."""
    from specdec.models.checkpoints import quantized_cache
    from specdec.models.checkpoints import weights as checkpoint_weights

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = shutil.copytree(checkpoints["wide-bf16"], tmp_path / "model")
    kw = dict(model=str(folder), quantize="q4_k", max_model_len=64, num_pages=16)
    first = _run(LLM(**kw))
    cached = list((tmp_path / "cache" / "quantized").glob("*.safetensors"))
    assert len(cached) == 1 and sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]

    def refuse(*args):
        raise AssertionError("quantized again")

    with monkeypatch.context() as m:
        m.setattr(checkpoint_weights, "quantize_matrix", refuse)
        again = LLM(**kw)
        assert again.engine.parts.model.layers[0].qkv_weight.file.files[0].path == cached[0]
        assert _logprobs(_run(again)) == _logprobs(first)
    w = load_file(folder / "model.safetensors")
    w["model.layers.0.mlp.down_proj.weight"] *= 2
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    changed = _run(LLM(**kw))
    now = list((tmp_path / "cache" / "quantized").glob("*.safetensors"))
    assert len(now) == 1 and now != cached  # the earlier version's blocks removed
    assert _logprobs(changed) != _logprobs(first)
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "blocked"))
    assert quantized_cache.read(checkpoint_weights.CheckpointFiles([]), "q4_k") is None
    assert _logprobs(_run(LLM(**kw))) == _logprobs(changed)


@needs_kernels
def test_a_foreign_file_in_the_cache_is_replaced(checkpoints, tmp_path, monkeypatch):
    """What sits at the cache's name without being our blocks (a foreign or truncated file;
    a crashed writer leaves only a hidden .tmp, never read) is quantized over."""
    from specdec.models.checkpoints import quantized_cache
    from specdec.models.checkpoints.safetensors_file import open_checkpoint

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = checkpoints["bf16"]
    files = open_checkpoint([folder / "model.safetensors"])
    path = quantized_cache.cache_path(quantized_cache.key_of(files, "q8_0"))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    (path.parent / f".{path.name}.123.abc.tmp").write_bytes(b"half written")
    kw = dict(model=str(folder), max_model_len=64, num_pages=16, quantize="q8_0")
    want = _logprobs(_run(LLM(**kw)))
    assert quantized_cache.read(files, "q8_0") is not None  # replaced by our blocks
    assert _logprobs(_run(LLM(**kw))) == want


@needs_kernels
def test_a_sharded_checkpoint_is_one_model(checkpoints, tmp_path):
    """Tensors spread over several files (as HF shards them; a fused matrix's parts in
    different files) load as the one-file checkpoint does."""
    folder = shutil.copytree(checkpoints["bf16"], tmp_path / "sharded")
    w = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(w)
    for i in range(3):
        save_file({n: w[n] for n in names[i::3]}, folder / f"model-0000{i + 1}-of-00003.safetensors",
                  metadata={"format": "pt"})
    kw = dict(max_model_len=64, num_pages=16)
    got = LLM(model=str(folder), **kw)
    assert got.engine.parts.weights == "native"
    assert _logprobs(_run(got)) == _logprobs(_run(LLM(model=str(checkpoints["bf16"]), **kw)))
