"""The verify stage of a step: one verifier call for every request at its frontier.

Builds the batch-flat `VerifyBatch` from the step's records and the target logits: each
request's logit options (penalties, bias, bans, grammar: ``specdec.logits``) are applied to its
rows along each node's path, after its raw rows are kept for logprobs; then each sampled
request's temperature / top-k / top-p / min-p, calls the configured verifier
(the `verifier` engine option picks it from the registry) and checks what comes back. A verifier
that raises, or returns something that is not an accepted root path of the request's tree, fails
only the request concerned (found by retrying request by request), naming the plugin.
"""

from __future__ import annotations

import torch

from specdec import plugins
from specdec.engine.step import Failures, StepRequest
from specdec.logits.logprobs import token_logprobs
from specdec.sampling import logits_to_probs, params_to_tensors
from specdec.tree import DraftTree
from specdec.tree_read import read_to_host
from specdec.verifiers.base import VerifyBatch, VerifyOutput, VerifyResult, host_copy

_EMPTY = DraftTree.empty()


class VerifyStage:
    def __init__(self, verifier, vocab_size: int) -> None:
        self.verifier = verifier
        self.vocab_size = vocab_size
        # device -> host reads of verification so far (VerifyBatch.to_host; counted on a CPU
        # too, where they copy nothing: the CPU rehearsal counts what a GPU would read)
        self.reads = 0
        self._along: list[DraftTree] = []  # trees whose tokens the next read brings along

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host, in the step's one read: the first int64 tensor a verifier reads
        brings along what the step's drafts left on the device (``DraftTree.on_device``: tokens,
        parents, path probabilities), so that they cost no read of their own."""
        self.reads += 1
        along = [x for x in self._along if not (x.tokens_on_host and x.shape_on_host)]
        self._along = []
        if not along or t.dtype != torch.int64 or any(x.tokens.device != t.device
                                                      for x in along):
            return host_copy(t)
        return read_to_host(along, t)

    @classmethod
    def create(cls, pm, name: str, vocab_size: int) -> VerifyStage:
        return cls(plugins.create(pm, "specdec_verifiers", "verifier", name), vocab_size)

    @property
    def name(self) -> str:
        v = self.verifier
        return f"{v.name!r} (plugin {getattr(v, 'plugin_name', '?')!r})"

    @property
    def supports_sampling(self) -> bool:
        return bool(getattr(self.verifier, "supports_sampling", True))

    def verify(self, records: list[StepRequest], logits: torch.Tensor | None) -> Failures:
        """Set ``result`` on every frontier record (and ``logprobs`` where asked); the requests
        whose verification failed are returned (their records keep no result)."""
        failures = Failures()
        _prompt_logprobs([r for r in records if r.prompt_rows is not None], logits)
        frontier = [r for r in records if r.at_frontier]
        if not frontier:
            return failures
        logits = logits[:sum(1 + r.num_nodes for r in frontier)]  # prompt rows come after
        raw = self._process(frontier, logits)
        batch = self.batch(frontier, logits)
        late = [r for r in frontier if r.num_nodes and r.tree.checked_late]
        self._along = [r.tree for r in late]
        results = self._run(batch, failures)
        self._along = []
        bad = {id(r): _read_problem(r, self.vocab_size) for r in late}
        for rec, result in zip(frontier, results):
            if bad.get(id(rec)):  # a draft checked only now is malformed (the forward saw
                failures.fail(rec.seq, bad[id(rec)])  # its tokens clamped into the vocab)
                continue
            if isinstance(result, str):
                failures.fail(rec.seq, f"verifier {self.name} {result}")
                continue
            rec.result = result
            if rec in raw:  # the raw row that decided each emitted token
                rows = [0, *(1 + a for a in result.accepted)]
                rec.logprobs = token_logprobs(raw[rec][rows], result.tokens,
                                              rec.seq.params.logprobs)
        return failures

    @staticmethod
    def _process(frontier: list[StepRequest], logits: torch.Tensor) -> dict:
        """Each request's sampling options applied to its rows in place (``specdec.logits``),
        after keeping the raw rows of those that asked for logprobs (returned by record)."""
        raw, start = {}, 0
        with torch.inference_mode():  # the forward's logits are inference tensors
            for rec in frontier:
                n = 1 + rec.num_nodes
                if rec.seq.params.logprobs is not None:
                    raw[rec] = logits[start:start + n].clone()
                if rec.seq.logits is not None:
                    tree = rec.tree if rec.tree is not None else _EMPTY
                    rec.seq.logits.process(logits[start:start + n], tree.token_list,
                                           tree.parent_list)
                start += n
        return raw

    def batch(self, frontier: list[StepRequest], logits: torch.Tensor) -> VerifyBatch:
        trees = [r.tree if r.tree is not None else _EMPTY for r in frontier]
        cu = [0]
        for t in trees:
            cu.append(cu[-1] + 1 + t.num_nodes)
        assert cu[-1] == logits.shape[0], (cu, logits.shape)
        params = [r.seq.params for r in frontier]
        greedy = [p.greedy for p in params]
        probs = None
        if not all(greedy):
            per_row = [p for p, t in zip(params, trees) for _ in range(1 + t.num_nodes)]
            probs = logits_to_probs(logits, *params_to_tensors(per_row, logits.device))
        return VerifyBatch(trees, cu, logits, probs, greedy, [r.seq.seed for r in frontier],
                           [r.seq.num_tokens for r in frontier], self.to_host)

    def _run(self, batch: VerifyBatch, failures: Failures) -> list[VerifyResult | str]:
        """Results (or error strings) for the requests of ``batch``; a failing call is retried
        request by request to find the failing ones. Every exception is kept in ``failures``
        (``caught``), and a batched call that raised though each request alone verified is
        reported: the outputs are right, the verifier's batched path has a bug."""
        try:
            out = self.verifier.verify(batch)
            if not isinstance(out, VerifyOutput):
                raise TypeError(f"verify returned {type(out).__name__}, not a VerifyOutput")
            results = out.to_results(self.to_host)
            if len(results) != batch.batch_size:
                raise ValueError(f"{len(results)} results for {batch.batch_size} requests")
            checked = [self._check(t, r) for t, r in zip(batch.trees, results)]
        except Exception as e:
            failures.caught(getattr(self.verifier, "plugin_name", "?"),
                            f"verifier {self.verifier.name!r} verify", e)
            if batch.batch_size == 1:
                return [f"failed: {e!r}"]
            alone = [self._run(batch.select([i]), failures)[0] for i in range(batch.batch_size)]
            if not any(isinstance(r, str) for r in alone):
                failures.report(f"verifier {self.name} raised for {batch.batch_size} requests "
                                f"at once ({e!r}) but not for any of them alone: verified "
                                "request by request, the outputs are right; its batched call "
                                "has a bug")
            return alone
        return checked

    def _check(self, tree: DraftTree, r: VerifyResult) -> VerifyResult | str:
        """The result must be a root path of the tree, its tokens, and one token in the vocab."""
        parents, tokens = tree.parent_list, tree.token_list
        prev = -1
        for j, a in enumerate(r.accepted):
            if not (0 <= a < len(tokens)) or parents[a] != prev or r.tokens[j] != tokens[a]:
                return f"returned accepted nodes {r.accepted} with tokens {r.tokens}, which are " \
                       "not a root path of the draft tree"
            prev = a
        if not 0 <= r.tokens[-1] < self.vocab_size:
            return f"emitted token {r.tokens[-1]} outside the vocab [0, {self.vocab_size})"
        return r


def _read_problem(rec: StepRequest, vocab_size: int) -> str | None:
    """What is wrong with a tree the step's read brought (its tokens in the vocab, its parents
    topological, its depth within the budget), which the drafter stage could not check."""
    tree = rec.tree
    try:
        if "unread_problem" in tree.__dict__:
            raise ValueError(tree.unread_problem)
        tree.validate(vocab_size=vocab_size, max_depth=rec.budget.max_depth)
    except ValueError as e:
        return f"drafter returned a malformed tree: {e}"
    return None


def _prompt_logprobs(records: list[StepRequest], logits: torch.Tensor) -> None:
    """Prompt tokens' log-probabilities from the chunk rows that decide them (a request
    recomputing its prompt after a preemption keeps the ones it has)."""
    for rec in records:
        start, first, n = rec.prompt_rows
        have = rec.seq.prompt_logprobs
        skip = len(have) - 1 - first  # rows whose token already has its figures
        if skip >= n:
            continue
        rows = logits[start + max(skip, 0):start + n]
        tokens = rec.seq.prompt_token_ids[first + 1 + max(skip, 0):first + 1 + n]
        have.extend(token_logprobs(rows, tokens, rec.seq.params.prompt_logprobs))
