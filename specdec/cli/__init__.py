"""The `specdec` command, one module per subcommand (generate, bench, bench_prefix, bench_serve,
serve, train; what they share: common.py).

    specdec generate "Write a haiku about tea" --drafter ngram --budget 8
    specdec bench --dataset mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 \\
        --baseline hf --drafter ngram --json out.json

User errors (bad flags, unknown drafter, unreadable dataset) exit 2 with a message naming the
argument; errors the engine reports as ValueError exit 1 with its message.
"""

from __future__ import annotations

import argparse
import sys

from specdec.cli import bench, bench_prefix, bench_serve, generate, serve, train
from specdec.cli.common import PROG

COMMANDS = (generate, bench, bench_prefix, serve, bench_serve, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _check_registered(parser, args) -> None:
    """Unknown drafter/controller names fail here, before any model is loaded."""
    from specdec import plugins

    pm = plugins.get_plugin_manager()
    drafter = None if args.drafter == "auto" else args.drafter  # resolved when generate runs
    for flag, hook, name in (("--drafter", "specdec_drafters", drafter),
                             ("--controller", "specdec_controllers", args.controller),
                             ("--verifier", "specdec_verifiers", args.verifier)):
        if name is None:
            continue
        try:
            names = plugins.collect(pm, hook)
        except plugins.PluginError as e:
            parser.error(f"argument {flag}: cannot list registered names: {e}")
        if name not in names:
            parser.error(f"argument {flag}: unknown name {name!r}; registered: "
                         f"{', '.join(sorted(names)) or '(none)'}")


def _merge_budget(parser, args) -> None:
    merged = dict(args.controller_args)
    if args.budget is not None:
        if merged.get("budget", args.budget) != args.budget:
            parser.error(f"argument --budget: {args.budget} conflicts with --controller-args "
                         f"budget={merged['budget']}")
        merged["budget"] = args.budget
    args.controller_args = merged


def _generate_drafter(args) -> str | None:
    """generate's --drafter: "auto" (the default, resolved when the command runs: the drafter
    measured fastest for the model here, specdec.engine.drafter_choice), "none" (plain decoding), or
    a registered name."""
    return None if args.drafter == "none" else args.drafter


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate; exits (SystemExit 2) with a message naming the bad argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        return args  # its settings are checked by TrainConfig (flags and --config together)
    _merge_budget(parser, args)
    if args.command == "generate":
        generate.check_sampling(parser, args)
        args.drafter = _generate_drafter(args)
    if args.command == "serve" and args.drafter == "none":  # plain decoding, as generate's
        args.drafter = None
    if args.drafter_args and args.drafter is None and not getattr(args, "drafters", None):
        parser.error("argument --drafter-args: given without --drafter")
    if args.drafter_args and args.drafter == "auto":
        parser.error("argument --drafter-args: name the drafter they are for (--drafter NAME), "
                     "not auto")
    if str(args.device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"argument --device: {args.device!r} but CUDA is not available here")
    _check_registered(parser, args)
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the message
        return e.code if isinstance(e.code, int) else 2
    from specdec.plugins import PluginError

    try:
        return args.func(args)
    except (ValueError, PluginError) as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1
