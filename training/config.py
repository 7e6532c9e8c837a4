"""`specdec train` settings: one dataclass, from CLI flags and an optional YAML file.

Precedence: defaults < YAML (`--config`) < flags given on the command line; with `--resume`,
defaults < the run's recorded settings < YAML < flags, where a setting given with another value
than the recorded one is an error unless `allow_changed` names it (training/record.py). Every
field is checked here, with errors naming the field and what is allowed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

KINDS = ("eagle3", "mtp", "block_diffusion")


@dataclass
class TrainConfig:
    kind: str = "eagle3"
    target: str = "smollm2-135m-instruct"
    data: list[str] = field(default_factory=list)  # json / jsonl files (see training/data.py)
    out: str = ""
    eval_files: list[str] = field(default_factory=list)  # extra held-out prompts (e.g. MT-Bench)
    resume: bool = False
    # settings a --resume may give with other values than the run recorded (training/record.py)
    allow_changed: list[str] = field(default_factory=list)
    regenerate: bool = False  # the target answers the prompts (self-distillation)
    regen_temperature: float = 0.0
    regen_max_tokens: int = 256
    regen_batch_size: int = 16
    # the target's activations while it answers ("float": the fp32 model's numbers; "q8":
    # int8 rows over a GGUF's blocks, cheaper at large batches: EngineConfig.activations)
    regen_activations: str = "float"
    limit: int | None = None  # conversations sampled from the data (None: all)
    holdout: int = 16  # conversations kept out of training for the end-of-run evaluation
    # training prompts whose word 3-gram Jaccard with a held-out prompt is at least this are
    # removed from the training side of the split (0: keep them; training/near_dup.py)
    holdout_near_dup: float = 0.5
    max_length: int = 512
    max_turn_tokens: int | None = None  # shorten longer user/system turns (keep head and tail)
    draft_vocab_size: int = 16000
    aux_layer_ids: list[int] | None = None  # default: (2, L // 2, L - 3), vLLM's convention
    ttt_steps: int = 7  # eagle3: training-time-test steps
    ttt_decay: float = 0.8  # eagle3: loss weight of TTT step j is ttt_decay^j
    num_heads: int = 4  # mtp: heads (head i predicts the token i + 2 past the state's)
    head_decay: float = 0.8  # mtp: loss weight of head i is head_decay^i
    num_layers: int | None = None  # mtp: residual blocks per head (1); block_diffusion: layers (1)
    block_size: int = 8  # block_diffusion: [last token, MASK x (B - 1)], B - 1 drafts
    target_layer_ids: list[int] | None = None  # block_diffusion: target layers fused (outputs)
    num_anchors: int = 32  # block_diffusion: blocks per training sequence
    loss_gamma: float = 4.0  # block_diffusion: position k's weight exp(-(k - 1) / gamma)
    calibration_examples: int = 32  # tokenized sequences kept out of training to calibrate
    epochs: int = 1
    # optimizer steps; None: epochs over the data; 0 (with init_from): no training, that
    # drafter calibrated on all the data (the kinds that calibrate), exported and evaluated
    max_steps: int | None = None
    batch_size: int = 4  # sequences per optimizer step
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.015
    max_grad_norm: float = 0.5
    weight_decay: float = 0.0
    checkpoint_every: int = 200  # optimizer steps between accelerate checkpoints
    seed: int = 0
    dtype: str = "float32"  # training dtype of the head and the target features
    mixed_precision: str = "no"  # accelerate's: "no", "bf16" (CPUs with bf16 units, GPUs), "fp16"
    init_from: str | None = None  # start from this drafter folder's weights and vocabulary
    save_dtype: str = "bfloat16"  # dtype of the exported checkpoint
    # engines the exported folder must load in besides specdec ("vllm", "sglang"): checked
    # before training, a kind whose format they cannot load is a ValueError naming both
    export_for: list[str] = field(default_factory=list)
    report_to: str = "none"  # "none" or "wandb" (offline unless configured)
    eval_max_tokens: int = 128
    eval_budget: int = 8

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.data:
            raise ValueError("data: give at least one training file (--data FILE ...; --resume "
                             "takes the recorded ones of a run that recorded its settings)")
        if not self.out:
            raise ValueError("out: give the output folder (--out DIR)")
        for name in ("regen_max_tokens", "regen_batch_size", "max_length", "draft_vocab_size",
                     "ttt_steps", "epochs", "batch_size", "checkpoint_every", "eval_max_tokens",
                     "eval_budget", "num_heads", "num_anchors"):
            _int_at_least(name, getattr(self, name), 1)
        _int_at_least("block_size", self.block_size, 2)
        _int_at_least("calibration_examples", self.calibration_examples, 0)
        for name in ("limit", "max_turn_tokens", "num_layers"):
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 1)
        if self.max_steps is not None:  # 0: calibrate and evaluate init_from, no training
            _int_at_least("max_steps", self.max_steps, 0 if self.init_from else 1)
        _int_at_least("holdout", self.holdout, 0)
        near = self.holdout_near_dup
        if not isinstance(near, (int, float)) or isinstance(near, bool) or not 0 <= near <= 1:
            raise ValueError("holdout_near_dup must be a Jaccard threshold in [0, 1] (0: off), got "
                             f"{self.holdout_near_dup!r}")
        for name in ("learning_rate", "max_grad_norm", "loss_gamma"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")
        if not 0 <= self.warmup_ratio < 1 or not 0 < self.ttt_decay <= 1:
            raise ValueError("warmup_ratio must be in [0, 1) and ttt_decay in (0, 1]")
        if not 0 < self.head_decay <= 1:
            raise ValueError(f"head_decay must be in (0, 1], got {self.head_decay!r}")
        if self.target_layer_ids is not None and (
                not isinstance(self.target_layer_ids, list) or not self.target_layer_ids
                or not all(isinstance(j, int) and j >= 0 for j in self.target_layer_ids)):
            raise ValueError("target_layer_ids must list target layer indices >= 0, got "
                             f"{self.target_layer_ids!r}")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError("mixed_precision must be 'no', 'bf16' or 'fp16', got "
                             f"{self.mixed_precision!r}")
        if self.report_to not in ("none", "wandb"):
            raise ValueError(f"report_to must be 'none' or 'wandb', got {self.report_to!r}")
        if self.regen_activations not in ("float", "q8"):
            raise ValueError("regen_activations must be 'float' or 'q8', got "
                             f"{self.regen_activations!r}")
        _check_export_for(self.kind, self.export_for)
        _check_allow_changed(self.allow_changed)
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must list 3 layer ids, got {self.aux_layer_ids!r}")

    @classmethod
    def from_sources(cls, yaml_file: str | None, overrides: dict) -> TrainConfig:
        """Defaults, then (``resume``) the run's recorded settings, then the YAML file's keys,
        then ``overrides`` (flags the user gave)."""
        values: dict = {}
        if yaml_file is not None:
            values.update(_read_yaml(Path(yaml_file)))
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        if values.get("resume") and values.get("out"):
            values = {**_recorded(values, known), **values}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def _recorded(given: dict, known: set[str]) -> dict:
    """The settings ``given["out"]`` recorded (none if it recorded none), after checking that
    ``given`` changes none of them that ``allow_changed`` does not name."""
    from specdec.training.record import (
        NOT_COMPARED,
        changed_settings,
        check_changes,
        normalized,
        read_record,
    )

    recorded = read_record(given["out"])
    if recorded is None:
        return {}
    check_changes(changed_settings(recorded, given), given.get("allow_changed") or [],
                  given["out"])
    return {k: v for k, v in normalized(recorded).items() if k in known and k not in NOT_COMPARED}


def _check_allow_changed(names) -> None:
    from specdec.training.record import NOT_COMPARED

    allowed = sorted({f.name for f in fields(TrainConfig)} - set(NOT_COMPARED))
    if not isinstance(names, list) or not all(n in allowed for n in names):
        raise ValueError(f"allow_changed must list training settings ({', '.join(allowed)}), "
                         f"got {names!r}")


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings, got "
                         f"{type(values).__name__}")
    return {k.replace("-", "_"): v for k, v in values.items()}


def _check_export_for(kind: str, export_for) -> None:
    from specdec.models.heads.export_formats import check_formats

    if not isinstance(export_for, list) or not all(isinstance(f, str) for f in export_for):
        raise ValueError(f"export_for must list engine names (vllm, sglang), got {export_for!r}")
    try:
        check_formats(kind, export_for)
    except ValueError as e:
        raise ValueError(f"export_for: {e}") from e


def _int_at_least(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
