"""The controller protocol: how many draft nodes each request gets this step (0 allowed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class RequestView:
    """What a controller sees of one request at the decode frontier."""

    request_id: str
    num_tokens: int
    num_output_tokens: int
    draft_tokens_proposed: int  # so far
    accepted_by_depth: tuple[int, ...]  # so far: times depth d was accepted
    num_verify_steps: int  # so far


@dataclass(frozen=True)
class StepOutcome:
    request_id: str
    budget: int
    num_proposed: int
    num_accepted: int


@runtime_checkable
class Controller(Protocol):
    name: str

    def budgets(self, requests: list[RequestView], batch_size: int) -> list[int]:
        """Tree budget (max draft nodes, >= 0) for each request, in order."""

    def observe(self, outcomes: list[StepOutcome], step_seconds: float) -> None:
        """What happened in the step that used the budgets."""
