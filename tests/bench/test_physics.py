"""The machine's rates (specdec/bench/physics.py): measured with the engine's own kernels, each
probe bounded by time, the three cached per machine."""

from __future__ import annotations

import pytest

from specdec.bench import physics


def test_rates_are_measured_once_and_then_read_back(cache, monkeypatch):
    rates = physics.machine_rates()
    assert rates["bandwidth_gbs"] > 0 and rates["fp32_macs_per_s"] > 0
    from specdec import native

    if native.load() is not None:  # the q8 kernels' rate, not torch's int8 GEMM
        assert rates["int8_macs_per_s"] > 0 and rates["kernels"] != "torch"

    def again():
        raise AssertionError("measured again: the cache was not read")

    monkeypatch.setattr(physics, "bandwidth_gbs", again)
    assert physics.machine_rates() == rates
    with pytest.raises(AssertionError, match="measured again"):
        physics.machine_rates(use_cache=False)


def test_a_probe_stops_after_its_time(monkeypatch):
    """_best repeats a call until PROBE_SECONDS have passed (at least twice), whatever it costs."""
    calls = []
    monkeypatch.setattr(physics, "PROBE_SECONDS", 0.0)
    assert physics._best(lambda: calls.append(1)) >= 0 and len(calls) == 2
