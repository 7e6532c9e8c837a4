"""A run's recorded settings, ``out/train_config.json``: written when the run starts, read by
``--resume``.

A resumed run trains with the recorded settings: a setting given again with another value is a
``ValueError`` naming it with both values, unless ``allow_changed`` names it; then the change
is logged and the settings it replaces are appended to ``out/train_config.history.jsonl``
(the record is never replaced silently). Paths are recorded absolute and compared resolved,
so a run resumed from another folder, or given ``./data.jsonl`` for ``data.jsonl``, finds and
matches its files.

    recorded = read_record(out)                     # None: nothing recorded (yet)
    check_changes(changed_settings(recorded, given), allowed=[], out=out)
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

RECORD = "train_config.json"
HISTORY = "train_config.history.jsonl"
# where and how a run is started, not what it trains: never compared
NOT_COMPARED = ("out", "resume", "allow_changed")
PATHS = ("target", "data", "eval_files", "init_from")  # made absolute where they name a file


def read_record(out: str | Path) -> dict | None:
    """The settings recorded in ``out``; None when there are none."""
    path = Path(out) / RECORD
    if not path.is_file():
        return None
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: cannot read the run's settings {path}: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"--resume: {path} holds {type(values).__name__}, not the run's settings")
    return values


def normalized(values: dict) -> dict:
    """``values`` with the paths that name existing files or folders made absolute."""
    def one(v):
        return str(Path(v).resolve()) if isinstance(v, str) and Path(v).exists() else v

    out = dict(values)
    for name in PATHS:
        if isinstance(out.get(name), list):
            out[name] = [one(v) for v in out[name]]
        elif name in out:
            out[name] = one(out[name])
    return out


def changed_settings(recorded: dict, given: dict) -> dict[str, tuple]:
    """{name: (recorded value, given value)} for each setting both hold, with other values."""
    rec, new = normalized(recorded), normalized(given)
    return {k: (rec[k], new[k]) for k in new
            if k in rec and k not in NOT_COMPARED and rec[k] != new[k]}


def check_changes(changes: dict[str, tuple], allowed, out: str | Path) -> None:
    """A ValueError naming every change that ``allowed`` does not name."""
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if refused:
        listed = "; ".join(f"{k}: recorded {a!r}, given {b!r}" for k, (a, b) in refused.items())
        raise ValueError(
            f"--resume: {Path(out) / RECORD} records other settings than given: {listed}. "
            "Leave them out (a resumed run takes its recorded settings), or name them in "
            f"--allow-changed to change them: --allow-changed {' '.join(refused)}")


def write_record(out: Path, settings: dict, changes: dict[str, tuple]) -> None:
    """Record ``settings`` (atomically); with ``changes`` (allowed ones), log them and append
    the settings they replace to the history first."""
    path = out / RECORD
    if changes:
        log.warning("--resume: %s changed (--allow-changed): %s", out, "; ".join(
            f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        entry = {"changed": {k: {"recorded": a, "given": b} for k, (a, b) in changes.items()},
                 "replaced": read_record(out)}
        with open(out / HISTORY, "a") as f:
            f.write(json.dumps(entry) + "\n")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(normalized(settings), indent=2) + "\n")
    os.replace(tmp, path)
