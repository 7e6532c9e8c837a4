"""Plugins: the example package through its entry point, failure isolation, the off switch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters.base import BaseDrafter
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "specdec-phrase-drafter"
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]

USE_PHRASE = """
import json, sys
from specdec import LLM, SamplingParams
folder, phrase = sys.argv[1], json.loads(sys.argv[2])
p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
plain = LLM(model=folder, dtype="float64").generate([[1, 2, 3]], p)[0]
try:
    llm = LLM(model=folder, dtype="float64", drafter="phrase",
              drafter_args={"token_phrases": [phrase]}, controller="static",
              controller_args={"budget": 6})
except ValueError as e:
    print("ERROR", e)
    raise SystemExit(0)
out = llm.generate([[1, 2, 3]], p)[0]
print(json.dumps({"same": out.token_ids == plain.token_ids,
                  "accepted": sum(out.metrics.accepted_by_depth),
                  "plugin": llm.engine.drafting.drafter.plugin_name}))
"""


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(EXAMPLE)],
                   check=True, capture_output=True)
    return target


def run_with_example(site: Path, folder: Path, phrase: list[int], **env) -> str:
    environ = {**os.environ, "PYTHONPATH": str(site), **env}
    proc = subprocess.run([sys.executable, "-c", USE_PHRASE, str(folder), str(phrase)],
                          capture_output=True, text=True, env=environ, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_example_plugin_by_entry_point(installed_example, tiny_llama):
    import json

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    ref = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20, min_new_tokens=20,
                      do_sample=False)[0, 3:].tolist()
    phrase = [3] + ref[:8]  # the model's own continuation, so the drafts are accepted
    result = json.loads(run_with_example(installed_example, tiny_llama, phrase))
    assert result["same"] and result["accepted"] >= 6
    assert result["plugin"] == "phrase"  # registered by the entry point's name


def test_autoload_off_switch(installed_example, tiny_llama):
    line = run_with_example(installed_example, tiny_llama, [3, 4, 5],
                            SPECDEC_DISABLE_PLUGIN_AUTOLOAD="1")
    assert line.startswith("ERROR unknown drafter 'phrase'")
    assert "ngram" in line  # built-ins stay registered


class _Flaky(BaseDrafter):
    """Raises for requests whose prompt starts with token 5; malformed trees for token 8."""

    name = "flaky"

    def __init__(self, target, **kwargs):
        pass

    def propose(self, requests):
        out = []
        for r in requests:
            if r.token_ids[0] == 5:
                raise RuntimeError("boom")
            if r.token_ids[0] == 8:
                out.append(DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1])))
            else:
                out.append(DraftTree.chain(torch.tensor(r.token_ids[-2:][: r.budget.max_nodes])))
        return out


class FlakyPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"flaky": _Flaky}


class StepRecorder:
    def __init__(self):
        self.steps = []

    @hookimpl
    def specdec_step_end(self, stats):
        self.steps.append(stats)


class BrokenObserver:
    @hookimpl
    def specdec_step_end(self, stats):
        raise KeyError("observer bug")


def test_failing_plugin_fails_only_its_request(tiny_llama):
    recorder = StepRecorder()
    llm = LLM(model=str(tiny_llama), dtype="float64", controller="static", drafter="flaky",
              plugins=(FlakyPlugin(), recorder), controller_args={"budget": 2})
    plain = LLM(model=str(tiny_llama), dtype="float64").generate(PROMPTS, GREEDY)
    # not declared replay_safe: the raising batch call is not retried; its requests draft
    # nothing that step and each proposes alone the next, where only the bad one raises
    with pytest.warns(RuntimeWarning, match="failed in propose for 3 requests at once"):
        outs = llm.generate(PROMPTS, GREEDY)
    assert outs[0].token_ids == plain[0].token_ids and outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "error" and "flaky" in outs[1].error and "boom" in outs[1].error
    assert outs[2].finish_reason == "error" and "malformed" in outs[2].error
    assert "plugin 'FlakyPlugin'" in outs[1].error
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_pages
    assert recorder.steps and sum(s.num_emitted for s in recorder.steps) == sum(
        len(o.token_ids) for o in outs)


def test_raising_observer_is_reported_by_name(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", plugins=(BrokenObserver(),))
    with pytest.warns(RuntimeWarning, match="BrokenObserver|observer bug"):
        out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert len(out.token_ids) == 20
    assert llm.engine.plugin_errors and "specdec_step_end" in llm.engine.plugin_errors[0]


def test_duplicate_names_are_rejected(tiny_llama):
    class Dup:
        @hookimpl
        def specdec_drafters(self):
            return {"ngram": _Flaky}

    with pytest.raises(Exception, match="'ngram' registered by both"):
        LLM(model=str(tiny_llama), drafter="ngram", plugins=(Dup(),))


class _FailsLater(BaseDrafter):
    """init_state raises for prompts starting with 11; on_verified raises for 12."""

    name = "fails_later"
    replay_safe = True  # pure: a raising on_verified may be retried request by request

    def __init__(self, target, **kwargs):
        pass

    def init_state(self, request_id, prompt_token_ids):
        if prompt_token_ids[0] == 11:
            raise RuntimeError("no state for you")
        return prompt_token_ids[0]

    def propose(self, requests):
        return [DraftTree.chain(torch.tensor(r.token_ids[-1:])) for r in requests]

    def on_verified(self, batch):
        if any(r.state == 12 for r in batch.requests):
            raise RuntimeError("bookkeeping bug")


class FailsLaterPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"fails_later": _FailsLater}


def test_drafter_failing_in_init_or_on_verified(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", controller="static", drafter="fails_later",
              plugins=(FailsLaterPlugin(),), controller_args={"budget": 1})
    plain = LLM(model=str(tiny_llama), dtype="float64").generate(PROMPTS[:1], GREEDY)
    outs = llm.generate([PROMPTS[0], [11, 1, 2], [12, 1, 2]], GREEDY)
    assert outs[0].token_ids == plain[0].token_ids and outs[0].finish_reason == "length"
    assert outs[1].finish_reason == "error" and "init_state" in outs[1].error
    assert outs[2].finish_reason == "error" and "on_verified" in outs[2].error
    assert "FailsLaterPlugin" in outs[2].error
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_pages
