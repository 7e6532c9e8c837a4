"""What the commands share: argument types, the model and speculation flags, the engine
keywords they make, and report writing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.attention import CHOICES as ATTENTION_CHOICES
from specdec.config import (
    ACTIVATION_CHOICES,
    DRAFT_WEIGHT_CHOICES,
    QUANTIZE_CHOICES,
    TP_REDUCE_CHOICES,
    WEIGHT_CHOICES,
)
from specdec.models.aliases import DEFAULT_MODEL
from specdec.models.decoder.config import DTYPES

PROG = "specdec"


def int_at_least(low: int):
    return _at_least(int, "an int", low)


def float_at_least(low: float):
    """A finite number >= low."""
    return _at_least(float, "a number", low)


def _at_least(cast, what: str, low):
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {text!r}") from None
        if not value >= low or value == float("inf"):  # NaN fails the first test
            finite = " (finite)" if cast is float else ""
            raise argparse.ArgumentTypeError(f"must be {what} >= {low}{finite}, got {text}")
        return value

    parse.__name__ = f"{what.split()[-1]} >= {low}"
    return parse


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON ({e.msg} at char {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"k\": 1}}', got {text!r}")
    return value


def prompt_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must contain some non-whitespace text, got {text!r}")
    return text


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"file not found: {text}")
    return text


def add_model_args(p: argparse.ArgumentParser, cache_flags: bool = True) -> None:
    """The engine's model flags; ``cache_flags=False`` leaves out --no-prefix-caching and the
    tier flags, for a command that sets them itself (bench-prefix, per workload)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias, HF folder, .gguf file or hub id (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto (default): bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int_at_least(1), default=1,
                   metavar="N", help="split the target over N ranks (torch.distributed; "
                   "started here, or by torchrun: docs/distributed.md); default 1")
    p.add_argument("--tensor-parallel-reduce", default="exact", choices=TP_REDUCE_CHOICES,
                   help="how the ranks sum the o / down partial sums at N > 1: exact (an "
                        "all-gather and a sum in rank order: speculation equals plain "
                        "decoding; default) or library (the backend's all-reduce: faster, "
                        "may part from plain decoding at N >= 3)")
    p.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help="a GGUF model's weights: native (its own blocks, Q4_0/Q4_1/Q5_0/Q5_1/"
                        "Q8_0/Q4_K/Q5_K/Q6_K: the same tokens as dequantized, a fraction of the "
                        "bytes), dequantized (fp32), or "
                        "auto (default: native where it can run)")
    p.add_argument("--activations", default="auto", choices=ACTIVATION_CHOICES,
                   help="what quantized blocks (a GGUF's, or --quantize's) multiply: q8 (rows "
                        "rounded to int8 per block of 32, as llama.cpp does: ~2x cheaper on "
                        "AVX2, still lossless speculation, numbers within ~0.5 %% of fp32's), "
                        "float (the fp32 model's numbers, bitwise), or auto (default: q8 for "
                        "quantized blocks, float for float weights)")
    p.add_argument("--quantize", default=None, choices=QUANTIZE_CHOICES,
                   help="quantize a safetensors checkpoint's matrices at load into GGUF blocks: "
                        "q8_0, or q4_k (q8_0 where the inputs are not a multiple of 256); "
                        "default: none (a bf16/fp16 checkpoint runs on its own bytes)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_CHOICES,
                   help="auto (default): torch on the CPU; on CUDA invariant (Triton) with "
                        "--linear-kernels invariant, else flashinfer when installed (bf16/fp16), "
                        "else torch")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly on CUDA (default: replay CUDA graphs)")
    if cache_flags:
        add_cache_args(p)


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="compute every request's KV from scratch (default: reuse cached full "
                        "pages of a common prefix)")
    p.add_argument("--kv-tier-path", default=None, metavar="FILE",
                   help="keep the prefix cache in this file on local disk (a second KV tier): "
                        "every full page a request computed is written when it ends, and a "
                        "later run on the same file reuses it; the folder must exist "
                        "(default: none)")
    p.add_argument("--kv-tier-bytes", type=int_at_least(1), default=2 << 30,
                   help="the most the tier file grows to, in bytes; it grows as pages are "
                        "written, then reuses its least recently used (default 2 GiB)")
    p.add_argument("--kv-host-tier-bytes", type=int_at_least(1), default=None,
                   help="instead of a file: a tier of this many bytes of pinned host memory "
                        "below a GPU's KV, for pages evicted from it (default: none)")


def add_spec_args(p: argparse.ArgumentParser, drafter: str | None = None,
                   drafter_help: str = "registered drafter name (default: none)") -> None:
    p.add_argument("--drafter", default=drafter, help=drafter_help)
    p.add_argument("--drafter-args", type=json_object, default={}, metavar="JSON",
                   help="the drafter's settings as a JSON object, e.g. '{\"min_ngram\": 2}' "
                        "for ngram; a composition's keyed by member, '{\"ngram\": {...}}' "
                        "(default: {}, the drafter's own defaults)")
    p.add_argument("--controller", default=None,
                   help="registered controller name (default: goodput with a drafter, else static)")
    p.add_argument("--budget", type=int_at_least(0), default=None,
                   help="draft budget per request per step (sets controller_args budget; "
                        "default: the controller's own, 16 for goodput)")
    p.add_argument("--controller-args", type=json_object, default={}, metavar="JSON",
                   help="the controller's settings as a JSON object, e.g. '{\"max_depth\": 4}' "
                        "(default: {}, the controller's own defaults)")
    p.add_argument("--verifier", default="gumbel",
                   help="registered verifier name: gumbel (default), rejection, greedy")
    p.add_argument("--draft-weights", choices=DRAFT_WEIGHT_CHOICES, default="auto",
                   help="a learned drafter's matrices: q8_0 or q4_1 blocks quantized at load "
                        "(drafts need no exactness), float (as loaded), or auto (default: where "
                        "the compiled kernels run, q4_1 for the learned heads (eagle3, mtp, "
                        "block_diffusion) and q8_0 for a draft model; else float)")
    p.add_argument("--linear-kernels", choices=("invariant", "tuned", "plain"),
                   default="invariant",
                   help="CPU matmul paths: the compiled row-invariant kernels (default), a "
                        "table timed at start-up, or F.linear only")


def add_dataset_arg(p, help_text: str) -> None:
    """--dataset, defaulting to the prompt set shipped with specdec."""
    from specdec.bench.data import DEFAULT_DATASET

    p.add_argument("--dataset", type=existing_file, default=str(DEFAULT_DATASET),
                   help=f"{help_text} (default: the 32 two-turn MT-Bench-style questions shipped "
                        f"with specdec, {DEFAULT_DATASET.name})")


def add_dataset_args(p, help_text: str, num_prompts: int, max_new_tokens: int) -> None:
    add_dataset_arg(p, help_text)
    p.add_argument("--num-prompts", type=int_at_least(1), default=num_prompts,
                   help=f"questions taken from the dataset, round-robin over its categories "
                        f"(default {num_prompts})")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=max_new_tokens,
                   help=f"tokens generated per request (default {max_new_tokens})")


# The engine options the engine flags set: each flag's argparse dest is the option's name
# (EngineConfig's, through LLM), e.g. --no-prefix-caching -> enable_prefix_caching.
ENGINE_OPTIONS = ("model", "dtype", "device", "tensor_parallel_size", "tensor_parallel_reduce",
                  "weights", "activations", "quantize",
                  "attention_backend", "cuda_graphs", "enable_prefix_caching", "kv_tier_path",
                  "kv_tier_bytes", "kv_host_tier_bytes", "drafter", "drafter_args",
                  "controller", "controller_args", "verifier", "draft_weights", "linear_kernels")


def engine_kwargs(args) -> dict:
    """The LLM keywords of parsed args: every engine option whose flag the command takes (the
    one place args become an engine's options; every command builds its engines from these)."""
    return {name: getattr(args, name) for name in ENGINE_OPTIONS if hasattr(args, name)}


def write_report(report: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {path}", file=sys.stderr)
