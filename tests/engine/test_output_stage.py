"""StopChecker: a verification emits several tokens at once; they are appended one at a time and
cut at the first stop condition (EOS, stop ids, stop strings, max_tokens, max_model_len)."""

from __future__ import annotations

import pytest
from conftest import oracle_plugin

from specdec import LLM, SamplingParams
from specdec.engine.output_stage import StopChecker
from specdec.engine.sequence import Sequence

EOS = 90


class Letters:
    """Token i decodes to the letter chr(ord('a') + i % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def seq(**params) -> Sequence:
    return Sequence("r", [0, 1], SamplingParams(temperature=0, **params), None)


LETTERS = Letters()


def checker(max_model_len: int = 100, tokenizer=LETTERS) -> StopChecker:
    return StopChecker((EOS, 91), max_model_len, tokenizer)


def test_plain_emission_appends_everything():
    s = seq()
    assert checker().append_and_check(s, [5, 6, 7]) == 3
    assert s.output_token_ids == [5, 6, 7] and s.finish_reason is None


@pytest.mark.parametrize("eos", [EOS, 91])
def test_eos_inside_an_emission_stops_after_it(eos):
    s = seq()
    assert checker().append_and_check(s, [5, eos, 7, 8]) == 2
    assert s.output_token_ids == [5, eos] and s.finish_reason == "stop"


def test_ignore_eos_and_stop_token_ids():
    s = seq(ignore_eos=True, stop_token_ids=[7])
    assert checker().append_and_check(s, [EOS, 6, 7, 8]) == 3
    assert s.output_token_ids == [EOS, 6, 7] and s.finish_reason == "stop"


def test_stop_string_across_one_multi_token_emission():
    s = seq(stop=["cd"])
    assert checker().append_and_check(s, [1, 2, 3, 4]) == 3  # "b", "c", "d": stops at "d"
    assert s.output_token_ids == [1, 2, 3] and s.finish_reason == "stop"
    assert s.stop_text_len == 1  # the text "bcd" is cut before "cd"


def test_stop_string_across_two_emissions():
    s = seq(stop=["xcd", "de"])
    ck = checker()
    assert ck.append_and_check(s, [1, 2]) == 2 and s.finish_reason is None  # "bc"
    assert ck.append_and_check(s, [3, 4, 5]) == 2  # "bcde": "de" ends at the 2nd token
    assert s.finish_reason == "stop" and s.stop_text_len == 2


def test_max_tokens_cuts_inside_accepted_tokens():
    s = seq(max_tokens=5)
    ck = checker()
    assert ck.append_and_check(s, [5, 6, 7]) == 3
    assert ck.append_and_check(s, [8, 9, 10, 11]) == 2
    assert s.output_token_ids == [5, 6, 7, 8, 9] and s.finish_reason == "length"


def test_max_model_len_cuts_and_stop_wins_over_length_on_the_same_token():
    s = seq()
    assert checker(max_model_len=5).append_and_check(s, [5, 6, 7, 8]) == 3
    assert s.num_tokens == 5 and s.finish_reason == "length"
    s = seq(max_tokens=2)
    assert checker().append_and_check(s, [5, EOS, 6]) == 2 and s.finish_reason == "stop"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="need a tokenizer"):
        checker(tokenizer=None).append_and_check(seq(stop=["a"]), [1])


def test_engine_cuts_accepted_drafts_at_max_tokens_and_stop_ids(tiny_llama):
    """An oracle drafter gets its true tokens accepted several at a time; the output still ends
    exactly at max_tokens, or at the stop token inside an accepted run."""
    prompt = [5, 6, 7, 8, 5, 6]
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    truth = LLM(model=str(tiny_llama), dtype="float64").generate([prompt], long)[0].token_ids
    spec = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
               plugins=(oracle_plugin(prompt + truth, depth=4),), controller="static",
               controller_args={"budget": 5})
    for n in (7, 10, 13):
        out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True))[0]
        assert out.token_ids == truth[:n] and out.finish_reason == "length"
        assert sum(out.metrics.accepted_by_depth) > 0
    stop = truth[8]
    cut = truth[: truth.index(stop) + 1]
    out = spec.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                 stop_token_ids=[stop]))[0]
    assert out.token_ids == cut and out.finish_reason == "stop"


@pytest.mark.slow
def test_stream_deltas_never_resend_and_hold_back_a_possible_stop(smollm2_dir):
    """Streamed deltas add up to the final text, each only adds, and no delta carries text a
    stop string spanning tokens later cuts (held back by the longest stop's length - 1)."""
    from specdec import LLM, SamplingParams

    llm = LLM(model=str(smollm2_dir), max_model_len=256)
    chat = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    # the model answers "1. 1\n2. 2\n..."; the stop spans five tokens
    params = SamplingParams(temperature=0, max_tokens=80, stop=["\n7. 7", "never appears"])
    final = llm.generate(chat, params)[0]
    assert final.finish_reason == "stop" and final.text.endswith("6. 6"), final.text
    deltas = [d.text for d in llm.stream(chat, params)]
    assert "".join(deltas) == final.text
    assert all("\n7" not in "".join(deltas[:i]) for i in range(len(deltas) + 1))
