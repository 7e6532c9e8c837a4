"""A plugin failing behind the server: the operator sees it in the log (the plugin's name and
the cause, not only an access line 500) and in /metrics (counted by plugin)."""

from __future__ import annotations

import logging

import httpx
import pytest
import serving_helpers
from serving_helpers import USER

from specdec.drafters.base import BaseDrafter
from specdec.hookspecs import hookimpl

chat_model_dir, make_server = serving_helpers.chat_model_dir, serving_helpers.make_server  # fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Raising(BaseDrafter):
    name = "raising"
    prefix_cache_safe = True

    def __init__(self, target, **kwargs):
        pass

    def propose(self, requests):
        raise RuntimeError("drafter exploded")


class RaisingPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"raising": Raising}


def test_a_plugin_failure_is_logged_with_its_name_and_counted(make_server, caplog):
    s = make_server(drafter="raising", plugins=(RaisingPlugin(),), controller="static",
                    controller_args={"budget": 2})
    with caplog.at_level(logging.ERROR, logger="specdec"):
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4})
    assert r.status_code == 500
    served = [rec.getMessage() for rec in caplog.records if rec.name == "specdec.serving"]
    assert any("'raising' (plugin 'RaisingPlugin')" in m and "drafter exploded" in m
               for m in served), served
    traced = [rec for rec in caplog.records if rec.exc_info and "RaisingPlugin" in rec.getMessage()]
    assert traced and traced[0].exc_info[0] is RuntimeError  # the plugin's own traceback
    text = httpx.get(s.url + "/metrics", timeout=10).text
    assert 'specdec_plugin_exceptions_total{plugin="RaisingPlugin"} 1.0' in text
