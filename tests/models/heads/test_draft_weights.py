"""Quantized draft weights: the blocks, the kernels over them, and the engine's choice.

A drafter's matrices may compute in Q8_0 / Q4_1 blocks (drafts need no exactness); what must
hold: the blocks are ggml's (close to the weight within the format's rounding), the kernel over
them computes with exactly their dequantized values, the drafter's own weights are untouched (a
head being trained), speculation stays lossless, and a choice that cannot run says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model

from specdec import LLM, SamplingParams, native
from specdec.config import EngineConfig
from specdec.models.gguf.blocks import dequantize
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.heads.weights import draft_panels, mode_of, quantize
from specdec.models.loader import load_model

needs_kernels = pytest.mark.skipif(native.load() is None, reason="CPU kernels not built")
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [11, 12]]


def random_head(model, cfg, hf) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 64), model.embed, hf)
    head.reset_parameters(0.5)
    head.set_vocab(torch.randperm(cfg.vocab_size)[:64].sort().values)
    return head


@pytest.mark.parametrize("kind, levels", [("Q8_0", 127), ("Q4_1", 15)])
def test_blocks_round_each_weight_within_half_a_step(kind, levels):
    """Half a quantization step, plus what rounding the block's scale (and Q4_1's minimum)
    to fp16 adds: at most 2**-11 of each, times the largest quant."""
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    back = dequantize(quantize(w, kind))
    blocks = w.view(40, 3, 32)
    step = (blocks.abs().amax(-1) if kind == "Q8_0"
            else blocks.amax(-1) - blocks.amin(-1))  # the block's range / levels
    err = (back - w).abs().view(40, 3, 32).amax(-1)
    scale_rounding = 2.0 ** -11 * (step + blocks.abs().amax(-1))
    assert bool((err <= 0.5 * step / levels + scale_rounding).all())
    assert bool((err > 0.4 * step / levels).any())  # the bound is not loose
    assert not torch.equal(back, w)


def test_inputs_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 40), "Q8_0")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("dw"), num_hidden_layers=4, seed=5)
    model, cfg, hf = load_model(folder, torch.float32, "cpu", 512)
    return folder, model, cfg, hf


@needs_kernels
@pytest.mark.parametrize("mode, kind", [("q8_0", "Q8_0"), ("q4_1", "Q4_1"), ("auto", "Q4_1")])
def test_kernel_computes_with_the_blocks_values(target, mode, kind):
    _, model, cfg, hf = target
    head = random_head(model, cfg, hf)
    before = {n: w.clone() for n, w in head.named_matrices().items()}
    adopted = draft_panels([head], mode, torch.float32, torch.device("cpu"), "invariant")
    assert [id(w) for w, _ in adopted] == [id(w) for w in head.matrices()]
    k = native.load()
    x = torch.randn(3, head.fc.shape[1])
    w, panels = adopted[0]
    expected = F.linear(x.double(), dequantize(quantize(w, kind)).double())
    torch.testing.assert_close(k.linear(x, panels).double(), expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(w, before[n]) for n, w in head.named_matrices().items())


@needs_kernels
def test_auto_is_q4_1_for_learned_heads_and_q8_0_for_a_draft_model(target):
    _, model, cfg, hf = target
    cpu = torch.device("cpu")
    head = draft_panels([random_head(model, cfg, hf)], "auto", torch.float32, cpu, "invariant")
    whole = draft_panels([model], "auto", torch.float32, cpu, "invariant")
    assert mode_of(head) == "q4_1" and mode_of(whole) == "q8_0"


def test_float_and_unrunnable_choices(target):
    _, model, cfg, hf = target
    head = random_head(model, cfg, hf)
    cpu = torch.device("cpu")
    assert draft_panels([head], "float", torch.float32, cpu, "invariant") == []
    assert draft_panels([head], "auto", torch.float64, cpu, "invariant") == []
    with pytest.raises(ValueError, match="draft_weights='q8_0' cannot run here: .*float64"):
        draft_panels([head], "q8_0", torch.float64, cpu, "invariant")
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        draft_panels([head], "q4_1", torch.float32, cpu, "plain")
    with pytest.raises(ValueError, match="draft_weights must be one of auto, q8_0, q4_1, float"):
        EngineConfig(draft_weights="int4")


@needs_kernels
@pytest.mark.parametrize("mode", ["q8_0", "q4_1", "float"])
def test_engine_drafts_with_quantized_heads_losslessly(target, mode):
    folder, model, cfg, hf = target
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(folder), dtype="float32").generate(PROMPTS[:4], params)
    llm = LLM(model=str(folder), dtype="float32", drafter="eagle3", controller="static",
              controller_args={"budget": 4}, draft_weights=mode,
              drafter_args={"head": random_head(model, cfg, hf), "depth": 3, "topk": 2})
    assert llm.engine.parts.draft_weights == mode
    spec = llm.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.draft_tokens_proposed for o in spec) > 0
    plain_engine = LLM(model=str(folder), dtype="float32").engine
    assert plain_engine.parts.draft_weights == "none"
