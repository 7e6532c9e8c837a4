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

import pluggy

PROJECT = "specdec"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class SpecdecHookSpec:
    @hookspec
    def specdec_drafters(self) -> dict:
        """Drafter factories: name -> callable(target: TargetInfo, **drafter_args) -> Drafter
        (`specdec.drafters.base`: propose(list[DraftRequest]), on_verified(VerifiedBatch))."""

    @hookspec
    def specdec_verifiers(self) -> dict:
        """Verifier factories: name -> callable() -> Verifier, selected by `EngineConfig.verifier`.

        A Verifier has `name`, `supports_sampling` and `verify(VerifyBatch) -> VerifyOutput`:
        one call per step for every request at its frontier, batch-flat (see
        `specdec.verifiers.base`)."""

    @hookspec
    def specdec_controllers(self) -> dict:
        """Controller factories: name -> callable(**controller_args) -> Controller
        (`specdec.controllers.base`: budgets(requests, BatchComposition) -> list[DraftBudget],
        observe(StepReport))."""

    @hookspec
    def specdec_step_end(self, stats) -> None:
        """Observe one engine step (a `specdec.metrics.StepStats`), after it is committed."""
