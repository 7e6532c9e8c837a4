"""Shared by the CLI and bench tests: a tiny random Llama with a small word-level tokenizer and
a chat template (the `tiny_llama` fixture has no tokenizer), an MT-Bench-style dataset, and a
"repeat" drafter registered as a built-in for one test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_tiny_model

from specdec import builtins
from specdec.drafters.base import BaseDrafter
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

WORDS = ("write a short poem about the sea and the sky explain how python lists work "
         "give three tips for sleep better solve two plus two now code function sum").split()


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


MT_BENCH = [
    {"question_id": 1, "category": "writing", "turns": ["write a short poem about the sea",
                                                         "now explain the poem"]},
    {"question_id": 2, "category": "writing", "turns": ["write a poem about the sky",
                                                         "give three tips"]},
    {"question_id": 3, "category": "coding", "turns": ["explain how python lists work",
                                                        "code function sum"]},
    {"question_id": 4, "category": "coding", "turns": ["code function sum of two lists",
                                                        "solve two plus two"]},
]


def make_tokenizer_model(folder: Path) -> Path:
    """A tiny random Llama whose vocab is a word-level tokenizer with a chat template (seed 1:
    its greedy answers to the test prompts are non-empty and repeat themselves)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    make_tiny_model(folder, seed=1, vocab_size=len(vocab), eos_token_id=2, bos_token_id=1)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return str(make_tokenizer_model(tmp_path_factory.mktemp("chat_model")))


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    return str(path)


class RepeatDrafter(BaseDrafter):
    """Proposes the last token repeated: accepted often on a tiny random model."""

    name = "repeat"

    def __init__(self, target, **kwargs) -> None:
        pass

    def propose(self, requests):
        return [DraftTree.chain([r.token_ids[-1]] * r.budget.depth_limit) for r in requests]


@pytest.fixture
def repeat_drafter(monkeypatch):
    @hookimpl
    def specdec_drafters():
        return {"repeat": RepeatDrafter}

    monkeypatch.setattr(builtins, "specdec_drafters", specdec_drafters)
