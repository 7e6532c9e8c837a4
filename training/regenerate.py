"""Self-distillation: the target answers the training prompts through specdec's own engine.

Each user turn is answered in order (a later turn sees the target's own earlier answers), with
n-gram speculation (exact, so greedy answers are the target's). The engine keeps ``batch_size``
requests running: each call hands it ``CHUNK_BATCHES`` batches of conversations, and a finished
request's place goes to the next one at once (a call of one batch spent its tail waiting on its
longest answer). ``prompt_of`` (the trainer's turn shortening) gives the prompt the target sees,
so that the answer is the one to the context the drafter trains on; the original turns are what
is stored. Each call's generated tokens and tokens/s go to the log and the progress bar.
Answers are appended to a JSON-lines file as each call finishes (flushed and fsynced), one
conversation per line in the `messages` format; a rerun skips the conversations already there, so
an interrupted regeneration resumes. A torn last line (a crash mid-write) is ignored and redone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from specdec.training.data import Conversation

log = logging.getLogger(__name__)
CHUNK_BATCHES = 4  # batches of conversations per engine call
KV_BYTES_PER_REQUEST = 64 << 20  # the engine's KV budget per running request


def regenerate(convs: list[Conversation], target: str, out_file: Path, *, temperature: float,
               max_tokens: int, batch_size: int, seed: int, dtype: str = "float32",
               device: str = "cpu", activations: str = "float", llm=None,
               skip: Path | None = None,
               prompt_of: Callable[[Conversation], Conversation] | None = None,
               ) -> list[Conversation]:
    """Conversations whose assistant turns are the target's; cached in ``out_file``. ``skip``:
    another answers file whose conversations are not answered again (a distributed run's merged
    file, beside each process's part): those are not returned either. ``prompt_of``: the
    conversation as the target sees it (same turns, user and system turns possibly shortened)."""
    from specdec import LLM, SamplingParams

    done = _read_done(out_file)
    skipped = _read_done(skip) if skip is not None else {}
    convs = [c for c in convs if _key(c) not in skipped]
    todo = [c for c in convs if _key(c) not in done]
    if todo:
        llm = llm or LLM(model=target, dtype=dtype, device=device, drafter="ngram",
                         activations=activations, max_num_seqs=batch_size,
                         kv_cache_memory=batch_size * KV_BYTES_PER_REQUEST)
        chunk = batch_size * CHUNK_BATCHES
        out_file.parent.mkdir(parents=True, exist_ok=True)
        with open(out_file, "a", encoding="utf-8") as f, \
                tqdm(total=len(todo), desc="regenerate", unit="conv") as bar:
            tokens, seconds = 0, 0.0
            for start in range(0, len(todo), chunk):
                batch = todo[start:start + chunk]
                t0 = time.perf_counter()
                answered, n = _answer(llm, batch, SamplingParams, temperature, max_tokens,
                                      seed + start, prompt_of or (lambda c: c))
                took = time.perf_counter() - t0
                tokens, seconds = tokens + n, seconds + took
                bar.set_postfix(tok_s=f"{tokens / seconds:.0f}")
                log.info("regenerate: %d conversations, %d tokens in %.1f s (%.0f tokens/s; "
                         "%.0f tokens/s so far)", len(batch), n, took, n / max(took, 1e-9),
                         tokens / seconds)
                for conv in answered:
                    f.write(json.dumps({"source": conv.source, "index": conv.index,
                                        "messages": conv.messages}) + "\n")
                    done[_key(conv)] = conv
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))
    return [done[_key(c)] for c in convs]


def merge_parts(out_file: Path, parts: list[Path]) -> None:
    """Append the parts' conversations that ``out_file`` lacks to it (flushed, fsynced), then
    remove the parts: a crash in between leaves both, and a rerun merges again."""
    done = _read_done(out_file)
    with open(out_file, "a", encoding="utf-8") as f:
        for part in parts:
            for key, conv in _read_done(part).items():
                if key not in done:
                    f.write(json.dumps({"source": conv.source, "index": conv.index,
                                        "messages": conv.messages}) + "\n")
                    done[key] = conv
        f.flush()
        os.fsync(f.fileno())
    for part in parts:
        part.unlink(missing_ok=True)


def _answer(llm, batch: list[Conversation], params_cls, temperature: float, max_tokens: int,
            seed: int, prompt_of: Callable[[Conversation], Conversation],
            ) -> tuple[list[Conversation], int]:
    """Answer every user turn of every conversation, turn by turn, batched across them;
    (the answered conversations, the tokens generated). The target sees ``prompt_of``'s turns;
    the stored conversation keeps the original ones."""
    tokens = 0
    stored = [_user_and_system(c) for c in batch]
    shown = [_user_and_system(prompt_of(c)) for c in batch]
    history = [list(system) for system, _ in stored]
    prompts = [list(system) for system, _ in shown]
    for turn in range(max(len(users) for _, users in stored)):
        live = [i for i, (_, users) in enumerate(stored) if turn < len(users)]
        for i in live:
            history[i].append(stored[i][1][turn])
            prompts[i].append(shown[i][1][turn])
        params = [params_cls(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
                  for i in live]
        outs = llm.generate([prompts[i] for i in live], params)
        for i, out in zip(live, outs):
            if out.finish_reason == "error":
                raise RuntimeError(f"regenerating {batch[i].source} record {batch[i].index} "
                                   f"failed: {out.error}")
            answer = {"role": "assistant", "content": out.text}
            history[i].append(answer)
            prompts[i].append(answer)
            tokens += len(out.token_ids)
    return [Conversation(h, c.source, c.index) for h, c in zip(history, batch)], tokens


def _user_and_system(conv: Conversation) -> tuple[list[dict], list[dict]]:
    """(its first system message or none, its user messages)."""
    system = [m for m in conv.messages if m["role"] == "system"][:1]
    return system, [m for m in conv.messages if m["role"] == "user"]


def _key(conv: Conversation) -> tuple[str, int]:
    return (conv.source, conv.index)


def _read_done(path: Path) -> dict[tuple[str, int], Conversation]:
    done: dict[tuple[str, int], Conversation] = {}
    if not path.exists():
        return done
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            conv = Conversation(rec["messages"], rec["source"], int(rec["index"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            if n == len(lines):
                log.warning("%s: ignoring a torn last line (redone)", path)
                _drop_last_line(path, len(lines) - 1)
                break
            raise ValueError(f"{path} line {n} is not a regenerated conversation; delete the "
                             "file to regenerate from scratch") from None
        done[_key(conv)] = conv
    return done


def _drop_last_line(path: Path, keep: int) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()[:keep]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
