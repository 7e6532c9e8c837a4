"""Self-distillation: the target answers the training prompts through specdec's own engine.

Each user turn is answered in order (a later turn sees the target's own earlier answers), the
requests of a batch together, with n-gram speculation (exact, so greedy answers are the target's).
Each batch's generated tokens and tokens/s go to the log and the progress bar. Answers are
appended to a JSON-lines file as each batch finishes (flushed and fsynced), one
conversation per line in the `messages` format; a rerun skips the conversations already there, so
an interrupted regeneration resumes. A torn last line (a crash mid-write) is ignored and redone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from specdec.training.data import Conversation

log = logging.getLogger(__name__)


def regenerate(convs: list[Conversation], target: str, out_file: Path, *, temperature: float,
               max_tokens: int, batch_size: int, seed: int, dtype: str = "float32",
               device: str = "cpu", activations: str = "float", llm=None,
               skip: Path | None = None) -> list[Conversation]:
    """Conversations whose assistant turns are the target's; cached in ``out_file``. ``skip``:
    another answers file whose conversations are not answered again (a distributed run's merged
    file, beside each process's part): those are not returned either."""
    from specdec import LLM, SamplingParams

    done = _read_done(out_file)
    skipped = _read_done(skip) if skip is not None else {}
    convs = [c for c in convs if _key(c) not in skipped]
    todo = [c for c in convs if _key(c) not in done]
    if todo:
        llm = llm or LLM(model=target, dtype=dtype, device=device, drafter="ngram",
                         activations=activations)
        out_file.parent.mkdir(parents=True, exist_ok=True)
        with open(out_file, "a", encoding="utf-8") as f, \
                tqdm(total=len(todo), desc="regenerate", unit="conv") as bar:
            tokens, seconds = 0, 0.0
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                t0 = time.perf_counter()
                answered, n = _answer(llm, batch, SamplingParams, temperature, max_tokens,
                                      seed + start)
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
            seed: int) -> tuple[list[Conversation], int]:
    """Answer every user turn of every conversation, turn by turn, batched across them;
    (the answered conversations, the tokens generated)."""
    tokens = 0
    users = [[m for m in c.messages if m["role"] == "user"] for c in batch]
    system = [[m for m in c.messages if m["role"] == "system"][:1] for c in batch]
    history = [list(s) for s in system]
    for turn in range(max(len(u) for u in users)):
        live = [i for i, u in enumerate(users) if turn < len(u)]
        for i in live:
            history[i].append(users[i][turn])
        params = [params_cls(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
                  for i in live]
        outs = llm.generate([history[i] for i in live], params)
        for i, out in zip(live, outs):
            if out.finish_reason == "error":
                raise RuntimeError(f"regenerating {batch[i].source} record {batch[i].index} "
                                   f"failed: {out.error}")
            history[i].append({"role": "assistant", "content": out.text})
            tokens += len(out.token_ids)
    return [Conversation(h, c.source, c.index) for h, c in zip(history, batch)], tokens


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
