"""Oracle drafter: drafts with a controlled acceptance rate, for benchmarking speculation.

A real drafter's acceptance depends on the model pair and the data; the target's speedup from
speculation depends on the acceptance and on the hardware. To read the speedup off as a
function of the mean acceptance length tau (tokens emitted per target forward) -- e.g. on a GPU
with random-weight models, for which no trained drafter exists -- this drafter knows the
target's own greedy continuation of each prompt (from a plain greedy run) and proposes a chain
of the next true tokens, each replaced independently with probability ``error_rate`` by a wrong
one (``(t + 1) % vocab_size``). Under greedy verification a draft of k nodes is then accepted
at least d deep with probability ``(1 - error_rate) ** d``, so

    tau = sum_{d=0..k} (1 - error_rate) ** d        (``expected_tau``; ``error_rate_for_tau``
                                                      inverts it)

while the output stays the target's greedy output token for token. The drafter costs next to
nothing, so the measured time is the target's verification alone: an upper bound on what a real
drafter reaching that tau could give. It is not a built-in (it needs the answers); register it
with ``oracle_plugin``::

    from specdec import LLM, SamplingParams
    from specdec.drafters.oracle import error_rate_for_tau, oracle_plugin

    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    plain = LLM(model=path, dtype="bfloat16", device="cuda")
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts, params))}
    rate = error_rate_for_tau(3.0, depth=4)  # tau 3 with 4-node chains
    spec = LLM(model=path, dtype="bfloat16", device="cuda", drafter="oracle",
               plugins=(oracle_plugin(truth, rate, depth=4),), controller_args={"budget": 4})
    outs = spec.generate(prompts, params)  # same tokens as plain; mean metrics.tau near 3

``drafter_args`` may override ``error_rate``, ``depth`` and ``seed``, so one plugin serves a
sweep. The draws come from a ``random.Random`` per request (host ints: a proposal costs no
tensor op, so a step's time is the engine's), seeded from (seed, request id):
a run is reproducible given the engine's request ids (which count up over an engine's life, so
a second ``generate`` on the same engine draws differently). Only greedy requests get the
promised acceptance: once a request's output leaves its known continuation (sampling, or a
continuation from another dtype or device whose argmax ties broke differently) the drafter
proposes nothing more for it. The last steps of a request draft less than ``depth`` (the engine
clips budgets at ``max_tokens``; the continuation runs out), so tau over whole requests sits a
little under ``expected_tau``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo
from specdec.tree import DraftTree


def expected_tau(error_rate: float, depth: int) -> float:
    """Mean tokens emitted per verify step with ``depth``-node chains, each node wrong with
    probability ``error_rate``: ``sum_{d=0..depth} (1 - error_rate) ** d``, from 1 (every
    draft wrong) to ``depth + 1`` (none wrong)."""
    _check_error_rate(error_rate)
    _check_depth(depth)
    p = 1.0 - float(error_rate)
    return math.fsum(p**d for d in range(depth + 1))


def error_rate_for_tau(tau: float, depth: int) -> float:
    """The ``error_rate`` whose ``expected_tau(error_rate, depth)`` is ``tau`` (bisection; tau
    in [1, depth + 1]: 1 needs error rate 1, depth + 1 needs 0)."""
    _check_depth(depth)
    if not _is_real(tau):
        raise TypeError(f"tau must be a real number, got {type(tau).__name__} {tau!r}")
    if not 1.0 <= tau <= depth + 1:
        raise ValueError(f"tau must be in [1, depth + 1] = [1, {depth + 1}] for depth {depth} "
                         f"(tokens per step with at most {depth} draft nodes), got {tau!r}")
    lo, hi = 0.0, 1.0  # expected_tau falls as the error rate rises: tau(lo) >= tau >= tau(hi)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if expected_tau(mid, depth) > tau:
            lo = mid
        else:
            hi = mid
    # the endpoint nearer in tau (exact at the ends of the range: tau 1 -> 1.0, depth+1 -> 0.0)
    return lo if abs(expected_tau(lo, depth) - tau) <= abs(expected_tau(hi, depth) - tau) else hi


@dataclass
class OracleState:
    """One request's state: its known continuation (None: prompt unknown) and its draws."""

    prompt_len: int
    continuation: list[int] | None
    generator: random.Random
    num_checked: int = 0  # generated tokens found equal to the continuation so far
    diverged: bool = False  # the output left the continuation: nothing more is drafted


class OracleDrafter(BaseDrafter):
    """Proposes the target's known greedy continuation, each token wrong with probability
    ``error_rate``; see the module docstring.

    ``continuations``: {prompt token ids (tuple): the target's greedy continuation (list)}.
    ``depth``: nodes per chain (>= 1; also capped by each step's budget). ``seed``: with the
    request id, seeds the request's generator.
    """

    name = "oracle"
    hidden_layers: tuple[int, ...] = ()
    replay_safe = False  # each propose draws coins from the request's generator

    def __init__(self, target: TargetInfo, continuations: Mapping[tuple[int, ...], list[int]],
                 error_rate: float, depth: int, seed: int = 0) -> None:
        _check_args(continuations, error_rate, depth, seed)
        self.vocab_size = target.vocab_size
        _check_vocab(continuations, self.vocab_size)
        self.continuations = {tuple(k): list(v) for k, v in continuations.items()}
        self.error_rate, self.depth, self.seed = float(error_rate), depth, seed

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> OracleState:
        generator = random.Random(_request_seed(self.seed, request_id))
        return OracleState(len(prompt_token_ids), self.continuations.get(tuple(prompt_token_ids)),
                           generator)

    def release(self, state: OracleState) -> None:
        state.continuation = None

    def restore(self, state: OracleState, token_ids, page_keys: list[bytes]) -> int:
        return len(page_keys)  # it reads token_ids only

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        state: OracleState = request.state
        truth = state.continuation
        if truth is None or state.diverged:
            return DraftTree.empty()
        tokens = request.token_ids
        done = len(tokens) - state.prompt_len  # generated so far; the next true one is truth[done]
        if not self._on_track(state, tokens, done):
            return DraftTree.empty()
        k = min(self.depth, request.budget.depth_limit, len(truth) - done)
        if k <= 0:
            return DraftTree.empty()
        rate, draw, vocab = self.error_rate, state.generator.random, self.vocab_size
        chain = [(t + 1) % vocab if draw() < rate else t for t in truth[done:done + k]]
        return DraftTree.chain(chain)

    @staticmethod
    def _on_track(state: OracleState, tokens, done: int) -> bool:
        """Whether the output so far is the continuation's prefix (checks only new tokens)."""
        truth = state.continuation
        upto = min(done, len(truth))
        if upto > state.num_checked:
            start = state.prompt_len + state.num_checked
            if tokens[start:state.prompt_len + upto] != truth[state.num_checked:upto]:
                state.diverged = True
                return False
            state.num_checked = upto
        return True


def oracle_plugin(continuations: Mapping[tuple[int, ...], list[int]], error_rate: float,
                  depth: int, seed: int = 0):
    """A plugin object registering ``OracleDrafter`` as drafter ``"oracle"`` with these
    arguments; ``drafter_args`` may override ``error_rate``, ``depth`` and ``seed``. Pass it
    as ``LLM(..., drafter="oracle", plugins=(oracle_plugin(...),))``."""
    from specdec.hookspecs import hookimpl

    _check_args(continuations, error_rate, depth, seed)  # fail here, not at engine start
    defaults = {"error_rate": error_rate, "depth": depth, "seed": seed}

    def factory(target: TargetInfo, **overrides) -> OracleDrafter:
        unknown = set(overrides) - set(defaults)
        if unknown:
            raise TypeError(f"oracle drafter_args may set {', '.join(sorted(defaults))}; got "
                            f"unknown {', '.join(sorted(unknown))}")
        return OracleDrafter(target, continuations, **{**defaults, **overrides})

    class OraclePlugin:
        @hookimpl
        def specdec_drafters(self):
            return {"oracle": factory}

    return OraclePlugin()


# ---- argument checks --------------------------------------------------------------------------


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_error_rate(error_rate) -> None:
    if not _is_real(error_rate):
        raise TypeError(f"error_rate must be a real number in [0, 1], got "
                        f"{type(error_rate).__name__} {error_rate!r}")
    if not 0.0 <= error_rate <= 1.0:  # NaN fails too
        raise ValueError(f"error_rate must be in [0, 1] (the probability that a drafted token "
                         f"is wrong), got {error_rate!r}")


def _check_depth(depth) -> None:
    if not _is_int(depth):
        raise TypeError(f"depth must be an int >= 1, got {type(depth).__name__} {depth!r}")
    if depth < 1:
        raise ValueError(f"depth must be an int >= 1 (draft nodes per chain), got {depth!r}")


def _check_args(continuations, error_rate, depth, seed) -> None:
    _check_error_rate(error_rate)
    _check_depth(depth)
    if not _is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not isinstance(continuations, Mapping):
        raise TypeError(f"continuations must be a mapping {{prompt token ids (tuple of ints): "
                        f"greedy continuation (list of ints)}}, got {type(continuations).__name__}")
    for prompt, cont in continuations.items():
        if not isinstance(prompt, tuple) or not prompt or not all(_is_int(t) for t in prompt):
            raise TypeError(f"continuations keys must be non-empty tuples of ints (prompt token "
                            f"ids), got {prompt!r}")
        if not isinstance(cont, (list, tuple)) or not all(_is_int(t) for t in cont):
            raise TypeError(f"continuations values must be lists of ints (the target's greedy "
                            f"continuation), got {_short(cont)} for prompt {_short(prompt)}")


def _check_vocab(continuations, vocab_size: int) -> None:
    for prompt, cont in continuations.items():
        for what, ids in (("prompt", prompt), ("continuation", cont)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"continuations: {what} of prompt {_short(prompt)} has token ids "
                                 f"outside the target's vocab [0, {vocab_size}): {bad[:5]}")


def _short(x) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


def _request_seed(seed: int, request_id: str) -> int:
    """A stable 63-bit seed from (seed, request id) (Python's hash() of a str is salted)."""
    digest = hashlib.blake2b(f"{seed}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
