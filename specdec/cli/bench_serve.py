"""``specdec bench-serve``: load on the HTTP server at request rates, as clients see it."""

from __future__ import annotations

import sys

from specdec.cli.common import (
    PROG,
    add_dataset_args,
    add_model_args,
    add_spec_args,
    engine_kwargs,
    int_at_least,
    write_report,
)


def add_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="load on the HTTP server at request rates: TTFT / "
                                           "TPOT / ITL percentiles, throughput, goodput")
    add_dataset_args(p, "MT-Bench / Spec-Bench or HumanEval jsonl (first turns as chats)",
                      32, 128)
    p.add_argument("--request-rates", default="0.5,1,inf", metavar="R,R,...",
                   help="requests/s, inf = all at once (default 0.5,1,inf)")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson",
                   help="gaps between arrivals: random (poisson) or equal (fixed) at the rate "
                        "(default poisson)")
    p.add_argument("--max-concurrency", type=int_at_least(1), default=16,
                   help="most requests in flight; later arrivals wait for one to end "
                        "(default 16)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="goodput counts only requests whose time to first token meets this "
                        "(default: no TTFT limit)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="goodput counts only requests whose time per output token meets this "
                        "(default: no TPOT limit)")
    p.add_argument("--drafters", default=None, metavar="none,NAME,...",
                   help="one server per entry (none = plain decoding), one after the other, "
                        "--drafter-args keyed by name (default: the one --drafter gives, plain "
                        "decoding without it)")
    p.add_argument("--compare-generate", action="store_true",
                   help="time LLM.generate at batch 1 on the same prompts first: the server's "
                        "TPOT overhead at the first rate (use --max-concurrency 1 for it; "
                        "default: off)")
    p.add_argument("--url", default=None, metavar="URL",
                   help="a running server instead of in-process ones: http://HOST:PORT or the "
                        "OpenAI base URL http://HOST:PORT/v1; its system is what its /v1/models "
                        "says (default: in-process servers)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' to a --url server that needs one "
                        "(default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id requests name (default: the one the server lists, else "
                        "--model)")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="write the report here (default: print only)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="goodput, TPOT and TTFT against the request rate (default: none)")
    add_model_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.bench.serve import mostly_failed, print_serve_report, run_serve_bench

    report = run_serve_bench(args, engine_kwargs(args))
    print_serve_report(report)
    write_report(report, args.json)
    failed = mostly_failed(report)
    for line in failed:
        print(f"{PROG} bench-serve: error: {line}", file=sys.stderr)
    return 1 if failed else 0
