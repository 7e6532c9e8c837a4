"""Self-distillation's regeneration (training/regenerate.py) against a scripted engine: what the
target is shown, what is stored, how calls keep the engine full, resuming."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.training import regenerate as regen
from specdec.training.data import Conversation


@dataclass
class _Out:
    text: str
    token_ids: list[int]
    finish_reason: str = "length"
    error: str | None = None


class _Engine:
    """Answers each prompt with "re: <its last user turn>" and records every call."""

    def __init__(self):
        self.calls: list[list[list[dict]]] = []

    def generate(self, prompts, params):
        assert len(params) == len(prompts)
        self.calls.append([list(p) for p in prompts])
        return [_Out("re: " + p[-1]["content"], [1, 2, 3]) for p in prompts]


def _convs(n: int, turns: int = 1) -> list[Conversation]:
    return [Conversation([{"role": "user", "content": f"q{i}.{t}"} for t in range(turns)],
                         "src.json", i) for i in range(n)]


def _run(convs, out, engine, **kw):
    return regen.regenerate(convs, "unused", out, temperature=0.0, max_tokens=4,
                            batch_size=2, seed=0, llm=engine, **kw)


def test_calls_hand_the_engine_several_batches_and_every_answer_is_stored(tmp_path):
    engine, out = _Engine(), tmp_path / "answers.jsonl"
    got = _run(_convs(9), out, engine)
    assert [len(c) for c in engine.calls] == [8, 1]  # CHUNK_BATCHES batches of 2 per call
    assert [c.messages[-1]["content"] for c in got] == [f"re: q{i}.0" for i in range(9)]
    assert len(out.read_text().splitlines()) == 9


def test_the_target_sees_the_shortened_turns_and_the_file_keeps_the_originals(tmp_path):
    def shorten(conv):
        return Conversation([{**m, "content": m["content"][:2]} for m in conv.messages],
                            conv.source, conv.index)

    engine, out = _Engine(), tmp_path / "answers.jsonl"
    got = _run(_convs(3, turns=2), out, engine, prompt_of=shorten)
    first, second = engine.calls  # turn by turn
    assert [p[-1]["content"] for p in first] == ["q0", "q1", "q2"]
    # the second turn's prompt carries the first answer, and the shortened turns
    assert second[0] == [{"role": "user", "content": "q0"},
                         {"role": "assistant", "content": "re: q0"},
                         {"role": "user", "content": "q0"}]
    assert got[0].messages == [{"role": "user", "content": "q0.0"},
                               {"role": "assistant", "content": "re: q0"},
                               {"role": "user", "content": "q0.1"},
                               {"role": "assistant", "content": "re: q0"}]
    stored = json.loads(out.read_text().splitlines()[0])["messages"]
    assert stored == got[0].messages


def test_a_rerun_resumes_and_a_torn_last_line_is_redone(tmp_path):
    out = tmp_path / "answers.jsonl"
    _run(_convs(5), out, _Engine())
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])  # a crash mid-write
    engine = _Engine()
    got = _run(_convs(6), out, engine)
    assert [[p[-1]["content"] for p in call] for call in engine.calls] == [["q4.0", "q5.0"]]
    assert [c.index for c in got] == list(range(6))
    assert len(out.read_text().splitlines()) == 6
