"""The `specdec` command, one module per subcommand (generate, bench, bench_prefix, bench_serve,
serve, train; what they share: common.py).

    specdec generate "Write a haiku about tea" --drafter ngram --budget 8
    specdec bench --dataset mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 \\
        --baseline hf --drafter ngram --json out.json

User errors (bad flags, unknown drafter, a controller setting the controller refuses,
unreadable dataset) exit 2 with a message naming the argument, all as ``specdec COMMAND: error:
...``; errors the engine reports as ValueError exit 1 with its message. ``specdec --version``
prints the installed version.
"""

from __future__ import annotations

import argparse
import sys

from specdec.cli import bench, bench_prefix, bench_serve, generate, serve, train
from specdec.cli.common import PROG

COMMANDS = (generate, bench, bench_prefix, serve, bench_serve, train)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{PROG} {version('specdec')}"
    except PackageNotFoundError:  # a source tree run without installing it
        return f"{PROG} (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="speculative decoding engine")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of these (specdec COMMAND --help lists its flags)")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _check_registered(parser, args) -> None:
    """Unknown drafter/controller/verifier names fail here, before any model is loaded; a
    drafter composition ("ngram+suffix") by each of its members, split as the engine splits it."""
    from specdec import plugins

    pm = plugins.get_plugin_manager()
    named = [(flag, "specdec_drafters", name, spec)
             for flag, name, spec in _drafter_names(parser, args)]
    named += [("--controller", "specdec_controllers", args.controller, args.controller),
              ("--verifier", "specdec_verifiers", args.verifier, args.verifier)]
    for flag, hook, name, spec in named:
        if name is None:
            continue
        try:
            names = plugins.collect(pm, hook)
        except plugins.PluginError as e:
            parser.error(f"argument {flag}: cannot list registered names: {e}")
        if name not in names:
            member = f" (a member of {spec!r})" if spec != name else ""
            parser.error(f"argument {flag}: unknown name {name!r}{member}; registered: "
                         f"{', '.join(sorted(names)) or '(none)'}"
                         f"{plugins.skipped_note(pm, hook, name)}")


def _drafter_names(parser, args) -> list[tuple[str, str, str]]:
    """(flag, registered name, what the flag gave) for every drafter --drafter and --drafters
    name: each member of a composition; none for generate's "auto" (resolved when it runs) or
    "none" (plain decoding)."""
    from specdec.engine.drafting.setup import composition_names

    auto = args.command == "generate" and args.drafter == "auto"
    specs = [("--drafter", args.drafter)] if args.drafter is not None and not auto else []
    drafters = getattr(args, "drafters", None)  # bench's and bench-serve's: NAME,NAME,...
    if drafters is not None:
        specs += [("--drafters", s.strip()) for s in drafters.split(",") if s.strip() != "none"]
    out = []
    for flag, spec in specs:
        try:
            out += [(flag, name, spec) for name in composition_names(spec)]
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")
    return out


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's parser: usage errors found after parsing come from it, as argparse's own
    do (``specdec generate: error: ...``), with its usage line."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("build_parser makes subcommands")


def _check_controller(parser, args) -> None:
    """The controller's own rules for --budget and --controller-args at parse time: each
    controller the command builds (goodput with a drafter, static without, or --controller) is
    made here once (no model needed), so that e.g. ``--budget 0`` with goodput (budget >= 1) is
    a usage error naming the flag, not a failure after the model loaded. Bench sweeps' own
    --controllers entries are checked when they run."""
    from specdec import plugins

    if getattr(args, "controllers", None):
        return
    drafters = getattr(args, "drafters", None)
    specs = ([d.strip() for d in drafters.split(",")] if drafters else
             [args.drafter or "none"])
    names = {args.controller or ("static" if spec == "none" else "goodput") for spec in specs}
    pm = plugins.get_plugin_manager()
    for name in sorted(names):
        try:
            plugins.create(pm, "specdec_controllers", "controller", name, **args.controller_args)
        except ValueError as e:
            budget = args.budget is not None and "budget" in str(e)
            parser.error(f"argument {'--budget' if budget else '--controller-args'}: {e}")


def _merge_budget(parser, args) -> None:
    merged = dict(args.controller_args)
    if args.budget is not None:
        if merged.get("budget", args.budget) != args.budget:
            parser.error(f"argument --budget: {args.budget} conflicts with --controller-args "
                         f"budget={merged['budget']}")
        merged["budget"] = args.budget
    args.controller_args = merged


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate; exits (SystemExit 2) with a message naming the bad argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        return args  # its settings are checked by TrainConfig (flags and --config together)
    parser = _command_parser(parser, args.command)
    _merge_budget(parser, args)
    if args.command == "generate":
        generate.check_sampling(parser, args)
    # --drafter: a registered name or composition ("ngram+suffix"), "none" (plain decoding) or,
    # for generate, "auto" (its default, resolved when it runs: specdec.engine.drafter_choice)
    if args.drafter == "none":
        args.drafter = None
    if args.drafter is not None and getattr(args, "drafters", None):
        parser.error("argument --drafters: give --drafter or --drafters, not both")
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
    _check_controller(parser, args)
    return args


def _torchrun_worker(args) -> bool:
    """Under torchrun, for a command whose engine is tensor-parallel (-tp N > 1), ranks
    1..N-1 serve rank 0's engine (built from the same command line) instead of running the
    command; True when this process was such a rank and is done. Anything else (``train``'s
    data parallelism) runs on every rank as it is."""
    from specdec.distributed.engine_tp import under_torchrun

    if not under_torchrun() or int(__import__("os").environ["RANK"]) == 0:
        return False
    from specdec.cli.common import engine_kwargs
    from specdec.config import EngineConfig
    from specdec.distributed.engine_tp import shard_config
    from specdec.engine.build import max_model_len_of
    from specdec.engine.tp_worker import worker_from_env

    kwargs = engine_kwargs(args)
    if kwargs.get("tensor_parallel_size", 1) == 1:
        return False  # not a tensor-parallel engine (e.g. `train`'s data parallelism): run it
    rank0_only = ("drafter", "drafter_args", "controller", "controller_args", "kv_tier_path",
                  "kv_host_tier_bytes")
    config = shard_config(EngineConfig(**{k: v for k, v in kwargs.items()
                                          if k not in rank0_only}))
    worker_from_env(config, max_model_len_of(config))
    return True


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the message
        return e.code if isinstance(e.code, int) else 2
    from specdec.plugins import PluginError

    try:
        if _torchrun_worker(args):
            return 0
        return args.func(args)
    except (ValueError, PluginError) as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1
