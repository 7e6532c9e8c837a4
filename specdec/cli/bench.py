"""``specdec bench``: the engine against a baseline on a prompt dataset, side by side; with
``--batch-sizes`` / ``--controllers`` / ``--drafters``, a sweep."""

from __future__ import annotations

from specdec.cli.common import (
    add_dataset_arg,
    add_model_args,
    add_spec_args,
    engine_kwargs,
    int_at_least,
    write_report,
)


def add_parser(sub) -> None:
    from specdec.bench.compare import BASELINES

    p = sub.add_parser("bench", help="engine vs a baseline on a prompt dataset (greedy)")
    add_dataset_arg(p, "MT-Bench/Spec-Bench, HumanEval or GSM8K jsonl (.gz ok)")
    p.add_argument("--num-prompts", type=int_at_least(1), default=None,
                   help="questions taken from the dataset, round-robin over its categories "
                        "(default: all)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=128,
                   help="tokens generated per prompt (default 128)")
    p.add_argument("--batch-size", type=int_at_least(1), default=1,
                   help="prompts per engine generate call (HF baselines stay at batch 1; "
                        "default 1)")
    p.add_argument("--baseline", choices=BASELINES, default="hf",
                   help="what the engine is compared with: HF transformers (hf, hf-pld: its "
                        "prompt lookup), llama.cpp (-pld), the engine without a drafter "
                        "(plain), or nothing (none) (default hf)")
    p.add_argument("--extra-baseline", choices=("hf", "hf-pld", "llama.cpp", "llama.cpp-pld"),
                   default=None,
                   help="a second baseline of --baseline's kind in the same run (e.g. hf-pld "
                        "next to hf, llama.cpp-pld next to llama.cpp), reported as a ratio to "
                        "--baseline, with its greedy match rate against it (default: none)")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="write the report here (default: print only)")
    p.add_argument("--multi-turn", action="store_true",
                   help="also run later turns, feeding back the engine's own answers "
                        "(default: first turns only)")
    p.add_argument("--repeats", type=int_at_least(1), default=3,
                   help="timed runs of every system, interleaved; medians reported (default 3)")
    p.add_argument("--warmup", type=int_at_least(0), default=2,
                   help="untimed runs of every system first (default 2)")
    sweep = p.add_argument_group("sweeps (several systems and batch sizes in one run)")
    sweep.add_argument("--batch-sizes", default=None, metavar="1,2,4,...",
                       help="run every system at each batch size (a sweep; default: "
                            "--batch-size only)")
    sweep.add_argument("--controllers", default=None, metavar="NAME[:BUDGET],...",
                       help="one speculative system per entry, e.g. static:0,static:4,goodput "
                            "(default: the one --controller gives)")
    sweep.add_argument("--drafters", default=None, metavar="NAME,...",
                       help="compare several drafters (--drafter-args keyed by name; default: "
                            "the one --drafter gives)")
    sweep.add_argument("--slo-tpot-ms", type=float, default=None,
                       help="goodput: tokens/s of the requests whose TPOT meets this "
                            "(default: no goodput figure)")
    sweep.add_argument("--plot", default=None, metavar="FILE.png",
                       help="plots of the sweep (throughput, acceptance by depth, TPOT; "
                            "default: none)")
    sweep.add_argument("--quick", action="store_true",
                       help="smoke run: 4 prompts, 16 new tokens, 1 repeat, 1 warm-up "
                            "(default: off)")
    add_model_args(p)
    add_spec_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.bench.compare import run_bench
    from specdec.bench.report import print_report, print_sweep
    from specdec.bench.sweep import run_sweep

    if args.quick:
        args.num_prompts = min(args.num_prompts or 4, 4)
        args.max_new_tokens, args.repeats, args.warmup = min(args.max_new_tokens, 16), 1, 1
    if args.batch_sizes or args.controllers or args.plot or args.drafters:
        args.batch_sizes = args.batch_sizes or str(args.batch_size)
        report = run_sweep(args, engine_kwargs(args))
        print_sweep(report)
    else:
        report = run_bench(args, engine_kwargs(args))
        print_report(report)
    write_report(report, args.json)
    return 0
