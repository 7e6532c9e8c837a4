"""The public surface docs/api.md lists ("Public surface") imports and reads, name by name: the
list is parsed from the doc, so the doc and this test cannot drift. A bullet names dotted
names (``specdec.LLM``); after its colon, attributes of the last of them (``generate``), read
on a live object where the class has one here (an LLM, its engine, an output ...)."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def documented_names(text: str) -> list[str]:
    """Every name of the doc's "Public surface" section, dotted in full.

    >>> documented_names("## Public surface\\n- `a.B`, `a.C`: `x`, `y`\\n## Next\\n- `a.D`")
    ['a.B', 'a.C', 'a.C.x', 'a.C.y']
    """
    section = ("\n" + text).split("\n## Public surface\n", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if not line.startswith("- "):
            continue
        head, _, tail = line.partition(": ")
        owners = [n for n in re.findall(r"`([\w.]+)`", head) if "." in n]
        names += owners
        names += [f"{owners[-1]}.{a}" for a in re.findall(r"`(\w+)`", tail)]
    return list(dict.fromkeys(names))


def resolve(name: str, live: dict):
    """The object a dotted name reaches: the longest module prefix imported, the rest read
    with getattr, the last part on a live object where its owner is a class in ``live`` (an
    instance attribute, or a property that must run)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for j, part in enumerate(parts[i:], start=i):
            last = j == len(parts) - 1
            obj = getattr(live[obj] if last and obj in live else obj, part)
        return obj
    raise ImportError(name)


@pytest.fixture(scope="module")
def live(tiny_llama):
    """A live object per class whose attributes the doc lists (instance attributes and
    properties are read on these)."""
    from specdec import LLM, RequestMetrics, RequestOutput, SamplingParams
    from specdec.config import EngineConfig
    from specdec.engine import LLMEngine
    from specdec.outputs import CompletionOutput

    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64, drafter="draft_model",
              drafter_args={"model": str(tiny_llama), "max_depth": 2})
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0]
    yield {LLM: llm, LLMEngine: llm.engine, RequestOutput: out, RequestMetrics: out.metrics,
           CompletionOutput: out.outputs[0], SamplingParams: SamplingParams(),
           EngineConfig: EngineConfig()}
    llm.close()


def test_the_doc_lists_the_names_users_reach_for():
    names = documented_names(API.read_text())
    for needed in ("specdec.LLM", "specdec.engine.LLMEngine.activations",
                   "specdec.engine.LLMEngine.kv_split", "specdec.drafters.eagle3.Eagle3Head"):
        assert needed in names
    assert len(names) > 60


def test_every_documented_name_imports_and_reads(live):
    missing = []
    for name in documented_names(API.read_text()):
        try:
            resolve(name, live)
        except (ImportError, AttributeError, RuntimeError) as e:
            missing.append(f"{name}: {type(e).__name__}: {e}")
    assert missing == []


def test_the_engine_attributes_are_read_only(live):
    from specdec.engine import LLMEngine

    engine = live[LLMEngine]
    assert engine.activations == engine.parts.activations
    assert engine.kv_split is engine.parts.kv_split and len(engine.drafter_runners) == 1
    with pytest.raises(AttributeError):
        engine.activations = "q8"


@pytest.mark.parametrize("old, names", [
    ("specdec.models.eagle3", ("Eagle3Head", "Eagle3Config")),
    ("specdec.models.mtp", ("MTPHeads", "MTPConfig")),
    ("specdec.models.block_diffusion", ("BlockDiffusionModel", "BlockDiffusionConfig"))])
def test_the_heads_old_paths_still_import_with_a_warning(old, names):
    """Before #47 the head classes were in specdec.models.<drafter> (CHANGELOG.md)."""
    import sys

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and "heads" in str(w.message)
               for w in caught)
    new = importlib.import_module(old.replace(".models.", ".models.heads."))
    drafter = importlib.import_module(old.replace(".models.", ".drafters."))
    for n in names:
        assert getattr(module, n) is getattr(new, n) is getattr(drafter, n)
