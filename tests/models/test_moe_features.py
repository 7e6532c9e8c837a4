"""Everything else works on a mixture-of-experts target (issue #55 item 4).

One tiny random folder per family (qwen3_moe, mixtral, qwen2_moe: 4 layers, 8 or 4 experts top
2, qwen2_moe with its shared expert), each with a word-level tokenizer and chat template. Greedy
float32, speculation gives plain decoding's tokens, token for token, for: suffix, mtp (random
heads), block_diffusion (a random drafter), draft_model (a second model folder as the draft: a
dense Llama, the MoE itself, its first 2 layers), the composition eagle3+ngram (a random head
of depth 1: at depth 3 it took the whole budget and nothing was accepted on mixtral); in
bfloat16 and with q8 activations (quantize="q8_0") every drafter, ngram and eagle3 alone too,
each on one family (rotating), gives plain decoding's greedy tokens in those numbers (which
part from float32's on most prompts), seeded samples too for one drafter per dtype; a
block-diffusion drafter starts from an MoE's layers (attention, norms, its experts' mean as the
MLP, an expert wide); prefix caching (the same prompt
twice: a hit, the same tokens); n samples with a seed (equal with and without drafts); a KV cache
small enough that requests are preempted; the OpenAI server (a chat completion equals
LLM.generate's); and `specdec train eagle3 --target <MoE>` for a few steps, whose head then
drafts on the MoE with plain decoding's tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from moe_cases import FAMILIES
from native_helpers import needs_kernels

from specdec import LLM, SamplingParams
from specdec.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
from drafter_helpers import random_block_diffusion, random_head  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs_kernels]

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=4, initializer_range=0.1, eos_token_id=2, bos_token_id=1)
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [11, 12, 13, 11, 12],
           [40, 41, 42, 40, 41], [60]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
STATIC = dict(controller="static", controller_args={"budget": 4})


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    """{family: folder}: a tiny random MoE with a word-level tokenizer of all its 96 ids and a
    chat template, its LM head scaled up (peaked distributions, for training to learn)."""
    from cli_helpers import CHAT_TEMPLATE, WORDS
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", *sorted(set(WORDS))]
    words += [f"w{i}" for i in range(96 - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    root = tmp_path_factory.mktemp("moe_features")
    out = {}
    for i, (family, kw) in enumerate(FAMILIES.items()):
        folder = make_tiny_model(root / family, family, seed=i, **{**COMMON, **kw})
        tok.save_pretrained(folder)
        weights = load_file(folder / "model.safetensors")
        weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        out[family] = folder
    out["dense"] = make_tiny_model(root / "dense", "llama", seed=7, eos_token_id=2,
                                   bos_token_id=1)
    return out


# the target's numbers: LLM keywords, and the dtype its drafters' heads are built in
NUMBERS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
           "float64": dict(dtype="float64"),
           "q8": dict(dtype="float32", quantize="q8_0", activations="q8")}


def _llm(folder, numbers: str = "float32", **kw) -> LLM:
    return LLM(model=str(folder), **{**NUMBERS[numbers], "max_model_len": 128, **kw})


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> tuple[list, int]:
    outs = llm.generate(prompts, params)
    assert [o.error for o in outs] == [None] * len(outs)
    accepted = sum(sum(o.metrics.accepted_by_depth) for o in outs)
    return [[list(s.token_ids) for s in o.outputs] for o in outs], accepted


_PLAIN: dict = {}


def _plain(moe, family, numbers: str = "float32") -> list:
    if (family, numbers) not in _PLAIN:
        _PLAIN[family, numbers] = _run(_llm(moe[family], numbers))[0]
    return _PLAIN[family, numbers]


def _drafter(name: str, moe, family, numbers: str = "float32") -> dict:
    """LLM keywords of drafter ``name`` on ``moe[family]``, its heads in the target's dtype."""
    folder = moe[family]
    dtype = getattr(torch, NUMBERS[numbers]["dtype"])
    model, cfg, hf = load_model(folder, dtype, "cpu", 128)
    if name == "ngram":
        return dict(drafter="ngram", drafter_args={"min_ngram": 1, "max_depth": 4})
    if name == "suffix":
        return dict(drafter="suffix")
    if name == "eagle3":  # a random head: 3 siblings of depth 1 get some accepted everywhere
        return dict(drafter="eagle3", drafter_args={
            "head": random_head(model, cfg, hf, aux_layer_ids=(1, 2, 3)), "depth": 1,
            "topk": 3})
    if name == "mtp":
        from specdec.models.heads.mtp import MTPConfig, MTPHeads

        torch.manual_seed(0)
        heads = MTPHeads(MTPConfig.for_target(cfg, 64, 3), dtype)
        heads.init_from_target(model.head_weight,
                               torch.randperm(cfg.vocab_size)[:64].sort().values)
        return dict(drafter="mtp", drafter_args={"heads": heads})
    if name == "block_diffusion":
        return dict(drafter="block_diffusion",
                    drafter_args={"model": random_block_diffusion(model, cfg, hf)})
    if name == "draft_model":  # a dense Llama, the MoE itself, the MoE's first 2 layers
        args = {"qwen3_moe": {"model": str(moe["dense"])}, "mixtral": {"model": str(folder)},
                "qwen2_moe": {"early_exit_layers": 2}}[family]
        return dict(drafter="draft_model", drafter_args={**args, "max_depth": 3})
    assert name == "eagle3+ngram"
    return dict(drafter="eagle3+ngram", drafter_args={
        "eagle3": {"head": random_head(model, cfg, hf, aux_layer_ids=(1, 2, 3)), "depth": 1,
                   "topk": 1},
        "ngram": {"min_ngram": 1}})


@pytest.mark.parametrize("drafter", ["suffix", "mtp", "block_diffusion", "draft_model",
                                     "eagle3+ngram"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_equals_plain_greedy(moe, family, drafter):
    got, accepted = _run(_llm(moe[family], **_drafter(drafter, moe, family), **STATIC))
    assert got == _plain(moe, family)
    assert accepted > 0, "no draft accepted: the test would pass vacuously"


# one family per drafter and dtype (rotating, so each drafter meets two families over the two)
DRAFTERS = ["ngram", "suffix", "mtp", "block_diffusion", "draft_model", "eagle3",
            "eagle3+ngram"]
CELLS = [(numbers, name, list(FAMILIES)[(i + shift) % len(FAMILIES)])
         for numbers, shift in (("bfloat16", 0), ("q8", 1), ("float64", 2))
         for i, name in enumerate(DRAFTERS)]
SEEDED = {("bfloat16", "eagle3"), ("q8", "block_diffusion"), ("float64", "mtp")}  # + seeded


@pytest.mark.parametrize(("numbers", "drafter", "family"), CELLS)
def test_every_drafter_equals_plain_in_each_number_format(moe, numbers, drafter, family):
    """Issue #55: bfloat16 (LLM(dtype="bfloat16")), q8 (a safetensors MoE quantized at load
    to Q8_0 blocks, q8 activations) and float64 (the torch layer: no argmax tie can flip):
    every drafter gives plain decoding's greedy tokens, some draft accepted; for one drafter
    per format seeded samples equal too."""
    spec = _llm(moe[family], numbers, **_drafter(drafter, moe, family, numbers), **STATIC)
    if numbers == "q8":
        assert (spec.engine.parts.weights, spec.engine.parts.activations) == ("q8_0", "q8")
    else:
        assert spec.engine.parts.dtype == getattr(torch, numbers)
    got, accepted = _run(spec)
    assert got == _plain(moe, family, numbers)
    assert accepted > 0, "no draft accepted: the test would pass vacuously"
    if (numbers, drafter) in SEEDED:
        params = [SamplingParams(seed=30 + i, temperature=0.8, max_tokens=16, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        got, accepted = _run(spec, params=params)
        assert got == _run(_llm(moe[family], numbers), params=params)[0] and accepted > 0


def test_block_diffusion_starts_from_an_moe_targets_layers(moe):
    """Its dense layers are as wide as one expert: attention and norms copied from the target's
    last layers, the MLP the mean of their experts' weights."""
    from specdec.models.heads.block_diffusion import BlockDiffusionConfig

    model, cfg, hf = load_model(moe["qwen3_moe"], torch.float32, "cpu", 128)
    assert BlockDiffusionConfig.for_target(cfg, 64).intermediate_size == 32
    bd = random_block_diffusion(model, cfg, hf)  # init_from_target, then perturbed by 0.05
    theirs = model.layers[-1]
    mean = torch.stack([e.down_weight for e in theirs.moe.experts]).mean(0)
    for got, want in ((bd.layers[-1].down_weight, mean),
                      (bd.layers[-1].o_weight, theirs.o_weight)):
        assert got.shape == want.shape and (got - want).std() < 0.06


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_caching_hits_and_keeps_the_tokens(moe, family):
    prompt = [(7 * i + 3) % 90 for i in range(23)]  # 5 full pages of 4 before the last token
    for kw in ({}, dict(drafter="ngram", drafter_args={"min_ngram": 1}, **STATIC)):
        llm = _llm(moe[family], page_size=4, **kw)
        first, second = (llm.generate([prompt], GREEDY)[0] for _ in range(2))
        assert first.metrics.num_cached_tokens == 0
        assert second.metrics.num_cached_tokens == 20
        assert second.token_ids == first.token_ids
        assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages


@pytest.mark.parametrize("family", FAMILIES)
def test_n_seeded_samples_equal_with_and_without_drafts(moe, family):
    params = [SamplingParams(n=2, seed=10 + i, temperature=0.8, max_tokens=16, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want, _ = _run(_llm(moe[family]), params=params)
    got, accepted = _run(_llm(moe[family], drafter="ngram", drafter_args={"min_ngram": 1},
                              **STATIC), params=params)
    assert got == want and accepted > 0
    assert all(len(samples) == 2 for samples in got)
    assert any(a != b for a, b in got), "the two samples of every request alike: seeds unused"


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_keeps_the_tokens(moe, family):
    eng = _llm(moe[family], page_size=4, num_pages=14, max_model_len=40, drafter="ngram",
               drafter_args={"min_ngram": 1}, **STATIC).engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    done = [eng.pop_finished(i) for i in ids]
    assert sum(s.num_preemptions for s in done) > 0, "14 pages of 4 must force preemption"
    want, _ = _run(_llm(moe[family]), params=params)
    assert [[s.output_token_ids] for s in done] == want
    assert eng.kv.num_free_pages == eng.kv.num_pages


def test_openai_chat_completion_equals_generate(moe):
    import httpx

    from specdec.serving.engine_loop import EngineLoop
    from specdec.serving.server import ServerLimits, ServerThread, create_app

    chat = [{"role": "user", "content": "write a short poem about the sea"}]
    llm = _llm(moe["qwen2_moe"], drafter="ngram", drafter_args={"min_ngram": 1}, **STATIC)
    want = llm.generate([chat], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert want.token_ids and want.text
    loop = EngineLoop(llm.engine, max_queued=8).start()
    server = ServerThread(create_app(loop, "moe", None, ServerLimits()))
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "moe", "messages": chat, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == want.text
        assert body["usage"]["completion_tokens"] == 12
    finally:
        server.stop()
        loop.shutdown()


@pytest.mark.filterwarnings("ignore:aux layer ids start at 1")
def test_train_eagle3_on_an_moe_target(moe, prompts_file, tmp_path):
    """`specdec train eagle3 --target <MoE>` (self-distillation, 3 steps, aux layers of the
    MoE): the head it exports drafts on the MoE with plain decoding's tokens."""
    import yaml

    from specdec.cli import main

    folder = moe["mixtral"]
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(dict(
        regen_max_tokens=16, regen_batch_size=4, aux_layer_ids=[1, 2, 3], draft_vocab_size=24,
        max_length=64, ttt_steps=2, batch_size=4, learning_rate=3e-3, warmup_ratio=0.0,
        eval_max_tokens=8, eval_budget=4, checkpoint_every=50)))
    out = tmp_path / "run"
    assert main(["train", "eagle3", "--target", str(folder), "--data", str(prompts_file),
                 "--out", str(out), "--regenerate", "--limit", "8", "--max-steps", "3",
                 "--config", str(config)]) == 0
    head = out / "drafter"
    llm = _llm(folder, drafter="eagle3", drafter_args={"path": str(head)}, **STATIC)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [[o.token_ids] for o in outs] == _plain(moe, "mixtral")
    assert sum(o.metrics.draft_tokens_proposed for o in outs) > 0
