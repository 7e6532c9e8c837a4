"""The engine: requests in, one draft -> verify step at a time, tokens out.

    schedule (rows, admissions, then controller budgets) -> drafter.propose -> one target
    forward over every request's new rows and tree nodes (ModelRunner) -> one verifier call for
    the batch -> commit accepted KV (KVManager), append tokens, stop -> drafter.on_verified ->
    controller.observe -> step observers

Every request's part in a step is one record (`specdec.step.StepRequest`).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import plugins, randomness
from specdec.batch import build_forward_batch
from specdec.config import EngineConfig
from specdec.controllers.base import ControllerContext
from specdec.costs import StepCosts
from specdec.drafters.base import TargetInfo
from specdec.drafting import DraftStage
from specdec.kv.fingerprint import weights_fingerprint
from specdec.kv.host_tier import HostTier
from specdec.kv.prefix import root_key
from specdec.kv.tier import DiskTier
from specdec.memory import KVSplit, split_kv
from specdec.metrics import EngineTotals, StepStats
from specdec.models.aliases import GGUF_NAME
from specdec.models.config import model_config_from_hf
from specdec.models.draft_weights import draft_panels, mode_of
from specdec.models.gguf_weights import native_panels
from specdec.models.kernel_choice import install_kernels
from specdec.models.linear import LinearKernels
from specdec.models.loader import load_hf_config, load_model, resolve_model_path
from specdec.models.prepared import PreparedLinears
from specdec.models.tokenizer import load_tokenizer
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence
from specdec.step import StepRequest
from specdec.step_profile import engine_step_costs
from specdec.stopping import StopChecker
from specdec.verification import VerifyStage

DEFAULT_KV_MEMORY_CAP = 1 << 30
logger = logging.getLogger("specdec")


@dataclass
class StepResult:
    emitted: list[tuple[Sequence, int]]  # requests that got tokens this step, and how many
    finished: list[Sequence]  # requests that ended this step (any reason)
    stats: StepStats


class LLMEngine:
    def __init__(self, config: EngineConfig, plugins_: tuple = ()) -> None:
        self.config = config
        self.dtype = config.torch_dtype
        self.device = torch.device(config.device)
        _check_device(self.device)
        self.pm = plugins.get_plugin_manager(plugins_)
        folder = resolve_model_path(config.model)
        self.model_config = cfg = model_config_from_hf(load_hf_config(folder))
        self.max_model_len = _max_model_len(config, cfg)
        self.model, _, self.hf_config = load_model(folder, self.dtype, self.device,
                                                   self.max_model_len)
        self.tokenizer = load_tokenizer(folder)
        self.runner = self._new_runner(self.model, "target")
        self.drafter_runners: list[ModelRunner] = []
        target = TargetInfo(self.model, cfg, self.hf_config, self.tokenizer, str(folder),
                            self.dtype, self.device, config.page_size, self.max_model_len,
                            self._drafter_runner)
        self.verifying = VerifyStage.create(self.pm, config.verifier, cfg.vocab_size)
        drafter, controller = DraftStage.plugins(self.pm, config, target)  # may add runners
        self.kv_split = self._allocate_kv()
        self._enable_cuda_graphs()
        draft_models = self._draft_models(drafter)
        adopted = self._native_weights(folder)
        self.weights = "native" if adopted else "dequantized"
        quantized = self._draft_weights(draft_models, adopted)
        self.draft_weights = ("none" if not draft_models else
                              mode_of(quantized) if quantized else "float")
        self.kernels = self._install_kernels(getattr(drafter, "matmul_models", ()),
                                             adopted + quantized)
        self.kv = self.runner.kv
        self.drafting = DraftStage(drafter, controller, cfg.vocab_size, self.max_model_len,
                                   self.kv)
        if drafter is not None and hasattr(controller, "setup"):
            controller.setup(ControllerContext(self.step_costs, str(self.device),
                                               config.max_num_seqs,
                                               config.max_num_batched_tokens,
                                               sources=self.drafting.sources))
        # everything that changes the KV a token sequence leaves, and its layout per page
        # (pages are shared only within one namespace; a tier file of another is replaced)
        self.cache_namespace = "|".join(map(str, (
            folder.resolve(), weights_fingerprint(folder), self.dtype, self.weights,
            config.activations, config.linear_kernels, tuple(self.kv.cache.tensor[:, 0].shape))))
        self.tier = self._open_tier()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_prefix_caching, self.drafting.restore,
                                   self.drafting.release)
        self.stopper = StopChecker(cfg.eos_token_ids, self.max_model_len, self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.samples: dict[str, list[str]] = {}  # request id -> its samples' sequence ids
        self.totals = EngineTotals()
        self._evicted = 0  # the pool's evictions counted into step stats so far
        self._tier_seen = (0, 0, 0.0)  # the tier's (hits, stores, seconds) counted so far
        self.plugin_errors: list[str] = []
        self._ids = itertools.count()
        self._seeds = None if config.seed is None else torch.Generator().manual_seed(config.seed)

    def _open_tier(self) -> DiskTier | HostTier | None:
        """The second KV tier below the target's KV (EngineConfig.kv_tier_path: a file on
        disk; kv_host_tier_bytes: host memory), if asked for. Drafters' own caches have none:
        after a hit they restore what they still hold in memory (specdec.drafters.base,
        "Prefix caching")."""
        c = self.config
        if c.kv_host_tier_bytes is not None:
            tier = HostTier(self.runner.bytes_per_page, c.kv_host_tier_bytes, self.device)
        elif c.kv_tier_path is not None:
            tier = DiskTier(c.kv_tier_path, self.runner.bytes_per_page, c.kv_tier_bytes,
                            self.cache_namespace)
        else:
            return None
        self.kv.attach_tier(tier)
        return tier

    def _new_runner(self, model, name: str, num_layers: int | None = None) -> ModelRunner:
        return ModelRunner(model, name, self.config.attention_backend, self.config.page_size,
                           self.device, num_layers)

    def _drafter_runner(self, model, name: str = "drafter",
                        num_layers: int | None = None) -> ModelRunner:
        """`TargetInfo.new_runner`: a drafter's runner, allocated with the target's."""
        runner = self._new_runner(model, name, num_layers)
        self.drafter_runners.append(runner)
        return runner

    def _allocate_kv(self) -> KVSplit:
        """One memory budget, the same pages for the target and every drafter runner."""
        runners = [self.runner, *self.drafter_runners]
        names = [r.name if i == 0 else f"drafter {r.name}" for i, r in enumerate(runners)]
        per_page = dict(zip(names, (r.bytes_per_page for r in runners)))
        c = self.config
        memory = c.kv_cache_memory
        if c.num_pages is None and memory is None:
            per_token = sum(per_page.values()) // c.page_size
            one = per_token * self.max_model_len
            memory = max(one, min(DEFAULT_KV_MEMORY_CAP, one * c.max_num_seqs))
        split = split_kv(per_page, c.page_size, self.max_model_len, memory, c.num_pages)
        for runner in runners:
            runner.allocate(split.num_pages)
        logger.info(split.describe())
        return split

    def _enable_cuda_graphs(self) -> None:
        """CUDA graphs for every runner whose attention backend supports them (on CUDA, unless
        ``cuda_graphs`` is off); the others stay eager."""
        c = self.config
        if not c.cuda_graphs or self.device.type != "cuda":
            return
        for runner in [self.runner, *self.drafter_runners]:
            if runner.backend.supports_cuda_graphs:
                runner.enable_cuda_graphs(c.max_num_seqs, c.max_num_batched_tokens,
                                          self.max_model_len)

    def _native_weights(self, folder: Path) -> list:
        """The GGUF panels ``EngineConfig.weights`` gives the target (specdec.models.
        gguf_weights) and, unless it says "dequantized", a draft model loaded from a GGUF too
        (as "auto": where they can run)."""
        c = self.config
        adopted = native_panels(self.model, folder / GGUF_NAME, c.weights, self.dtype,
                                self.device, c.linear_kernels, c.activations)
        if c.weights != "dequantized":
            for runner in self.drafter_runners:
                m = runner.model
                if m is not self.model and getattr(m, "source_folder", None) is not None:
                    adopted += native_panels(m, m.source_folder / GGUF_NAME, "auto", self.dtype,
                                             self.device, c.linear_kernels, c.activations,
                                             strict=False)
        return adopted

    def _draft_models(self, drafter) -> list:
        """The models a drafter computes with besides the target (its runners' models, e.g. an
        EAGLE-3 head, and its ``matmul_models``, e.g. MTP heads)."""
        models = [r.model for r in self.drafter_runners if r.model is not self.model]
        return list(dict.fromkeys([*models, *getattr(drafter, "matmul_models", ())]))

    def _draft_weights(self, models: list, adopted: list) -> list:
        """Quantized panels (``EngineConfig.draft_weights``, specdec.models.draft_weights) for
        the draft models whose matrices have no panels yet (a draft model from a GGUF computes
        with the file's own blocks)."""
        have = {id(w) for w, _ in adopted}
        models = [m for m in models if not any(id(w) in have for w in m.matrices())]
        return draft_panels(models, self.config.draft_weights, self.dtype, self.device,
                            self.config.linear_kernels, self.config.activations)

    @property
    def activations(self) -> str:
        """What the GGUF's blocks multiply ("float" | "q8": EngineConfig.activations)."""
        return self.config.activations

    @property
    def weight_bytes_per_forward(self) -> int:
        """Bytes of target and drafter matrices one forward of each streams: the prepared
        panels (native GGUF blocks or fp32/bf16 panels), else the models' weights."""
        return getattr(self.kernels, "weight_bytes", None) or sum(
            w.numel() * w.element_size() for r in [self.runner, *self.drafter_runners]
            for w in r.model.matrices())

    def _install_kernels(self, extra_models=(), adopted=()) -> LinearKernels | PreparedLinears:
        """The matmul hook of every runner's model and of a drafter's ``matmul_models`` (e.g. MTP
        heads), chosen by ``EngineConfig.linear_kernels`` (specdec.models.kernel_choice), with
        the target's native GGUF panels where ``EngineConfig.weights`` takes them."""
        models = [*(r.model for r in [self.runner, *self.drafter_runners]), *extra_models]
        return install_kernels(models, self.config.linear_kernels, self.dtype, self.device,
                               adopted)

    def step_costs(self) -> StepCosts:
        """The target's forward seconds by rows on this machine (specdec.step_profile: profiled
        once within what this engine's KV and max_model_len allow, cached)."""
        return engine_step_costs(self)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request (``params.n`` samples of the prompt: sequences ``request_id`` and,
        for n > 1, ``request_id/1`` .. ``request_id/n-1``, listed by ``samples_of``);
        ValueError (and no change to the engine) if it is malformed."""
        self.check_request(prompt_token_ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        ids = [request_id] + [f"{request_id}/{i}" for i in range(1, params.n)]
        if request_id in self.samples or any(i in self.requests for i in ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        root = root_key(self.cache_namespace, params.cache_salt)
        seed = None if params.greedy else self._seed(params)
        leader = None
        for i, sid in enumerate(ids):
            sample_seed = None if seed is None else (
                seed if i == 0 else randomness.splitmix64(seed ^ i) & (2**63 - 1))
            seq = Sequence(sid, list(prompt_token_ids), params, sample_seed, cache_root=root,
                           leader=leader, sample_index=i)
            leader = leader or seq
            self.requests[sid] = seq
            self.scheduler.add(seq)
        self.samples[request_id] = ids
        return request_id

    def samples_of(self, request_id: str) -> list[str]:
        """The sequence ids of a request's samples (``[request_id]`` when n == 1)."""
        return self.samples.get(request_id, [request_id])

    def _seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        return int(torch.randint(2**62, (), generator=self._seeds).item())

    def check_request(self, ids, params: SamplingParams) -> None:
        """ValueError/TypeError for a request this engine cannot run (nothing is queued)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not params.greedy and not self.verifying.supports_sampling:
            raise ValueError(f"verifier {self.verifying.name} verifies greedy requests only; "
                             f"temperature={params.temperature} needs a sampling verifier "
                             "(e.g. verifier='gumbel')")
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                f"at most {self.max_model_len - 1} prompt tokens are allowed"
            )

    def abort(self, request_id: str) -> None:
        """End a request (all its samples) now; its pages go back at once."""
        for sid in self.samples_of(request_id):
            seq = self.requests.get(sid)
            if seq is not None and not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        self.drafting.release_ended()  # between steps: no step's observe comes first

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def pop_finished(self, request_id: str) -> Sequence:
        """A finished sequence, forgotten by the engine (a request's samples: ``samples_of``)."""
        seq = self.requests.pop(request_id)
        assert seq.is_finished
        group = request_id if seq.leader is None else seq.leader.request_id
        if not any(i in self.requests for i in self.samples_of(group)):
            self.samples.pop(group, None)
        return seq

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> StepResult:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(self.drafting.budgets)
        failed = self.drafting.propose(sched.scheduled) + [
            s for s in sched.preempted if s.finish_reason == "error"]
        for seq in failed:
            self._finish(seq)
        records = [r for r in sched.scheduled if not r.seq.is_finished]
        if not records and not failed and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress: no request fits the KV cache "
                               f"({self.kv.num_free_pages} of {self.kv.num_pages} pages free)")
        t1 = time.perf_counter()
        t2 = t3 = t1
        if records:
            out = self.runner.forward(build_forward_batch(records, self.config.page_size,
                                                          self.device),
                                      self.drafting.hidden_layers)
            t2 = time.perf_counter()
            self.verifying.verify(records, out.logits)
            self._commit(records)
            t3 = time.perf_counter()
            self.drafting.on_verified(records, out.hidden)
        for rec in records:
            if rec.seq.finish_reason == "error" and not rec.seq.is_finished:
                failed.append(rec.seq)
                self._finish(rec.seq)
        stats = self._stats(records, sched.preempted, failed, (t0, t1, t2, t3))
        self._prefix_stats(stats, sched)
        self.totals.add(stats)
        self.drafting.observe(records, stats)
        self._controller_figures(stats)
        self.plugin_errors += plugins.notify_step_end(self.pm, stats) + self.drafting.errors
        self.drafting.errors = []
        emitted = [(r.seq, r.appended) for r in records if r.result is not None]
        finished = list(dict.fromkeys(
            [*failed, *(r.seq for r in records if r.seq.is_finished)]))
        return StepResult(emitted, finished, stats)

    def _commit(self, records: list[StepRequest]) -> None:
        """Append each frontier request's tokens (stop conditions apply) and commit its KV;
        advance prefill chunks."""
        now = time.perf_counter()
        commits = []
        for rec in records:
            seq = rec.seq
            if rec.result is None:
                if not rec.at_frontier:
                    seq.num_computed += rec.num_new_tokens
                continue
            n, accepted = seq.num_tokens, rec.result.accepted
            rec.appended = self.stopper.append_and_check(seq, rec.result.tokens)
            seq.num_computed = n + len(accepted)
            _count(seq, rec, now)
            if seq.finish_reason is not None:
                self._finish(seq, final_slots=n)  # the accepted nodes' KV was not moved
            else:
                commits.append((seq.block_table, n, accepted))
        self.kv.commit_all(commits)
        if self.config.enable_prefix_caching:
            self._register_pages(records)

    def _register_pages(self, records: list[StepRequest]) -> None:
        for rec in records:
            if not rec.seq.is_finished:
                self._register(rec.seq, rec.seq.num_computed)

    def _register(self, seq: Sequence, final_slots: int) -> None:
        """Name the full pages below ``final_slots`` (KV that will never be written again), so
        later requests with the same prefix reuse them (``specdec.kv.prefix``)."""
        ps = self.config.page_size
        full = min(final_slots // ps, len(seq.block_table.pages))
        if self.config.enable_prefix_caching and full > seq.block_table.num_keyed:
            self.kv.register_full(seq.block_table, seq.keys(ps, full), final_slots)

    def _stats(self, records, preempted, failed, times) -> StepStats:
        t0, t1, t2, t3 = times
        frontier = [r for r in records if r.result is not None]
        return StepStats(
            step=self.totals.steps, num_requests=len(records),
            num_decode=sum(1 for r in records if r.at_frontier and r.num_new_tokens == 1),
            num_prefill_tokens=sum(r.num_new_tokens for r in records if r.num_new_tokens > 1),
            num_draft_nodes=sum(r.num_nodes for r in records),
            num_verified_rows=sum(1 + r.num_nodes for r in frontier),
            num_accepted=sum(r.num_accepted for r in frontier),
            num_emitted=sum(r.appended for r in frontier),
            num_draft_no_kv=sum(1 for r in records if r.no_kv),
            draft_seconds=t1 - t0, forward_seconds=t2 - t1, verify_seconds=t3 - t2,
            step_seconds=time.perf_counter() - t0, num_preempted=len(preempted),
            failed_requests=[s.request_id for s in dict.fromkeys(failed)],
        )

    def _prefix_stats(self, stats: StepStats, sched) -> None:
        stats.num_lookup_tokens, stats.num_lookup_pages = sched.lookup_tokens, sched.lookup_pages
        stats.num_cached_tokens, stats.num_cached_pages = sched.cached_tokens, sched.cached_pages
        pool = self.kv.pool
        stats.num_evicted_pages, self._evicted = pool.num_evicted - self._evicted, pool.num_evicted
        if self.tier is not None:
            now = (self.tier.hits, self.tier.stores, self.tier.seconds)
            stats.tier_hits, stats.tier_stores, stats.tier_seconds = (
                a - b for a, b in zip(now, self._tier_seen))
            self._tier_seen = now
        self.kv.observe_prefill(stats.forward_seconds, stats.num_prefill_tokens,
                                stats.num_prefill_tokens + stats.num_decode)

    def _controller_figures(self, stats: StepStats) -> None:
        decision = getattr(self.drafting.controller, "decision", None)
        if self.drafting.drafter is not None and isinstance(decision, dict) and decision:
            stats.controller = dict(decision)

    def _finish(self, seq: Sequence, final_slots: int | None = None) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        self._register(seq, seq.num_computed if final_slots is None else final_slots)
        self.drafting.end(seq)
        self.scheduler.finish(seq)
        seq.times.finished = time.perf_counter()


def _count(seq: Sequence, rec: StepRequest, now: float) -> None:
    """Per-request metrics of one verification."""
    k = rec.num_accepted
    seq.num_steps_decoding += 1
    seq.draft_tokens_proposed += rec.num_nodes
    seq.last_proposed, seq.last_accepted = rec.num_nodes, k
    while len(seq.accepted_by_depth) < k:
        seq.accepted_by_depth.append(0)
    for d in range(k):
        seq.accepted_by_depth[d] += 1
    if seq.times.first_token is None:
        seq.times.first_token = now
    seq.times.emissions.append((now, rec.appended))


def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} but CUDA is not available here (torch "
                         f"{torch.__version__}); use device 'cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    # streams, graph captures and flashinfer's JIT follow the current device: make it ours
    torch.cuda.set_device(device)


def _max_model_len(config: EngineConfig, cfg) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)  # attention here is full; stay inside the window
    if config.max_model_len is None:
        return min(limit, 4096)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len
