"""``specdec bench-serve --url`` against a running server, as a user points it (#52): every
failure keeps its status and the server's message, grouped in the report; a run where most
requests fail exits 1; ``http://HOST:PORT`` and the OpenAI client's ``.../v1`` both work; the
system is what the server's ``/v1/models`` says it runs (``unknown`` when it does not say)."""

from __future__ import annotations

import json
import time

import httpx
import serving_helpers

from specdec.bench.serve import UNKNOWN, api_base, grouped_errors, served_system
from specdec.cli import main

chat_model_dir, make_server = serving_helpers.chat_model_dir, serving_helpers.make_server

BENCH = ["bench-serve", "--num-prompts", "2", "--max-new-tokens", "4", "--request-rates", "inf"]


def test_without_the_key_every_failure_says_401_and_the_command_exits_1(make_server, capsys,
                                                                         tmp_path):
    s = make_server(keys=("k1",))
    out = tmp_path / "out.json"
    assert main([*BENCH, "--url", s.url, "--json", str(out)]) == 1
    printed = capsys.readouterr()
    report = json.loads(out.read_text())
    run = report["systems"][UNKNOWN]["inf"]
    assert run["failed"] == 2 and len(run["errors"]) == 1 and run["errors"][0]["count"] == 2
    reason = run["errors"][0]["error"]
    assert reason.startswith("401 Unauthorized: ") and len(reason) > len("401 Unauthorized: ")
    assert f"401 Unauthorized x2: {reason.split(': ', 1)[1]}" in printed.out
    assert "2 of 2 requests failed: 401 Unauthorized x2" in printed.err
    assert "401 Unauthorized" in report["config"]["system_from"]  # nor a system claimed


def test_both_url_forms_work_and_the_system_is_the_servers(make_server, capsys, tmp_path):
    s = make_server(keys=("k1",), drafter="ngram")
    for url in (s.url, s.url + "/", s.url + "/v1", s.url + "/v1/"):
        out = tmp_path / "out.json"
        assert main([*BENCH, "--url", url, "--api-key", "k1", "--json", str(out)]) == 0, url
        report = json.loads(out.read_text())
        assert list(report["systems"]) == ["ngram"], url
        run = report["systems"]["ngram"]["inf"]
        assert run["failed"] == 0 and run["errors"] == [] and run["output_tokens_per_s"] > 0
        assert report["config"]["model"] == "tiny"  # the id the server lists
    assert "ngram" in capsys.readouterr().out
    assert api_base("http://h:1/v1/") == api_base("http://h:1") == "http://h:1"


def test_models_say_what_the_server_runs_and_since_when(make_server):
    before = time.time()
    plain = make_server()
    models = httpx.get(plain.url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["speculation"] == {"drafter": None, "controller": "static",
                                        "verifier": "gumbel"}
    assert before - 5 <= models[0]["created"] <= time.time()
    assert served_system(plain.url + "/v1", None)[:2] == ("none", "tiny")


def test_a_server_that_does_not_say_what_it_runs_is_not_claimed(monkeypatch):
    def models(url, **kw):
        return httpx.Response(200, json={"object": "list", "data": [
            {"id": "m", "object": "model", "created": 1, "owned_by": "other"}]})

    monkeypatch.setattr(httpx, "get", models)
    system, model, why = served_system("http://elsewhere:8000/v1", None)
    assert (system, model) == (UNKNOWN, "m") and "does not say" in why


def test_grouped_errors_read_as_status_count_and_message():
    run = {"errors": [{"error": "401 Unauthorized: bad key", "count": 2},
                      {"error": "ReadTimeout", "count": 1}]}
    assert grouped_errors(run) == "401 Unauthorized x2: bad key; ReadTimeout x1"
