"""The markdown tables of docs/bench/step_budget.sh's runs (one `specdec bench` JSON each).

    .venv/bin/python docs/bench/step_budget_table.py OUT_DIR > OUT_DIR/table.md

Per run (activations, drafter, controller): its speed against plain decoding in the same run,
tau, and its speculative steps' parts beside that run's plain step (ms per step); then the
forward by rows (the engine's step profile) and drafting by depth beside the physics.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HOST = ("schedule", "verify", "commit", "feedback", "other")


def _cpu(out: Path) -> str:
    text = (out / "lscpu.txt").read_text() if (out / "lscpu.txt").exists() else ""
    m = re.search(r"^Model name:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else "unknown CPU"


def _f(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def main() -> int:
    out = Path(sys.argv[1])
    runs = sorted(out.glob("*.json"))
    print(f"CPU: {_cpu(out)}; MT-Bench, batch 1, greedy; each row one `specdec bench` run "
          "against plain decoding in the same process (ms per step).\n")
    print("| activations | drafter | controller | vs plain | tau | spec. steps | rows | draft | "
          "forward | host | step | plain step | step / plain | draft share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    forward, drafting = {}, {}
    for path in runs:
        parts = path.stem.rsplit("_", 2)  # <drafter>_<controller>_<activations>
        if len(parts) != 3 or parts[2] not in ("q8", "float"):
            continue  # not one of step_budget.sh's runs
        drafter, controller, act = parts
        report = json.loads(path.read_text())
        budget = report.get("step_budget") or {}
        systems = budget.get("systems", {})
        engine, plain = systems.get("engine", {}), systems.get("plain", {})
        spec = engine.get("kinds", {}).get("speculative")
        base = plain.get("kinds", {}).get("plain", {}).get("ms", {})
        steps = sum(k["steps"] for n, k in engine.get("kinds", {}).items() if n != "prefill")
        row = [act, drafter, controller, _f(report.get("speedup_vs_plain"), 3),
               _f(report.get("tau"), 2)]
        if spec:
            ms = spec["ms"]
            host = sum(ms[p] for p in HOST)
            row += [f"{spec['steps']} / {steps}", _f(spec["rows_per_step"]), _f(ms["draft"]),
                    _f(ms["forward"]), _f(host), _f(ms["step"]), _f(base.get("step")),
                    _f(ms["step"] / base["step"] if base.get("step") else None),
                    f"{100 * ms['draft'] / ms['step']:.1f} %"]
        else:
            row += [f"0 / {steps}"] + ["–"] * 8
        print("| " + " | ".join(row) + " |")
        forward.setdefault(act, engine if engine.get("forward_rows_ms") else plain)
        if engine.get("draft_ms_by_depth"):
            drafting[f"{drafter}, {act}"] = engine["draft_ms_by_depth"]
    print("\nForward by rows (the engine's step profile) beside the physics:\n")
    print("| activations | T(1) | T(2) | T(4) | T(8) | T(16) | memory-bound | extra row "
          "(T(8) - T(1)) / 7 | a row at the int8 / fp32 GEMM rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for act, s in forward.items():
        rows = s.get("forward_rows_ms", {})
        print("| " + " | ".join([act, *(_f(rows.get(str(n))) for n in (1, 2, 4, 8, 16)),
                                 _f(s.get("forward_memory_bound_ms")), _f(s.get("extra_row_ms")),
                                 _f(s.get("row_compute_bound_ms"), 3)]) + " |")
    if drafting:
        print("\nDrafting by depth (the goodput controller's fitted line, ms):\n")
        print("| drafter | d = 1 | d = 2 | d = 4 |")
        print("|---|---|---|---|")
        for name, line in drafting.items():
            print(f"| {name} | " + " | ".join(_f(line.get(str(d))) for d in (1, 2, 4)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
