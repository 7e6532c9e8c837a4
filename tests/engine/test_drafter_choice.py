"""--drafter auto: measured here at first use, cached, logged; the CLI runs with the choice."""

from __future__ import annotations

import json
import logging

import cli_helpers
import pytest

from specdec.cli import main
from specdec.engine import drafter_choice
from specdec.engine.drafter_choice import TOLERANCE, choose_drafter

chat_model = cli_helpers.chat_model  # fixture


def test_measured_once_then_cached(chat_model, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # whatever other tests measured
    assert drafter_choice.candidates(chat_model) == ["ngram"]  # nothing shipped for it
    with caplog.at_level(logging.INFO, logger="specdec"):
        first = choose_drafter(chat_model, dtype="float32", max_tokens=8)
    rates = first.tokens_per_s
    assert set(rates) == {"plain", "ngram"} and all(r > 0 for r in rates.values())
    assert first.drafter == ("ngram" if rates["ngram"] >= TOLERANCE * rates["plain"] else None)
    assert not first.from_cache and "drafter auto:" in caplog.text and "measured in" in caplog.text
    files = list((drafter_choice.cache_dir() / "drafter_choice").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["tokens_per_s"] == rates

    def no_engines(*a, **k):
        raise AssertionError("a cached choice builds no engine")

    monkeypatch.setattr(drafter_choice, "_measure", no_engines)
    again = choose_drafter(chat_model, dtype="float32", max_tokens=8)
    assert again.from_cache and (again.drafter, again.tokens_per_s) == (first.drafter, rates)
    with pytest.raises(AssertionError, match="builds no engine"):  # other settings: measured
        choose_drafter(chat_model, dtype="float64", max_tokens=8)


def test_generate_auto_uses_the_choice(chat_model, monkeypatch, capsys):
    picked = []
    real = drafter_choice.choose_drafter

    def spy(model, **kw):
        choice = real(model, max_tokens=4, **kw)
        picked.append(choice.drafter)
        return choice

    monkeypatch.setattr(drafter_choice, "choose_drafter", spy)
    assert main(["generate", "hi", "--model", chat_model, "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert len(picked) == 1 and (("tau" in err) == (picked[0] is not None))
    assert "drafter auto: " in err and "tok/s" in err
