"""A schema fuzz of the server from its own /openapi.json (schemathesis): requests that follow
the schema and requests that break it, a deterministic seed and a few dozen of each per route,
against a tiny random model. Nothing a client sends may give a 500."""

from __future__ import annotations

import pytest
import serving_helpers
from hypothesis import HealthCheck, given, settings

from specdec.serving.limits import ServerLimits

schemathesis = pytest.importorskip("schemathesis")
chat_model_dir = serving_helpers.chat_model_dir  # a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fuzzed(chat_model_dir):
    # short answers and few prompts a request: the fuzz is about input, not generation
    s = serving_helpers.serve(chat_model_dir, keys=("fuzz-key",),
                              limits=ServerLimits(max_tokens=4, max_prompts=4))
    yield s
    s.server.stop()
    s.loop.shutdown()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_from_the_schema_gives_a_500(fuzzed, mode):
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json",
                                           headers=fuzzed.headers())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    failures, statuses = [], []
    for op in operations:
        if mode == "negative" and op.method != "post":
            continue  # a GET without parameters has no wrong form
        strategy = op.as_strategy(generation_mode=GenerationMode(mode))

        @settings(max_examples=30 if op.method == "post" else 3, derandomize=True,
                  deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case):
            r = case.call(base_url=fuzzed.url, headers=fuzzed.headers(), timeout=60)
            statuses.append(r.status_code)
            if r.status_code >= 500:
                failures.append((case.method, case.path, case.body, r.status_code,
                                 r.text[:300]))

        check()
    assert not failures, failures[:3]
    assert len(statuses) >= 40 and (mode == "negative" or 200 in statuses), statuses
    assert fuzzed.pages_back(10)
