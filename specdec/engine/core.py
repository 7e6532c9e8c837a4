"""The engine: requests in, one step at a time, tokens out.

``step()`` runs the stages in order, each over the step's records (one per scheduled request:
``specdec.engine.step.StepRequest``), data moving one way:

    schedule   Scheduler: rows, admissions (prefix hits), preemptions, budgets
               (ControllerStage: the controller's, checked and clipped; idle requests)
    draft      DrafterStage: drafter.propose -> one tree per request; ControllerStage: pruning
    forward    ModelRunner: one target forward over every request's new rows and tree nodes
    verify     VerifyStage: one verifier call -> accepted path + emitted tokens per request
    output     OutputStage: tokens appended, stop conditions, per-request counts
    commit     CommitStage: accepted KV into place, pages named, finished requests freed
    feedback   DrafterStage: drafter.on_verified; StepRecorder (stats); ControllerStage:
               controller.observe, then release of the requests that ended; step observers

What goes wrong in a stage's plugin calls comes back as a value (``specdec.engine.step.Failures``)
and the step's failed requests end in one place (``LLMEngine._fail``).

What the stages run with is built once by ``specdec.engine.build.build_engine``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from specdec import plugins, randomness
from specdec.config import EngineConfig
from specdec.engine.batch import build_forward_batch
from specdec.engine.build import build_engine
from specdec.engine.commit_stage import CommitStage
from specdec.engine.drafting.controller_stage import ControllerStage
from specdec.engine.drafting.drafter_stage import DrafterStage
from specdec.engine.output_stage import OutputStage
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence
from specdec.engine.step import Failures
from specdec.engine.step_stats import StepRecorder, StepTimes
from specdec.kv.prefix import root_key
from specdec.logits.setup import LogitsSetup
from specdec.metrics import StepStats
from specdec.sampling_params import RequestError, SamplingParams


@dataclass
class StepResult:
    emitted: list[tuple[Sequence, int]]  # requests that got tokens this step, and how many
    finished: list[Sequence]  # requests that ended this step (any reason)
    stats: StepStats


def _part(name: str, doc: str) -> property:
    """A read-only engine attribute that reads ``engine.parts.<name>``."""
    def get(self):
        return getattr(self.parts, name)

    return property(get, doc=doc)


class _Closed:
    """What a closed engine holds in place of its parts and stages: any use says so."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"this LLM was closed (LLM.close() or the end of its 'with' block): "
                           f"its model, KV and stages are gone ({name!r}); make a new one")


class LLMEngine:
    # what the engine was built with, read-only: the public names of docs/api.md ("Public
    # surface") over ``parts`` (specdec.engine.build.EngineParts), which may change shape
    activations = _part("activations", 'what the target\'s blocks multiply: "float" | "q8"')
    weights = _part("weights", 'the target\'s weights: "native", "dequantized" or a quantize '
                    "mode")
    draft_weights = _part("draft_weights", 'a learned drafter\'s matrices: "none", "float" or '
                          "a quantized mode")
    kernels = _part("kernels", "the matmul kernels every model runs with")
    tier = _part("tier", "the second KV tier (DiskTier | HostTier), or None")
    runner = _part("runner", "the target's ModelRunner")
    drafter_runners = _part("drafter_runners", "the drafter's ModelRunners (maybe none)")
    device = _part("device", "the torch.device the engine runs on")
    kv_split = _part("kv_split", "the KV budget's split over the runners (KVSplit)")
    model = _part("model", "the target model (LlamaDecoder)")
    max_model_len = _part("max_model_len", "the most tokens (prompt + output) of a request")
    weight_bytes_per_forward = _part("weight_bytes_per_forward",
                                     "bytes of matrices one target and drafter forward stream")

    def __init__(self, config: EngineConfig, plugins_: tuple = ()) -> None:
        self.config = config
        p = self.parts = build_engine(config, plugins_)  # what the step runs with (read-only)
        self.kv = p.runner.kv  # the target's KV: its pages, block tables and prefix cache
        self.tokenizer = p.tokenizer
        # the stages (wired here: none holds another)
        self.drafting = DrafterStage(p.drafter, p.model_config.vocab_size)
        self.controlling = ControllerStage(p.controller, p.drafter is not None, p.sources,
                                           p.max_model_len)
        self.verifying = p.verifier
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_prefix_caching, self._restore,
                                   self.drafting.release)
        self.outputs = OutputStage(p.model_config.eos_token_ids, p.max_model_len, p.tokenizer)
        self.logits = LogitsSetup(p.tokenizer, p.model_config.vocab_size,
                                  tuple(p.model_config.eos_token_ids))
        self.commits = CommitStage(self.kv, config.page_size, config.enable_prefix_caching,
                                   self.drafting.release, self.scheduler.finish)
        self.recorder = StepRecorder(self.kv, p.tier, p.tp)
        self.totals = self.recorder.totals
        # requests
        self.requests: dict[str, Sequence] = {}
        self.samples: dict[str, list[str]] = {}  # request id -> its samples' sequence ids
        self.plugin_errors: list[str] = []  # plugin failures no request could be failed for
        self.faults = plugins.Faults()  # every exception a plugin raised: counted, logged once
        self.closed = False
        self._ids = itertools.count()
        self._seeds = None if config.seed is None else torch.Generator().manual_seed(config.seed)

    def close(self) -> None:
        """Let go of what outlives a step: the disk tier's file and its lock (a later engine
        on the same path may open it), and the memory: the model, its weights and kernels,
        the drafter, the KV (``_release``), the other ranks of a tensor-parallel engine (they
        end). Requests still running are aborted (their pages go
        back) and every request is forgotten; afterwards the engine refuses new work
        (``check_open``). Twice is fine."""
        if self.closed:
            return
        for request_id in list(self.samples):
            self.abort(request_id)
        self.requests.clear()
        self.samples.clear()
        self.closed = True
        if self.parts.tier is not None:
            self.kv.detach_tier()  # no eviction or admission reaches the closed tier
            self.parts.tier.close()
        if self.parts.tp is not None:
            self.parts.tp.close()  # the other ranks leave their loop and end
        self._release()

    def _release(self) -> None:
        """Memory goes back at close, not when the engine object does: every runner's KV
        tensor is emptied, and the parts and the stages (which reach the model, the
        drafter and the KV) are dropped; config, tokenizer, totals and errors stay."""
        for runner in (self.parts.runner, *self.parts.drafter_runners):
            runner.kv.cache.tensor = runner.kv.cache.tensor.new_empty(0)
        gone = _Closed()
        self.parts = self.kv = self.drafting = self.controlling = self.verifying = gone
        self.scheduler = self.outputs = self.commits = self.recorder = gone

    def check_open(self) -> None:
        """RuntimeError once ``close()`` ran: a closed engine takes no new work."""
        if self.closed:
            raise RuntimeError("this LLM was closed (LLM.close() or the end of its 'with' "
                               "block): it takes no new requests; make a new one")

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request (``params.n`` samples of the prompt: sequences ``request_id`` and,
        for n > 1, ``request_id/1`` .. ``request_id/n-1``, listed by ``samples_of``);
        ValueError (and no change to the engine) if it is malformed; RuntimeError once the
        engine is closed."""
        self.check_request(prompt_token_ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        ids = [request_id] + [f"{request_id}/{i}" for i in range(1, params.n)]
        if request_id in self.samples or any(i in self.requests for i in ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        root = root_key(self.parts.cache_namespace, params.cache_salt)
        seed = None if params.greedy else _seed(params, self._seeds)
        # each sample its own processing state (a grammar compiles here: ValueError if not)
        processing = [self.logits.make(params, list(prompt_token_ids)) for _ in ids]
        leader = None
        for i, sid in enumerate(ids):
            sample_seed = None if seed is None else (
                seed if i == 0 else randomness.splitmix64(seed ^ i) & (2**63 - 1))
            seq = Sequence(sid, list(prompt_token_ids), params, sample_seed, cache_root=root,
                           leader=leader, sample_index=i, logits=processing[i])
            leader = leader or seq
            self.requests[sid] = seq
            self.scheduler.add(seq)
        self.samples[request_id] = ids
        return request_id

    def samples_of(self, request_id: str) -> list[str]:
        """The sequence ids of a request's samples (``[request_id]`` when n == 1)."""
        return self.samples.get(request_id, [request_id])

    def check_request(self, ids, params: SamplingParams) -> None:
        """RequestError (a ValueError naming the field: a SamplingParams one, or "prompt") for
        a request this engine cannot run, TypeError for params that are not SamplingParams
        (nothing is queued); RuntimeError once the engine is closed."""
        self.check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not params.greedy and not self.verifying.supports_sampling:
            raise RequestError("temperature", f"verifier {self.verifying.name} verifies greedy "
                               f"requests only; temperature={params.temperature} needs a "
                               "sampling verifier (e.g. verifier='gumbel')")
        self.logits.check(params)
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError("prompt", "prompt is empty: at least one token is required")
        vocab, max_model_len = self.parts.model_config.vocab_size, self.parts.max_model_len
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in ids):
            raise RequestError("prompt", f"prompt token ids must be ints in [0, {vocab})")
        if len(ids) >= max_model_len:
            raise RequestError(
                "prompt", f"prompt has {len(ids)} tokens but max_model_len is "
                f"{max_model_len}: at most {max_model_len - 1} prompt tokens are allowed")

    def abort(self, request_id: str) -> None:
        """End a request (all its samples) now; its pages go back at once, and the controller
        forgets it at once (between steps: no step's observe comes first). Nothing to do once
        the engine is closed (close() aborted every request)."""
        if self.closed:
            return
        ended, failures = [], Failures()
        for sid in self.samples_of(request_id):
            seq = self.requests.get(sid)
            if seq is not None and not seq.is_finished:
                seq.finish_reason = "abort"
                failures.add(self.commits.finish(seq))
                ended.append(seq)
        failures.add(self.controlling.release(ended))
        self.faults.add(failures.raised)
        self.plugin_errors += failures.reports

    def has_unfinished(self) -> bool:
        return not self.closed and self.scheduler.has_work()

    def pop_finished(self, request_id: str) -> Sequence:
        """A finished sequence, forgotten by the engine (a request's samples: ``samples_of``)."""
        seq = self.requests.pop(request_id)
        assert seq.is_finished
        group = request_id if seq.leader is None else seq.leader.request_id
        if not any(i in self.requests for i in self.samples_of(group)):
            self.samples.pop(group, None)
        return seq

    # ---- one step ---------------------------------------------------------------------------

    def transfers(self) -> tuple[int, int]:
        """(host -> device copies, device -> host reads) made so far: every runner's staged
        inputs and KV moves, and verification's reads (what a GPU copies; counted on a CPU)."""
        runners = [self.parts.runner, *self.parts.drafter_runners]
        h2d = sum(r.staging.copies + r.kv.cache.copies for r in runners)
        return h2d, self.verifying.reads

    def step(self) -> StepResult:
        """One step (module docstring). Each stage returns what went wrong in its plugin calls
        (``Failures``); they are gathered here, and the step's failed requests end together
        after the forward (``_fail``), left out of every stage after the one that failed them."""
        self.check_open()
        times, moved = StepTimes(time.perf_counter()), self.transfers()
        self.recorder.begin()  # (tensor parallel: the collectives' counts)
        sched = self.scheduler.schedule(self.controlling.budgets)
        stop, failures = self.controlling.idle(sched.scheduled)
        failures.add(sched.failures).add(self.drafting.stop(stop))
        times.scheduled = time.perf_counter()
        records = [r for r in sched.scheduled if r.seq not in failures]
        failures.add(self.drafting.propose(records))
        records = [r for r in records if r.seq not in failures]
        self.controlling.prune(records, sched.composition)
        self.scheduler.trim_drafts(records)
        if not records and not failures.requests and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress: no request fits the KV cache "
                               f"({self.kv.num_free_pages} of {self.kv.num_pages} pages free)")
        times.drafted = time.perf_counter()
        times.skip_forward()
        out = None
        if records:
            out = self.parts.runner.forward(
                build_forward_batch(records, self.config.page_size, self.parts.device,
                                    self.parts.runner.graphs),
                self.drafting.hidden_layers_for(records))
            times.forwarded = time.perf_counter()
            failures.add(self.verifying.verify(records, out.logits))
            times.verified = time.perf_counter()
            self.outputs.append(records)
            failures.add(self.commits.commit(records))
            times.committed = time.perf_counter()
            fed = [r for r in records if r.seq not in failures]  # (a failed verification)
            failures.add(self.drafting.on_verified(fed, out.hidden))
            times.fed_back = time.perf_counter()
        failed = self._fail(failures)
        now = self.transfers()
        # (on CUDA the forward's events are done by now: verification read what it computed)
        stats = self.recorder.record(records, sched, failed, times,
                                     None if out is None else out.graphed,
                                     (now[0] - moved[0], now[1] - moved[1]),
                                     None if out is None else out.seconds,
                                     None if out is None else out.woken_counts())
        self.controlling.observe(records, stats, self.drafting.source_seconds)
        ended = list(dict.fromkeys([*failed, *(r.seq for r in records if r.seq.is_finished)]))
        failures.add(self.controlling.release(ended))  # after observe: it heard their outcome
        stats.plugin_errors = [str(r) for r in failures.raised]
        reports, raised = plugins.notify_step_end(self.parts.pm, stats)
        stats.plugin_errors += [str(r) for r in raised]  # (after the observers saw the stats)
        self.faults.add(failures.raised + raised)
        self.plugin_errors += reports + failures.reports
        emitted = [(r.seq, r.appended) for r in records if r.result is not None]
        return StepResult(emitted, ended, stats)

    def _fail(self, failures: Failures) -> list[Sequence]:
        """The step's failed requests end here, all of them (finish_reason "error", the message
        naming the plugin); returns them."""
        failed = [seq for seq in failures.requests if not seq.is_finished]
        for seq in failed:
            seq.finish_reason, seq.error = "error", failures.requests[seq]
            finished = self.commits.finish(seq)  # (no request left to fail: reports only)
            failures.reports += finished.reports
            failures.raised += finished.raised
        return failed

    def _restore(self, seq: Sequence, keys: list[bytes]) -> tuple[int, Failures]:
        """The scheduler's RestoreFn: the drafter restores what it can of a prefix hit; where
        it restored part of it, the controller decides whether the target recomputes the rest
        for the drafter (``keep_drafting``) or reuses it all and the request decodes on without
        drafts."""
        pages, failures = self.drafting.restore(seq, keys)
        missing = (len(keys) - pages) * self.config.page_size
        if missing and seq.drafting.ready:
            keep, asked = self.controlling.keep_drafting(seq, missing)
            failures.add(asked)
            if not keep:
                return len(keys), failures.add(self.drafting.stop([seq]))
        return pages, failures


def _seed(params: SamplingParams, seeds: torch.Generator | None) -> int:
    """A sampled request's seed: its own, else one drawn from the engine's ``seed``."""
    if params.seed is not None:
        return params.seed
    return int(torch.randint(2**62, (), generator=seeds).item())
