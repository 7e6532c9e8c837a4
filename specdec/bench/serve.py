"""``specdec bench-serve``: load on the OpenAI-compatible server through HTTP, as clients see it.

For each system (``--drafter``'s, plain decoding without one; or each ``--drafters`` entry,
``none`` being plain decoding) a server is started in this process (or ``--url`` names a
running one, as ``http://HOST:PORT`` or the OpenAI client's ``http://HOST:PORT/v1``; its system is
what its ``/v1/models`` says it runs, or ``unknown``), and for each request rate the dataset's prompts arrive as a Poisson process (or at
fixed intervals; ``inf``: all at once), at most ``--max-concurrency`` in flight, each a
streamed chat completion read by an async HTTP client. Per rate: TTFT (to the first content),
TPOT ((e2e - TTFT) / (tokens - 1)) and ITL (gaps between streamed chunks) P50/P90/P99, request
and token throughput, and goodput: the tokens/s of the requests that met ``--slo-ttft-ms`` and
``--slo-tpot-ms``. ``--compare-generate`` first times ``LLM.generate`` at batch 1 on the same
prompts: the server's overhead on TPOT. Every failed request keeps its reason (HTTP status and
the server's message, or the client's exception), grouped by reason in the report; the command
exits 1 when most requests of a run failed.

The clients run in this process beside the server (the engine steps in the main thread, uvicorn
and the clients' event loop in others, sharing the GIL with it): on a 2-core machine their cost
is part of what is measured, as it would be for a load generator on the serving host. Each run
(system and rate) sends its own ``cache_salt``, so it starts with a cold prefix cache instead of
finding the previous rate's prompts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from specdec.bench.compare import keyed_drafters, percentiles
from specdec.bench.data import load_questions

PLAIN = "none"
UNKNOWN = "unknown"  # a server at --url that does not say what it runs


def api_base(url: str) -> str:
    """The server's root from either form a user has: ``http://HOST:PORT`` (trailing slash or
    not) or the OpenAI client's base URL ``http://HOST:PORT/v1`` (docs/serving.md)."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


def http_error(status: int, body: bytes) -> str:
    """``"401 Unauthorized: <the server's message>"``: the status, its reason phrase and the
    OpenAI-shaped error's message (else the body's start)."""
    try:
        phrase = f" {HTTPStatus(status).phrase}"
    except ValueError:
        phrase = ""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):  # not an OpenAI-shaped error: show the body
        message = body[:200].decode("utf-8", "replace").strip() or "(empty body)"
    return f"{status}{phrase}: {message}"


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


async def _one(client, url: str, body: dict, headers: dict) -> Result:
    t0 = time.perf_counter()
    res, last = Result(False), None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return Result(False, error=http_error(r.status_code, await r.aread()))
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # an error after the stream began (e.g. the engine's)
                    return Result(False, error=f"error in the stream: "
                                               f"{chunk['error'].get('message', chunk['error'])}")
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
        res.ok, res.e2e = True, time.perf_counter() - t0
    except Exception as e:  # a failed request counts against goodput, and is reported
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return res


async def run_load(url: str, model: str, prompts: list[list[dict]], rate: float,
                   max_concurrency: int, max_tokens: int, poisson: bool, seed: int = 0,
                   api_key: str | None = None) -> tuple[list[Result], float]:
    """Every prompt once, arriving at ``rate`` requests/s; (results, wall seconds)."""
    import httpx

    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    salt = f"bench-serve-{time.time_ns()}"  # each run starts with a cold prefix cache

    async def limited(client, messages):
        async with sem:
            body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "cache_salt": salt,
                    "stream_options": {"include_usage": True}}  # the token count
            return await _one(client, api_base(url) + "/v1/chat/completions", body, headers)

    limits = httpx.Limits(max_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks, t0 = [], time.perf_counter()
        for messages in prompts:
            tasks.append(asyncio.create_task(limited(client, messages)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate) if poisson else 1 / rate)
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


def summarize(results: list[Result], seconds: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict:
    ok = [r for r in results if r.ok]

    def meets(r: Result) -> bool:
        return ((slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms))
                and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms))

    good = [r for r in ok if meets(r)]
    tokens = sum(r.tokens for r in ok)
    reasons = Counter(r.error or "failed (no reason)" for r in results if not r.ok)
    return {"requests": len(results), "failed": len(results) - len(ok),
            "errors": [{"error": e, "count": n} for e, n in reasons.most_common()],
            "seconds": seconds, "request_throughput": len(ok) / seconds,
            "output_tokens_per_s": tokens / seconds,
            "goodput_tokens_per_s": sum(r.tokens for r in good) / seconds,
            "slo_met": len(good) / len(results) if results else None,
            "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
            "itl_ms": percentiles([x for r in ok for x in r.itls])}


def _prompts(args) -> list[list[dict]]:
    questions = load_questions(Path(args.dataset), args.num_prompts)
    return [[{"role": "user", "content": q.turns[0]}] for q in questions]


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",")]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rates must be positive numbers or inf, got {text!r}")
    return rates


def _generate_tpot(llm, prompts, max_tokens: int) -> dict:
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tpots = [o.metrics.tpot for p in prompts for o in llm.generate([p], params)
             if o.metrics.tpot is not None]
    return percentiles(tpots)


def serve_systems(args) -> list[tuple[str, dict]]:
    """(system, drafter_args) per in-process server, in order: each ``--drafters`` entry
    (``none``: plain decoding) with ``--drafter-args`` keyed by name, as in bench sweeps; else
    the one system ``--drafter`` names (plain decoding without it)."""
    if not args.drafters:
        return [(args.drafter or PLAIN, args.drafter_args)]
    if args.drafter:
        raise ValueError("give --drafter or --drafters, not both")
    return keyed_drafters(args.drafters, args.drafter_args)


def served_system(url: str, api_key: str | None) -> tuple[str, str | None, str]:
    """(system, model id, how it was known) of the server at ``url``, from its ``/v1/models``:
    a specdec server says what it runs (``speculation.drafter``, None: plain decoding); any
    other answer leaves the system ``unknown`` rather than claiming one."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    where = api_base(url) + "/v1/models"
    try:
        r = httpx.get(where, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        return UNKNOWN, None, f"{where}: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return UNKNOWN, None, f"{where}: {http_error(r.status_code, r.content)}"
    try:
        models = r.json()["data"]
        model = models[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return UNKNOWN, None, f"{where}: no model listed"
    model_id = model.get("id") if len(models) == 1 else None
    speculation = model.get("speculation")
    if not isinstance(speculation, dict) or "drafter" not in speculation:
        return UNKNOWN, model_id, f"{where}: the server does not say what it runs"
    return speculation["drafter"] or PLAIN, model_id, where


def run_serve_bench(args, engine_kwargs: dict) -> dict:
    from specdec.engine.llm import LLM
    from specdec.serving.engine_loop import EngineLoop
    from specdec.serving.server import ServerThread, create_app

    prompts = _prompts(args)
    rates = _rates(args.request_rates)
    config = {"model": args.model, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "rates": rates, "arrival": args.arrival,
              "max_concurrency": args.max_concurrency, "slo_ttft_ms": args.slo_ttft_ms,
              "slo_tpot_ms": args.slo_tpot_ms, "url": args.url}
    if args.url:
        system, served_id, source = served_system(args.url, args.api_key)
        config.update(system_from=source, model=args.served_model_name or served_id or args.model)
        systems = [(system, {})]
    else:
        systems = serve_systems(args)
    report: dict = {"config": config, "systems": {}}
    for system, drafter_args in systems:
        runs, server, loop = {}, None, None
        url, model = args.url, args.served_model_name or config["model"]
        if url is None:
            kw = dict(engine_kwargs, drafter=None if system == PLAIN else system,
                      drafter_args=drafter_args)
            llm = LLM(max_num_seqs=max(32, args.max_concurrency), **kw)
            if args.compare_generate:
                runs["generate_tpot_ms"] = _generate_tpot(llm, prompts, args.max_new_tokens)
            loop = EngineLoop(llm.engine, max_queued=max(256, len(prompts)))
            server = ServerThread(create_app(loop, model))
            url = server.url
        load = functools.partial(_load_rates, url, model, prompts, rates, args, runs)
        if server is None:
            load()
        else:  # the engine steps in this thread, the one that built it (EngineLoop.run)
            clients = threading.Thread(target=_then(load, loop.shutdown), daemon=True)
            clients.start()
            loop.run()
            clients.join()
            server.stop()
            llm.close()  # its tier file, for the next system's engine
            gen = runs.get("generate_tpot_ms", {}).get("p50")
            first = runs[str(rates[0])]["tpot_ms"].get("p50")
            runs["server_tpot_overhead"] = first / gen - 1 if gen and first else None
        report["systems"][system] = runs
    if args.plot:
        plot_serve(report, args.plot)
    return report


def _load_rates(url: str, model: str, prompts, rates: list[float], args, runs: dict) -> None:
    """Every rate in turn against the server at ``url``; results into ``runs``."""
    for rate in rates:
        results, seconds = asyncio.run(run_load(
            url, model, prompts, rate, args.max_concurrency, args.max_new_tokens,
            args.arrival == "poisson", api_key=args.api_key))
        runs[str(rate)] = summarize(results, seconds, args.slo_ttft_ms, args.slo_tpot_ms)


def _then(first, second):
    def both() -> None:
        try:
            first()
        finally:
            second()
    return both


def plot_serve(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["config"]["rates"]
    xs = [r if math.isfinite(r) else 2 * max([x for x in rates if math.isfinite(x)] or [1])
          for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for system, runs in report["systems"].items():
        pts = [runs[str(r)] for r in rates]
        axes[0].plot(xs, [p["goodput_tokens_per_s"] for p in pts], marker="o", label=system)
        axes[1].plot(xs, [p["tpot_ms"].get("p50") for p in pts], marker="o", label=system)
        axes[2].plot(xs, [p["ttft_ms"].get("p50") for p in pts], marker="o", label=system)
    for ax, title in zip(axes, ("goodput (tok/s)", "TPOT P50 (ms)", "TTFT P50 (ms)")):
        ax.set_xlabel("request rate (req/s; rightmost: all at once)" if math.inf in rates
                      else "request rate (req/s)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def grouped_errors(run: dict) -> str:
    """A run's failures by reason: ``"401 Unauthorized x2: Missing or invalid API key"``."""
    groups = []
    for e in run["errors"]:
        head, sep, tail = e["error"].partition(":")
        groups.append(f"{head} x{e['count']}{sep}{tail}")
    return "; ".join(groups)


def mostly_failed(report: dict) -> list[str]:
    """One line per run (system and rate) where most requests failed: what makes the command
    exit 1 (figures of such a run describe the failures, not the server)."""
    return [f"system {system}, rate {rate}: {r['failed']} of {r['requests']} requests failed: "
            f"{grouped_errors(r)}"
            for system, runs in report["systems"].items() for rate in report["config"]["rates"]
            if (r := runs[str(rate)])["failed"] * 2 > r["requests"]]


def print_serve_report(report: dict) -> None:
    from specdec.bench.report import fmt

    print("specdec bench-serve")
    source = report["config"].get("system_from")
    for system, runs in report["systems"].items():
        over = runs.get("server_tpot_overhead")
        extra = f"  (server TPOT vs LLM.generate: {fmt(over, '+.1%')})" if over is not None \
            else ""
        print(f"  {system}{extra}" + (f"  (from {source})" if source else ""))
        for rate in report["config"]["rates"]:
            r = runs[str(rate)]
            print(f"    rate {rate:>5}: {fmt(r['output_tokens_per_s'], '.1f')} tok/s, goodput "
                  f"{fmt(r['goodput_tokens_per_s'], '.1f')}, TTFT P50 "
                  f"{fmt(r['ttft_ms'].get('p50'), '.0f')} ms, TPOT P50 "
                  f"{fmt(r['tpot_ms'].get('p50'), '.1f')} ms, ITL P99 "
                  f"{fmt(r['itl_ms'].get('p99'), '.1f')} ms, failed {r['failed']} of "
                  f"{r['requests']}")
            if r["failed"]:
                print(f"      failures: {grouped_errors(r)}")
