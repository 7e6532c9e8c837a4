"""The draft stage of a step: controller budgets, drafter proposals, and their failures.

A drafter that raises, or returns something that is not a valid tree within budget, fails only
the request concerned (finish_reason "error", the message names the plugin); the others go on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specdec import plugins
from specdec.controllers.base import RequestView, StepOutcome
from specdec.drafters.base import DraftRequest, TargetInfo, VerifiedStep
from specdec.scheduler import ScheduledRequest
from specdec.sequence import Sequence
from specdec.tree import DraftTree


class DraftStage:
    def __init__(self, drafter, controller, vocab_size: int, max_model_len: int, kv) -> None:
        self.drafter = drafter
        self.controller = controller
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv

    @classmethod
    def create(cls, engine, folder: Path) -> DraftStage:
        cfg = engine.config
        drafter = None
        if cfg.drafter is not None:
            target = TargetInfo(engine.model, engine.model_config, engine.hf_config,
                                engine.tokenizer, str(folder), engine.dtype, engine.device)
            drafter = plugins.create(engine.pm, "specdec_drafters", "drafter", cfg.drafter,
                                     target, **cfg.drafter_args)
        controller = plugins.create(engine.pm, "specdec_controllers", "controller",
                                    cfg.controller, **cfg.controller_args)
        return cls(drafter, controller, engine.model_config.vocab_size, engine.max_model_len,
                   engine.kv)

    @property
    def name(self) -> str:
        return f"{self.drafter.name!r} (plugin {getattr(self.drafter, 'plugin_name', '?')!r})"

    def budgets(self, frontier: list[Sequence]) -> list[int]:
        """Tree budget per frontier request: the controller's, clipped to what can be used."""
        if self.drafter is None or not frontier:
            return [0] * len(frontier)
        views = [_view(s) for s in frontier]
        wanted = self.controller.budgets(views, len(frontier))
        if len(wanted) != len(frontier):
            raise plugins.PluginError(
                f"controller {self.controller.name!r} returned {len(wanted)} budgets "
                f"for {len(frontier)} requests")
        # drafts past max_model_len or past max_tokens (the bonus token comes on top) are waste
        return [max(0, min(int(b), self.max_model_len - s.num_tokens,
                           s.params.max_tokens - s.num_output_tokens - 1))
                for b, s in zip(wanted, frontier)]

    def propose(self, scheduled: list[ScheduledRequest]):
        """(requests still in the batch, their trees or None, requests that failed)."""
        trees: list[DraftTree | None] = [None] * len(scheduled)
        failed = self._ensure_states(scheduled)
        jobs = [i for i, r in enumerate(scheduled) if r.draft_budget > 0 and i not in failed]
        if jobs:
            requests = [self._request(scheduled[i]) for i in jobs]
            for i, outcome in zip(jobs, self._call_propose(requests)):
                tree, error = self._check(outcome, scheduled[i].draft_budget)
                if error is not None:
                    self._fail(scheduled[i].seq, error)
                    failed.add(i)
                else:
                    trees[i] = tree
                    self._shrink(scheduled, i, tree)
        keep = [i for i in range(len(scheduled)) if i not in failed]
        return ([scheduled[i] for i in keep], [trees[i] for i in keep],
                [scheduled[i].seq for i in sorted(failed)])

    def _ensure_states(self, scheduled: list[ScheduledRequest]) -> set[int]:
        """Per-request drafter state from a request's first step on (and after preemption);
        a drafter failing to set up a request fails only that request."""
        failed = set()
        if self.drafter is None:
            return failed
        for i, req in enumerate(scheduled):
            seq = req.seq
            if seq.drafter_ready:
                continue
            try:
                seq.drafter_state = self.drafter.init_state(seq.request_id, seq.prompt_token_ids)
                seq.drafter_ready = True
            except Exception as e:
                self._fail(seq, f"drafter {self.name} failed in init_state: {e!r}")
                failed.add(i)
        return failed

    @staticmethod
    def _fail(seq: Sequence, error: str) -> None:
        seq.finish_reason, seq.error = "error", error

    def _request(self, req: ScheduledRequest) -> DraftRequest:
        seq = req.seq
        return DraftRequest(seq.request_id, seq.token_ids, req.draft_budget, seq.params,
                            seq.generator, seq.drafter_state)

    def _call_propose(self, requests: list[DraftRequest]) -> list:
        """Trees or exceptions, one per request; a batch failure is retried per request."""
        try:
            trees = self.drafter.propose(requests)
            if isinstance(trees, list) and len(trees) == len(requests):
                return trees
            raise TypeError(f"propose returned {type(trees).__name__} of wrong length")
        except Exception as batch_error:
            if len(requests) == 1:
                return [batch_error]
            out = []
            for r in requests:
                try:
                    out.append(self.drafter.propose([r])[0])
                except Exception as e:
                    out.append(e)
            return out

    def _check(self, outcome, budget: int) -> tuple[DraftTree | None, str | None]:
        if isinstance(outcome, Exception):
            return None, f"drafter {self.name} failed: {outcome!r}"
        if not isinstance(outcome, DraftTree):
            return None, f"drafter {self.name} returned {type(outcome).__name__}, not a DraftTree"
        try:
            outcome.validate(max_nodes=budget, vocab_size=self.vocab_size)
        except ValueError as e:
            return None, f"drafter {self.name} returned a malformed tree: {e}"
        return outcome, None

    def _shrink(self, scheduled: list[ScheduledRequest], i: int, tree: DraftTree) -> None:
        """Give back reserved draft slots the tree did not use."""
        req = scheduled[i]
        if tree.num_nodes < req.draft_budget:
            self.kv.truncate(req.seq.block_table,
                             req.seq.num_computed + req.num_new_tokens + tree.num_nodes)
            scheduled[i] = replace(req, draft_budget=tree.num_nodes)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.hidden_layers) if self.drafter is not None else ()

    def on_verified(self, seq: Sequence, step: VerifiedStep) -> bool:
        """Tell the drafter; False (and the request marked failed) if it raised."""
        if self.drafter is None or not seq.drafter_ready:
            return True
        try:
            self.drafter.on_verified(seq.drafter_state, step)
        except Exception as e:
            self._fail(seq, f"drafter {self.name} failed in on_verified: {e!r}")
            return False
        return True

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None and seq.drafter_ready:
            state, seq.drafter_state, seq.drafter_ready = seq.drafter_state, None, False
            self.drafter.release(state)

    def observe(self, scheduled, trees, stats) -> None:
        outcomes = [StepOutcome(r.seq.request_id, r.draft_budget, t.num_nodes, r.seq.last_accepted)
                    for r, t in zip(scheduled, trees) if t is not None]
        self.controller.observe(outcomes, stats.step_seconds)


def _view(seq: Sequence) -> RequestView:
    return RequestView(seq.request_id, seq.num_tokens, seq.num_output_tokens,
                       seq.draft_tokens_proposed, tuple(seq.accepted_by_depth),
                       seq.num_steps_decoding)
