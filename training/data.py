"""Training data for drafters: local json/jsonl files → conversations → token ids + loss mask.

Formats, detected per file from the first record's fields (first match in this order):

    sharegpt   {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}
    messages   {"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}
    turns      {"turns": [str, ...]}                  Spec-Bench / MT-Bench: user turns, no answers
    alpaca     {"instruction", "input", "output"}     (Code Alpaca: "response" instead of "output")
    gsm8k      {"question", "answer"}
    text       {"text": str}                          plain text: loss on every token, no template

A record with a blank turn is skipped (counted and logged per file); a file with nothing left is
an error. Tokenization renders the target's chat template and masks exactly the assistant's tokens
(see `tokenize`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system"}


class BlankTurn(Exception):
    """A record has a blank or missing turn: the record is skipped, not the file."""


@dataclass
class Conversation:
    messages: list[dict[str, str]]  # [{"role": "user"|"assistant"|"system", "content": str}]
    source: str  # the file it came from
    index: int  # record index in that file
    plain: bool = False  # plain text: one "assistant" message, tokenized without a template


@dataclass
class FileLoad:
    format: str
    conversations: list[Conversation]
    skipped: int  # records dropped: a blank or missing turn, or assistant turns only


@dataclass
class TokenizedExample:
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool, True on the assistant's tokens (and its end-of-turn token)


# ---------------------------------------------------------------- record → messages, per format

def _text(value: Any) -> str:
    if value is None:
        raise BlankTurn
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise BlankTurn
    return value


def _msg(role: str, content: Any) -> dict[str, str]:
    return {"role": role, "content": _text(content)}


def _turn_list(turns: Any) -> list:
    if not turns:
        raise BlankTurn
    return list(turns)


def _sharegpt(rec: dict) -> list[dict[str, str]]:
    out = []
    for turn in _turn_list(rec["conversations"]):
        speaker = turn.get("from") or turn.get("role")
        if speaker not in SHAREGPT_ROLES:
            raise ValueError(f"unknown speaker {speaker!r}; allowed: {sorted(SHAREGPT_ROLES)}")
        out.append(_msg(SHAREGPT_ROLES[speaker], turn.get("value", turn.get("content"))))
    return out


def _messages(rec: dict) -> list[dict[str, str]]:
    out = []
    for turn in _turn_list(rec["messages"]):
        if turn.get("role") not in ROLES:
            raise ValueError(f"unknown role {turn.get('role')!r}; allowed: {list(ROLES)}")
        out.append(_msg(turn["role"], turn.get("content")))
    return out


def _turns(rec: dict) -> list[dict[str, str]]:
    return [_msg("user", t) for t in _turn_list(rec["turns"])]


def _alpaca(rec: dict) -> list[dict[str, str]]:
    prompt = _text(rec["instruction"])
    extra = rec.get("input")
    if isinstance(extra, str) and extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    answer = rec.get("output") if rec.get("output") is not None else rec.get("response")
    return [_msg("user", prompt), _msg("assistant", answer)]


def _gsm8k(rec: dict) -> list[dict[str, str]]:
    return [_msg("user", rec["question"]), _msg("assistant", rec["answer"])]


def _plain(rec: dict) -> list[dict[str, str]]:
    return [_msg("assistant", rec["text"])]


# (name, fields that identify it, converter); the first whose fields are all present wins
FORMATS: tuple[tuple[str, tuple[str, ...], Callable[[dict], list[dict[str, str]]]], ...] = (
    ("sharegpt", ("conversations",), _sharegpt),
    ("messages", ("messages",), _messages),
    ("turns", ("turns",), _turns),
    ("alpaca", ("instruction", "output"), _alpaca),
    ("alpaca", ("instruction", "response"), _alpaca),
    ("gsm8k", ("question", "answer"), _gsm8k),
    ("text", ("text",), _plain),
)


def detect_format(record: dict, source: str) -> tuple[str, Callable[[dict], list[dict[str, str]]]]:
    """The format whose identifying fields the record has, else ValueError naming the file."""
    for name, fields, convert in FORMATS:
        if all(record.get(f) is not None for f in fields):
            return name, convert
    allowed = "; ".join(f"{n} ({' + '.join(f)})" for n, f, _ in FORMATS)
    raise ValueError(f"{source}: no known format for its first record, which has fields "
                     f"{sorted(record)}; allowed formats (fields): {allowed}")


# ---------------------------------------------------------------- files → conversations

def _read_records(path: Path):
    """The file as a `datasets.Dataset` (json list or jsonl)."""
    if not path.is_file():
        raise FileNotFoundError(f"training data file {path} does not exist")
    head = path.read_bytes()[:4096].strip()
    if not head:
        raise ValueError(f"{path}: the file is empty; expected json or jsonl records")
    if b"".join(head.split()) in (b"[]", b"{}"):
        raise ValueError(f"{path}: the file holds no records")
    from datasets import load_dataset

    try:
        ds = load_dataset("json", data_files=str(path), split="train")
    except Exception as e:
        raise ValueError(f"{path}: could not be read as json or jsonl records: {e}") from e
    if len(ds) == 0:
        raise ValueError(f"{path}: the file holds no records")
    return ds


def _drop_leading_assistant(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """ShareGPT dumps sometimes open with the bot's turn; a template needs a user turn first."""
    head = messages[:1] if messages[0]["role"] == "system" else []
    rest = messages[len(head):]
    while rest and rest[0]["role"] == "assistant":
        rest = rest[1:]
    return head + rest


def load_file(path: Path) -> FileLoad:
    """One file's conversations; records with a blank turn are skipped and counted."""
    ds = _read_records(Path(path))
    source = str(path)
    name, convert = detect_format(ds[0], source)
    convs, skipped = [], 0
    for index, record in enumerate(ds):
        try:
            messages = convert(record)
        except BlankTurn:
            skipped += 1
            continue
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: record {index} ({name} format): {e}") from e
        if name != "text":
            messages = _drop_leading_assistant(messages)
            if not any(m["role"] == "user" for m in messages):
                skipped += 1
                continue
        convs.append(Conversation(messages, source, index, plain=name == "text"))
    if not convs:
        raise ValueError(f"{source}: all {len(ds)} records have a blank turn or no user turn; "
                         "nothing is left to train on")
    return FileLoad(name, convs, skipped)


def load_conversations(files: list[Path], limit: int | None = None,
                       seed: int = 0) -> list[Conversation]:
    """All conversations of the files, in file order; with `limit`, a random subset of that size
    (drawn with `seed`, kept in file order). Skipped records are logged per file."""
    if not files:
        raise ValueError("files: no training data files given; pass one or more json/jsonl files")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of conversations, got {limit}")
    convs: list[Conversation] = []
    for path in files:
        loaded = load_file(Path(path))
        if loaded.skipped:
            log.warning("%s: skipped %d of %d records with a blank turn or no user turn", path,
                        loaded.skipped, loaded.skipped + len(loaded.conversations))
        log.info("%s: %d conversations (%s format)", path, len(loaded.conversations),
                 loaded.format)
        convs.extend(loaded.conversations)
    if limit is not None and limit < len(convs):
        keep = sorted(random.Random(seed).sample(range(len(convs)), limit))
        convs = [convs[i] for i in keep]
    return convs


def prompts_of(conv: Conversation) -> list[dict[str, str]]:
    """The messages up to and including the last user turn: what the target answers when it
    regenerates the data. Empty when there is no user turn (plain text)."""
    users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
    return [dict(m) for m in conv.messages[: users[-1] + 1]] if users else []


def has_answers(conv: Conversation) -> bool:
    """Whether the conversation has an assistant turn to train on."""
    return any(m["role"] == "assistant" for m in conv.messages)


# ---------------------------------------------------------------- tokenization

def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:
        raise ValueError(f"{where}: the tokenizer's chat template failed on "
                         f"{len(messages)} messages: {type(e).__name__}: {e}") from e


def _assistant_spans(conv: Conversation, tokenizer, text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant turn in `text` (the whole conversation
    rendered): the difference between rendering the messages before it with the generation
    prompt and rendering them with it, i.e. the content plus what the template closes it with."""
    where = f"{conv.source}: record {conv.index}"
    spans, cursor = [], 0
    for k, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        head = _render(tokenizer, conv.messages[:k], True, where)
        upto = _render(tokenizer, conv.messages[: k + 1], False, where)
        if not upto.startswith(head):
            raise ValueError(f"{where}: the chat template's generation prompt is not the start of "
                             f"the rendered assistant turn {k}; cannot locate its tokens")
        turn = upto[len(head):]
        if text.startswith(upto):
            start = len(head)
        else:  # the template renders past assistant turns differently (e.g. drops <think>)
            start = text.find(turn, cursor)
            if start < 0:
                turn = turn[max(turn.find(m["content"].strip()), 0):]
                start = text.find(turn, cursor)
            if start < 0:
                raise ValueError(f"{where}: assistant turn {k} as rendered alone is not found in "
                                 "the whole conversation rendered by the chat template")
        spans.append((start, start + len(turn)))
        cursor = start + len(turn)
    return spans


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


def _mask_spans(offsets: list[tuple[int, int]], ids: list[int], spans: list[tuple[int, int]],
                special: set[int]) -> list[bool]:
    """True on tokens overlapping a span, up to and including the span's first special token
    (the end of turn: what the template appends after it, like a newline, is not generated)."""
    mask = [False] * len(ids)
    t = 0
    for start, end in spans:
        while t < len(ids) and offsets[t][1] <= start and offsets[t][0] < start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = True
            t += 1
            if ids[t - 1] in special:
                break
    return mask


def shorten_turns(conv: Conversation, tokenizer, max_turn_tokens: int) -> Conversation:
    """The conversation with each user/system turn longer than ``max_turn_tokens`` tokens cut to
    its first and last ``max_turn_tokens // 2`` tokens, joined by ``"\n...\n"``.

    Long pasted prompts (ShareGPT: a tenth are over 500 tokens) would otherwise fill
    ``max_length`` and push the assistant's answer, the part a drafter learns from, out of the
    window. The target's features and labels are computed on the shortened text, so teacher and
    student still see the same conversation."""
    if conv.plain or max_turn_tokens < 2:
        return conv
    half = max_turn_tokens // 2
    out = []
    for m in conv.messages:
        if m["role"] != "assistant":
            ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"]
            if len(ids) > max_turn_tokens:
                text = (tokenizer.decode(ids[:half]) + "\n...\n" + tokenizer.decode(ids[-half:]))
                m = {**m, "content": text}
        out.append(m)
    return Conversation(out, conv.source, conv.index, conv.plain)


def tokenize(conv: Conversation, tokenizer, max_length: int) -> TokenizedExample:
    """Token ids of the conversation rendered by the tokenizer's chat template, and a loss mask
    True exactly on the assistant's tokens (content + end-of-turn token; not role headers, not
    the template's text after the end-of-turn token), truncated to `max_length`.

    Example (SmolLM2's ChatML template), mask shown under the tokens:
        <|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n  hello  <|im_end|>  \\n
              0       0  0     0      0      0        0     0      1         1       0
    Plain text: the whole text without a template, loss on every token."""
    if max_length < 1:
        raise ValueError(f"max_length must be a positive number of tokens, got {max_length}")
    if conv.plain:
        ids = tokenizer(conv.messages[0]["content"], add_special_tokens=False)["input_ids"]
        mask = [True] * len(ids)
    else:
        ids, mask = _tokenize_chat(conv, tokenizer)
    return TokenizedExample(torch.tensor(ids[:max_length], dtype=torch.int64),
                            torch.tensor(mask[:max_length], dtype=torch.bool))


def _tokenize_chat(conv: Conversation, tokenizer) -> tuple[list[int], list[bool]]:
    if not has_answers(conv):
        raise ValueError(f"{conv.source}: record {conv.index} has no assistant turn, so there is "
                         "nothing to train on; run `specdec train` with --regenerate to have the "
                         "target write the answers")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("tokenizer: a fast (Rust) tokenizer is needed for the loss mask, since "
                        "it maps tokens to characters; load it with AutoTokenizer(use_fast=True)")
    last = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    messages = conv.messages[: last + 1]  # later user turns carry no loss
    text = _render(tokenizer, messages, False, f"{conv.source}: record {conv.index}")
    spans = _assistant_spans(Conversation(messages, conv.source, conv.index), tokenizer, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return ids, _mask_spans(list(enc["offset_mapping"]), ids, spans, _special_ids(tokenizer))


def tokenize_all(convs: Iterable[Conversation], tokenizer, max_length: int,
                 max_turn_tokens: int | None = None):
    """A `datasets.Dataset` with columns input_ids (int64 lists) and loss_mask (bool lists);
    examples whose loss mask is empty after truncation are dropped, counted and logged.
    ``max_turn_tokens``: shorten long prompt turns first (`shorten_turns`)."""
    from datasets import Dataset, Features, Sequence, Value

    rows, dropped = [], 0
    for conv in convs:
        if max_turn_tokens is not None:
            conv = shorten_turns(conv, tokenizer, max_turn_tokens)
        ex = tokenize(conv, tokenizer, max_length)
        if not bool(ex.loss_mask.any()):
            dropped += 1
            continue
        rows.append({"input_ids": ex.input_ids.tolist(), "loss_mask": ex.loss_mask.tolist()})
    if dropped:
        log.warning("dropped %d of %d examples with no assistant token within max_length=%d",
                    dropped, dropped + len(rows), max_length)
    if not rows:
        raise ValueError(f"no example has an assistant token within max_length={max_length} "
                         f"({dropped} dropped); raise max_length or check the data")
    features = Features({"input_ids": Sequence(Value("int64")),
                         "loss_mask": Sequence(Value("bool"))})
    return Dataset.from_list(rows, features=features)
