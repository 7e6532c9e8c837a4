"""A GGUF's own blocks through the compiled kernels (specdec/models/gguf/weights.py).

Random blocks of every type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): dequantization
bitwise gguf-py's, directly and from the kernel format each is repacked into; a linear layer
over the prepared blocks
bitwise the same layer over the fp32 panels of the dequantized weight, for any set of rows (so
it is row-invariant as they are). The real file (SmolLM2's Q4_1 layers and Q8_0 embedding):
its matrices are the file's blocks (a draft model's fp32 ones are checked bitwise against
them), stream ~96 MB instead of ~540 MB, and the engine on native weights gives the tokens of
the engine on dequantized ones, plain and speculative.
"""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import KINDS, inputs, random_blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from native_helpers import KERNELS, needs_kernels

from specdec import LLM, SamplingParams
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import weights as gw


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out, blocks", [(40, 3), (16, 1), (203, 5), (7, 2)])
def test_dequantize_is_bitwise_gguf_py(kind, out, blocks):
    """The weights as gguf-py dequantizes them, and as the kernels compute them from their
    format (gguf_blocks.repack: every claim of exactness in its docstring), bitwise."""
    from gguf import GGMLQuantizationType, quants

    inp = inputs(kind, blocks)
    b = random_blocks(kind, out, inp)
    ref = quants.dequantize(b.rows.numpy(), getattr(GGMLQuantizationType, kind))
    ref = torch.from_numpy(ref.reshape(out, inp))
    assert torch.equal(gb.dequantize(b), ref)
    assert torch.equal(gb.repack(b).weights(), ref)
    assert torch.equal(gb.dequantize(b).view(torch.int32), ref.view(torch.int32))  # -0.0 too


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out, blocks", [(40, 3), (203, 5), (7, 2)])
def test_linear_over_blocks_is_bitwise_the_fp32_one(kind, out, blocks):
    inp = inputs(kind, blocks)
    b = random_blocks(kind, out, inp, seed=out)
    panels = gb.prepare(b)
    assert panels.fmt == gb.FORMATS[gb.KERNEL_FORMAT[kind]]
    assert panels.nbytes < 0.45 * out * inp * 4 + 2 * 16 * 128 * inp // 32  # <= 1.25 B/weight
    fp32 = KERNELS.prepare(gb.dequantize(b))
    for t in (1, 2, 3, 5, 8, 13, 33):
        x = torch.randn(t, inp)
        assert torch.equal(KERNELS.linear(x, panels), KERNELS.linear(x, fp32)), t


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 23), min_size=1, max_size=24), kind=st.sampled_from(KINDS),
       q8=st.booleans())
def test_rows_over_blocks_do_not_depend_on_the_call(rows, kind, q8):
    """For fp32 rows and for int8 rows (activations="q8": specdec.models.gguf.q8_activations)."""
    from specdec.models.gguf import q8_activations

    inp = inputs(kind, 1 if gb.BLOCK_WIDTH[kind] > 32 else 6)
    blocks = random_blocks(kind, 50, inp, seed=1)
    panels = (q8_activations.prepare if q8 else gb.prepare)(blocks)
    x = torch.randn(24, inp, generator=torch.Generator().manual_seed(2))
    full = KERNELS.linear(x, panels)
    assert torch.equal(KERNELS.linear(x[rows].contiguous(), panels), full[rows])


def test_weights_option_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="weights must be one of auto, native, dequantized"):
        LLM(model=str(tiny_llama), weights="int4")
    with pytest.raises(ValueError, match="weights='native' cannot run here: the model does not "
                                         "come from a GGUF file"):
        LLM(model=str(tiny_llama), weights="native")
    assert LLM(model=str(tiny_llama)).engine.parts.weights == "dequantized"  # auto


# the tests of smollm2_engines run on one xdist worker (--dist loadgroup): it builds them once
on_one_worker = pytest.mark.xdist_group("gguf_weights_smollm2_engines")


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_dir):
    """The real model on its native blocks and on its dequantized weights (float activations:
    the fp32 model's numbers, which the two must share bitwise)."""
    kw = dict(model=str(smollm2_dir), max_model_len=512, activations="float")
    return LLM(weights="native", **kw), LLM(weights="dequantized", **kw)


@needs_kernels
@on_one_worker
def test_smollm2_native_weights_stream_a_sixth(smollm2_engines):
    nat, deq = smollm2_engines
    assert nat.engine.parts.weights == "native" and deq.engine.parts.weights == "dequantized"
    assert 90e6 < nat.engine.parts.kernels.weight_bytes < 100e6  # Q4_1 layers + Q8_0 embedding
    assert deq.engine.parts.kernels.weight_bytes > 5 * nat.engine.parts.kernels.weight_bytes


@needs_kernels
@on_one_worker
def test_smollm2_native_tokens_are_the_dequantized_ones(smollm2_engines, smollm2_dir):
    nat, deq = smollm2_engines
    prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0, max_tokens=32)
    plain = [o.token_ids for o in nat.generate(prompts, sp)]
    assert plain == [o.token_ids for o in deq.generate(prompts, sp)]
    spec = LLM(model=str(smollm2_dir), max_model_len=512, drafter="ngram", controller="static",
               controller_args={"budget": 4}, activations="float")
    assert spec.engine.parts.weights == "native"  # auto
    assert [o.token_ids for o in spec.generate(prompts, sp)] == plain


@needs_kernels
def test_native_refuses_blocks_that_do_not_match(tiny_llama, tmp_path, monkeypatch):
    """Blocks that do not dequantize bitwise to the model's weights (here: random ones) are
    refused by "native" and make "auto" fall back, naming the matrix."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "model.gguf").write_bytes(b"GGUF")  # read_matrices is replaced below

    def blocks_of_the_right_shapes(path, cfg):
        llm = LLM(model=str(tiny_llama), weights="dequantized", linear_kernels="plain")
        m = llm.engine.parts.model
        shapes = {"head": m.head_weight.shape}
        for i, layer in enumerate(m.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                shapes[f"layers.{i}.{name}"] = getattr(layer, f"{name}_weight").shape
        return {k: [random_blocks("Q8_0", o, n, seed=3)] for k, (o, n) in shapes.items()}

    monkeypatch.setattr(gw, "read_matrices", blocks_of_the_right_shapes)
    with pytest.raises(ValueError, match="weights='native' cannot run here: the file's "
                                         "head blocks do not dequantize"):
        LLM(model=str(folder), weights="native")
    fallback = LLM(model=str(folder)).engine.parts
    assert (fallback.weights, fallback.activations) == ("dequantized", "float")  # auto, auto


@needs_kernels
@on_one_worker
def test_smollm2_a_gguf_draft_model_runs_on_its_blocks_too(smollm2_engines, smollm2_dir):
    nat, _ = smollm2_engines
    spec = LLM(model=str(smollm2_dir), max_model_len=256, drafter="draft_model",
               drafter_args={"model": str(smollm2_dir), "max_depth": 3}, controller="static",
               controller_args={"budget": 3}, activations="float")
    assert spec.engine.parts.weights == "native"
    # the target's blocks and the draft model's (its own copy of the same file)
    assert 180e6 < spec.engine.parts.kernels.weight_bytes < 200e6
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["Write a haiku about the sea."]
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in nat.generate(prompts, sp)]
    assert got[0].metrics.tau > 2  # the draft is the target: its drafts are accepted


@needs_kernels
@on_one_worker
def test_smollm2_starts_write_no_panels(smollm2_engines, smollm2_dir):
    """The panels are made at every start (specdec.models.gguf.repack: ~0.05 s for SmolLM2), never
    cached: after the fixture's native engines, the alias's folder holds the file and its
    metadata's small files only (issue 46: a copy of the file per activation mode before)."""
    gguf = smollm2_dir / "model.gguf"
    others = [p for p in smollm2_dir.iterdir() if p.name != gguf.name]
    assert not any(p.name.startswith("native_panels") for p in others)
    assert sum(p.lstat().st_size for p in others) < 0.05 * gguf.stat().st_size
