"""Step statistics (for hooks and bench) and request metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """One engine step, as `specdec_step_end` observers see it."""

    step: int
    num_requests: int  # requests in the forward
    num_decode: int  # requests verifying a decode row (plus their draft nodes)
    num_prefill_tokens: int  # rows fed by prefill chunks (requests feeding more than one token)
    num_draft_nodes: int  # tree nodes verified this step
    num_verified_rows: int  # logits rows verified: 1 + nodes per frontier request
    num_accepted: int  # draft nodes accepted
    num_emitted: int  # tokens appended to requests
    num_draft_no_kv: int  # requests the drafter could not draft for (no KV in its runner)
    draft_seconds: float  # scheduling, budgets and drafting
    forward_seconds: float  # the target forward (batch packing included)
    verify_seconds: float  # verification, token appending and KV commit
    step_seconds: float
    # finer parts of the above (the step budget): scheduling and budgets (within draft_seconds),
    # appending and KV commit (within verify_seconds), the drafter's feedback (on_verified)
    schedule_seconds: float = 0.0
    commit_seconds: float = 0.0
    feedback_seconds: float = 0.0
    # the target forward replayed a CUDA graph (True), ran eagerly (False), or did not run
    graphed: bool | None = None
    # host -> device copies the step made (staged forward inputs, every runner's; KV moves) and
    # device -> host reads (verification's): on a CPU, what a GPU would copy (none happen)
    h2d_copies: int = 0
    d2h_reads: int = 0
    # the target forward's own time: on a GPU the device's (CUDA events), within forward +
    # verify seconds, since nothing waits for it until verification reads its result; on a
    # CPU the forward's wall time. None: no forward
    forward_device_seconds: float | None = None
    # a mixture-of-experts target: per layer, the distinct experts the forward's rows routed to
    # (what its experts' weights streamed; the goodput controller prices trees by it); None for
    # a dense target or without a forward
    experts_woken: list[int] | None = None
    num_preempted: int = 0
    failed_requests: list[str] = field(default_factory=list)
    # every exception a plugin raised this step, one line each naming the plugin and its call
    # (specdec.plugins.Raised), a retry that saved the step included; also logged (the first of
    # each kind, with its traceback) and counted by plugin (LLMEngine.faults, /metrics)
    plugin_errors: list[str] = field(default_factory=list)
    controller: dict | None = None  # the controller's ``decision`` figures, if it keeps them
    # prefix caching, over this step's admissions: tokens / full pages they had to compute
    # without the cache, and how many of them came from it instead
    num_lookup_tokens: int = 0
    num_lookup_pages: int = 0
    num_cached_tokens: int = 0
    num_cached_pages: int = 0
    num_evicted_pages: int = 0  # cached pages the pool handed out for new content
    # the second KV tier (EngineConfig.kv_tier_path): pages brought back / stored, and seconds
    tier_hits: int = 0
    tier_stores: int = 0
    tier_seconds: float = 0.0
    # tensor parallelism (tensor_parallel_size > 1), rank 0 during the step: the layers'
    # reductions (o and down of every layer, each forward: calls, seconds in them, bytes of
    # rank 0's partial sums) and the control messages it sent the workers (a forward, a KV
    # move: count, seconds). None: no tensor parallelism
    tp_reductions: int | None = None
    tp_reduce_seconds: float = 0.0
    tp_reduce_bytes: int = 0
    tp_messages: int = 0
    tp_message_seconds: float = 0.0


def forward_seconds(stats: StepStats) -> float:
    """The target forward's own seconds: the device's where measured apart (a GPU), else the
    forward stage's wall time (what a controller's cost model learns from)."""
    if stats.forward_device_seconds is not None:
        return stats.forward_device_seconds
    return stats.forward_seconds


BUDGET_PARTS = ("schedule", "draft", "forward", "verify", "commit", "feedback", "other")


def step_kind(stats: StepStats) -> str:
    """"prefill" (a prefill chunk in the step), "speculative" (draft nodes verified) or
    "plain" (decode rows only)."""
    if stats.num_prefill_tokens:
        return "prefill"
    return "speculative" if stats.num_draft_nodes else "plain"


def budget_parts(stats: StepStats) -> dict[str, float]:
    """The step's seconds by part (BUDGET_PARTS); they add up to ``step_seconds``."""
    parts = {"schedule": stats.schedule_seconds,
             "draft": stats.draft_seconds - stats.schedule_seconds,
             "forward": stats.forward_seconds,
             "verify": stats.verify_seconds - stats.commit_seconds,
             "commit": stats.commit_seconds, "feedback": stats.feedback_seconds}
    parts["other"] = stats.step_seconds - sum(parts.values())
    return parts


@dataclass
class StepBudget:
    """Sums over the steps of one kind: how many, their rows, and their seconds by part."""

    steps: int = 0
    rows: int = 0  # verified rows + prefill tokens
    draft_nodes: int = 0
    graphed_steps: int = 0  # steps whose target forward replayed a CUDA graph
    eager_steps: int = 0  # steps whose target forward ran eagerly
    h2d_copies: int = 0
    d2h_reads: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUDGET_PARTS, 0.0))
    # tensor parallelism, sums of StepStats.tp_* (None: no tensor parallelism): reductions,
    # their seconds and bytes; control messages and their seconds (within the parts above:
    # the reductions and the forward's message inside "forward", a KV move's in "commit")
    tp: dict[str, float] | None = None

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.rows += stats.num_verified_rows + stats.num_prefill_tokens
        self.draft_nodes += stats.num_draft_nodes
        self.graphed_steps += stats.graphed is True
        self.eager_steps += stats.graphed is False
        self.h2d_copies += stats.h2d_copies
        self.d2h_reads += stats.d2h_reads
        for k, v in budget_parts(stats).items():
            self.seconds[k] += v
        if stats.tp_reductions is not None:
            tp = self.tp if self.tp is not None else dict.fromkeys(TP_FIELDS, 0)
            for k in TP_FIELDS:
                tp[k] += getattr(stats, f"tp_{k}")
            self.tp = tp

    def minus(self, other: StepBudget) -> StepBudget:
        tp = None if self.tp is None else {
            k: v - (other.tp or {}).get(k, 0) for k, v in self.tp.items()}
        return StepBudget(self.steps - other.steps, self.rows - other.rows,
                          self.draft_nodes - other.draft_nodes,
                          self.graphed_steps - other.graphed_steps,
                          self.eager_steps - other.eager_steps,
                          self.h2d_copies - other.h2d_copies, self.d2h_reads - other.d2h_reads,
                          {k: self.seconds[k] - other.seconds[k] for k in BUDGET_PARTS}, tp)

    def per_step_ms(self) -> dict:
        """Mean milliseconds per step by part, rows and draft nodes per step (reports); with
        tensor parallelism its collectives per step (``tensor_parallel_per_step``)."""
        n = max(self.steps, 1)
        out = {k: 1000.0 * v / n for k, v in self.seconds.items()}
        out["step"] = sum(out.values())
        report = {"steps": self.steps, "rows_per_step": self.rows / n,
                  "draft_nodes_per_step": self.draft_nodes / n,
                  "graphed_steps": self.graphed_steps, "eager_steps": self.eager_steps,
                  "h2d_copies_per_step": self.h2d_copies / n,
                  "d2h_reads_per_step": self.d2h_reads / n, "ms": out}
        if self.tp is not None:
            report["tensor_parallel"] = tensor_parallel_per_step(self.tp, self.steps,
                                                                 self.seconds)
        return report


TP_FIELDS = ("reductions", "reduce_seconds", "reduce_bytes", "messages", "message_seconds")


def tensor_parallel_per_step(tp: dict, steps: int, seconds: dict[str, float]) -> dict:
    """A step budget's collectives per step (rank 0's): reductions, their ms and bytes,
    control messages and their ms, and the share of the step's time the collectives took
    (``collective_share``: reductions and messages over the step's seconds)."""
    n = max(steps, 1)
    step = sum(seconds.values())
    spent = tp["reduce_seconds"] + tp["message_seconds"]
    return {"reductions_per_step": tp["reductions"] / n,
            "reduce_ms_per_step": 1000.0 * tp["reduce_seconds"] / n,
            "reduce_bytes_per_step": tp["reduce_bytes"] / n,
            "messages_per_step": tp["messages"] / n,
            "message_ms_per_step": 1000.0 * tp["message_seconds"] / n,
            "collective_share": spent / step if step > 0 else None}


@dataclass
class EngineTotals:
    """Running sums over the engine's life (for bench: draft share, tau)."""

    steps: int = 0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0
    draft_no_kv: int = 0
    lookup_tokens: int = 0
    lookup_pages: int = 0
    cached_tokens: int = 0
    cached_pages: int = 0
    evicted_pages: int = 0
    tier_hits: int = 0
    tier_stores: int = 0
    tier_seconds: float = 0.0
    budget: dict[str, StepBudget] = field(default_factory=dict)  # step kind -> sums

    @property
    def prefix_hit_rate(self) -> dict[str, float | None]:
        """Share of the tokens / full pages admissions looked up that the cache served."""
        return {"tokens": self.cached_tokens / self.lookup_tokens if self.lookup_tokens else None,
                "pages": self.cached_pages / self.lookup_pages if self.lookup_pages else None}

    def prefix_summary(self) -> dict:
        """The prefix-cache figures of a run (bench reports)."""
        return {"hit_rate": self.prefix_hit_rate, "lookup_tokens": self.lookup_tokens,
                "cached_tokens": self.cached_tokens, "cached_pages": self.cached_pages,
                "evicted_pages": self.evicted_pages, "tier_hits": self.tier_hits,
                "tier_stores": self.tier_stores, "tier_seconds": self.tier_seconds}

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.budget.setdefault(step_kind(stats), StepBudget()).add(stats)
        self.draft_seconds += stats.draft_seconds
        self.forward_seconds += stats.forward_seconds
        self.verify_seconds += stats.verify_seconds
        self.step_seconds += stats.step_seconds
        self.draft_no_kv += stats.num_draft_no_kv
        self.lookup_tokens += stats.num_lookup_tokens
        self.lookup_pages += stats.num_lookup_pages
        self.cached_tokens += stats.num_cached_tokens
        self.cached_pages += stats.num_cached_pages
        self.evicted_pages += stats.num_evicted_pages
        self.tier_hits += stats.tier_hits
        self.tier_stores += stats.tier_stores
        self.tier_seconds += stats.tier_seconds
