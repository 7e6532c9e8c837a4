"""``--drafter auto``: the drafter to decode with, chosen without a minute of measuring first.

The choice is made from what was measured before (a prior shipped per model and CPU class) or,
where this machine was calibrated for the model and settings, from that measurement:

- **prior** (``PRIOR``): for SmolLM2-135M-Instruct, ``ngram`` on every CPU class: measured
  fastest, or within a percent or two of the fastest, on an AVX2-only EPYC (1.02 x plain in
  float, 1.07 x in q8), a Sapphire Rapids (1.01 / 1.04 x) and an AVX-512 EPYC (docs/drafters.md,
  docs/benchmarks.md); the learned drafters came out 0.89-1.03 x there, each start loading
  them costs seconds, and ngram under the goodput controller drafts only where its measured
  acceptance pays (its step costs and acceptance are learned online during the run), so a
  prompt it does not suit costs ~1 %. Any other model: ``ngram`` too (nothing is shipped for
  it). On CUDA no drafter has been measured with a real model yet: ``ngram``.
- **calibration** (``calibrate=True``, ``specdec generate --calibrate``): a short run (about
  35 s on 2 cores) times plain decoding and each candidate — ``ngram`` and every drafter
  shipped for the model, each under the goodput controller — on built-in prompts (explaining,
  listing, code, rewriting a given text), greedy, interleaved prompt by prompt after a
  warm-up, without the second KV tier (each engine closed after). The fastest wins, plain
  decoding included (``pick``: then ``None``; plain also wins a tie): what is cached is what
  was measured fastest, as the line that reports it says.
  The figures are logged and cached as JSON under ``$SPECDEC_CACHE/drafter_choice``
  (atomically); later ``auto`` choices for the same model, machine and settings (every engine
  option that can change what was measured: ``NOT_KEYED`` names the others) read them instead
  of the prior.

    choice = choose_drafter("smollm2-135m-instruct", dtype="auto", device="cpu")
    choice.drafter        # "ngram", "eagle3", ... or None
    choice.source         # "prior", "measured" or "cached"
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from specdec.config import EngineConfig
from specdec.models.aliases import cache_dir
from specdec.models.matmul.linear import cache_key

logger = logging.getLogger("specdec")

RULE = "the fastest, plain included"  # how the measured figures choose (see pick); keyed
MAX_TOKENS = 48
PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "List the first ten prime numbers, one per line, each with a short remark.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence three times, each time more formally: the meeting got moved to "
    "Friday because the room was double booked.",
)
# A cached choice is keyed by the model, the machine (CPU, torch version, threads), the drafters
# and every EngineConfig field, anything that can change a step's cost or the drafts' acceptance
# (dtype, quantize, weights, activations, kernels, prefix caching, page size, batch limits,
# verifier, controller, ...): a field added later is keyed unless NOT_KEYED names it, with why it
# cannot change what the calibration measures.
SECOND_TIER = ("kv_tier_path", "kv_tier_bytes", "kv_host_tier_bytes")
NOT_KEYED = {
    "model": "keyed by its resolved folder and config.json's mtime",
    "drafter": "what is chosen (each candidate is measured)",
    "seed": "seeds only unseeded sampled requests; the calibration is greedy",
    **dict.fromkeys(SECOND_TIER, "the calibration runs without a second tier (see _measure)"),
}


# (model alias, CPU class) -> drafter; a missing entry falls back to (None, CPU class), then
# "ngram". CPU classes: the compiled kernels' widest q8 instruction set ("amx", "avx512-vnni",
# "avx-vnni", "avx2"), "cpu" without them, "cuda".
PRIOR = {
    ("smollm2-135m-instruct", "amx"): "ngram",
    ("smollm2-135m-instruct", "avx512-vnni"): "ngram",
    ("smollm2-135m-instruct", "avx2"): "ngram",
}


@dataclass(frozen=True)
class Choice:
    drafter: str | None  # None: plain decoding
    tokens_per_s: dict[str, float]  # "plain" and every candidate (empty for the prior)
    machine: str
    seconds: float  # the calibration's duration (when it ran)
    from_cache: bool = False
    source: str = "measured"  # "prior" | "measured" | "cached"


def candidates(model_path: str) -> list[str]:
    """ngram, then every drafter kind shipped for the model (specdec.drafters.catalog)."""
    from specdec.drafters.catalog import SHIPPED, shipped_folder

    return ["ngram", *(kind for kind in SHIPPED if shipped_folder(kind, model_path))]


def choose_drafter(model: str, use_cache: bool = True, max_tokens: int = MAX_TOKENS,
                   calibrate: bool = False, **engine_args) -> Choice:
    """The drafter for ``model`` with ``engine_args`` (LLM's keyword arguments, e.g. dtype,
    device, weights) here: this machine's calibration when one is cached, a new one when
    ``calibrate``, else the prior (see the module docstring)."""
    from specdec.models.loader import resolve_model_path

    folder = str(resolve_model_path(model))
    names = candidates(folder)
    machine = cache_key(torch.float32, torch.get_num_threads())
    path = _cache_path(folder, names, machine, engine_args)
    if use_cache and path.is_file() and not calibrate:
        with open(path) as f:
            choice = Choice(**{**json.load(f), "from_cache": True, "source": "cached"})
        logger.info(describe(choice))
        return choice
    if not calibrate:
        return prior_choice(model, folder, machine, engine_args.get("device", "cpu"))
    choice = _measure(folder, names, machine, max_tokens, engine_args)
    logger.info("%s on %s", describe(choice), machine)
    _write(path, choice)
    return choice


def cpu_class(device: str = "cpu") -> str:
    """The class of machine the prior is keyed by (see PRIOR)."""
    if str(device).startswith("cuda"):
        return "cuda"
    from specdec import native

    kernels = native.load()
    return kernels.q8_isa if kernels is not None else "cpu"


def prior_choice(model: str, folder: str, machine: str, device: str = "cpu") -> Choice:
    """The shipped prior for ``model`` (an alias, or the folder it resolved to) on this class
    of machine; nothing is measured."""
    alias = Path(folder).name if Path(folder).resolve().parent == (
        cache_dir() / "models").resolve() else str(model)
    klass = cpu_class(device)
    drafter = PRIOR.get((alias, klass), PRIOR.get((None, klass), "ngram"))
    choice = Choice(drafter, {}, machine, 0.0, source="prior")
    logger.info(describe(choice, klass))
    return choice


def _measure(folder: str, names: list[str], machine: str, max_tokens: int,
             engine_args: dict) -> Choice:
    from specdec import LLM

    # without the second tier: the engines run side by side (interleaved prompt by prompt, so
    # that a change in the machine's load falls on every candidate alike), and a disk tier's
    # file is locked by the one engine that opens it; nor should the calibration's prompts
    # evict the user's pages from the tier, or each engine hold its own host tier. A tier only
    # moves evicted prefix pages, a cost that does not depend on the drafter.
    engine_args = {k: v for k, v in engine_args.items() if k not in SECOND_TIER}
    start = time.perf_counter()
    systems = {}
    try:  # every engine closed, also when one fails to build or to run
        systems["plain"] = LLM(model=folder, **engine_args)
        for name in names:
            systems[name] = LLM(model=folder, drafter=name, **engine_args)
        rates = _rates(systems, max_tokens)
    finally:
        for llm in systems.values():
            llm.close()
    figures = {n: round(r, 2) for n, r in rates.items()}  # chosen from what is cached, shown
    return Choice(pick(figures), figures, machine, round(time.perf_counter() - start, 1))


def pick(rates: dict[str, float]) -> str | None:
    """The fastest of ``rates`` (tokens/s by name, "plain" among them); None when it is plain
    decoding, which also wins a tie: a drafter is taken only when it measured faster.

    >>> pick({"plain": 100.0, "ngram": 101.0, "mtp": 99.0})
    'ngram'
    >>> pick({"plain": 100.0, "mtp": 99.0}) is None
    True
    """
    best = max(rates, key=lambda name: (rates[name], name == "plain"))
    return None if best == "plain" else best


def _rates(systems: dict, max_tokens: int) -> dict[str, float]:
    """Tokens per second of each engine over PROMPTS, after a warm-up."""
    from specdec import SamplingParams

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
    return {n: tokens[n] / seconds[n] for n in systems}


def describe(choice: Choice, klass: str | None = None) -> str:
    """One line for the user: the choice and the figures it was made from."""
    if choice.source == "prior":
        return (f"drafter auto: {choice.drafter or 'none'} (the prior for this model on "
                f"{klass + ' machines' if klass else 'this class of machine'}; --calibrate "
                f"measures the candidates here)")
    how = "cached" if choice.from_cache else f"measured in {choice.seconds:.0f} s"
    return (f"drafter auto: {choice.drafter or 'none'} ({RULE}; {how}: "
            f"{_figures(choice)})")


def _figures(choice: Choice) -> str:
    plain = choice.tokens_per_s["plain"]
    return ", ".join(f"{n} {r:.2f} tok/s ({r / plain:.3f}x)"
                     for n, r in choice.tokens_per_s.items())


def _cache_path(folder: str, names: list[str], machine: str, engine_args: dict) -> Path:
    from specdec.drafters.catalog import SHIPPED, shipped_folder

    stamps = []
    for kind in SHIPPED:  # a drafter retrained (or a model converted again) is measured again
        shipped = shipped_folder(kind, folder)
        if shipped is not None:
            stamps.append(f"{kind}:{(shipped / 'config.json').stat().st_mtime_ns}")
    model = Path(folder) / "config.json"
    # defaults filled in, values checked (LLM's own keyword, plugins, is not an option)
    config = EngineConfig(model=folder, **{k: v for k, v in engine_args.items()
                                           if k != "plugins"})
    settings = {f.name: getattr(config, f.name) for f in fields(EngineConfig)
                if f.name not in NOT_KEYED}
    settings["dtype"] = config.torch_dtype  # "auto" is the dtype it stands for here
    key = json.dumps([str(Path(folder).resolve()), model.stat().st_mtime_ns if model.exists()
                      else 0, names, stamps, machine, settings, RULE, MAX_TOKENS, PROMPTS],
                     sort_keys=True, default=str)
    return cache_dir() / "drafter_choice" / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _write(path: Path, choice: Choice) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = {k: v for k, v in asdict(choice).items() if k not in ("from_cache", "source")}
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: measured again next time
        logger.info("drafter auto: choice not cached in %s (%s)", path.parent, e)
        tmp.unlink(missing_ok=True)
