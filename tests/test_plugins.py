"""Plugins: the example package through its entry point, failure isolation, the off switch."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
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


# ---- a plugin that cannot be used is skipped, and an error only where it is asked for ---------

BROKEN = {  # the module an installed-looking entry point names, and the hook to ask by name
    "import": ("raise ImportError('needs libfoo 2')\n", "specdec_drafters", ImportError),
    "register": ("from specdec.hookspecs import hookimpl\n"
                 "@hookimpl\ndef specdec_drafters(bogus):\n    return {}\n",
                 "specdec_drafters", Exception),
    "unknown-hook": ("from specdec.hookspecs import hookimpl\n"
                     "@hookimpl\ndef specdec_drafter():\n    return {}\n",
                     "specdec_drafters", Exception),
    "hook-raises": ("from specdec.hookspecs import hookimpl\n"
                    "@hookimpl\ndef specdec_controllers():\n"
                    "    raise RuntimeError('bad registry')\n", "specdec_controllers",
                    RuntimeError),
}


def fake_distribution(site: Path, module_source: str, module: str = "broken_plug_mod") -> Path:
    """An installed-looking distribution `broken-plug` 1.2.3 on ``site`` (a *.dist-info folder
    that importlib.metadata finds) whose entry point `broken` in group `specdec` names
    ``<module>:plugin``, a module of ``module_source`` (``plugin``: the module itself)."""
    info = site / "broken_plug-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plug\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[specdec]\nbroken = {module}:plugin\n")
    (site / f"{module}.py").write_text(module_source + "plugin = __import__(__name__)\n")
    return site


def _names_it(text: str, module: str = "broken_plug_mod") -> bool:
    return all(s in text for s in ("'broken'", f"{module}:plugin", "broken-plug 1.2.3"))


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_installed_plugin_is_skipped_with_one_warning(kind, tmp_path, monkeypatch,
                                                              request, tiny_llama):
    source, hook, cause = BROKEN[kind]
    module = f"broken_plug_{kind.replace('-', '_')}"  # one module per case: it may import
    monkeypatch.syspath_prepend(str(fake_distribution(tmp_path, source, module)))
    request.addfinalizer(lambda: sys.modules.pop(module, None))
    monkeypatch.delenv("SPECDEC_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        llm = LLM(model=str(tiny_llama), dtype="float32", drafter=None)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3
    about = [str(w.message) for w in seen if "broken" in str(w.message)]
    assert len(about) == 1 and _names_it(about[0], module) and "skipped" in about[0], about
    # asked for by name: a ValueError naming the plugin, its distribution and the error
    kw = {"drafter": "broken"} if hook == "specdec_drafters" else {"controller": "broken"}
    with warnings.catch_warnings(), pytest.raises(ValueError) as info:
        warnings.simplefilter("ignore")
        LLM(model=str(tiny_llama), dtype="float32", **kw)
    assert _names_it(str(info.value), module) and "skipped" in str(info.value)
    assert isinstance(info.value.__cause__, cause)
    if kind in ("import", "hook-raises"):
        assert ("needs libfoo 2" if kind == "import" else "bad registry") in str(info.value)


def test_the_cli_runs_beside_a_broken_plugin_and_names_it_when_asked(tmp_path):
    import cli_helpers

    model = cli_helpers.make_tokenizer_model(tmp_path / "model")
    site = fake_distribution(tmp_path / "site", BROKEN["import"][0])
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SPECDEC_DISABLE_PLUGIN_AUTOLOAD", None)
    specdec = Path(sys.executable).parent / "specdec"

    def run(*flags):
        return subprocess.run([str(specdec), "generate", "write a poem", "--model", str(model),
                               "--max-tokens", "3", *flags], capture_output=True, text=True,
                              env=env, timeout=300)

    plain = run("--drafter", "none")
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr.count("could not be loaded") == 1 and _names_it(plain.stderr)
    assert "needs libfoo 2" in plain.stderr and "Traceback" not in plain.stderr
    asked = run("--drafter", "broken")
    assert asked.returncode == 2 and "Traceback" not in asked.stderr
    error = asked.stderr.strip().splitlines()[-1]
    assert "argument --drafter: unknown name 'broken'" in error and _names_it(error)
    assert "ImportError('needs libfoo 2')" in error
