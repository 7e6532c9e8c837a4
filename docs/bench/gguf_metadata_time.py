"""Time of writing a GGUF's metadata folder (config.json + tokenizer): transformers' readers
answered from specdec's header (aliases.write_metadata_files as it is) against transformers
reading the file itself (``gguf_metadata.reading_from_header`` made a no-op), in one process,
interleaved, and whether the two folders are the same file by file.

    .venv/bin/python docs/bench/gguf_metadata_time.py FILE.gguf [FILE.gguf ...] [--repeats 2]

Each file is linked into a folder of its own, so no tokenizer file lying beside it is read.
The first pass of each pays the imports: it is reported apart and not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from specdec.models import aliases
from specdec.models.gguf import metadata as gguf_metadata


def write(path: Path, out: Path, fast: bool) -> float:
    original = gguf_metadata.reading_from_header
    if not fast:
        gguf_metadata.reading_from_header = lambda f: nullcontext()
    try:
        start = time.perf_counter()
        aliases.write_metadata_files(path, out)
        return time.perf_counter() - start
    finally:
        gguf_metadata.reading_from_header = original


def folder(out: Path) -> dict:
    def load(p: Path):
        return json.loads(p.read_text()) if p.suffix == ".json" else p.read_text()
    return {p.name: load(p) for p in sorted(out.iterdir())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n, file in enumerate(args.files):
            link = Path(tmp) / f"in{n}" / "model.gguf"
            link.parent.mkdir()
            link.symlink_to(file.resolve())
            times: dict[bool, list[float]] = {True: [], False: []}
            outs = {}
            for r in range(args.repeats + 1):
                for fast in ((True, False) if r % 2 else (False, True)):
                    out = Path(tmp) / f"out{n}_{r}_{int(fast)}"
                    seconds = write(link, out, fast)
                    outs[fast] = out
                    if r == 0:
                        print(f"{file.name}: first pass ({'header' if fast else 'transformers'})"
                              f" {seconds:.2f} s (imports included, not counted)")
                    else:
                        times[fast].append(seconds)
            same = folder(outs[True]) == folder(outs[False])
            print(f"{file.name}: transformers' readers {statistics.median(times[False]):.2f} s, "
                  f"header {statistics.median(times[True]):.2f} s (median of {args.repeats}); "
                  f"folders the same: {same}")


if __name__ == "__main__":
    main()
