"""``specdec train KIND``: train a drafter for a target model on your prompts."""

from __future__ import annotations

import sys
from pathlib import Path

from specdec.cli.common import existing_file, int_at_least
from specdec.models.aliases import DEFAULT_MODEL


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter for a target model on your prompts")
    p.add_argument("kind", choices=["eagle3", "mtp", "block_diffusion"], help="drafter kind")
    p.add_argument("--target", default=None, help=f"target model (default {DEFAULT_MODEL})")
    p.add_argument("--data", nargs="+", type=existing_file, default=None, metavar="FILE",
                   help="json/jsonl: ShareGPT, Alpaca, MT-Bench turns, GSM8K or plain text "
                        "(no default: required, unless --resume or --config gives it)")
    p.add_argument("--out", default=None,
                   help="output folder (must not exist, or --resume; no default: required "
                        "unless --config gives it)")
    p.add_argument("--regenerate", action="store_true", default=None,
                   help="the target answers the prompts first (self-distillation; default: "
                        "train on the data's own answers)")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue the run in --out from its last checkpoint, with the settings "
                   "it recorded (--out DIR/train_config.json); a setting given with another "
                   "value is an error unless --allow-changed names it (default: a new run)")
    p.add_argument("--allow-changed", nargs="+", default=None, metavar="SETTING",
                   help="with --resume: settings (training/config.py names, e.g. max_steps) "
                   "that may differ from the run's recorded ones; the change is logged and "
                   "the replaced settings kept in DIR/train_config.history.jsonl (default: "
                   "none)")
    p.add_argument("--eval", nargs="+", type=existing_file, default=None, metavar="FILE",
                   dest="eval_files", help="extra held-out prompts for the final evaluation "
                                           "(default: the held-out part of --data only)")
    p.add_argument("--config", type=existing_file, default=None, metavar="YAML",
                   help="settings (training/config.py names); flags override them (default: "
                        "none, every setting at its default)")
    p.add_argument("--report-to", choices=["none", "wandb"], default=None,
                   help="where the training curves go: wandb (offline unless configured) or "
                        "none (default: none)")
    p.add_argument("--max-steps", type=int_at_least(1), default=None,
                   help="stop after this many optimizer steps (default: the epochs over the "
                        "data, 1 epoch unless --config says otherwise)")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="use this many conversations of the data (seeded sample; default: "
                        "all)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this drafter's weights and vocabulary (fine-tune it; "
                        "default: fresh weights)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="accelerate's mixed precision (bf16: CPUs with bf16 units, GPUs; "
                        "default: no)")
    p.add_argument("--export-for", nargs="+", choices=["vllm", "sglang"], default=None,
                   metavar="ENGINE", help="engines the exported drafter must load in (vllm, "
                   "sglang); an error before training if its format cannot (default: none "
                   "checked)")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.training.config import TrainConfig
    from specdec.training.trainer import train

    flags = {k: getattr(args, k) for k in ("kind", "target", "data", "out", "regenerate",
                                           "resume", "eval_files", "report_to", "max_steps",
                                           "limit", "init_from", "mixed_precision",
                                           "export_for", "allow_changed")}
    if args.allow_changed:  # setting names, as flags spell them or as training/config.py does
        flags["allow_changed"] = [n.replace("-", "_") for n in args.allow_changed]
    config = TrainConfig.from_sources(args.config, flags)
    report = train(config)
    print(f"drafter: {Path(config.out) / 'drafter'}", file=sys.stderr)
    for line in report.get("summary", []):  # eval.json keeps the same lines
        print(line, file=sys.stderr)
    return 0
