"""The user API: `LLM(...).generate(prompts, SamplingParams)` and `LLM(...).stream(...)`.

A prompt is a string, a chat (list of {"role", "content"} dicts, formatted with the tokenizer's
chat template), or a list of token ids; `prompts` is one prompt or a list of them.

Concurrency: one LLM may be used from several threads at once, and several of its streams may
be consumed interleaved (or one paused while ``generate`` runs): every call gets only its own
requests' outputs, complete. One call at a time holds the engine and steps it for all
(specdec.engine.turns): each step runs every request in flight as one batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tqdm.auto import tqdm

from specdec.config import EngineConfig
from specdec.engine.core import LLMEngine
from specdec.engine.sequence import Sequence
from specdec.engine.streaming import DeltaTracker
from specdec.engine.turns import EngineTurns, StreamCursor
from specdec.models.aliases import DEFAULT_MODEL
from specdec.models.tokenizer import chat_token_ids
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "cpu",
                 drafter: str | None = None, drafter_args: dict[str, Any] | None = None,
                 controller: str | None = None, controller_args: dict[str, Any] | None = None,
                 plugins: tuple = (), **engine_args: Any) -> None:
        config = EngineConfig(model=model, dtype=dtype, device=device, drafter=drafter,
                              drafter_args={} if drafter_args is None else drafter_args,
                              controller=controller,
                              controller_args={} if controller_args is None else controller_args,
                              **engine_args)
        self.engine = LLMEngine(config, plugins)
        self._turns = EngineTurns(self.engine)  # every call's engine work takes its turn

    def close(self) -> None:
        """Abort what still runs and let go of what outlives the engine: the disk tier's file
        and its lock, so that another engine may open it. Also ``with LLM(...) as llm:``.
        Afterwards ``generate`` / ``stream`` raise RuntimeError (make a new LLM); twice is
        fine."""
        self._turns.call(self.engine.close)  # after the step another thread may be running

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Safe from several threads
        at once (see the module docstring)."""
        ids = self._add_all(prompts, sampling_params)
        remaining = [s for i in ids for s in self.engine.samples_of(i)]
        bar = tqdm(total=len(remaining), desc="generate", disable=not use_tqdm)

        def finished() -> list[RequestOutput] | None:  # with the engine held
            nonlocal remaining
            self.engine.check_open()  # closed meanwhile (another thread): say so
            remaining = [s for s in remaining if not self.engine.requests[s].is_finished]
            bar.update(bar.total - len(remaining) - bar.n)
            if remaining:
                return None
            return [self._group_output([self.engine.pop_finished(s)
                                        for s in self.engine.samples_of(i)]) for i in ids]

        try:
            return self._turns.advance(finished)
        except BaseException:  # a step raised (or Ctrl-C): no request of this call stays
            self._turns.end(ids)
            raise
        finally:
            bar.close()

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield a delta (new tokens and text) each time a request of this call emits, then a
        final one per sample: only this call's requests, whatever else runs on this LLM
        meanwhile (other streams, ``generate`` in other threads). Requests are queued at the
        first ``next()``; closing the generator early aborts them."""
        ids = self._add_all(prompts, sampling_params)
        cursor = StreamCursor(self._turns, ids, self._delta)
        try:
            while batch := cursor.next_batch():
                yield from batch
        finally:
            self._turns.end(ids)

    async def astream(self, prompts, sampling_params=None) -> AsyncIterator[RequestOutput]:
        """``stream`` for asyncio: ``async for delta in llm.astream(...)``. The engine steps in
        a worker thread (``asyncio.to_thread``), so the event loop stays free meanwhile."""
        ids = await asyncio.to_thread(self._add_all, prompts, sampling_params)
        cursor = StreamCursor(self._turns, ids, self._delta)
        try:
            while batch := await asyncio.to_thread(cursor.next_batch):
                for delta in batch:
                    yield delta
        finally:
            await asyncio.to_thread(self._turns.end, ids)

    def _delta(self, seq: Sequence, sent: DeltaTracker) -> RequestOutput:
        delta = sent.delta(seq)
        sample = self._sample(seq, "")
        sample.token_ids, sample.text = delta.token_ids, delta.text
        if seq.logprobs is not None:  # the delta's tokens' (they end the output so far)
            end = seq.num_output_tokens
            sample.logprobs = seq.logprobs[end - len(delta.token_ids):end]
        return _request_output(seq, [sample])

    def _add_all(self, prompts, sampling_params) -> list[str]:
        token_lists = self._tokenize_all(prompts)
        params = _params_list(sampling_params, len(token_lists))
        for i, (ids, p) in enumerate(zip(token_lists, params)):  # all checked, then queued
            try:
                self.engine.check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        return self._turns.call(lambda: [self.engine.add_request(ids, p)
                                         for ids, p in zip(token_lists, params)])

    def _tokenize_all(self, prompts) -> list[list[int]]:
        if _is_single_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a prompt or a non-empty list of prompts")
        return [self._tokenize(p, i) for i, p in enumerate(prompts)]

    def _tokenize(self, prompt, index: int) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(f"prompt {index}: this model has no tokenizer; pass token ids")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            return tok(prompt).input_ids
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            return _chat_ids(tok, prompt, index)
        raise TypeError(f"prompt {index}: expected str, list of chat messages or list of token "
                        f"ids, got {type(prompt).__name__}")

    def _text(self, seq: Sequence) -> str:
        tok = self.engine.tokenizer
        return "" if tok is None else seq.text(tok)

    def _sample(self, seq: Sequence, text: str | None = None) -> CompletionOutput:
        return CompletionOutput(
            index=seq.sample_index, token_ids=seq.output_token_ids,
            text=self._text(seq) if text is None else text, finished=seq.is_finished,
            finish_reason=seq.finish_reason, error=seq.error, metrics=seq.metrics(),
            logprobs=None if seq.logprobs is None else list(seq.logprobs))

    def _group_output(self, seqs: list[Sequence]) -> RequestOutput:
        return _request_output(seqs[0], [self._sample(s) for s in seqs])



def _request_output(seq: Sequence, samples: list[CompletionOutput]) -> RequestOutput:
    """A prompt's output: the request's id (its first sample's), the samples, and the first of
    them repeated at the top."""
    first = samples[0]
    rid = seq.request_id if seq.leader is None else seq.leader.request_id
    return RequestOutput(
        request_id=rid, prompt_token_ids=seq.prompt_token_ids, token_ids=first.token_ids,
        text=first.text, finished=first.finished, finish_reason=first.finish_reason,
        error=first.error, metrics=first.metrics, outputs=samples, logprobs=first.logprobs,
        prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs))


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(
        isinstance(x, (int, dict)) for x in prompts)


def _chat_ids(tok, messages: list[dict], index: int) -> list[int]:
    try:
        return chat_token_ids(tok, messages)
    except ValueError as e:
        raise ValueError(f"prompt {index}: {e}") from e


def _params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, list) and len(sampling_params) == n and all(
            isinstance(p, SamplingParams) for p in sampling_params):
        return list(sampling_params)
    raise ValueError(f"sampling_params must be SamplingParams or a list of {n} of them")
