"""Load time of a GGUF's native panels three ways, in one process, interleaved, medians:

- ``repack``: what a load does now, the compiled repacker over the mapped file
  (specdec/models/gguf/repack.py, specdec/native/repack.c);
- ``torch``: the torch layouts (gguf_blocks.prepare / q8_activations.prepare), what a load
  without a cached copy did before;
- ``cache``: reading the panels back from a safetensors copy of them (what a load with the
  copy earlier versions cached did: the copy is written once, beforehand, in a temporary
  folder), every page touched, as a first forward would.

Each run loads the model from the file (load_model, BlockWeights) and makes or reads the panels
of every matrix, for ``--activations`` (float, q8 or both); ``--threads`` torch threads (the
repacker takes at most one per 16 MB of a matrix's blocks); ``--cold`` evicts the file's and
the copy's pages from the page cache before each run (posix_fadvise), so each reads its bytes
from the disk as a first start after a reboot does. The repack's panels are checked bitwise
against the torch ones once.

    .venv/bin/python docs/bench/repack_load.py FILE.gguf [--repeats 5] [--threads 1]
        [--activations float q8] [--no-torch] [--cold]

Quick form (the test suite's, tests/bench/test_bench_scripts.py): a tiny GGUF, ``--repeats 1``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdec.models.gguf import q8_activations, repack
from specdec.models.gguf import weights as gw
from specdec.models.loader import load_model, resolve_model_path
from specdec.native import PanelParts


def _parts(p):
    return p.parts if isinstance(p, PanelParts) else (p,)


def panels(folder: Path, activations: str, make) -> list:
    """load_model + every matrix's panels by ``make`` (blocks -> Panels), pages dropped."""
    model, _, _ = load_model(folder, torch.float32, "cpu", 512, blocks=True)
    out = []
    for w in model.named_matrices().values():
        ps = [make(b) for b in gw.native_runs(w)]
        out.append(ps[0] if len(ps) == 1 else PanelParts(tuple(ps)))
        w.file.release_pages()
    return out


def cached(folder: Path, copy: Path) -> int:
    """load_model + the panels read back from ``copy``, every page touched."""
    from safetensors.torch import load_file

    load_model(folder, torch.float32, "cpu", 512, blocks=True)
    touched = 0
    for t in load_file(copy).values():
        touched += int(t.view(-1)[::4096].sum())
    return touched


def drop_pages(*paths: Path) -> None:
    """Evict the files' pages from the page cache (a cold start reads them from disk)."""
    import os

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, cold: tuple[Path, ...] = ()) -> float:
    drop_pages(*cold)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--activations", nargs="+", default=["float", "q8"])
    ap.add_argument("--no-torch", action="store_true", help="skip the torch layouts (slow)")
    ap.add_argument("--cold", action="store_true",
                    help="evict the file's and the copy's pages before each run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model_path(str(args.gguf))
    size = (folder / "model.gguf").stat().st_size
    print(f"{args.gguf} ({size / 1e9:.3f} GB), {args.threads} torch threads")
    with tempfile.TemporaryDirectory(prefix="repack-load-") as tmp:
        for act in args.activations:
            fast, slow = repack.preparer(act), q8_activations.preparer(act)
            ours = panels(folder, act, fast)
            copy = Path(tmp) / f"{act}.safetensors"
            tensors = {f"{i}#{j}": p.data for i, m in enumerate(ours)
                       for j, p in enumerate(_parts(m))}
            from safetensors.torch import save_file

            save_file(tensors, copy)
            nbytes = sum(t.numel() for t in tensors.values())
            if not args.no_torch:
                theirs = panels(folder, act, slow)
                assert all(torch.equal(a.data, b.data) for m, n in zip(ours, theirs)
                           for a, b in zip(_parts(m), _parts(n))), "repack != torch layouts"
            del ours, tensors
            times: dict[str, list[float]] = {"repack": [], "cache": [], "torch": []}
            runs = {"repack": lambda a=act, f=fast: panels(folder, a, f),
                    "cache": lambda c=copy: cached(folder, c),
                    "torch": lambda a=act, f=slow: panels(folder, a, f)}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    if name != "torch" or not args.no_torch:
                        cold = ((folder / "model.gguf").resolve(), copy) if args.cold else ()
                        times[name].append(timed(run, cold))
            print(f"  {act}: panels {nbytes / 1e9:.3f} GB (the copy a cache wrote)")
            for name, ts in times.items():
                if ts:
                    med = statistics.median(ts)
                    print(f"    {name:7s} median {med:7.3f} s  ({' '.join(f'{t:.3f}' for t in ts)})"
                          f"  {nbytes / med / 1e9:5.2f} GB/s of panels")
            copy.unlink()


if __name__ == "__main__":
    main()
