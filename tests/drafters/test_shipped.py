"""The learned drafters shipped for SmolLM2 load by name (no path) and draft losslessly on the
real model, with drafts accepted; each is within the size the issue allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.drafters.catalog import SHIPPED

SHIPPED_DIR = Path(__file__).parents[2] / "drafters" / "shipped"
CHATS = ["Explain what a hash table is in two sentences.",
         "Write a Python function that returns the square of a number."]
# two requests of < 100 tokens: KV for them, not the default 1 GiB each engine would zero
ENGINE = dict(max_model_len=256, max_num_seqs=2)
# on a shared 2-core machine a second OpenMP thread mostly waits on barriers
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_shipped_folders_exist_and_are_small(kind):
    for folder in SHIPPED[kind]["smollm2-135m-instruct"].values():
        files = {p.name: p.stat().st_size for p in (SHIPPED_DIR / folder).iterdir()}
        assert {"config.json", "model.safetensors"} <= set(files)
        assert files["model.safetensors"] <= 32 * 2**20


@pytest.mark.slow
def test_shipped_learned_drafters_are_lossless_on_smollm2(smollm2_dir):
    prompts = [[{"role": "user", "content": c}] for c in CHATS]
    # 24 tokens: each drafter has drafts accepted on both prompts (3 to 11 each)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(model=str(smollm2_dir), **ENGINE).generate(prompts, params)]
    for kind in ("mtp", "block_diffusion", "eagle3"):
        llm = LLM(model=str(smollm2_dir), drafter=kind, controller="static",
                  controller_args={"budget": 4}, **ENGINE)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want, kind
        accepted = sum(sum(o.metrics.accepted_by_depth) for o in outs)
        assert accepted > 0, kind


@pytest.mark.parametrize(("kind", "form"), [("eagle3", "EAGLE-3 format"),
                                            ("mtp", "Medusa format"),
                                            ("block_diffusion", "block-diffusion folder")])
def test_no_path_and_none_shipped_names_the_path_argument(tiny_llama, kind, form):
    with pytest.raises(ValueError, match=rf"{kind} needs drafter_args.path: a.*{form}.*none is "
                                         "shipped for"):
        LLM(model=str(tiny_llama), dtype="float64", drafter=kind)
