"""The engine: requests in, one draft -> verify step at a time, tokens out.

    schedule (controller budgets) -> drafter.propose -> one target forward over every request's
    new rows and tree nodes -> verifier -> commit accepted KV, free the rest -> observers
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from specdec import plugins
from specdec.attention import create_backend
from specdec.batch import ModelInput, build_model_input
from specdec.config import EngineConfig
from specdec.drafters.base import VerifiedStep
from specdec.drafting import DraftStage
from specdec.kv.block_table import KVCacheManager, num_pages_for_budget, slot_of
from specdec.kv.cache import KVCache
from specdec.kv.page_pool import PagePool
from specdec.metrics import EngineTotals, StepStats
from specdec.models.config import model_config_from_hf, resolve_dtype
from specdec.models.loader import load_hf_config, load_model, resolve_model_path
from specdec.models.tokenizer import load_tokenizer
from specdec.sampling import logits_to_probs, make_generator, params_to_tensors, sample
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest, Scheduler
from specdec.sequence import Sequence
from specdec.stopping import StopChecker
from specdec.tree import DraftTree
from specdec.verifiers.base import VerifyResult

DEFAULT_KV_MEMORY_CAP = 1 << 30


@dataclass
class StepResult:
    emitted: list[tuple[Sequence, int]]  # requests that got tokens this step, and how many
    finished: list[Sequence]  # requests that ended this step (any reason)
    stats: StepStats


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins_: tuple = ()) -> None:
        self.config = config
        self.dtype = resolve_dtype(config.dtype)
        self.device = torch.device(config.device)
        self.pm = plugins.get_plugin_manager(plugins_)
        folder = resolve_model_path(config.model)
        hf_config = load_hf_config(folder)
        self.model_config = cfg = model_config_from_hf(hf_config)
        self.max_model_len = _max_model_len(config, cfg)
        self.model, _, self.hf_config = load_model(folder, self.dtype, self.device, self.max_model_len)
        self.tokenizer = load_tokenizer(folder)
        self.kv_cache = self._allocate_kv(config)
        self.kv = KVCacheManager(PagePool(self.kv_cache.num_pages), config.page_size)
        self.backend = create_backend(config.attention_backend)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.stopper = StopChecker(cfg.eos_token_ids, self.max_model_len, self.tokenizer)
        self.verifier = plugins.create(self.pm, "specdec_verifiers", "verifier", "rejection")
        self.drafting = DraftStage.create(self, folder)
        self.requests: dict[str, Sequence] = {}
        self.totals = EngineTotals()
        self.plugin_errors: list[str] = []
        self._ids = itertools.count()

    def _allocate_kv(self, config: EngineConfig) -> KVCache:
        cfg = self.model_config
        num_pages = config.num_pages
        if num_pages is None:
            budget = config.kv_cache_memory or _default_kv_memory(config, cfg, self.max_model_len, self.dtype)
            num_pages = num_pages_for_budget(budget, cfg.num_layers, config.page_size,
                                             cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if num_pages * config.page_size < self.max_model_len:
            raise ValueError(
                f"num_pages={num_pages} x page_size={config.page_size} holds fewer slots than "
                f"max_model_len={self.max_model_len}; one full-length request must fit"
            )
        return KVCache(cfg.num_layers, num_pages, config.page_size, cfg.num_kv_heads,
                       cfg.head_dim, self.dtype, self.device)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; ValueError (and no change to the engine) if it is malformed."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_prompt(prompt_token_ids)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # unseeded requests draw their seed from torch's global RNG (torch.manual_seed applies)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        generator = None if params.greedy else make_generator(seed, self.device)
        seq = Sequence(request_id, list(prompt_token_ids), params, generator)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _check_prompt(self, ids) -> None:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens are allowed"
            )

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def pop_finished(self, request_id: str) -> Sequence:
        seq = self.requests.pop(request_id)
        assert seq.is_finished
        return seq

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> StepResult:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(self.drafting.budgets)
        for seq in sched.preempted:
            self.drafting.release(seq)
        scheduled, trees, failed = self.drafting.propose(sched.scheduled)
        for seq in failed:
            self._finish(seq)
        if not scheduled and not failed and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress: no request fits the KV cache "
                               f"({self.kv.pool.num_free} of {self.kv.pool.num_pages} pages free)")
        t1 = time.perf_counter()
        emitted: list[tuple[Sequence, int]] = []
        accepted_total = 0
        if scheduled:
            inp = build_model_input(scheduled, trees, self.config.page_size, self.device)
            logits, hidden = self._forward(inp)
            t2 = time.perf_counter()
            emitted, accepted_total = self._commit_all(scheduled, trees, inp, logits, hidden)
        else:
            t2 = t1
        finished = [s for s in failed] + [s for s, _ in emitted if s.is_finished]
        stats = StepStats(
            step=self.totals.steps, num_requests=len(scheduled),
            num_prefill_tokens=sum(r.num_new_tokens for r in scheduled if r.num_new_tokens > 1),
            num_draft_nodes=sum(t.num_nodes for t in trees if t is not None),
            num_accepted=accepted_total, num_emitted=sum(n for _, n in emitted),
            draft_seconds=t1 - t0, forward_seconds=t2 - t1,
            step_seconds=time.perf_counter() - t0, num_preempted=len(sched.preempted),
            failed_requests=[s.request_id for s in failed],
        )
        self.totals.add(stats)
        self.drafting.observe(scheduled, trees, stats)
        self.plugin_errors += plugins.notify_step_end(self.pm, stats)
        return StepResult(emitted, finished, stats)

    def _forward(self, inp: ModelInput) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """(logits [R, V] of the rows that need them, {layer: [T, hidden]} the drafter asked for)."""
        self.backend.plan(inp.metadata)
        out = self.model(inp.input_ids, inp.positions, self.backend, self.kv_cache,
                         capture_layers=self.drafting.hidden_layers)
        if inp.logits_rows.numel() == 0:
            return None, out.layer_hidden
        logits = self.model.compute_logits(out.hidden.index_select(0, inp.logits_rows))
        return logits, out.layer_hidden

    def _commit_all(self, scheduled: list[ScheduledRequest], trees, inp: ModelInput, logits,
                    hidden: dict[int, torch.Tensor]):
        """Verify every frontier request, commit accepted tokens and KV; advance prefills."""
        plain = [i for i, (r, t) in enumerate(zip(scheduled, trees))
                 if r.at_frontier and (t is None or t.num_nodes == 0)]
        results: dict[int, VerifyResult] = self._sample_plain(scheduled, plain, inp, logits)
        emitted, accepted_total = [], 0
        for i, (req, tree) in enumerate(zip(scheduled, trees)):
            seq, start, accepted = req.seq, req.seq.num_computed, []
            if req.at_frontier:
                if i not in results:
                    a, b = inp.logits_ranges[i]
                    results[i] = self._verify_tree(seq, tree, logits[a:b])
                accepted = results[i].accepted
                emitted.append((seq, self._commit(seq, tree, results[i])))
                accepted_total += len(accepted)
            else:
                seq.num_computed += req.num_new_tokens
            if not seq.is_finished:
                self._tell_drafter(seq, req, tree, accepted, start, inp.row_starts[i], hidden)
        return emitted, accepted_total

    def _tell_drafter(self, seq, req, tree, accepted, start: int, row0: int, hidden) -> None:
        """on_verified with what the step committed; a failing drafter fails the request."""
        if hidden:
            fed = req.num_new_tokens
            rows = torch.tensor([*range(row0, row0 + fed), *(row0 + fed + a for a in accepted)],
                                device=self.device)
            hidden = {layer: h.index_select(0, rows) for layer, h in hidden.items()}
        step = VerifiedStep(seq.token_ids, seq.num_computed, seq.num_computed - start,
                            tree.num_nodes if tree is not None else 0, len(accepted), hidden)
        if not self.drafting.on_verified(seq, step):
            self._finish(seq)

    def _sample_plain(self, scheduled, plain: list[int], inp: ModelInput, logits) -> dict:
        """Requests without a tree: one batched argmax / sample for all of them."""
        if not plain:
            return {}
        rows = torch.tensor([inp.logits_ranges[i][0] for i in plain], device=logits.device)
        sub = logits.index_select(0, rows)
        params = [scheduled[i].seq.params for i in plain]
        tokens = sub.argmax(dim=-1)
        sampled = [j for j, p in enumerate(params) if not p.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            probs = logits_to_probs(sub.index_select(0, idx),
                                    *params_to_tensors([params[j] for j in sampled], logits.device))
            draws = sample(probs, [scheduled[plain[j]].seq.generator for j in sampled])
            tokens[idx] = draws
        return {i: VerifyResult([], [t]) for i, t in zip(plain, tokens.tolist())}

    def _verify_tree(self, seq: Sequence, tree: DraftTree, rows: torch.Tensor) -> VerifyResult:
        probs = None
        if not seq.params.greedy:
            probs = logits_to_probs(rows, *params_to_tensors([seq.params] * rows.shape[0], rows.device))
        return self.verifier.verify(tree, rows, probs, seq.generator)

    def _commit(self, seq: Sequence, tree, result: VerifyResult) -> int:
        """Move accepted nodes' KV into place, append tokens, stop or shrink; returns #appended."""
        n = seq.num_tokens
        k = len(result.accepted)
        moves = [(n + a, n + j) for j, a in enumerate(result.accepted) if a != j]
        if moves:
            self.kv_cache.move_slots(*self._slots(seq, moves))
        appended = self.stopper.append_and_check(seq, result.tokens)
        seq.num_computed = n + k
        seq.num_steps_decoding += 1
        m = tree.num_nodes if tree is not None else 0
        seq.draft_tokens_proposed += m
        seq.last_accepted = k
        _count_depths(seq, k)
        now = time.perf_counter()
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.emissions.append((now, appended))
        if seq.finish_reason is not None:
            self._finish(seq)
        else:
            self.kv.truncate(seq.block_table, seq.num_computed)
        return appended

    def _slots(self, seq: Sequence, moves: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        pages, ps = seq.block_table.pages, self.config.page_size
        return [slot_of(pages, s, ps) for s, _ in moves], [slot_of(pages, d, ps) for _, d in moves]

    def _finish(self, seq: Sequence) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        self.drafting.release(seq)
        self.scheduler.finish(seq)
        seq.times.finished = time.perf_counter()


def _count_depths(seq: Sequence, k: int) -> None:
    while len(seq.accepted_by_depth) < k:
        seq.accepted_by_depth.append(0)
    for d in range(k):
        seq.accepted_by_depth[d] += 1


def _max_model_len(config: EngineConfig, cfg) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)  # attention here is full; stay inside the window
    if config.max_model_len is None:
        return min(limit, 4096)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len


def _default_kv_memory(config: EngineConfig, cfg, max_model_len: int, dtype) -> int:
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    one_request = per_token * max_model_len
    return max(one_request, min(DEFAULT_KV_MEMORY_CAP, one_request * config.max_num_seqs))

