"""--drafter auto: a prior per model and class of machine, no measuring up front; a calibration
when asked, cached and preferred afterwards; the CLI runs with the choice."""

from __future__ import annotations

import json
import logging

import cli_helpers
import pytest

from specdec.cli import main
from specdec.engine import drafter_choice
from specdec.engine.drafter_choice import TOLERANCE, choose_drafter

chat_model = cli_helpers.chat_model  # fixture


def _no_engines(*a, **k):
    raise AssertionError("built an engine to choose")


def test_the_prior_builds_no_engine(chat_model, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(drafter_choice, "_measure", _no_engines)
    with caplog.at_level(logging.INFO, logger="specdec"):
        choice = choose_drafter(chat_model, dtype="float32")
    assert (choice.drafter, choice.source, choice.tokens_per_s) == ("ngram", "prior", {})
    assert "drafter auto: ngram (the prior for this model" in caplog.text
    klass = drafter_choice.cpu_class()
    monkeypatch.setitem(drafter_choice.PRIOR, (None, klass), None)  # a class whose prior is none
    assert choose_drafter(chat_model, dtype="float32").drafter is None
    assert drafter_choice.cpu_class("cuda:0") == "cuda"


def test_calibrated_once_then_preferred_to_the_prior(chat_model, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # whatever other tests measured
    assert drafter_choice.candidates(chat_model) == ["ngram"]  # nothing shipped for it
    with caplog.at_level(logging.INFO, logger="specdec"):
        first = choose_drafter(chat_model, dtype="float32", max_tokens=8, calibrate=True)
    rates = first.tokens_per_s
    assert set(rates) == {"plain", "ngram"} and all(r > 0 for r in rates.values())
    assert first.drafter == ("ngram" if rates["ngram"] >= TOLERANCE * rates["plain"] else None)
    assert first.source == "measured" and "measured in" in caplog.text
    files = list((drafter_choice.cache_dir() / "drafter_choice").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["tokens_per_s"] == rates

    monkeypatch.setattr(drafter_choice, "_measure", _no_engines)
    again = choose_drafter(chat_model, dtype="float32", max_tokens=8)
    assert again.source == "cached" and (again.drafter, again.tokens_per_s) == (first.drafter,
                                                                                 rates)
    other = choose_drafter(chat_model, dtype="float64", max_tokens=8)  # other settings
    assert other.source == "prior"
    with pytest.raises(AssertionError, match="built an engine"):  # asked: measured again
        choose_drafter(chat_model, dtype="float32", max_tokens=8, calibrate=True)


def test_generate_auto_uses_the_choice(chat_model, monkeypatch, capsys):
    picked = []
    real = drafter_choice.choose_drafter

    def spy(model, **kw):
        choice = real(model, max_tokens=4, **kw)
        picked.append((choice.drafter, kw["calibrate"]))
        return choice

    monkeypatch.setattr(drafter_choice, "choose_drafter", spy)
    assert main(["generate", "hi", "--model", chat_model, "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert picked == [("ngram", False)] and "tau" in err and "drafter auto: ngram" in err
    assert main(["generate", "hi", "--model", chat_model, "--max-tokens", "4",
                 "--calibrate"]) == 0
    assert picked[-1][1] is True and "measured in" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", chat_model, "--drafter", "ngram",
                 "--calibrate"]) == 2
    assert "--calibrate: only with --drafter auto" in capsys.readouterr().err
