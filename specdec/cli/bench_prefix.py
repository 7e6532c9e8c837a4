"""``specdec bench-prefix``: prefix caching and the disk tier, with against without."""

from __future__ import annotations

from specdec.cli.common import (
    add_dataset_args,
    add_model_args,
    add_spec_args,
    engine_kwargs,
    int_at_least,
    write_report,
)


def add_parser(sub) -> None:
    from specdec.bench.prefix import WORKLOADS

    p = sub.add_parser("bench-prefix", help="prefix caching and the disk tier: with vs without "
                                            "(TTFT, prefill tokens, no-hit throughput)")
    add_dataset_args(p, "MT-Bench jsonl (two turns per question)", 16, 64)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--repeats", type=int_at_least(1), default=3,
                   help="repeats of the no-hit throughput comparison (default 3)")
    p.add_argument("--tier-dir", default=None, help="folder for the tier workload's file "
                                                    "(default: a temporary folder)")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="write the report here (default: print only)")
    add_model_args(p, cache_flags=False)  # each workload sets the cache and tier itself
    add_spec_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.bench.prefix import print_prefix_report, run_prefix_bench

    report = run_prefix_bench(args, engine_kwargs(args))
    print_prefix_report(report)
    write_report(report, args.json)
    return 0
