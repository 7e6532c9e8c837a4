"""``specdec generate PROMPT``: stream one completion to stdout (``--drafter auto``: the drafter
chosen for the model on this class of machine; ``--calibrate`` measures the candidates here)."""

from __future__ import annotations

import sys
import time

from specdec.cli.common import (
    PROG,
    add_model_args,
    add_spec_args,
    engine_kwargs,
    int_at_least,
    prompt_text,
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream one completion to stdout")
    p.add_argument("prompt", type=prompt_text,
                   help="the user message (or raw text with --no-chat)")
    add_model_args(p)
    add_spec_args(p, "auto", "registered drafter name, or none; default auto: the drafter "
                              "shipped as the choice for the model on this class of machine "
                              "(ngram for SmolLM2 on every CPU measured), or this machine's "
                              "calibration where one was run (--calibrate)")
    p.add_argument("--calibrate", action="store_true",
                   help="with --drafter auto: time plain decoding, ngram and the drafters "
                        "shipped for the model here first (~35 s on 2 cores), cache the "
                        "fastest for later runs and use it (default: use the cached or "
                        "shipped choice)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=256,
                   help="most tokens to generate; fewer when the model ends its answer "
                        "(default 256)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); below 1e-5 also decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling, in (0, 1]; 1 = off (default)")
    p.add_argument("--top-k", type=int, default=-1,
                   help="sample from the k likeliest tokens; -1 or 0 = off (default -1)")
    p.add_argument("--seed", type=int, default=None,
                   help="int in [0, 2**63 - 1]: the same seed, the same sampled text (default: "
                        "a fresh one each run)")
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as raw text (default: a user message under the chat "
                        "template)")
    p.set_defaults(func=run)


# generate's sampling flags and the SamplingParams field each one sets
SAMPLING_FLAGS = (("--temperature", "temperature"), ("--top-p", "top_p"),
                  ("--top-k", "top_k"), ("--seed", "seed"), ("--max-tokens", "max_tokens"))


def sampling_params(args):
    from specdec.sampling_params import SamplingParams

    return SamplingParams(**{f: getattr(args, f) for _, f in SAMPLING_FLAGS})


def check_sampling(parser, args) -> None:
    """SamplingParams' rules at parse time, each flag checked alone so the error names it
    (and --calibrate, which only --drafter auto takes)."""
    from specdec.sampling_params import SamplingParams

    if getattr(args, "calibrate", False) and args.drafter != "auto":
        parser.error(f"argument --calibrate: only with --drafter auto (got --drafter "
                     f"{args.drafter})")

    for flag, field in SAMPLING_FLAGS:
        try:
            SamplingParams(**{field: getattr(args, field)})
        except ValueError as e:
            parser.error(f"argument {flag}: {e}")
    try:
        sampling_params(args)
    except ValueError as e:  # a rule across flags (none today); still a usage error
        parser.error(f"arguments {', '.join(f for f, _ in SAMPLING_FLAGS)}: {e}")


def run(args) -> int:
    from specdec.engine.llm import LLM

    params = sampling_params(args)
    if args.drafter == "auto":
        from specdec.engine.drafter_choice import choose_drafter, describe

        kwargs = {k: v for k, v in engine_kwargs(args).items()
                  if k not in ("model", "drafter", "drafter_args", "controller",
                               "controller_args")}
        choice = choose_drafter(args.model, calibrate=args.calibrate, **kwargs)
        print(describe(choice), file=sys.stderr)
        args.drafter = choice.drafter
    with LLM(**engine_kwargs(args)) as llm:  # closed: the tier file complete for the next run
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
            print(f"{PROG} generate: error: {last.error if last else 'no output'}",
                  file=sys.stderr)
            return 1
        print(generate_stats(last.metrics, seconds, args.drafter is not None), file=sys.stderr)
        tier = llm.engine.parts.tier
        if args.kv_tier_path is not None and tier is not None:
            print(tier_stats(tier, last.metrics), file=sys.stderr)
    return 0


def tier_stats(tier, m) -> str:
    """What the disk tier did for this run, plainly: a second run of the same prompt reuses
    the pages this one wrote (the file grows as pages are written, up to --kv-tier-bytes)."""
    return (f"[kv tier {tier.path}: {m.num_cached_tokens} of {m.num_prompt_tokens} prompt tokens "
            f"reused ({tier.hits} pages read from the file), {tier.stores} pages written; it "
            f"holds {len(tier)} pages in {tier.path.stat().st_size / 2**20:.1f} MiB, at most "
            f"{tier.num_slots} pages]")


def generate_stats(m, seconds: float, speculative: bool) -> str:
    ttft = f"{m.ttft * 1000:.1f} ms" if m.ttft is not None else "n/a"
    parts = [f"{m.num_output_tokens} tokens", f"{m.num_output_tokens / seconds:.2f} tokens/s",
             f"TTFT {ttft}"]
    if speculative:
        accepted, proposed = sum(m.accepted_by_depth), m.draft_tokens_proposed
        tau = f"{m.tau:.2f}" if m.tau is not None else "n/a"
        parts += [f"tau {tau}", f"acceptance {accepted / proposed:.1%} ({accepted}/{proposed})"
                  if proposed else "nothing drafted"]
    return "[" + ", ".join(parts) + "]"
