"""A checkpoint's *.safetensors files memory-mapped: each tensor a view of the file's pages in
its stored dtype, nothing read until it is touched, the pages dropped again on request.

``safetensors.safe_open`` maps the file too, but gives no way to drop the pages it read, and
loading touches every matrix once (to lay it out for the kernels): without dropping them the
process would hold the checkpoint's pages beside the panels made of them. This reads the
header (8 bytes of length, a JSON index of name -> dtype, shape, data_offsets) and maps the
file copy-on-write, as gguf/file.py does for a GGUF:

    files = open_checkpoint([Path("model.safetensors")])   # ValueError names a bad file
    files["model.layers.0.mlp.up_proj.weight"]               # [1536, 576] bfloat16, a view
    files.kind("model.embed_tokens.weight")                  # "BF16"
    files.release_pages()                                    # after the panels were made

A ``CheckpointFiles`` is a read-only mapping name -> tensor over every file (a name in two
files is an error naming both).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # the format's own limit on the JSON index


@dataclass(frozen=True)
class Entry:
    kind: str  # the file's dtype name ("BF16", "F16", "F32", ...)
    shape: tuple[int, ...]
    start: int  # of its first byte in the file
    nbytes: int


@dataclass
class MappedFile:
    path: Path
    entries: dict[str, Entry]
    metadata: dict = field(default_factory=dict)  # the header's "__metadata__" (str -> str)
    _map: mmap.mmap | None = field(default=None, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor, a view of the file's pages (copy-on-write: nothing is written
        back)."""
        e = self.entries[name]
        if self._map is None:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=DTYPES[e.kind])
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=e.nbytes, offset=e.start)
        return flat.view(DTYPES[e.kind]).view(e.shape)

    def release_pages(self) -> None:
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)


class CheckpointFiles(Mapping):
    """name -> tensor over a checkpoint's files (see module docstring)."""

    def __init__(self, files: list[MappedFile]) -> None:
        self.files = files
        self._where: dict[str, MappedFile] = {}
        for f in files:
            for name in f.entries:
                if name in self._where:
                    raise ValueError(f"tensor {name!r} is in both {self._where[name].path} and "
                                     f"{f.path}")
                self._where[name] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def kind(self, name: str) -> str:
        """The stored dtype's name ("BF16", "F16", "F32", ...)."""
        return self._where[name].entries[name].kind

    def path_of(self, name: str) -> Path:
        return self._where[name].path

    def release_pages(self) -> None:
        """Drop the mapped pages from this process's memory (read again if touched)."""
        for f in self.files:
            f.release_pages()


def open_checkpoint(paths: list[Path]) -> CheckpointFiles:
    return CheckpointFiles([open_safetensors(p) for p in paths])


def open_safetensors(path: Path) -> MappedFile:
    """The file's tensor index; ValueError naming the file for anything that is not a complete
    safetensors file (header, a dtype this reader does not know, a tensor whose bytes do not
    match its shape or lie past the end of the file)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError(f"corrupt or truncated weights file {path}: {size} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"corrupt or truncated weights file {path}: a header of {n} "
                                 f"bytes in a file of {size}")
            raw = fh.read(n)
    except OSError as e:
        raise ValueError(f"cannot read weights file {path}: {e}") from e
    try:
        index = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt weights file {path}: its header is not JSON ({e})") from e
    if not isinstance(index, dict):
        raise ValueError(f"corrupt weights file {path}: its header is not a JSON object")
    base = 8 + n
    entries = {name: _entry(path, name, info, base, size)
               for name, info in index.items() if name != "__metadata__"}
    meta = index.get("__metadata__")
    return MappedFile(path, entries, meta if isinstance(meta, dict) else {})


def _entry(path: Path, name: str, info, base: int, size: int) -> Entry:
    try:
        kind, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        ok = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"corrupt weights file {path}: tensor {name!r} has a malformed entry "
                         f"{info!r}")
    if kind not in DTYPES:
        raise ValueError(f"weights file {path}: tensor {name} is {kind}; readable: "
                         f"{', '.join(DTYPES)}")
    numel = 1
    for s in shape:
        numel *= s
    want = numel * DTYPES[kind].itemsize
    if end - begin != want or base + end > size:
        raise ValueError(f"corrupt or truncated weights file {path}: tensor {name} "
                         f"({kind} {list(shape)}, {want} bytes) at bytes {begin}..{end} of "
                         f"{size - base}")
    return Entry(kind, shape, base + begin, want)
