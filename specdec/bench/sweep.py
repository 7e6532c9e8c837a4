"""`specdec bench --batch-sizes ... --controllers ...`: several systems over several batch sizes in
one run, on the same prompts, interleaved batch by batch (DESIGN.md's performance method).

Systems: the plain engine (always: the reference at every batch size), one speculative engine
per ``--controllers`` entry (``name[:budget]``) and drafter (``--drafter``, or each of
``--drafters a,b``: systems are then named ``drafter/controller``), and with
``--baseline hf|hf-pld`` HF ``generate`` at batch 1 (HF runs one prompt at a time). Each batch
size runs every prompt through every system; ``--repeats`` passes, medians reported, each pass
(and the warm-up) under its own cache salt (``compare.pass_salt``).

One ``runs`` entry per (system, batch size): tokens/s, speedups vs plain (same batch size) and
vs HF (its batch-1 tokens/s), tau, acceptance by depth, TTFT / TPOT / ITL P50/P90/P99, goodput
under ``--slo-tpot-ms`` (tokens/s of the requests whose TPOT met it), and for a controller that
keeps ``decision`` figures, their averages (depths chosen, predicted vs measured step time).
``--plot FILE.png``: throughput vs batch size, acceptance by depth, TPOT percentiles.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from specdec.bench.compare import (
    EngineSystem,
    HFSystem,
    Tally,
    keyed_drafters,
    pass_salt,
    percentiles,
    plain_options,
    run_config,
    runtime_info,
    speculation_summary,
    system_options,
)
from specdec.bench.data import first_turn_items, load_questions
from specdec.engine.llm import LLM
from specdec.hookspecs import hookimpl
from specdec.models.loader import resolve_model_path


def parse_controllers(spec: str) -> list[tuple[str, int | None]]:
    """``"static:0,static:4,goodput"`` -> [("static", 0), ("static", 4), ("goodput", None)]."""
    out = []
    for part in spec.split(","):
        name, _, budget = part.strip().partition(":")
        if not name:
            raise ValueError(f"--controllers: empty entry in {spec!r}; use name[:budget],...")
        if budget and not budget.isdigit():
            raise ValueError(f"--controllers: budget of {part!r} must be an int >= 0")
        out.append((name, int(budget) if budget else None))
    if len(set(out)) != len(out):
        raise ValueError(f"--controllers: {spec!r} names a system twice")
    return out


def parse_batch_sizes(spec: str) -> list[int]:
    try:
        sizes = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes: expected ints like 1,2,4,8, got {spec!r}") from None
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"--batch-sizes: distinct ints >= 1, got {spec!r}")
    return sorted(sizes)


class StepRecorder:
    """A plugin that keeps the controller figures of every step of one engine."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    @hookimpl
    def specdec_step_end(self, stats) -> None:
        if stats.controller:
            self.steps.append({**stats.controller, "step_seconds": stats.step_seconds})

    def summary(self) -> dict | None:
        if not self.steps:
            return None
        depths = [d for s in self.steps for d in s.get("depths", [])]
        pred = [(s["predicted_step_seconds"], s["step_seconds"]) for s in self.steps
                if s.get("predicted_step_seconds")]
        out = {"steps": len(self.steps),
               "mean_depth": statistics.mean(depths) if depths else None,
               "zero_budget_share": (sum(1 for d in depths if d == 0) / len(depths)
                                     if depths else None)}
        if pred:
            out["mean_predicted_step_ms"] = 1e3 * statistics.mean(p for p, _ in pred)
            out["mean_measured_step_ms"] = 1e3 * statistics.mean(m for _, m in pred)
        kept = [s for s in self.steps if "proposed_nodes" in s]
        if kept:
            out["kept_node_share"] = (sum(s["kept_nodes"] for s in kept)
                                      / max(1, sum(s["proposed_nodes"] for s in kept)))
        last = self.steps[-1]
        if "acceptance_by_depth" in last:
            out["estimated_acceptance_by_depth"] = last["acceptance_by_depth"]
        return out


@dataclass
class SweepSystem:
    name: str
    runner: object  # EngineSystem or HFSystem
    recorder: StepRecorder | None = None
    batch_sizes: list[int] = field(default_factory=list)


def make_sweep_systems(args, batch_sizes: list[int], engine_kwargs: dict) -> list[SweepSystem]:
    """The plain engine, then one per drafter and controller, made with ``engine_kwargs`` (the
    CLI's), each with its own tier file (``compare.system_options``); HF at batch 1."""
    common = dict(engine_kwargs, max_num_seqs=max(32, max(batch_sizes)))
    controllers = parse_controllers(args.controllers) if args.controllers else [
        (args.controller, None)]
    drafters = _drafters(args)
    plain = LLM(**system_options(plain_options(common), 0))
    systems = [SweepSystem("plain", EngineSystem(plain, args.max_new_tokens),
                           batch_sizes=batch_sizes)]
    for drafter, dargs in drafters:
        for name, budget in controllers:
            cargs = dict(args.controller_args)
            if budget is not None:
                cargs["budget"] = budget
            recorder = StepRecorder()
            options = dict(common, drafter=drafter, drafter_args=dargs, controller=name,
                           controller_args=cargs)
            llm = LLM(**system_options(options, len(systems)), plugins=(recorder,))
            label = llm.engine.config.controller_name + (
                f":{budget}" if budget is not None else "")
            if len(drafters) > 1:
                label = f"{drafter}/{label}"
            systems.append(SweepSystem(label, EngineSystem(llm, args.max_new_tokens), recorder,
                                       batch_sizes))
    if args.baseline in ("hf", "hf-pld") and 1 in batch_sizes:
        eos = systems[0].runner.llm.engine.parts.model_config.eos_token_ids
        hf = HFSystem(resolve_model_path(args.model), systems[0].runner.llm.engine.parts.dtype,
                      args.device,
                      args.max_new_tokens, eos, pld=args.baseline == "hf-pld")
        systems.append(SweepSystem(args.baseline, hf, batch_sizes=[1]))
    return systems


def _drafters(args) -> list[tuple[str, dict]]:
    """(name, drafter_args) per speculative drafter: ``--drafter`` with ``--drafter-args``, or
    ``--drafters a,b`` with ``--drafter-args`` keyed by name (``{"eagle3": {...}}``)."""
    names = getattr(args, "drafters", None)
    if not names:
        if not args.drafter:
            raise ValueError("--controllers compares speculative systems: give --drafter "
                             "(or --drafters a,b)")
        return [(args.drafter, args.drafter_args)]
    if args.drafter:
        raise ValueError("give --drafter or --drafters, not both")
    return keyed_drafters(names, args.drafter_args)


def run_sweep(args, engine_kwargs: dict) -> dict:
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    questions = load_questions(Path(args.dataset), args.num_prompts)
    systems = make_sweep_systems(args, batch_sizes, engine_kwargs)
    tok = systems[0].runner.llm.tokenizer
    items = first_turn_items(questions, tok)
    failed: dict[str, str] = {}  # a speculative system that failed: its error (the rest go on)
    if args.warmup:  # untimed: one prompt per system
        systems = [s for s in systems
                   if _survives(s, failed, [items[0].prompt_ids], pass_salt(None)) is not None]
    tallies: dict[tuple[str, int], Tally] = {}
    steps_before: dict[tuple[str, int], int] = {}
    recorded: dict[tuple[str, int], StepRecorder] = {}
    drafting: dict[tuple[str, int], dict] = {}
    total = sum(args.repeats * len(items) for _ in batch_sizes)
    with tqdm(total=total, desc="bench sweep", unit="prompt", file=sys.stderr) as bar:
        for bs in batch_sizes:
            live = [s for s in systems if bs in s.batch_sizes]
            before = {}
            for s in live:
                tallies[(s.name, bs)] = Tally(args.repeats)
                if s.recorder is not None:
                    steps_before[(s.name, bs)] = len(s.recorder.steps)
                before[s.name] = _engine_totals(s)
            for r in range(args.repeats):
                for start in range(0, len(items), bs):
                    batch = items[start:start + bs]
                    prompts = [it.prompt_ids for it in batch]
                    for s in [s for s in live if s.name not in failed]:
                        out = _survives(s, failed, prompts, pass_salt(r, bs))
                        if out is not None:
                            tallies[(s.name, bs)].add(r, batch, *out)
                    bar.update(len(batch))
            for s in live:
                drafting[(s.name, bs)] = _draft_figures(before[s.name], _engine_totals(s))
                if s.recorder is not None:
                    part = StepRecorder()
                    part.steps = s.recorder.steps[steps_before[(s.name, bs)]:]
                    recorded[(s.name, bs)] = part
    systems = [s for s in systems if s.name not in failed]
    tallies = {k: v for k, v in tallies.items() if k[0] not in failed}
    runs = build_runs(systems, tallies, recorded, batch_sizes, args.slo_tpot_ms)
    for row in runs:
        row.update(drafting.get((row["system"], row["batch_size"])) or {})
    report = {"runs": runs, "batch_sizes": batch_sizes, "systems": [s.name for s in systems],
              "num_prompts": len(questions), "config": run_config(args),
              "runtime": runtime_info(systems[0].runner.llm.engine)}
    report["best_static"] = best_static(runs)
    if failed:
        report["failed"] = failed
    if args.plot:
        plot_runs(runs, args.plot)
        report["plot"] = str(args.plot)
    return report


def _survives(system, failed: dict[str, str], prompts, salt):
    """``system.runner.run(prompts, salt)``, or None when it raised: a speculative system is
    then dropped from the sweep with its error (said on stderr and in the report's
    ``failed``), the others go on; plain decoding failing ends the sweep."""
    try:
        return system.runner.run(prompts, salt)
    except Exception as e:
        if system.name == "plain":
            raise
        failed[system.name] = f"{type(e).__name__}: {e}"
        print(f"bench sweep: {system.name} failed and is left out: {failed[system.name]}",
              file=sys.stderr)
        return None


def _engine_totals(system) -> tuple[int, float, float] | None:
    """(steps, draft seconds, step seconds) of an engine system so far; None for HF."""
    llm = getattr(system.runner, "llm", None)
    if llm is None:
        return None
    t = llm.engine.totals
    return t.steps, t.draft_seconds, t.step_seconds


def _draft_figures(before, after) -> dict | None:
    """The draft share of step time and draft milliseconds per step between two totals."""
    if before is None or after is None or after[0] == before[0]:
        return None
    steps, draft, step = (a - b for a, b in zip(after, before))
    return {"draft_share": draft / step if step > 0 else None,
            "draft_ms_per_step": 1000 * draft / steps}


def build_runs(systems, tallies, recorded, batch_sizes, slo_tpot_ms) -> list[dict]:
    hf_tps = None
    for s in systems:
        if s.name in ("hf", "hf-pld") and (s.name, 1) in tallies:
            hf_tps = statistics.median(tallies[(s.name, 1)].tps())
    runs = []
    for bs in batch_sizes:
        plain = tallies[("plain", bs)]
        for s in systems:
            t = tallies.get((s.name, bs))
            if t is None:
                continue
            tps = t.tps()
            row = {"system": s.name, "batch_size": bs,
                   "tokens_per_s": statistics.median(tps), "tokens_per_s_repeats": tps,
                   "speedup_vs_plain": statistics.median(
                       a / b for a, b in zip(tps, plain.tps()) if b > 0),
                   "speedup_vs_hf": statistics.median(tps) / hf_tps if hf_tps else None}
            outs = list(t.outputs[0].values())
            metrics = [o.metrics for r in t.outputs for o in r.values() if o.metrics is not None]
            if metrics:
                row.update(speculation_summary(outs))
                row["ttft_ms"] = percentiles([m.ttft for m in metrics if m.ttft is not None])
                row["tpot_ms"] = percentiles([m.tpot for m in metrics if m.tpot is not None])
                row["itl_ms"] = percentiles([x for m in metrics for x in m.itls])
                row["goodput_tokens_per_s"] = _goodput(t, slo_tpot_ms)
                row["slo_tpot_ms"] = slo_tpot_ms
                row["greedy_match_rate_vs_plain"] = _match(t, plain)
            rec = recorded.get((s.name, bs))
            row["controller"] = rec.summary() if rec is not None else None
            runs.append(row)
    return runs


def _goodput(t: Tally, slo_ms: float | None) -> float | None:
    """Tokens/s counting only requests whose TPOT met the SLO (median over repeats)."""
    if slo_ms is None:
        return None
    vals = []
    for r, outs in enumerate(t.outputs):
        good = sum(len(o.token_ids) for o in outs.values()
                   if o.metrics is not None and (o.metrics.tpot is None
                                                 or 1e3 * o.metrics.tpot <= slo_ms))
        vals.append(good / t.seconds[r] if t.seconds[r] > 0 else 0.0)
    return statistics.median(vals)


def _match(t: Tally, plain: Tally) -> float:
    a, b = t.outputs[0], plain.outputs[0]
    return sum(a[k].token_ids == b[k].token_ids for k in a) / max(1, len(a))


def best_static(runs: list[dict]) -> list[dict]:
    """Per batch size: the best static system and each other system's ratio to it."""
    out = []
    for bs in sorted({r["batch_size"] for r in runs}):
        rows = [r for r in runs if r["batch_size"] == bs]
        static = [r for r in rows if r["system"].startswith("static")]
        if not static:
            continue
        best = max(static, key=lambda r: r["tokens_per_s"])
        out.append({"batch_size": bs, "best_static": best["system"],
                    "ratios": {r["system"]: r["tokens_per_s"] / best["tokens_per_s"]
                               for r in rows}})
    return out


def plot_runs(runs: list[dict], path) -> None:
    """Three panels: tokens/s vs batch size, acceptance by depth (smallest batch), TPOT."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib "
                         "(or specdec[dev])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name in systems:
        rows = sorted((r for r in runs if r["system"] == name), key=lambda r: r["batch_size"])
        xs = [r["batch_size"] for r in rows]
        axes[0].plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        acc = next((r.get("acceptance_by_depth") for r in rows if r.get("acceptance_by_depth")),
                   None)
        if acc:
            axes[1].plot(range(1, len(acc) + 1), acc, marker="o", label=name)
        tp = [(r["batch_size"], r["tpot_ms"]) for r in rows if r.get("tpot_ms")]
        if tp:
            line, = axes[2].plot([x for x, _ in tp], [v["p50"] for _, v in tp], marker="o",
                                 label=f"{name} p50")
            axes[2].plot([x for x, _ in tp], [v["p99"] for _, v in tp], linestyle="--",
                         color=line.get_color(), label=f"{name} p99")
    axes[0].set(xscale="log", xlabel="batch size", ylabel="tokens/s", title="throughput")
    axes[1].set(xlabel="depth", ylabel="P(accepted at depth)",
                title="acceptance by depth (smallest batch)")
    axes[2].set(xscale="log", xlabel="batch size", ylabel="TPOT ms", title="TPOT p50 / p99")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
