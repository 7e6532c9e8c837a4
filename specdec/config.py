"""Engine configuration (validated on construction; errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.models.aliases import DEFAULT_MODEL
from specdec.models.config import DTYPES


@dataclass
class EngineConfig:
    """Everything that is fixed for the life of an engine.

    KV capacity: `num_pages` if given, else `kv_cache_memory` bytes, else enough pages for
    `max_num_seqs` sequences of `max_model_len` tokens (capped at 1 GiB).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None  # default: min(model's max positions, 4096)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    attention_backend: str = "torch"
    drafter: str | None = None
    drafter_args: dict[str, Any] = field(default_factory=dict)
    controller: str = "static"
    controller_args: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or str(self.device).startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _positive("page_size", self.page_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        for name in ("num_pages", "kv_cache_memory", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.drafter_args, dict) or not isinstance(self.controller_args, dict):
            raise ValueError("drafter_args and controller_args must be dicts")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
