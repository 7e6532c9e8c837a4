"""`specdec bench` reports as tables on the terminal (rich when installed, plain text else)."""

from __future__ import annotations


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _summary_rows(r: dict) -> list[tuple[str, str]]:
    base, plain = r["baseline"] or {}, r["plain"] or {}
    rows = [("engine tokens/s", fmt(r["engine"]["tokens_per_s"])),
            (f"baseline ({base.get('name', 'none')}) tokens/s", fmt(base.get("tokens_per_s"))),
            ("plain engine tokens/s", fmt(plain.get("tokens_per_s"))),
            ("speedup vs baseline", fmt(r["speedup_vs_baseline"], ".3f")),
            ("speedup vs plain", fmt(r["speedup_vs_plain"], ".3f")),
            *_match_rows(r),
            ("tau (tokens / target forward)", fmt(r["tau"], ".3f")),
            ("acceptance rate", fmt(r["acceptance_rate"], ".1%")),
            ("acceptance by depth", " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) or "-"),
            ("draft share of step time", fmt(r["draft_ms_share"], ".1%"))]
    runtime = r.get("runtime")
    if runtime:
        picked = sorted(set(runtime["linear_kernels"]["choices"].values()))
        rows += [("dtype / device", f"{runtime['dtype']} / {runtime['device']}"),
                 ("linear kernels used", ", ".join(picked) or runtime["linear_kernels"]["key"])]
        if "weights" in runtime:
            rows.append(("weights / MB streamed per forward",
                         f"{runtime['weights']} / {runtime['weight_bytes_per_token'] / 1e6:.0f}"))
    extra = r.get("extra_baseline")
    if extra:
        rows += [(f"{extra['name']} tokens/s", fmt(extra["tokens_per_s"])),
                 (f"{extra['name']} speedup vs baseline", fmt(extra["speedup_vs_baseline"], ".3f")),
                 (f"engine speedup vs {extra['name']}", fmt(extra["engine_speedup_vs_it"], ".3f")),
                 (f"{extra['name']} greedy match vs baseline", fmt(extra["greedy_match_rate"], ".1%"))]
    rows += tensor_parallel_rows(r.get("tensor_parallel"))
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        p = r[key]
        rows.append((f"{key[:-3].upper()} ms p50/p90/p99",
                     "/".join(fmt(p[q], ".1f") for q in ("p50", "p90", "p99"))))
    rows.append(("prompts / requests / new tokens",
                 f"{r['num_prompts']} / {r['num_requests']} / {r['total_new_tokens']}"))
    return rows


def tensor_parallel_rows(tp: dict | None) -> list[tuple[str, str]]:
    """A report's tensor parallelism: N and the reduction, each system's collectives per step
    on rank 0, and the mismatch against plain decoding (None at N = 1: no rows)."""
    if not tp:
        return []
    rows = [("tensor parallel size / reduce / threads a rank",
             f"{tp['size']} / {tp['reduce']} / {tp['threads_per_rank']}")]
    for name, per in tp["per_step"].items():
        if per is None:
            continue
        rows.append((f"{name}: reductions / messages per step",
                     f"{per['reductions_per_step']:.1f} ({per['reduce_ms_per_step']:.3f} ms, "
                     f"{per['reduce_bytes_per_step'] / 1e3:.1f} kB) / "
                     f"{per['messages_per_step']:.2f} ({per['message_ms_per_step']:.3f} ms)"))
        rows.append((f"{name}: collectives' share of step time",
                     fmt(per["collective_share"], ".1%")))
    if tp.get("mismatch_vs_plain") is not None:
        m = tp["mismatch_vs_plain"]
        rows.append((f"mismatch vs plain ({tp['reduce']} reduce): requests / tokens",
                     f"{m['requests']:.1%} / {m['tokens']:.1%}"))
    return rows


def _match_rows(r: dict) -> list[tuple[str, str]]:
    """Greedy and token match rates, each against what it compares: the baseline (labelled
    "agreement" with the reason when it computes other numbers than the engine: not an
    exactness check) and plain decoding (same numbers: exact)."""
    name = (r["baseline"] or {}).get("name", "baseline")
    numbers = r.get("numbers") or {}
    same = numbers.get("same", True)
    label = f"vs {name}" if same else f"agreement with {name} (other numbers)"
    rows = [(f"greedy match {label}", fmt(r["greedy_match_rate"], ".1%")),
            (f"token match {label}", fmt(r["token_match_rate"], ".1%"))]
    if r.get("greedy_match_rate_vs_plain") is not None:
        rows += [("greedy match vs plain (same numbers)",
                  fmt(r["greedy_match_rate_vs_plain"], ".1%")),
                 ("token match vs plain", fmt(r["token_match_rate_vs_plain"], ".1%"))]
    if numbers.get("note"):
        rows += [("compared", f"{numbers['engine']} | {numbers['baseline']}"),
                 ("why they differ", numbers["note"])]
    return rows


def _category_rows(r: dict) -> list[tuple[str, ...]]:
    return [(cat, fmt(c["engine_tokens_per_s"]), fmt(c["baseline_tokens_per_s"]),
             fmt(c["speedup"], ".3f"), fmt(c["tau"], ".3f"))
            for cat, c in r["per_category"].items()]


def print_report(report: dict) -> None:
    tables = [("specdec bench", ("metric", "value"), _summary_rows(report)),
              ("per category", ("category", "engine tok/s", "baseline tok/s", "speedup", "tau"),
               _category_rows(report))]
    if report.get("step_budget"):
        tables.append(("step budget (ms per step; forward beside its memory-bound time)",
                       BUDGET_HEADER, budget_rows(report["step_budget"])))
        tables.append(("forward rows and drafting beside the physics (ms)", PHYSICS_HEADER,
                       physics_rows(report["step_budget"])))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, header, rows in tables:
            _print_plain(title, header, rows)
        return
    console = Console()
    for title, header, rows in tables:
        table = Table(title=title)
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        console.print(table)


BUDGET_HEADER = ("system", "kind", "steps", "rows", "nodes", "schedule", "draft", "forward",
                 "verify", "commit", "feedback", "other", "step", "fwd / mem-bound")


def budget_rows(budget: dict) -> list[tuple]:
    """One row per system and step kind of a report's ``step_budget``."""
    rows = []
    for name, sys_budget in budget["systems"].items():
        bound = sys_budget["forward_memory_bound_ms"]
        for kind, b in sorted(sys_budget["kinds"].items()):
            ms = b["ms"]
            rows.append((name, kind, str(b["steps"]), fmt(b["rows_per_step"], ".2f"),
                         fmt(b["draft_nodes_per_step"], ".2f"),
                         *(fmt(ms[k], ".3f") for k in ("schedule", "draft", "forward", "verify",
                                                       "commit", "feedback", "other", "step")),
                         fmt(ms["forward"] / bound if bound else None, ".2f")))
    return rows


PHYSICS_HEADER = ("system", "T(1)", "T(2)", "T(4)", "T(8)", "T(16)", "memory-bound",
                  "extra row", "row compute-bound", "draft d=1 / 2 / 4")


def physics_rows(budget: dict) -> list[tuple]:
    rows = []
    for name, s in budget["systems"].items():
        t = s["forward_rows_ms"]
        draft = s.get("draft_ms_by_depth")
        rows.append((name, *(fmt(t[n], ".2f") for n in sorted(t, key=int)),
                     fmt(s["forward_memory_bound_ms"], ".2f"), fmt(s["extra_row_ms"], ".2f"),
                     fmt(s["row_compute_bound_ms"], ".3f"),
                     " / ".join(fmt(v, ".2f") for v in draft.values()) if draft else "-"))
    return rows


def print_sweep(report: dict) -> None:
    header = ("system", "batch", "tok/s", "vs plain", "vs HF", "tau", "TPOT p50 ms",
              "mean depth", "draft ms/step", "draft share")
    rows = [(r["system"], str(r["batch_size"]), fmt(r["tokens_per_s"]),
             fmt(r["speedup_vs_plain"], ".3f"), fmt(r["speedup_vs_hf"], ".3f"),
             fmt(r.get("tau"), ".2f"), fmt((r.get("tpot_ms") or {}).get("p50"), ".1f"),
             fmt((r.get("controller") or {}).get("mean_depth"), ".2f"),
             fmt(r.get("draft_ms_per_step"), ".2f"), fmt(r.get("draft_share"), ".3f"))
            for r in report["runs"]]
    _print_plain("specdec bench sweep", header, rows)


def _print_plain(title: str, header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(title)
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    print()
