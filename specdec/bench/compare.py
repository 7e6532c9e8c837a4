"""`specdec bench`: the engine against a baseline on the same prompts and weights, side by side.

Method (see DESIGN.md, performance method): every system runs in this one process on the same
token ids with the same weights; the systems are interleaved batch by batch (baseline, then the
plain engine if measured, then the engine, on the same prompts) after `--warmup` untimed prompts,
and the whole pass is repeated `--repeats` times, each pass (and the warm-up) under its own cache
salt (`pass_salt`: a later pass never drafts or reads pages from an earlier one's). Throughputs and speedups are medians over
repeats (a speedup is the median of the per-repeat ratios). Decoding is greedy everywhere.

Systems:
    engine    specdec LLM with the given drafter/controller, `--batch-size` prompts per generate
    plain     a second specdec LLM without drafter (shares nothing with `engine`); measured when
              `--baseline plain`, and also with `--drafter` and `--baseline hf|hf-pld`, so that
              `speedup_vs_plain` separates speculation from the rest of the engine
    hf        transformers `generate(do_sample=False)` at batch 1 (always batch 1: with
              `--batch-size` > 1 the tokens/s ratio compares throughputs, not latencies)
    hf-pld    the same with `prompt_lookup_num_tokens=10` (HF prompt lookup decoding)
    llama.cpp llama-cpp-python on the same GGUF file, greedy, batch 1 (specdec.bench.llamacpp);
              llama.cpp-pld with its prompt-lookup decoding

tokens/s of a system = its generated tokens / the wall time of its generate calls.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specdec import native
from specdec.bench.budget import snapshot, step_budget
from specdec.bench.data import Item, first_turn_items, load_questions, next_turn_items
from specdec.bench.llamacpp import LLAMA_CPP_BASELINES, LlamaCppSystem, gguf_path
from specdec.bench.timing import Out, one_by_one
from specdec.engine.llm import LLM
from specdec.models.decoder.config import resolve_dtype
from specdec.models.loader import resolve_model_path
from specdec.sampling_params import SamplingParams

HF_BASELINES = ("hf", "hf-pld")
BASELINES = (*HF_BASELINES, *LLAMA_CPP_BASELINES, "plain", "none")
FAMILIES = (HF_BASELINES, LLAMA_CPP_BASELINES)  # an extra baseline is compared with its own kind
PLD_NUM_TOKENS = 10
SPECULATION = ("drafter", "drafter_args", "controller", "controller_args")  # engine options


def pass_salt(repeat: int | None, batch_size: int | None = None) -> str:
    """The cache salt of a bench pass (``repeat``, at ``batch_size``; None: the warm-up). A pass never profits from
    what a system kept of an earlier pass over the same prompts (prefix-cache pages, a suffix
    drafter's history of responses: it would draft every answer it had seen, 3 x plain on a
    second pass); what earlier prompts of the same pass leave serves later ones, as in
    serving."""
    if repeat is None:
        return "bench-warmup"
    return f"bench-pass-{repeat}" + ("" if batch_size is None else f"-batch-{batch_size}")


class EngineSystem:
    def __init__(self, llm: LLM, max_new_tokens: int) -> None:
        self.llm = llm
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)

    def run(self, prompts: list[list[int]], salt: str | None = None
            ) -> tuple[float, list[Out], list[float]]:
        """(wall seconds, outputs, seconds attributed to each prompt by its share of e2e), the
        requests under cache salt ``salt`` (``pass_salt``)."""
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, replace(self.params, cache_salt=salt))
        seconds = time.perf_counter() - t0
        bad = [o for o in outs if o.finish_reason == "error"]
        if bad:
            raise RuntimeError(f"engine request failed: {bad[0].error}")
        e2e = [o.metrics.e2e or 0.0 for o in outs]
        total = sum(e2e) or 1.0
        return seconds, [Out(o.token_ids, o.metrics) for o in outs], [seconds * e / total for e in e2e]


class HFSystem:
    """transformers generate on the engine's weights folder, one prompt at a time."""

    def __init__(self, folder: Path, dtype, device: str, max_new_tokens: int,
                 eos_ids: tuple[int, ...], pld: bool) -> None:
        from transformers import AutoModelForCausalLM

        from specdec.models.loader import hf_weights_kwargs

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype),
                                                          **hf_weights_kwargs(folder))
        self.model.to(device).eval()
        self.device = device
        # the engine's stop set (config.json's eos), not generation_config.json's, so that both
        # systems stop on exactly the same tokens
        self.config = copy.deepcopy(self.model.generation_config)
        self.config.update(do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=list(eos_ids) or None,
                           pad_token_id=eos_ids[0] if eos_ids else 0)
        if pld:
            self.config.prompt_lookup_num_tokens = PLD_NUM_TOKENS

    def _one(self, ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            y = self.model.generate(x, attention_mask=torch.ones_like(x),
                                    generation_config=self.config)
        return y[0, len(ids):].tolist()

    def run(self, prompts: list[list[int]], salt: str | None = None
            ) -> tuple[float, list[Out], list[float]]:
        return one_by_one(self._one, prompts)  # keeps nothing across calls: salt unused


@dataclass
class Tally:
    """One system's timed results, per repeat."""

    repeats: int
    seconds: list[float] = field(init=False)
    tokens: list[int] = field(init=False)
    by_cat: list[dict] = field(init=False)  # category -> [seconds, tokens]
    outputs: list[dict] = field(init=False)  # item key -> Out
    categories: dict = field(default_factory=dict)  # item key -> category

    def __post_init__(self) -> None:
        self.seconds, self.tokens = [0.0] * self.repeats, [0] * self.repeats
        self.by_cat = [defaultdict(lambda: [0.0, 0]) for _ in range(self.repeats)]
        self.outputs = [{} for _ in range(self.repeats)]

    def add(self, r: int, items: list[Item], seconds: float, outs: list[Out], secs) -> None:
        self.seconds[r] += seconds
        for item, out, s in zip(items, outs, secs):
            self.tokens[r] += len(out.token_ids)
            cat = self.by_cat[r][item.category]
            cat[0] += s
            cat[1] += len(out.token_ids)
            self.outputs[r][item.key] = out
            self.categories[item.key] = item.category

    def tps(self) -> list[float]:
        return [t / s if s > 0 else 0.0 for t, s in zip(self.tokens, self.seconds)]

    def cat_tps(self, cat: str) -> list[float]:
        return [c[cat][1] / c[cat][0] if c[cat][0] > 0 else 0.0 for c in self.by_cat]


def plain_options(engine_kwargs: dict) -> dict:
    """A bench's plain reference engine: the CLI's engine options without speculation."""
    return {k: v for k, v in engine_kwargs.items() if k not in SPECULATION}


def system_options(engine_kwargs: dict, index: int) -> dict:
    """The options of a bench's engine system ``index`` (0, 1, ...: the systems of one run are
    alive side by side, and a tier file is locked by the one engine that opened it): a disk tier
    of ``--kv-tier-path FILE`` in FILE for the first, FILE.1, FILE.2, ... for the others."""
    path = engine_kwargs.get("kv_tier_path")
    return engine_kwargs if path is None or not index else dict(
        engine_kwargs, kv_tier_path=f"{path}.{index}")


def keyed_drafters(spec: str, drafter_args: dict) -> list[tuple[str, dict]]:
    """``--drafters a,b`` with ``--drafter-args`` keyed by drafter name (``{"eagle3": {...}}``):
    (name, its drafter_args) per entry, in order."""
    names = [n.strip() for n in spec.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(f"--drafters: distinct names like eagle3,ngram, got {spec!r}")
    unknown = set(drafter_args) - set(names)
    if unknown:
        raise ValueError(f"--drafter-args with --drafters is keyed by drafter name; "
                         f"{sorted(unknown)} is not among {names}")
    return [(n, drafter_args.get(n, {})) for n in names]


def make_systems(args, engine_kwargs: dict) -> dict:
    """{"baseline"?, "plain"?, "engine"}: in the order they run on each batch; the engines made
    with ``engine_kwargs`` (the CLI's, ``specdec.cli.common.engine_kwargs``)."""
    common = dict(engine_kwargs, max_num_seqs=max(32, args.batch_size))
    engine = LLM(**system_options(common, 0))
    systems: dict = {}
    if args.baseline not in ("plain", "none"):
        systems["baseline"] = _baseline(args.baseline, args, engine)
    extra = getattr(args, "extra_baseline", None)
    if extra is not None:
        _check_extra(args)
        systems["extra"] = _baseline(extra, args, engine)
    if _needs_plain(args):
        plain = LLM(**system_options(plain_options(common), 1))
        systems["plain"] = EngineSystem(plain, args.max_new_tokens)
    systems["engine"] = EngineSystem(engine, args.max_new_tokens)
    return systems


def _needs_plain(args) -> bool:
    return args.baseline == "plain" or bool(args.drafter and args.baseline != "none")


def _baseline(name: str, args, engine: LLM | None, eos=None, dtype=None):
    """The HF or llama.cpp system ``name`` names, on the engine's model and stop set (the
    engine's, or ``eos`` and ``dtype`` read from it earlier)."""
    folder = resolve_model_path(args.model)
    if engine is not None:
        eos, dtype = engine.engine.parts.model_config.eos_token_ids, engine.engine.parts.dtype
    if name in LLAMA_CPP_BASELINES:
        return LlamaCppSystem(gguf_path(args.model, folder), args.max_new_tokens, eos,
                              pld=name == "llama.cpp-pld")
    return HFSystem(folder, dtype, args.device, args.max_new_tokens, eos,
                    pld=name == "hf-pld")


def _check_extra(args) -> None:
    extra = getattr(args, "extra_baseline", None)
    if extra is not None:
        family = next((f for f in FAMILIES if extra in f), ())
        if args.baseline not in family:
            raise ValueError(f"--extra-baseline {extra} needs --baseline {' or '.join(family)} "
                             "(its reference)")


def _batches(items: list[Item], size: int) -> list[list[Item]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _warmup(systems: dict, items: list[Item], args) -> None:
    if args.warmup <= 0:
        return
    picked = [items[i % len(items)] for i in range(args.warmup)]
    for system in systems.values():
        for batch in _batches(picked, args.batch_size):
            system.run([it.prompt_ids for it in batch], pass_salt(None))


def _run_phase(systems: dict, tallies: dict, items: list[Item], args, bar) -> None:
    for r in range(args.repeats):
        for batch in _batches(items, args.batch_size):
            prompts = [it.prompt_ids for it in batch]
            for name, system in systems.items():
                tallies[name].add(r, batch, *system.run(prompts, pass_salt(r)))
            bar.update(len(batch))


def run_bench(args, engine_kwargs: dict) -> dict:
    """Run the benchmark described by parsed CLI args on engines made with ``engine_kwargs``;
    return the report (see `build_report`)."""
    questions = load_questions(Path(args.dataset), args.num_prompts)  # fail before loading
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:
        return run_bench_one_at_a_time(args, engine_kwargs, questions)
    systems = make_systems(args, engine_kwargs)
    tok = systems["engine"].llm.tokenizer
    items = first_turn_items(questions, tok)
    num_turns = max(len(q.turns) for q in questions) if args.multi_turn else 1
    total = args.repeats * sum(1 for q in questions for _ in q.turns[:num_turns])
    _warmup(systems, items, args)
    start = _totals(systems["engine"])  # draft share over the timed runs only
    engines = {name: s.llm.engine for name, s in systems.items() if isinstance(s, EngineSystem)}
    budgets = snapshot(engines)
    tallies = {name: Tally(args.repeats) for name in systems}
    with tqdm(total=total, desc="bench", unit="prompt", file=sys.stderr) as bar:
        for turn in range(num_turns):
            if turn:
                answers = {k: tok.decode(o.token_ids, skip_special_tokens=True)
                           for k, o in tallies["engine"].outputs[0].items()}
                items = next_turn_items(questions, tok, answers, turn)
            _run_phase(systems, tallies, items, args, bar)
    draft = _share(start, _totals(systems["engine"]))
    report = build_report(args, tallies, questions, draft)
    report["runtime"] = runtime_info(systems["engine"].llm.engine)
    report["numbers"] = compared_numbers(report["runtime"], args.baseline)
    report["step_budget"] = step_budget(engines, budgets)
    # warm-up and repeats run the same prompts: with the cache on, timed runs reuse their
    # prompts' full pages (the hit rate says how much)
    report["prefix_cache"] = systems["engine"].llm.engine.totals.prefix_summary()
    report["tensor_parallel"] = tensor_parallel_summary(report)
    return report


def run_bench_one_at_a_time(args, engine_kwargs: dict, questions) -> dict:
    """The bench at tensor_parallel_size > 1: a process holds one TP group (torch.distributed's
    default group), so two TP engines cannot live side by side. Each system runs alone: the
    engine (built, warmed up, every timed pass, its step budget and runtime read, closed),
    then the plain reference at the same N and reduction, then an HF / llama.cpp baseline.
    The same prompts, passes and cache salts as the interleaved bench; a later turn's prompts
    are the engine's answers, as there. Systems are not interleaved batch by batch: drift of
    the machine between them is not averaged out (``tensor_parallel.systems_run`` says so)."""
    common = dict(engine_kwargs, max_num_seqs=max(32, args.batch_size))
    _check_extra(args)
    num_turns = max(len(q.turns) for q in questions) if args.multi_turn else 1
    total = args.repeats * sum(1 for q in questions for _ in q.turns[:num_turns])
    tallies: dict = {}
    budget: dict = {}
    turn_items: list = []  # the engine's prompts of each turn, for the others

    def timed(name: str, system, bar) -> None:
        tally = tallies[name] = Tally(args.repeats)
        for turn in range(num_turns):
            if turn == len(turn_items):  # the engine, in its run: its answers so far
                answers = {k: tok.decode(o.token_ids, skip_special_tokens=True)
                           for k, o in tallies["engine"].outputs[0].items()}
                turn_items.append(next_turn_items(questions, tok, answers, turn))
            _run_phase({name: system}, {name: tally}, turn_items[turn], args, bar)

    with tqdm(total=total * (1 + _needs_plain(args)), desc="bench", unit="prompt",
              file=sys.stderr) as bar:
        llm = LLM(**common)
        try:
            tok = llm.tokenizer
            turn_items.append(first_turn_items(questions, tok))
            eos, dtype = llm.engine.parts.model_config.eos_token_ids, llm.engine.parts.dtype
            engine = EngineSystem(llm, args.max_new_tokens)
            _warmup({"engine": engine}, turn_items[0], args)
            start, before = _totals(engine), snapshot({"engine": llm.engine})
            timed("engine", engine, bar)
            draft = _share(start, _totals(engine))
            runtime = runtime_info(llm.engine)
            budget = step_budget({"engine": llm.engine}, before)
            prefix = llm.engine.totals.prefix_summary()
        finally:
            llm.close()
        if _needs_plain(args):
            with LLM(**plain_options(common)) as plain_llm:
                plain = EngineSystem(plain_llm, args.max_new_tokens)
                _warmup({"plain": plain}, turn_items[0], args)
                before = snapshot({"plain": plain_llm.engine})
                timed("plain", plain, bar)
                budget["systems"].update(step_budget({"plain": plain_llm.engine},
                                                     before)["systems"])
        for name, which in (("baseline", args.baseline),
                            ("extra", getattr(args, "extra_baseline", None))):
            if which is None or which in ("plain", "none"):
                continue
            system = _baseline(which, args, None, eos, dtype)
            _warmup({name: system}, turn_items[0], args)
            timed(name, system, bar)
    report = build_report(args, tallies, questions, draft)
    report["runtime"] = runtime
    report["numbers"] = compared_numbers(runtime, args.baseline)
    report["step_budget"] = budget
    report["prefix_cache"] = prefix
    report["tensor_parallel"] = tensor_parallel_summary(report)
    report["tensor_parallel"]["systems_run"] = "one after the other (one TP group a process)"
    return report


def tensor_parallel_summary(report: dict) -> dict | None:
    """Tensor parallelism in a bench report (None at N = 1): the size and the reductions'
    mode, each engine system's collectives per step on rank 0 (from the step budget), and,
    where plain decoding ran beside speculation at the same N and mode, the mismatch against
    it: exact mode promises none; the library mode's ring may part a verified row from the
    row decoded alone at N >= 3 (docs/distributed.md)."""
    runtime = report["runtime"].get("tensor_parallel")
    if runtime is None:
        return None
    systems = report["step_budget"]["systems"]
    out = {**runtime, "per_step": {name: s.get("tensor_parallel")
                                   for name, s in systems.items()}}
    mismatch = report.get("mismatch_vs_plain")
    if mismatch is not None:
        out["mismatch_vs_plain"] = mismatch
        out["note"] = (
            "speculative tokens compared with plain decoding's at the same N and reduction: "
            + ("exact reduction, none may differ" if runtime["reduce"] == "exact" else
               "library all-reduce: a row's bits may change with the step's rows at N >= 3, "
               "so speculation may part from plain decoding at near-ties (the mismatch rate)"))
    return out


def runtime_info(engine) -> dict:
    """What ran: dtype, device, attention backend, CUDA graphs, the matmul kernels chosen on
    this machine (and the q8 kernels' instruction set), the weights (native GGUF blocks or
    dequantized), the draft weights and the bytes of them one forward streams, the KV split."""
    kernels = engine.parts.kernels.describe()
    q8_isa = native.load().q8_isa if engine.parts.activations == "q8" else None
    return {"dtype": str(engine.parts.dtype), "device": str(engine.parts.device), "weights": engine.parts.weights,
            "activations": engine.parts.activations, "q8_isa": q8_isa,
            "draft_weights": engine.parts.draft_weights,
            "weight_bytes_per_token": engine.parts.weight_bytes_per_forward,
            "attention_backend": engine.parts.runner.backend.name,
            "cuda_graphs": engine.parts.runner.graphs is not None,
            "linear_kernels": {k: kernels[k] for k in ("key", "choices", "from_cache")},
            "kv_cache": engine.parts.kv_split.describe(),
            "prefix_caching": engine.config.enable_prefix_caching,
            "tensor_parallel": (None if engine.parts.tp is None else
                                {"size": engine.parts.tp.size,
                                 "reduce": engine.parts.tp.reduce_mode,
                                 "threads_per_rank": torch.get_num_threads()})}


def compared_numbers(runtime: dict, baseline: str) -> dict:
    """What the match rates against ``baseline`` compare: {"engine", "baseline": the numbers
    each computes, "same": whether greedy tokens must match (an exactness check), "note": why
    not, and what to compare instead}. HF transformers computes in the engine's dtype with
    float activations: the engine's numbers wherever it computes in float too (its native
    blocks and dequantized weights are bitwise the float model's). q8 activations round each
    row to int8 as llama.cpp does, so greedy text parts from the float model's at the first
    near-tie; llama.cpp's own kernels are never bitwise the engine's."""
    dtype = runtime["dtype"].removeprefix("torch.")
    engine = f"specdec: {runtime['weights']} weights, {runtime['activations']} activations, {dtype}"
    if baseline in HF_BASELINES:
        other = f"HF transformers: {dtype}, float activations"
        same = runtime["activations"] == "float" and runtime["weights"] in ("native",
                                                                            "dequantized")
    elif baseline in LLAMA_CPP_BASELINES:
        other, same = "llama.cpp: its own kernels (q8 activations over quantized blocks)", False
    else:  # plain (the same engine without a drafter) or none
        return {"engine": engine, "baseline": engine if baseline == "plain" else None,
                "same": baseline == "plain", "note": None}
    note = None if same else (
        f"not an exactness check: the engine computes with {runtime['activations']} "
        f"activations, {baseline} with {'float' if baseline in HF_BASELINES else 'its own'} "
        "numbers, so greedy outputs part at near-ties by design; exactness is the match with "
        "plain decoding (same numbers)" + (
            "; --activations float compares with HF token for token"
            if baseline in HF_BASELINES and runtime["activations"] == "q8" else ""))
    return {"engine": engine, "baseline": other, "same": same, "note": note}


def _totals(system: EngineSystem) -> tuple[float, float]:
    t = system.llm.engine.totals
    return t.draft_seconds, t.step_seconds


def _share(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    step = after[1] - before[1]
    return (after[0] - before[0]) / step if step > 0 else None


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    """{p50, p90, p99} of values times scale (seconds -> ms); None entries without values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values, dtype=np.float64) * scale, [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def match_rates(a: dict, b: dict) -> tuple[float, float]:
    """(fraction of keys whose token ids are equal, mean matching-prefix fraction)."""
    exact, prefix = [], []
    for key, out in a.items():
        x, y = out.token_ids, b[key].token_ids
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        exact.append(x == y)
        prefix.append(n / max(len(x), len(y)) if (x or y) else 1.0)
    return float(np.mean(exact)), float(np.mean(prefix))


def mismatch(a: dict, b: dict) -> dict:
    """How far outputs ``a`` part from ``b`` (keyed alike): "requests": the fraction of requests
    whose tokens differ; "tokens": the fraction of ``a``'s tokens from each request's first
    difference on (greedy text after a difference is another continuation: every later token
    counts as differing), 0.0 when every request is the same."""
    differ, tokens, after = 0, 0, 0
    for key, out in a.items():
        x, y = out.token_ids, b[key].token_ids
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        differ += x != y
        tokens += len(x)
        after += len(x) - n if x != y else 0
    return {"requests": differ / len(a) if a else 0.0,
            "tokens": after / tokens if tokens else 0.0}


def _median_ratio(a: list[float], b: list[float]) -> float | None:
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(ratios) if ratios else None


def _system_summary(t: Tally, name: str) -> dict:
    tps = t.tps()
    return {"name": name, "tokens_per_s": statistics.median(tps), "tokens_per_s_repeats": tps,
            "seconds": statistics.median(t.seconds), "new_tokens": t.tokens[0]}


def speculation_summary(outs: list[Out]) -> dict:
    metrics = [o.metrics for o in outs]
    taus = [m.tau for m in metrics if m.tau is not None]
    forwards = sum(m.num_target_forwards for m in metrics)
    depth = max((len(m.accepted_by_depth) for m in metrics), default=0)
    by_depth = [sum(m.accepted_by_depth[d] for m in metrics if d < len(m.accepted_by_depth))
                for d in range(depth)]
    proposed = sum(m.draft_tokens_proposed for m in metrics)
    return {
        "tau": float(np.mean(taus)) if taus else None,
        "acceptance_by_depth": [a / forwards for a in by_depth] if forwards else [],
        "acceptance_rate": sum(by_depth) / proposed if proposed else None,
        "draft_tokens_proposed": proposed,
    }


def _per_category(tallies: dict, ref: str | None) -> dict:
    eng = tallies["engine"]
    out = {}
    for cat in sorted({c for r in eng.by_cat for c in r}):
        outs = [o for k, o in eng.outputs[0].items() if eng.categories[k] == cat]
        row = {"engine_tokens_per_s": statistics.median(eng.cat_tps(cat)),
               "baseline_tokens_per_s": None, "speedup": None,
               "tau": speculation_summary(outs)["tau"], "num_requests": len(outs)}
        if ref is not None:
            base = tallies[ref].cat_tps(cat)
            row["baseline_tokens_per_s"] = statistics.median(base)
            row["speedup"] = _median_ratio(eng.cat_tps(cat), base)
        out[cat] = row
    return out


def build_report(args, tallies: dict, questions, draft_share: float | None) -> dict:
    eng = tallies["engine"]
    ref = "baseline" if "baseline" in tallies else ("plain" if "plain" in tallies else None)
    outs0 = list(eng.outputs[0].values())
    all_metrics = [o.metrics for r in eng.outputs for o in r.values()]
    report = {
        "num_prompts": len(questions), "num_requests": len(outs0),
        "total_new_tokens": eng.tokens[0],
        "engine": _system_summary(eng, "speculative" if args.drafter else "plain"),
        "baseline": _system_summary(tallies[ref], args.baseline) if ref else None,
        "plain": _system_summary(tallies["plain"], "plain") if "plain" in tallies else None,
        "ttft_ms": percentiles([m.ttft for m in all_metrics if m.ttft is not None]),
        "tpot_ms": percentiles([m.tpot for m in all_metrics if m.tpot is not None]),
        "itl_ms": percentiles([x for m in all_metrics for x in m.itls]),
        "per_category": _per_category(tallies, ref),
        **speculation_summary(outs0),
        "draft_ms_share": draft_share if args.drafter else None,
    }
    report.update(_comparisons(tallies, ref))
    report["extra_baseline"] = _extra(tallies, args) if "extra" in tallies else None
    report["config"] = run_config(args)
    return report


def _comparisons(tallies: dict, ref: str | None) -> dict:
    eng = tallies["engine"]
    out = {"speedup_vs_baseline": None, "speedup_vs_plain": None,
           "greedy_match_rate": None, "token_match_rate": None}
    if ref is not None:
        out["speedup_vs_baseline"] = _median_ratio(eng.tps(), tallies[ref].tps())
        out["greedy_match_rate"], out["token_match_rate"] = match_rates(
            eng.outputs[0], tallies[ref].outputs[0])
    if "plain" in tallies:
        out["speedup_vs_plain"] = _median_ratio(eng.tps(), tallies["plain"].tps())
        rates = match_rates(eng.outputs[0], tallies["plain"].outputs[0])
        out["greedy_match_rate_vs_plain"], out["token_match_rate_vs_plain"] = rates
        out["mismatch_vs_plain"] = mismatch(eng.outputs[0], tallies["plain"].outputs[0])
    return out


def _extra(tallies: dict, args) -> dict:
    """The second baseline, as a ratio to the first (e.g. hf-pld vs hf, llama.cpp-pld vs
    llama.cpp) in the same run; its greedy match rate is against the first's output."""
    summary = _system_summary(tallies["extra"], args.extra_baseline)
    summary["speedup_vs_baseline"] = _median_ratio(tallies["extra"].tps(),
                                                   tallies["baseline"].tps())
    summary["engine_speedup_vs_it"] = _median_ratio(tallies["engine"].tps(),
                                                    tallies["extra"].tps())
    summary["greedy_match_rate"] = match_rates(tallies["extra"].outputs[0],
                                               tallies["baseline"].outputs[0])[0]
    return summary


def run_config(args) -> dict:
    import transformers

    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(model_folder=str(resolve_model_path(args.model)),
                  torch_version=torch.__version__, transformers_version=transformers.__version__,
                  num_threads=torch.get_num_threads(), python=sys.version.split()[0])
    if str(args.device).startswith("cuda") and torch.cuda.is_available():
        config["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
    return config
