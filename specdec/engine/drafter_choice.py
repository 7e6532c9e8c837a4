"""``--drafter auto``: the drafter measured fastest for this model on this machine.

At first use for a model, machine (CPU, torch, threads), engine settings and set of shipped
drafters, a short calibration run times plain decoding and each candidate — ``ngram`` and every
drafter shipped for the model, each under the goodput controller — on built-in prompts
(explaining, listing, code, rewriting a given text), greedy, the systems interleaved prompt by
prompt after a warm-up. The fastest candidate wins — under goodput a drafter drafts only where
its measured acceptance pays, so it costs little where it does not — unless it is slower than
plain decoding by more than ``TOLERANCE`` (then ``None``: plain decoding). The choice and its figures are logged and cached as JSON under
``$SPECDEC_CACHE/drafter_choice`` (atomically), beside the kernel tables and step costs.

    choice = choose_drafter("smollm2-135m-instruct", dtype="auto", device="cpu")
    choice.drafter        # "ngram", "eagle3", ... or None
    choice.tokens_per_s   # {"plain": 55.1, "ngram": 60.3, ...}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.models.aliases import cache_dir
from specdec.models.linear import cache_key

logger = logging.getLogger("specdec")

TOLERANCE = 0.95  # the fastest drafter is chosen unless below 0.95x plain decoding
MAX_TOKENS = 48
PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "List the first ten prime numbers, one per line, each with a short remark.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence three times, each time more formally: the meeting got moved to "
    "Friday because the room was double booked.",
)
# engine settings the choice depends on (besides the model, the machine and the drafters)
SETTINGS = ("dtype", "device", "weights", "activations", "draft_weights", "linear_kernels",
            "attention_backend", "cuda_graphs", "verifier")


@dataclass(frozen=True)
class Choice:
    drafter: str | None  # None: plain decoding
    tokens_per_s: dict[str, float]  # "plain" and every candidate
    machine: str
    seconds: float  # the calibration's duration (when it ran)
    from_cache: bool = False


def candidates(model_path: str) -> list[str]:
    """ngram, then every drafter kind shipped for the model (specdec.drafters.catalog)."""
    from specdec.drafters.catalog import SHIPPED, shipped_folder

    return ["ngram", *(kind for kind in SHIPPED if shipped_folder(kind, model_path))]


def choose_drafter(model: str, use_cache: bool = True, max_tokens: int = MAX_TOKENS,
                   **engine_args) -> Choice:
    """The fastest drafter for ``model`` with ``engine_args`` (LLM's keyword arguments, e.g.
    dtype, device, weights) here: from the cache, else measured now (see module docstring)."""
    from specdec.models.loader import resolve_model_path

    folder = str(resolve_model_path(model))
    names = candidates(folder)
    machine = cache_key(torch.float32, torch.get_num_threads())
    path = _cache_path(folder, names, machine, engine_args)
    if use_cache and path.is_file():
        with open(path) as f:
            choice = Choice(**{**json.load(f), "from_cache": True})
        logger.info(describe(choice))
        return choice
    choice = _measure(folder, names, machine, max_tokens, engine_args)
    logger.info("%s on %s", describe(choice), machine)
    _write(path, choice)
    return choice


def _measure(folder: str, names: list[str], machine: str, max_tokens: int,
             engine_args: dict) -> Choice:
    from specdec import LLM, SamplingParams

    start = time.perf_counter()
    systems = {"plain": LLM(model=folder, **engine_args)}
    for name in names:
        systems[name] = LLM(model=folder, drafter=name, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chat = getattr(systems["plain"].tokenizer, "chat_template", None) is not None
    prompts = [[{"role": "user", "content": p}] if chat else p for p in PROMPTS]
    for llm in systems.values():  # warm-up: first-call costs, the controller's first steps
        llm.generate(prompts[:1], params)
    tokens = dict.fromkeys(systems, 0)
    seconds = dict.fromkeys(systems, 0.0)
    for prompt in prompts:
        for name, llm in systems.items():
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(out.token_ids)
    rates = {n: tokens[n] / seconds[n] for n in systems}
    best = max(names, key=rates.__getitem__)
    drafter = best if rates[best] >= TOLERANCE * rates["plain"] else None
    return Choice(drafter, {n: round(r, 2) for n, r in rates.items()}, machine,
                  round(time.perf_counter() - start, 1))


def describe(choice: Choice) -> str:
    """One line for the user: the choice and the figures it was made from."""
    how = "cached" if choice.from_cache else f"measured in {choice.seconds:.0f} s"
    return f"drafter auto: {choice.drafter or 'none'} ({how}: {_figures(choice)})"


def _figures(choice: Choice) -> str:
    plain = choice.tokens_per_s["plain"]
    return ", ".join(f"{n} {r:.1f} tok/s ({r / plain:.2f}x)"
                     for n, r in choice.tokens_per_s.items())


def _cache_path(folder: str, names: list[str], machine: str, engine_args: dict) -> Path:
    from specdec.drafters.catalog import SHIPPED, shipped_folder

    stamps = []
    for kind in SHIPPED:  # a drafter retrained (or a model converted again) is measured again
        shipped = shipped_folder(kind, folder)
        if shipped is not None:
            stamps.append(f"{kind}:{(shipped / 'config.json').stat().st_mtime_ns}")
    model = Path(folder) / "config.json"
    settings = {k: engine_args.get(k) for k in SETTINGS}
    key = json.dumps([str(Path(folder).resolve()), model.stat().st_mtime_ns if model.exists()
                      else 0, names, stamps, machine, settings, TOLERANCE, MAX_TOKENS, PROMPTS],
                     sort_keys=True, default=str)
    return cache_dir() / "drafter_choice" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _write(path: Path, choice: Choice) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = {k: v for k, v in asdict(choice).items() if k != "from_cache"}
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measured again next time
        logger.info("drafter auto: choice not cached in %s (%s)", path.parent, e)
        tmp.unlink(missing_ok=True)
