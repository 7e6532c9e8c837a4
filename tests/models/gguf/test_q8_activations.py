"""8-bit activations over a GGUF's blocks (specdec/models/gguf/q8_activations.py, native/linear_q8.c).

Random blocks: the compiled kernel bitwise its pure-torch reference for any rows (that a row's
result never depends on the call is tested with the float layout, test_gguf_weights), the
activations' rounding within half a step of each
block's scale, and the products within ~1 % of the fp32 ones. The real model: speculation in
this mode is token for token plain decoding in this mode, and bad settings are refused by name.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf_helpers import KINDS, inputs, random_blocks
from native_helpers import KERNELS, needs_kernels, run_capped

from specdec import LLM, SamplingParams
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa
from specdec.models.gguf import weights as gw
from specdec.native import Q8_ISAS


def test_rows_round_to_int8_within_half_a_step():
    x = torch.randn(5, 96) * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(32)
    x[2, 32:64] = 0.0  # a block of zeros: scale 0, quants 0
    q, d, s = qa.quantize_rows(x)
    back = q.float() * d.unsqueeze(-1)
    assert (back - x.reshape(5, 3, 32)).abs().le(d.unsqueeze(-1) / 2 * (1 + 1e-6)).all()
    assert q.abs().max() == 127 and d[2, 1] == 0 and (q[2, 1] == 0).all()
    assert torch.equal(s, d * q.float().sum(-1))


# (out, blocks of 32): (24, 19) runs past the AMX kernel's runs of 8 blocks to a partial one
SHAPES = [(40, 3), (16, 1), (203, 5), (7, 2), (24, 19)]


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out, blocks", SHAPES)
def test_kernel_is_bitwise_the_reference(kind, out, blocks):
    """Every GGUF type in its kernel format (gguf_blocks.repack); K-quants at 256 to 1792
    inputs (test_gguf_weights.inputs)."""
    inp = inputs(kind, blocks)
    b = random_blocks(kind, out, inp, seed=out)
    panels = qa.prepare(b)
    assert panels.fmt == qa.FORMATS[gb.KERNEL_FORMAT[kind]]
    assert panels.nbytes == gb.prepare(b).nbytes  # the same bytes, laid out for int8 rows
    fp32 = gb.dequantize(b)
    for t in (1, 2, 3, 4, 5, 8, 9, 11, 13, 16, 17, 40):  # AMX from 9, 11 or 16 rows by format
        x = torch.randn(t, inp, generator=torch.Generator().manual_seed(1000 * out + t))
        y = KERNELS.linear(x, panels)
        assert torch.equal(y, qa.reference_linear(x, b)), t
        exact = x.double() @ fp32.double().T
        assert ((y.double() - exact).norm() / exact.norm()) < 0.02


def test_activations_option_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="activations must be one of auto, float, q8"):
        LLM(model=str(tiny_llama), activations="int4")
    with pytest.raises(ValueError, match="activations='q8' computes with a GGUF's own blocks: "
                                         "it needs weights='native' or 'auto'"):
        LLM(model=str(tiny_llama), activations="q8", weights="dequantized")
    with pytest.raises(ValueError, match="activations='q8' cannot run here: the model does not "
                                         "come from a GGUF file"):
        LLM(model=str(tiny_llama), activations="q8")


@pytest.fixture
def one_thread():
    """One torch thread for this test only (on a shared 2-core machine a second OpenMP thread
    mostly waits on barriers); the kernel tests keep every thread, their threaded splits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_kernels
def test_smollm2_q8_speculation_is_plain_decoding(smollm2_dir, one_thread):
    """eagle3 (its head's Q8_0 matrices over int8 rows too) and ngram together, under a static
    budget: the tokens of plain decoding in the same mode, greedy and (a seed gives the same
    text with and without speculation) sampled."""
    kw = dict(model=str(smollm2_dir), max_model_len=256, max_num_seqs=4, activations="q8")
    plain = LLM(**kw)
    assert (plain.engine.parts.weights, plain.engine.parts.activations) == ("native", "q8")
    assert {p.fmt for p in plain.engine.parts.kernels._panels.values()} == {qa.FORMATS["Q4_1"],
                                                                      qa.FORMATS["Q8_0"]}
    prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
    sp = [SamplingParams(temperature=0, max_tokens=24)] * 2 + [
        SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=24) for i in range(2)]
    prompts = prompts * 2
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = LLM(**kw, drafter="eagle3+ngram", controller="static", controller_args={"budget": 4})
    assert spec.engine.parts.draft_weights == "q4_1"  # the EAGLE-3 head's "auto"
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0


def test_a_draft_model_without_blocks_is_not_refused(tiny_llama):
    """Only the target must run q8 (strict); a draft model that cannot computes otherwise."""
    llm = LLM(model=str(tiny_llama), weights="dequantized")
    m, cpu = llm.engine.parts.model, torch.device("cpu")
    missing = tiny_llama / "model.gguf"
    assert gw.native_panels(m, missing, "auto", torch.float32, cpu, "invariant", "q8",
                            strict=False) == []
    with pytest.raises(ValueError, match="activations='q8' cannot run here"):
        gw.native_panels(m, missing, "auto", torch.float32, cpu, "invariant", "q8")


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "avx-vnni", "avx512-vnni"])
def test_every_narrower_isa_is_bitwise_the_reference(isa):
    """The test above runs the widest kernels this CPU has; the narrower ones (what CPUs
    without AMX, AVX512-VNNI or VNNI run) are asked for by the environment, in a process of
    their own (the choice is made once per process)."""
    if Q8_ISAS.index(isa) >= Q8_ISAS.index(KERNELS.q8_isa):
        pytest.skip(f"this CPU's widest q8 kernels are {KERNELS.q8_isa} (the test above)")
    out = run_capped("test_q8_activations",
                     "print(t.KERNELS.q8_isa)\n"
                     "for kind in ['Q4_1', 'Q8_0', 'Q4_K', 'Q5_K', 'Q6_K']:  # a type per format\n"
                     "    for out, blocks in [(203, 5), (24, 19)]:\n"
                     "        t.test_kernel_is_bitwise_the_reference(kind, out, blocks)\n", isa)
    ran = out.split()[0]
    assert Q8_ISAS.index(ran) <= Q8_ISAS.index(isa), ran  # at most the one asked for


@needs_kernels
def test_an_unknown_isa_cap_is_said_and_ignored():
    code = ("from specdec.native import load, Q8_ISAS\n"
            "k = load()\n"
            "print(k.q8_isa)\n")
    env = {**os.environ, "SPECDEC_NATIVE_ISA": "sse9"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SPECDEC_NATIVE_ISA='sse9' is not one of avx2, avx-vnni" in done.stderr
    bare = {k: v for k, v in os.environ.items() if k != "SPECDEC_NATIVE_ISA"}
    widest = subprocess.run([sys.executable, "-c", code], env=bare, capture_output=True,
                            text=True, timeout=120).stdout.split()[0]
    assert done.stdout.split()[0] == widest  # as without the variable (this run may cap it)
