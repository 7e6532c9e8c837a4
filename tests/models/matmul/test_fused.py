"""The compiled decoder layers (specdec/models/matmul/fused.py, specdec/native/layer.c).

Against the framework path of the same model (the oracle: ``LlamaDecoder``'s own layers), for
every architecture the engine takes (biases, qk-norm, GQA, tied heads) in float32 and bfloat16:
a prefill, then a step of tree rows over the cache, give close logits and close K/V. Which path
a model takes is fixed by its configuration (float64 and models the kernels do not cover take
the framework path), a weight changed in place is prepared again, and an EAGLE-3 head's one
layer ([embedding; feature] into its projections) runs compiled as well.
"""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, native
from specdec.kv.block_table import BlockTable

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(native.load() is None, reason="compiled kernels not built")]

PROMPT = [3, 17, 5, 42, 8, 11, 29, 60, 7, 2, 33]
TREE_IDS = [9, 14, 21, 4]
# 4 tree rows after the prompt: nodes 0 and 1 children of the root, 2 of 0, 3 of 2
TREE_MASK = torch.ones(4, len(PROMPT) + 4, dtype=torch.bool)
TREE_MASK[:, len(PROMPT):] = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0],
                                           [1, 0, 1, 1]], dtype=torch.bool)
TREE_POS = [len(PROMPT), len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]


def _run(llm: LLM, fused: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of a prefill and of a tree step after it, and the K/V they wrote."""
    eng = llm.engine
    model, runner = eng.parts.model, eng.parts.runner
    keep, model.fused = model.fused, (model.fused if fused else None)
    runner.kv.cache.tensor.zero_()
    table = BlockTable()
    assert runner.kv.try_reserve(table, len(PROMPT) + len(TREE_IDS))
    try:
        first = runner.forward(runner.pack([PROMPT], [0], [table], logits="all")).logits
        tree = runner.forward(runner.pack([TREE_IDS], [len(PROMPT)], [table], logits="all",
                                          positions=[TREE_POS], masks=[TREE_MASK])).logits
        return [first.clone(), tree.clone()], runner.kv.cache.tensor.clone()
    finally:
        runner.kv.release(table)
        model.fused = keep


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_layers_match_the_framework_path(tiny_models, arch, dtype):
    llm = LLM(model=str(tiny_models[arch]), dtype=dtype, max_model_len=64)
    assert llm.engine.parts.model.fused is not None  # the default CPU engine takes the compiled layers
    (f_logits, f_kv), (r_logits, r_kv) = _run(llm, True), _run(llm, False)
    # fp32 activations in the fused path against bf16 ones in the framework path: bf16 noise
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=0.05, atol=0.05)
    for f, r in zip(f_logits, r_logits):
        torch.testing.assert_close(f, r, **tol)
    torch.testing.assert_close(f_kv.float(), r_kv.float(), **tol)
    assert f_kv.abs().sum() > 0  # the prompt and the tree were written


def test_the_path_is_fixed_by_the_configuration(tiny_llama):
    assert LLM(model=str(tiny_llama), dtype="float64").engine.parts.model.fused is None
    assert LLM(model=str(tiny_llama), linear_kernels="plain").engine.parts.model.fused is None
    assert LLM(model=str(tiny_llama), linear_kernels="tuned").engine.parts.model.fused is None


def test_a_weight_changed_in_place_is_prepared_again(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=64)
    before, _ = _run(llm, True)
    with torch.no_grad():
        llm.engine.parts.model.layers[0].down_weight.mul_(3.0)
    after, _ = _run(llm, True)
    reference, _ = _run(llm, False)
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(after[0], reference[0], rtol=1e-4, atol=1e-4)


def test_an_eagle3_heads_layer_runs_compiled_too(tiny_llama):
    """The head's one layer takes [embedding; feature] as its projections' input (qkv_input):
    compiled, it gives the framework path's rows and K/V."""
    from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head

    llm0 = LLM(model=str(tiny_llama), max_model_len=64)
    model, cfg, hf = llm0.engine.parts.model, llm0.engine.parts.model_config, llm0.engine.parts.hf_config
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 32, (1, 1, 1)), model.embed, hf)
    head.reset_parameters(0.5)
    head.set_vocab(torch.arange(32))
    llm = LLM(model=str(tiny_llama), max_model_len=64, drafter="eagle3",
              drafter_args={"head": head, "depth": 2, "topk": 2})
    runner = llm.engine.parts.drafter_runners[0]
    assert runner.model is head and head.fused is not None
    features = torch.randn(len(PROMPT), cfg.hidden_size)

    def step(table):
        out = runner.forward(runner.pack([PROMPT], [0], [table], logits="all",
                                         features=features.clone()))
        return out.final_hidden.clone(), out.logits.clone()

    outs = _compiled_and_framework(head, runner, len(PROMPT), step)
    for f, r in zip(*outs):
        torch.testing.assert_close(f, r, rtol=1e-4, atol=1e-4)
    assert outs[0][2].abs().sum() > 0


def _block_diffusion(llm0: LLM, num_layers: int):
    from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel

    model, cfg, hf = llm0.engine.parts.model, llm0.engine.parts.model_config, llm0.engine.parts.hf_config
    torch.manual_seed(0)
    c = BlockDiffusionConfig.for_target(cfg, 32, num_layers=num_layers, block_size=4,
                                        target_layer_ids=(0, 1))
    bd = BlockDiffusionModel(c, model.embed, hf)
    bd.init_from_target(model, torch.arange(32))
    with torch.no_grad():
        for p in bd.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return bd


def test_a_block_diffusion_layer_runs_compiled_too(tiny_llama):
    """Context rows (their projections read the fused context) then a block of MASK rows over
    them: compiled, the framework path's states and K/V."""
    from specdec.attention.block_masks import block_mask

    llm0 = LLM(model=str(tiny_llama), max_model_len=64)
    bd = _block_diffusion(llm0, 1)
    llm = LLM(model=str(tiny_llama), max_model_len=64, drafter="block_diffusion",
              drafter_args={"model": bd})
    runner = llm.engine.parts.drafter_runners[0]
    assert runner.model is bd and bd.fused is not None
    c, n = bd.config, len(PROMPT)
    feed = [0] * n + [PROMPT[-1]] + [c.mask_id(k) for k in range(1, c.block_size)]
    features = torch.randn(len(feed), llm0.engine.parts.model_config.hidden_size)
    context = torch.tensor([True] * n + [False] * c.block_size)

    def step(table):
        out = runner.forward(runner.pack(
            [feed], [0], [table], logits="none", positions=[list(range(len(feed)))],
            masks=[block_mask(0, n, c.block_size)], features=features.clone(),
            context_rows=context))
        return (out.final_hidden.clone(),)

    outs = _compiled_and_framework(bd, runner, len(feed), step)
    for f, r in zip(*outs):
        torch.testing.assert_close(f, r, rtol=1e-4, atol=1e-4)
    assert outs[0][1].abs().sum() > 0


def test_a_shape_the_compiled_call_refuses_runs_the_torch_forward(tiny_llama, caplog):
    """Two block-diffusion layers: refused by name and shape, said once, drafting still runs."""
    llm0 = LLM(model=str(tiny_llama), max_model_len=64)
    bd = _block_diffusion(llm0, 2)
    with caplog.at_level("INFO", logger="specdec"):
        llm = LLM(model=str(tiny_llama), max_model_len=64, drafter="block_diffusion",
                  drafter_args={"model": bd}, controller_args={"budget": 3})
    said = [r.getMessage() for r in caplog.records if "compiled layer call" in r.getMessage()]
    assert len(said) == 1 and "BlockDiffusionModel" in said[0] and "2 layers" in said[0], said
    assert bd.fused is None
    from specdec import SamplingParams
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.metrics.draft_tokens_proposed > 0


class _LayerByLayer:
    """A cache of another kind than KVCache (each layer its own tensor): fused.run checks and
    runs it layer by layer."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def layer(self, i: int) -> torch.Tensor:
        return self.tensors[i]


@pytest.mark.parametrize("num_layers, capture", [(None, (0,)), (None, (0, 1)), (None, ()),
                                                 (1, (0, 5))])
def test_a_cache_of_another_kind_gives_the_same_rows(tiny_llama, num_layers, capture):
    """One sd_layers call over a KVCache's tensor (runs split at the captured layers) and one
    call per layer over separate tensors: bitwise the same rows, captures and K/V."""
    import torch.nn.functional as F

    llm = LLM(model=str(tiny_llama), max_model_len=64)
    runner, model = llm.engine.parts.runner, llm.engine.parts.model
    table = BlockTable()
    assert runner.kv.try_reserve(table, len(PROMPT))
    batch = runner.pack([PROMPT], [0], [table], logits="all")
    runner.backend.plan(batch.metadata)
    plan = runner.backend.key_lists()
    kv = runner.kv.cache
    kv.tensor.zero_()
    alone = _LayerByLayer([torch.zeros_like(kv.tensor[i]) for i in range(kv.tensor.shape[0])])
    with torch.inference_mode():
        x = F.embedding(batch.input_ids, model.embed)
        cos, sin = model.rope.lookup(batch.positions)
        outs = [model.fused.run(x.clone(), cos, sin, plan, cache, num_layers, capture)
                for cache in (kv, alone)]
    (y, got), (y_alone, got_alone) = outs
    layers = range(kv.tensor.shape[0])[:num_layers]
    assert torch.equal(y, y_alone) and got.keys() == got_alone.keys() == set(capture) & {*layers}
    assert all(torch.equal(got[i], got_alone[i]) for i in got)
    assert torch.equal(kv.tensor, torch.stack(alone.tensors)) and kv.tensor.abs().sum() > 0


def _compiled_and_framework(model, runner, slots: int, step) -> list[tuple]:
    """``step(table)``'s outputs and the K/V it wrote, first through the model's compiled layer
    calls, then through its framework path (``fused`` off), each from a zeroed cache."""
    outs = []
    for fused in (True, False):
        keep, model.fused = model.fused, (model.fused if fused else None)
        runner.kv.cache.tensor.zero_()
        table = BlockTable()
        assert runner.kv.try_reserve(table, slots)
        try:
            outs.append((*step(table), runner.kv.cache.tensor.clone()))
        finally:
            runner.kv.release(table)
            model.fused = keep
    return outs
