"""Failures, what a stage returns of its plugin calls: requests to fail (the first message for a
request stands) and reports (warned when found)."""

from __future__ import annotations

import pytest

from specdec import SamplingParams
from specdec.engine.sequence import Sequence
from specdec.engine.step import Failures


def test_failures_gather_requests_once_and_reports_in_order():
    a, b = (Sequence(rid, [1], SamplingParams(temperature=0), None) for rid in "ab")
    first = Failures()
    first.fail(a, "first")
    with pytest.warns(RuntimeWarning, match="no request"):
        first.report("no request")
    second = Failures()
    second.fail(a, "second")
    second.fail(b, "b")
    second.reports.append("later")
    assert first.add(second) is first
    assert first.requests == {a: "first", b: "b"} and first.reports == ["no request", "later"]
    assert a in first and Sequence("c", [1], SamplingParams(), None) not in first
