"""The `specdec` command: `specdec generate PROMPT ...` and `specdec bench ...`.

    specdec generate "Write a haiku about tea" --drafter ngram --budget 8
    specdec bench --dataset mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 \\
        --baseline hf --drafter ngram --json out.json

User errors (bad flags, unknown drafter, unreadable dataset) exit 2 with a message naming the
argument; errors the engine reports as ValueError exit 1 with its message.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from specdec.attention import CHOICES as ATTENTION_CHOICES
from specdec.config import ACTIVATION_CHOICES, DRAFT_WEIGHT_CHOICES, WEIGHT_CHOICES
from specdec.models.aliases import DEFAULT_MODEL
from specdec.models.config import DTYPES

PROG = "specdec"


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON ({e.msg} at char {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"k\": 1}}', got {text!r}")
    return value


def _prompt_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must contain some non-whitespace text, got {text!r}")
    return text


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"file not found: {text}")
    return text


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias, HF folder, .gguf file or hub id (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto (default): bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help="a GGUF model's weights: native (its own Q4_1/Q8_0 blocks, the same "
                        "tokens as dequantized, a sixth of the bytes), dequantized (fp32), or "
                        "auto (default: native where it can run)")
    p.add_argument("--activations", default="float", choices=ACTIVATION_CHOICES,
                   help="what a GGUF's blocks multiply: float (default: the fp32 model's "
                        "numbers) or q8 (rows rounded to int8 per block of 32, as llama.cpp "
                        "does: cheaper rows, still lossless speculation, numbers within ~0.5 %% "
                        "of fp32's)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_CHOICES,
                   help="auto (default): flashinfer on CUDA when installed, else torch")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly on CUDA (default: replay CUDA graphs)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="compute every request's KV from scratch (default: reuse cached full "
                        "pages of a common prefix)")
    p.add_argument("--kv-tier-path", default=None, metavar="FILE",
                   help="keep cached pages evicted from memory in this file on local disk "
                        "(a second KV tier; default: none)")
    p.add_argument("--kv-tier-bytes", type=_int_at_least(1), default=2 << 30,
                   help="the tier file's size limit in bytes (default 2 GiB)")
    p.add_argument("--kv-host-tier-bytes", type=_int_at_least(1), default=None,
                   help="instead of a file: a tier of this many bytes of pinned host memory "
                        "below a GPU's KV")


def _add_spec_args(p: argparse.ArgumentParser, drafter: str | None = None,
                   drafter_help: str = "registered drafter name (default: none)") -> None:
    p.add_argument("--drafter", default=drafter, help=drafter_help)
    p.add_argument("--drafter-args", type=_json_object, default={}, metavar="JSON")
    p.add_argument("--controller", default=None,
                   help="registered controller name (default: goodput with a drafter, else static)")
    p.add_argument("--budget", type=_int_at_least(0), default=None,
                   help="draft budget per request per step (sets controller_args budget)")
    p.add_argument("--controller-args", type=_json_object, default={}, metavar="JSON")
    p.add_argument("--verifier", default="gumbel",
                   help="registered verifier name: gumbel (default), rejection, greedy")
    p.add_argument("--draft-weights", choices=DRAFT_WEIGHT_CHOICES, default="auto",
                   help="a learned drafter's matrices: q8_0 or q4_1 blocks quantized at load "
                        "(drafts need no exactness), float (as loaded), or auto (default: q8_0 "
                        "where the compiled kernels run)")
    p.add_argument("--linear-kernels", choices=("invariant", "tuned", "plain"),
                   default="invariant",
                   help="CPU matmul paths: the compiled row-invariant kernels (default), a "
                        "table timed at start-up, or F.linear only")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream one completion to stdout")
    p.add_argument("prompt", type=_prompt_text, help="the user message (or raw text with --no-chat)")
    _add_model_args(p)
    _add_spec_args(p, "auto", "registered drafter name, or none; default auto: the drafter "
                              "measured fastest for the model on this machine (a short "
                              "calibration of ngram and the drafters shipped for it at first "
                              "use, cached), else none")
    p.add_argument("--max-tokens", type=_int_at_least(1), default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); below 1e-5 also decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off")
    p.add_argument("--seed", type=int, default=None, help="int in [0, 2**63 - 1]")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=cmd_generate)


def _bench_parser(sub) -> None:
    from specdec.bench.compare import BASELINES

    p = sub.add_parser("bench", help="engine vs a baseline on a prompt dataset (greedy)")
    p.add_argument("--dataset", type=_existing_file, required=True,
                   help="MT-Bench/Spec-Bench or HumanEval jsonl (.gz ok)")
    p.add_argument("--num-prompts", type=_int_at_least(1), default=None, help="default: all")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=128)
    p.add_argument("--batch-size", type=_int_at_least(1), default=1,
                   help="prompts per engine generate call (HF baselines stay at batch 1)")
    p.add_argument("--baseline", choices=BASELINES, default="hf")
    p.add_argument("--extra-baseline", choices=("hf", "hf-pld", "llama.cpp", "llama.cpp-pld"),
                   default=None,
                   help="a second baseline of --baseline's kind in the same run (e.g. hf-pld "
                        "next to hf, llama.cpp-pld next to llama.cpp), reported as a ratio to "
                        "--baseline, with its greedy match rate against it")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write the report here")
    p.add_argument("--multi-turn", action="store_true",
                   help="also run later turns, feeding back the engine's own answers")
    p.add_argument("--repeats", type=_int_at_least(1), default=3)
    p.add_argument("--warmup", type=_int_at_least(0), default=2)
    sweep = p.add_argument_group("sweeps (several systems and batch sizes in one run)")
    sweep.add_argument("--batch-sizes", default=None, metavar="1,2,4,...",
                       help="run every system at each batch size (a sweep)")
    sweep.add_argument("--controllers", default=None, metavar="NAME[:BUDGET],...",
                       help="one speculative system per entry, e.g. static:0,static:4,goodput")
    sweep.add_argument("--drafters", default=None, metavar="NAME,...",
                       help="compare several drafters (--drafter-args keyed by name)")
    sweep.add_argument("--slo-tpot-ms", type=float, default=None,
                       help="goodput: tokens/s of the requests whose TPOT meets this")
    sweep.add_argument("--plot", default=None, metavar="FILE.png",
                       help="plots of the sweep (throughput, acceptance by depth, TPOT)")
    sweep.add_argument("--quick", action="store_true",
                       help="smoke run: 4 prompts, 16 new tokens, 1 repeat, 1 warm-up")
    _add_model_args(p)
    _add_spec_args(p)
    p.set_defaults(func=cmd_bench)


def _add_dataset_args(p, help_text: str, num_prompts: int, max_new_tokens: int) -> None:
    p.add_argument("--dataset", type=_existing_file, required=True, help=help_text)
    p.add_argument("--num-prompts", type=_int_at_least(1), default=num_prompts)
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=max_new_tokens)


def _bench_prefix_parser(sub) -> None:
    from specdec.bench.prefix import WORKLOADS

    p = sub.add_parser("bench-prefix", help="prefix caching and the disk tier: with vs without "
                                            "(TTFT, prefill tokens, no-hit throughput)")
    _add_dataset_args(p, "MT-Bench jsonl (two turns per question)", 16, 64)
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--repeats", type=_int_at_least(1), default=3,
                   help="repeats of the no-hit throughput comparison")
    p.add_argument("--tier-dir", default=None, help="folder for the tier workload's file "
                                                    "(default: a temporary folder)")
    p.add_argument("--json", default=None, metavar="OUT.json", help="write the report here")
    _add_model_args(p)
    _add_spec_args(p)
    p.set_defaults(func=cmd_bench_prefix)


def _bench_serve_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="load on the HTTP server at request rates: TTFT / "
                                           "TPOT / ITL percentiles, throughput, goodput")
    _add_dataset_args(p, "MT-Bench / Spec-Bench or HumanEval jsonl (first turns as chats)",
                      32, 128)
    p.add_argument("--request-rates", default="0.5,1,inf", metavar="R,R,...",
                   help="requests/s, inf = all at once (default 0.5,1,inf)")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--max-concurrency", type=_int_at_least(1), default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--drafters", default="none", metavar="none,NAME,...",
                   help="one server per entry (none = plain decoding), one after the other")
    p.add_argument("--compare-generate", action="store_true",
                   help="time LLM.generate at batch 1 on the same prompts first: the server's "
                        "TPOT overhead at the first rate (use --max-concurrency 1 for it)")
    p.add_argument("--url", default=None, help="a running server instead of in-process ones")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    _add_model_args(p)
    _add_spec_args(p)
    p.set_defaults(func=cmd_bench_serve)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_int_at_least(0), default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $SPECDEC_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: --model)")
    p.add_argument("--max-model-len", type=_int_at_least(2), default=None)
    p.add_argument("--max-num-seqs", type=_int_at_least(1), default=32)
    p.add_argument("--max-queued", type=_int_at_least(1), default=256,
                   help="requests waiting beyond this get 503 with Retry-After")
    p.add_argument("--max-tokens-limit", type=_int_at_least(1), default=None,
                   help="largest max_tokens a request may ask (default: max_model_len)")
    p.add_argument("--max-body-bytes", type=_int_at_least(1), default=1 << 20)
    _add_model_args(p)
    _add_spec_args(p)
    p.set_defaults(func=cmd_serve)


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter for a target model on your prompts")
    p.add_argument("kind", choices=["eagle3", "mtp", "block_diffusion"], help="drafter kind")
    p.add_argument("--target", default=None, help=f"target model (default {DEFAULT_MODEL})")
    p.add_argument("--data", nargs="+", type=_existing_file, default=None, metavar="FILE",
                   help="json/jsonl: ShareGPT, Alpaca, MT-Bench turns, GSM8K or plain text")
    p.add_argument("--out", default=None, help="output folder (must not exist, or --resume)")
    p.add_argument("--regenerate", action="store_true", default=None,
                   help="the target answers the prompts first (self-distillation)")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue the run in --out from its last checkpoint")
    p.add_argument("--eval", nargs="+", type=_existing_file, default=None, metavar="FILE",
                   dest="eval_files", help="extra held-out prompts for the final evaluation")
    p.add_argument("--config", type=_existing_file, default=None, metavar="YAML",
                   help="settings (training/config.py names); flags override them")
    p.add_argument("--report-to", choices=["none", "wandb"], default=None)
    p.add_argument("--max-steps", type=_int_at_least(1), default=None)
    p.add_argument("--limit", type=_int_at_least(1), default=None,
                   help="use this many conversations of the data (seeded sample)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this drafter's weights and vocabulary (fine-tune it)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="accelerate's mixed precision (bf16: CPUs with bf16 units, GPUs)")
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _bench_parser(sub)
    _bench_prefix_parser(sub)
    _serve_parser(sub)
    _bench_serve_parser(sub)
    _train_parser(sub)
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


# generate's sampling flags and the SamplingParams field each one sets
SAMPLING_FLAGS = (("--temperature", "temperature"), ("--top-p", "top_p"),
                  ("--top-k", "top_k"), ("--seed", "seed"), ("--max-tokens", "max_tokens"))


def _sampling_params(args):
    from specdec.sampling_params import SamplingParams

    return SamplingParams(**{f: getattr(args, f) for _, f in SAMPLING_FLAGS})


def _check_sampling(parser, args) -> None:
    """SamplingParams' rules at parse time, each flag checked alone so the error names it."""
    from specdec.sampling_params import SamplingParams

    for flag, field in SAMPLING_FLAGS:
        try:
            SamplingParams(**{field: getattr(args, field)})
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")
    try:
        _sampling_params(args)
    except ValueError as e:  # a rule across flags (none today); still a usage error
        parser.error(f"arguments {', '.join(f for f, _ in SAMPLING_FLAGS)}: {e}")


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
        _check_sampling(parser, args)
        args.drafter = _generate_drafter(args)
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


# ---- generate ---------------------------------------------------------------------------------


def _engine_kwargs(args) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, drafter=args.drafter,
                drafter_args=args.drafter_args, controller=args.controller,
                controller_args=args.controller_args, verifier=args.verifier,
                linear_kernels=args.linear_kernels, attention_backend=args.attention_backend,
                cuda_graphs=args.cuda_graphs, weights=args.weights,
                activations=args.activations, draft_weights=args.draft_weights,
                enable_prefix_caching=args.enable_prefix_caching,
                kv_tier_path=args.kv_tier_path, kv_tier_bytes=args.kv_tier_bytes,
                kv_host_tier_bytes=args.kv_host_tier_bytes)


def cmd_generate(args) -> int:
    from specdec.engine.llm import LLM

    params = _sampling_params(args)
    if args.drafter == "auto":
        from specdec.engine.drafter_choice import choose_drafter, describe

        kwargs = {k: v for k, v in _engine_kwargs(args).items()
                  if k not in ("model", "drafter", "drafter_args", "controller",
                               "controller_args")}
        choice = choose_drafter(args.model, **kwargs)
        print(describe(choice), file=sys.stderr)
        args.drafter = choice.drafter
    llm = LLM(**_engine_kwargs(args))
    prompt = args.prompt if args.no_chat else [{"role": "user", "content": args.prompt}]
    if not args.no_chat and getattr(llm.tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; pass --no-chat")
    t0, last = time.perf_counter(), None
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        last = delta
    seconds = time.perf_counter() - t0
    sys.stdout.write("\n")
    if last is None or last.finish_reason == "error":
        print(f"{PROG} generate: error: {last.error if last else 'no output'}", file=sys.stderr)
        return 1
    print(generate_stats(last.metrics, seconds, args.drafter is not None), file=sys.stderr)
    return 0


def generate_stats(m, seconds: float, speculative: bool) -> str:
    ttft = f"{m.ttft * 1000:.1f} ms" if m.ttft is not None else "n/a"
    parts = [f"{m.num_output_tokens} tokens", f"{m.num_output_tokens / seconds:.2f} tokens/s",
             f"TTFT {ttft}"]
    if speculative:
        accepted = sum(m.accepted_by_depth)
        rate = accepted / m.draft_tokens_proposed if m.draft_tokens_proposed else 0.0
        tau = f"{m.tau:.2f}" if m.tau is not None else "n/a"
        parts += [f"tau {tau}", f"acceptance {rate:.1%} ({accepted}/{m.draft_tokens_proposed})"]
    return "[" + ", ".join(parts) + "]"


# ---- train ---------------------------------------------------------------------------------


def cmd_train(args) -> int:
    from specdec.bench.report import fmt
    from specdec.training.config import TrainConfig
    from specdec.training.trainer import train

    flags = {k: getattr(args, k) for k in ("kind", "target", "data", "out", "regenerate",
                                           "resume", "eval_files", "report_to", "max_steps",
                                           "limit", "init_from", "mixed_precision")}
    config = TrainConfig.from_sources(args.config, flags)
    report = train(config)
    tau, speed = report.get("tau"), report.get("speedup_vs_plain")
    print(f"drafter: {Path(config.out) / 'drafter'}  tau {fmt(tau)}  speedup vs plain "
          f"{fmt(speed)}x on {report.get('num_prompts')} held-out prompts", file=sys.stderr)
    return 0


# ---- bench ------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from specdec.bench.compare import run_bench
    from specdec.bench.report import print_report, print_sweep
    from specdec.bench.sweep import run_sweep

    if args.quick:
        args.num_prompts = min(args.num_prompts or 4, 4)
        args.max_new_tokens, args.repeats, args.warmup = min(args.max_new_tokens, 16), 1, 1
    if args.batch_sizes or args.controllers or args.plot or args.drafters:
        args.batch_sizes = args.batch_sizes or str(args.batch_size)
        report = run_sweep(args)
        print_sweep(report)
    else:
        report = run_bench(args)
        print_report(report)
    _write_report(report, args.json)
    return 0


def cmd_bench_prefix(args) -> int:
    from specdec.bench.prefix import print_prefix_report, run_prefix_bench

    report = run_prefix_bench(args, _engine_kwargs(args))
    print_prefix_report(report)
    _write_report(report, args.json)
    return 0


def cmd_bench_serve(args) -> int:
    from specdec.bench.serve import print_serve_report, run_serve_bench

    report = run_serve_bench(args, _engine_kwargs(args))
    print_serve_report(report)
    _write_report(report, args.json)
    return 0


def cmd_serve(args) -> int:
    from specdec.engine.llm import LLM
    from specdec.serving.engine_loop import EngineLoop
    from specdec.serving.server import ServerLimits, ServerThread, create_app

    llm = LLM(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              **_engine_kwargs(args))
    loop = EngineLoop(llm.engine, max_queued=args.max_queued)
    key = args.api_key or os.environ.get("SPECDEC_API_KEY") or None
    app = create_app(loop, args.served_model_name or args.model, key,
                     ServerLimits(args.max_body_bytes, args.max_tokens_limit))
    if args.host not in ("127.0.0.1", "localhost", "::1") and key is None:
        print(f"{PROG} serve: warning: listening on {args.host} without an API key",
              file=sys.stderr)
    server = ServerThread(app, args.host, args.port, log_level="info")
    print(f"{PROG} serve: {server.url}/v1 (Ctrl-C or SIGTERM stops)", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: loop.shutdown())  # e.g. docker stop: end cleanly
    try:
        loop.run()  # the engine steps in the thread that built it; HTTP runs in another
    except KeyboardInterrupt:
        pass
    finally:
        loop.shutdown()
        server.stop()
    return 0


def _write_report(report: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
