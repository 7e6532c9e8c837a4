"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own (no global
state): finished requests are counted by the engine thread (``finished``), the rest is read
from the engine loop at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.serving.engine_loop import EngineLoop, StreamEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (no global state); finished
    requests are counted by the engine thread (``finished``), gauges read at scrape time."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.registry = r = CollectorRegistry()
        self.running = Gauge("specdec_requests_running", "requests in the engine's batch",
                             registry=r)
        self.waiting = Gauge("specdec_requests_waiting",
                             "sequences waiting beyond the batch's free seats", registry=r)
        self.step_failures = Counter("specdec_step_failures",
                                     "engine steps that raised (each ended the requests it ran)",
                                     registry=r)
        self.plugin_exceptions = Counter(
            "specdec_plugin_exceptions", "exceptions raised by plugins (drafters, controllers, "
            "step observers), whatever came of them (a failed request, or a retry that saved the "
            "step)", ["plugin"], registry=r)
        self.kv_usage = Gauge("specdec_kv_cache_usage", "share of the target's KV pages in use",
                              registry=r)
        self.prefix_hit = Gauge("specdec_prefix_cache_hit_rate",
                                "share of admitted tokens served from the prefix cache",
                                registry=r)
        self.draft_share = Gauge("specdec_draft_time_share",
                                 "share of step time spent scheduling and drafting", registry=r)
        self.tau = Gauge("specdec_tokens_per_target_forward",
                         "tokens emitted per target forward of finished requests (tau)",
                         registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "TTFT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "TPOT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "gaps between emissions",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("specdec_requests_finished", "finished requests by reason",
                                ["finish_reason"], registry=r)
        self.tokens = Counter("specdec_generation_tokens", "tokens generated", registry=r)
        self.drafted = Counter("specdec_draft_tokens", "draft tokens verified", registry=r)
        self.accepted = Counter("specdec_accepted_tokens_by_depth",
                                "draft tokens accepted, by tree depth", ["depth"], registry=r)
        self.controller = Gauge("specdec_controller_figure",
                                "the draft controller's latest decision figures (list figures: "
                                "their mean)", ["figure"], registry=r)
        self._generated = self._forwards = self._failures = 0
        self._plugin_exceptions: dict[str, int] = {}  # engine.faults.counts at the last scrape

    def finished(self, event: StreamEvent) -> None:
        m = event.metrics
        self.requests.labels(event.finish_reason or "unknown").inc()
        if m is None:
            return
        for value, hist in ((m.ttft, self.ttft), (m.tpot, self.tpot)):
            if value is not None:
                hist.observe(value)
        for gap in m.itls:
            self.itl.observe(gap)
        self.tokens.inc(m.num_output_tokens)
        self._generated += m.num_output_tokens
        self.drafted.inc(m.draft_tokens_proposed)
        for depth, n in enumerate(m.accepted_by_depth, 1):
            self.accepted.labels(str(depth)).inc(n)
        self._forwards += m.num_target_forwards

    def render(self) -> bytes:
        engine = self.loop.engine
        self.running.set(self.loop.num_running)
        self.waiting.set(self.loop.num_waiting)
        failures = self.loop.step_failures
        self.step_failures.inc(failures - self._failures)
        self._failures = failures
        for plugin, n in dict(engine.faults.counts).items():
            self.plugin_exceptions.labels(plugin).inc(n - self._plugin_exceptions.get(plugin, 0))
            self._plugin_exceptions[plugin] = n
        kv = engine.kv
        self.kv_usage.set(1 - kv.num_free_pages / kv.num_pages)
        rate = engine.totals.prefix_hit_rate["tokens"]
        self.prefix_hit.set(rate or 0.0)
        t = engine.totals
        self.draft_share.set(t.draft_seconds / t.step_seconds if t.step_seconds else 0.0)
        self.tau.set(self._generated / self._forwards if self._forwards else 0.0)
        stats = self.loop.last_stats
        for name, value in ((stats.controller or {}) if stats is not None else {}).items():
            if isinstance(value, list) and value and all(isinstance(v, (int, float))
                                                         for v in value):
                name, value = f"{name}_mean", sum(value) / len(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.controller.labels(name).set(value)
        return generate_latest(self.registry)
