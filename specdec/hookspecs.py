"""Hook specifications of the `specdec` pluggy project.

Registration hooks return `{name: factory}`; built-ins are registered through these same hooks
(`specdec.builtins`). Per-step observation is `specdec_step_end`; no hook runs per token.

Example plugin module, exposed as an entry point in group `specdec`:

    from specdec.hookspecs import hookimpl

    @hookimpl
    def specdec_drafters():
        return {"my_drafter": MyDrafter}   # MyDrafter(target: TargetInfo, **drafter_args)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from specdec.controllers.base import Controller
    from specdec.drafters.base import Drafter
    from specdec.metrics import StepStats
    from specdec.verifiers.base import Verifier

# what each registration hook maps names to (a class is a factory too)
DrafterFactory = Callable[..., "Drafter"]  # (target: TargetInfo, **drafter_args)
VerifierFactory = Callable[[], "Verifier"]
ControllerFactory = Callable[..., "Controller"]  # (**controller_args)

PROJECT = "specdec"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class SpecdecHookSpec:
    @hookspec
    def specdec_drafters(self) -> dict[str, DrafterFactory]:
        """Drafter factories: name -> callable(target: TargetInfo, **drafter_args) -> Drafter
        (`specdec.drafters.base`: the `Drafter` protocol; subclass `BaseDrafter` for the
        defaults of its optional members)."""

    @hookspec
    def specdec_verifiers(self) -> dict[str, VerifierFactory]:
        """Verifier factories: name -> callable() -> Verifier, selected by `EngineConfig.verifier`.

        A Verifier has `name`, `supports_sampling` and `verify(VerifyBatch) -> VerifyOutput`:
        one call per step for every request at its frontier, batch-flat (see
        `specdec.verifiers.base`)."""

    @hookspec
    def specdec_controllers(self) -> dict[str, ControllerFactory]:
        """Controller factories: name -> callable(**controller_args) -> Controller
        (`specdec.controllers.base`: the `Controller` protocol, budgets(requests,
        BatchComposition) -> list[DraftBudget] and observe(StepReport); subclass
        `BaseController` for the defaults of its optional members)."""

    @hookspec
    def specdec_step_end(self, stats: StepStats) -> None:
        """Observe one engine step (a `specdec.metrics.StepStats`), after it is committed."""
