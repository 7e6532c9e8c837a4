"""Structured output's grammar along a draft tree: masks after each node's path equal a fresh
matcher's after consuming that path; pruning keeps exactly the allowed paths; the matcher is
never fed a forbidden token; malformed specs are errors naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from logits_helpers import byte_model_fixture
from transformers import AutoTokenizer

from specdec.logits.grammar import GrammarCompiler
from specdec.sampling_params import StructuredOutputs

byte_model = byte_model_fixture()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(byte_model):
    tok = AutoTokenizer.from_pretrained(byte_model)
    return GrammarCompiler(tok, len(tok), (tok.eos_token_id,)), tok


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_masks_along_a_tree_are_a_fresh_matchers_after_each_path(compiler):
    comp, tok = compiler
    g = comp.compile(StructuredOutputs(json=SCHEMA))
    good = _ids(tok, '{"name":"Bo')  # llguidance's compact JSON
    g.commit(good[:2])
    rest = good[2:]
    # a chain of the true continuation, a forbidden sibling at its root, a forbidden child
    bad = _ids(tok, "x")[0]
    tokens = [*rest, bad, bad]
    parents = [-1, *range(len(rest) - 1), -1, 0]
    kept = g.prune(tokens, parents, sequential=False)
    assert kept == list(range(len(rest)))
    for n in range(len(rest) + 1):
        path = tuple(rest[:n])
        fresh = comp.compile(StructuredOutputs(json=SCHEMA))
        fresh.commit(good[:2] + list(path))
        assert torch.equal(g.allowed(path), fresh.allowed(())), n
    # sampled drafts: a forbidden node drops its later siblings
    assert g.prune([bad, rest[0]], [-1, -1], sequential=True) == []
    assert g.prune([bad, rest[0]], [-1, -1], sequential=False) == [1]


def test_until_complete_cuts_at_the_token_that_completes_the_grammar(compiler):
    comp, tok = compiler
    g = comp.compile(StructuredOutputs(choice=["yes", "no"]))
    yes = _ids(tok, "yes")
    eos = tok.eos_token_id
    assert g.until_complete(yes + [eos]) == len(yes)
    assert not g.stopped  # nothing consumed
    g.commit(yes)
    assert g.stopped
    g2 = comp.compile(StructuredOutputs(regex=r"[0-9]+"))
    digits = _ids(tok, "0123")
    assert g2.until_complete(digits) == len(digits)  # more digits may follow: not complete
    assert g2.until_complete(digits + [eos]) == len(digits) + 1  # EOS completes it


def test_json_object_and_whitespace(compiler):
    comp, tok = compiler
    g = comp.compile(StructuredOutputs(json_object=True))
    assert g.allowed(())[_ids(tok, "{")[0]] and not g.allowed(())[_ids(tok, "[")[0]]
    space = _ids(tok, " ")[0]
    for flexible in (False, True):
        g = comp.compile(StructuredOutputs(json_object=True, whitespace_flexible=flexible))
        g.commit(_ids(tok, "{"))
        assert bool(g.allowed(())[space]) == flexible
    g = comp.compile(StructuredOutputs(json=json.dumps(SCHEMA)))  # JSON text is a schema too
    assert g.allowed(()).nonzero().flatten().tolist() == [_ids(tok, '{"')[0]]


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputs(regex="a(b"), "regex"),
    (StructuredOutputs(grammar="start: missing_rule"), "grammar"),
    (StructuredOutputs(json="{not json"), "json"),
    (StructuredOutputs(json={"type": "no-such-type"}), "json"),
])
def test_malformed_specs_name_the_field(compiler, spec, field):
    comp, _ = compiler
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        comp.compile(spec)


def test_structured_outputs_takes_exactly_one_kind():
    for bad in ({}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": [""]},
                {"regex": ""}, {"json": 3}, {"json_object": "yes"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputs(**bad)


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        GrammarCompiler(None, 10, (2,)).compile(StructuredOutputs(regex="a"))
