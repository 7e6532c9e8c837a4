"""Benchmark prompts: read a dataset file, pick prompts, format them with the chat template.

Formats, detected from the first record's fields:
    MT-Bench / Spec-Bench   {"question_id", "category", "turns": [str, ...]}
    HumanEval               {"task_id", "prompt", ...}          category "humaneval"
    GSM8K                   {"question", "answer"}              category "gsm8k"
Files are JSON lines, optionally gzip-compressed (`.gz`). Without ``--dataset`` the bench
commands read ``DEFAULT_DATASET``: 32 questions of two turns each, four per MT-Bench category,
written for specdec and shipped with it (package data), so that they run as documented.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specdec.models.tokenizer import chat_token_ids

# the prompt set shipped with the package (pyproject package-data): --dataset's default
DEFAULT_DATASET = Path(__file__).with_name("prompts.jsonl")


@dataclass(frozen=True)
class Question:
    """One benchmark record: its user turns (the model answers each in order)."""

    qid: str
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Item:
    """One generation request of the benchmark (a question at one turn), already tokenized."""

    key: tuple[int, int]  # (question index, turn index)
    category: str
    prompt_ids: list[int]


def read_records(path: Path) -> list[dict]:
    """Every JSON object in a JSON-lines file (`.gz` is decompressed); errors name the line."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    records.append(_parse_line(line, path, n))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset: cannot read {path}: {e}") from e
    if not records:
        raise ValueError(f"--dataset: {path} has no records")
    return records


def _parse_line(line: str, path: Path, n: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset: {path} line {n} is not valid JSON: {e}") from e
    if not isinstance(record, dict):
        raise ValueError(f"--dataset: {path} line {n} is not a JSON object")
    return record


def to_question(record: dict, index: int) -> Question:
    """A record of any supported format as a Question; ValueError says what fields were found,
    or which text field of record `index` (0-based) is not a non-blank string."""
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"--dataset: record {index}: 'turns' must be a non-empty list of "
                             f"non-blank strings, got {_short(turns)}")
        for t, turn in enumerate(turns):
            _text(turn, index, f"turns[{t}]")
        qid = record.get("question_id", index)
        return Question(str(qid), str(record.get("category", "default")), tuple(turns))
    if "prompt" in record and "task_id" in record:
        prompt = _text(record["prompt"], index, "prompt")
        return Question(str(record["task_id"]), "humaneval", (prompt,))
    if "question" in record:
        return Question(str(index), "gsm8k", (_text(record["question"], index, "question"),))
    raise ValueError(
        f"--dataset: record {index} has fields {sorted(record)}; expected MT-Bench/Spec-Bench "
        "(question_id, category, turns), HumanEval (task_id, prompt) or GSM8K (question)"
    )


def _text(value, index: int, field: str) -> str:
    """`value` if it is a string with some non-whitespace text (an empty prompt would make the
    engine and the baseline answer nothing, or the chat template alone)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"--dataset: record {index}: '{field}' must be a non-blank string, "
                         f"got {_short(value)}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_questions(path: Path, num_prompts: int | None) -> list[Question]:
    """`num_prompts` questions (all when None), taken round-robin over categories so that a
    small sample covers every category, then kept in file order."""
    questions = [to_question(r, i) for i, r in enumerate(read_records(path))]
    if num_prompts is None:
        return questions
    if num_prompts > len(questions):
        raise ValueError(f"--num-prompts {num_prompts} exceeds the {len(questions)} records "
                         f"in {path}")
    by_cat: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_cat.setdefault(q.category, []).append(i)
    picked: list[int] = []
    queues = [list(v) for v in by_cat.values()]
    while len(picked) < num_prompts:
        for queue in queues:
            if queue and len(picked) < num_prompts:
                picked.append(queue.pop(0))
    return [questions[i] for i in sorted(picked)]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat, formatted with the tokenizer's template plus the generation prompt."""
    if tokenizer is None:
        raise ValueError("--model: bench needs a model folder with a tokenizer")
    try:
        return chat_token_ids(tokenizer, messages)
    except ValueError as e:
        raise ValueError(f"--model: {e}; bench formats every prompt as a chat") from e


def first_turn_items(questions: list[Question], tokenizer) -> list[Item]:
    return [Item((i, 0), q.category, chat_ids(tokenizer, [_user(q.turns[0])]))
            for i, q in enumerate(questions)]


def next_turn_items(questions: list[Question], tokenizer, answers: dict[tuple[int, int], str],
                    turn: int) -> list[Item]:
    """Items for `turn` of every question that has it; `answers[(i, t)]` is the model's text
    answer to turn t of question i, fed back as the assistant message."""
    items = []
    for i, q in enumerate(questions):
        if len(q.turns) <= turn:
            continue
        messages = []
        for t in range(turn):
            messages += [_user(q.turns[t]), {"role": "assistant", "content": answers[(i, t)]}]
        messages.append(_user(q.turns[turn]))
        items.append(Item((i, turn), q.category, chat_ids(tokenizer, messages)))
    return items


def _user(text: str) -> dict:
    return {"role": "user", "content": text}
