"""A GGUF file's header read fast and checked, its tensors memory-mapped as they are stored.

gguf-py's ``GGUFReader`` turns every metadata field into numpy arrays, one per string: the
49,152-token vocabulary of SmolLM2 takes it ~6 s on a slow core. Loading needs only the
scalars and the tensor index, so this reads the header with ``struct`` (a string array is
skipped by its lengths) and maps the file copy-on-write: a tensor is a uint8 view of the
file's pages, [rows, bytes per row], nothing is read until it is touched.

    f = open_gguf(Path("model.gguf"))          # ValueError: not GGUF, truncated, unknown type
    f.architecture, f.metadata["llama.block_count"], f.tensors["blk.0.attn_q.weight"].shape
    rows = f.rows("blk.0.attn_q.weight")        # [576, 360] uint8 (576 x 576 of Q4_1)

Everything wrong with the file is a ValueError naming it (and the tensor) before any weight is
used: ``check_finite`` finds blocks whose fp16 scales are NaN or infinite.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# value types of the metadata (gguf.GGUFValueType): struct format of the scalars
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
SMALL_ARRAY = 64  # arrays of at most this many scalars are kept (e.g. eos ids); others skipped


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, ..., row length); GGUF stores it reversed
    kind: str  # gguf.GGMLQuantizationType name: "Q4_1", "Q8_0", "F32", "Q6_K", ...
    offset: int  # of its first byte in the file
    nbytes: int
    row_bytes: int  # bytes of one row (shape[-1] weights)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict  # key -> scalar, str or small list; larger arrays -> ("array", type, count)
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap | None = field(default=None, repr=False)
    array_offsets: dict[str, int] = field(default_factory=dict, repr=False)  # of those skipped

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def array(self, key: str) -> list:
        """Every value of the metadata array ``key`` as Python values (a placeholder
        ``("array", type, count)`` read from the file now); ValueError naming the file and key
        for a key that is not an array, an array of arrays, or a string that is not UTF-8."""
        value = self.metadata.get(key)
        if isinstance(value, list):
            return list(value)
        if not (isinstance(value, tuple) and value[:1] == ("array",)):
            raise ValueError(f"{self.path}: metadata {key!r} is {value!r}, not an array")
        _, itype, count = value
        with open(self.path, "rb") as fh, \
                mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read_array(buf, self.array_offsets[key], itype, count,
                               f"{self.path}: metadata {key!r}")

    def rows(self, name: str) -> torch.Tensor:
        """The tensor's stored bytes, [rows, row bytes] uint8 (1-D tensors: [1, bytes]), a view
        of the file's pages (copy-on-write: nothing is ever written back)."""
        t = self.tensors[name]
        if self._map is None:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        return flat.view(-1, t.row_bytes)

    def release_pages(self) -> None:
        """Drop the mapped pages from this process's memory (they are read again from the file
        if touched): after the matrices were laid out elsewhere, the few rows an embedding
        lookup reads come back one page at a time."""
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)


class _Cursor:
    """Reads the header's values in order; running past the end is a truncated file."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as e:
            raise ValueError(f"{self.path}: truncated GGUF header (at byte {self.pos} of "
                             f"{len(self.buf)}): {e}") from e
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header (a string of {n} bytes at "
                             f"byte {self.pos} of {len(self.buf)})")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if itype in _SCALARS and count <= SMALL_ARRAY:
                return [self.value(itype) for _ in range(count)]
            self.skip_array(itype, count)
            return ("array", itype, count)
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")

    def skip_array(self, itype: int, count: int) -> None:
        if itype in _SCALARS:
            self.pos += count * struct.calcsize("<" + _SCALARS[itype])
        elif itype == _STRING:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self.buf, self.pos
            try:
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
            except struct.error as e:
                raise ValueError(f"{self.path}: truncated GGUF header (a string array at byte "
                                 f"{pos} of {len(buf)})") from e
            self.pos = pos
        else:
            for _ in range(count):
                self.value(itype)
        if self.pos > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header (an array runs to byte "
                             f"{self.pos} of {len(self.buf)})")


def open_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor index; ValueError naming the file for anything that is
    not a complete GGUF file (magic, version, header, a tensor of an unknown type, of a row
    length its blocks do not divide, or past the end of the file)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < 24:
                raise ValueError(f"{path}: {size} bytes, too short to be a GGUF file")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, size)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e


def _parse(buf, path: Path, size: int) -> GGUFFile:
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not "
                         f"{MAGIC!r})")
    c = _Cursor(buf, path)
    c.pos = 4
    version = c.take("I")
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version {version}; readable: {VERSIONS}")
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    metadata, array_offsets = {}, {}
    for _ in range(n_kv):
        key = c.string()
        vtype, at = c.take("I"), c.pos
        metadata[key] = c.value(vtype)
        if vtype == _ARRAY and isinstance(metadata[key], tuple):  # skipped: its values follow
            array_offsets[key] = at + 12  # its element type (u32) and count (u64)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("Q") for _ in range(c.take("I"))]
        infos.append((name, dims, c.take("I"), c.take("Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    tensors = {name: _tensor(path, name, dims, code, start + off, size)
               for name, dims, code, off in infos}
    return GGUFFile(path, version, metadata, tensors, array_offsets=array_offsets)


def _read_array(buf, pos: int, itype: int, count: int, what: str) -> list:
    """``count`` values of type ``itype`` from byte ``pos`` (strings strictly UTF-8, as
    transformers reads them)."""
    if itype in _SCALARS:
        dtype = np.dtype("<" + _SCALARS[itype])
        return np.frombuffer(buf[pos:pos + count * dtype.itemsize], dtype, count).tolist()
    if itype != _STRING:
        raise ValueError(f"{what} is an array of value type {itype}; readable: scalars, strings")
    unpack, out = struct.Struct("<Q").unpack_from, []
    try:
        for _ in range(count):
            n = unpack(buf, pos)[0]
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
            pos += 8 + n
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: string {len(out)} is not UTF-8: {e}") from e
    return out


def _tensor(path: Path, name: str, dims: list[int], code: int, offset: int,
            size: int) -> TensorInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise ValueError(f"{path}: tensor {name} has type code {code}, which gguf-py does not "
                         "know") from None
    block, block_bytes = GGML_QUANT_SIZES[kind]
    n = int(np.prod(dims)) if dims else 1
    if not dims or dims[0] % block:
        raise ValueError(f"{path}: tensor {name} of {kind.name} has rows of {dims[:1]} values, "
                         f"not a multiple of its {block}-value blocks")
    row_bytes = dims[0] // block * block_bytes
    nbytes = n // dims[0] * row_bytes
    if offset + nbytes > size:
        raise ValueError(f"{path}: tensor {name} ({nbytes} bytes at byte {offset}) runs past "
                         f"the end of the file ({size} bytes): the file is truncated")
    return TensorInfo(name, tuple(reversed(dims)), kind.name, offset, nbytes, row_bytes)


# where a block keeps its fp16 scales (byte offsets; ggml's block_* structs)
FP16_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}
CHUNK = 1 << 24  # values dequantized at a time where a type's scales are not listed above


def check_finite(f: GGUFFile, name: str, dequantize) -> None:
    """ValueError naming the file, tensor and first bad row unless every scale (the fp16 ones
    of the block types in FP16_SCALES; every value for float tensors and other types, through
    ``dequantize(kind, rows, row length)``) is finite."""
    t = f.tensors[name]
    rows = f.rows(name)
    if t.kind in FP16_SCALES:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        size = GGML_QUANT_SIZES[GGMLQuantizationType[t.kind]][1]
        blocks = rows.view(rows.shape[0], -1, size)
        for at in FP16_SCALES[t.kind]:
            scales = blocks[..., at:at + 2].contiguous().view(torch.float16)
            _raise_unless_finite(f, t, scales.reshape(rows.shape[0], -1), f"fp16 scale at "
                                 f"byte {at} of a {size}-byte block")
        return
    step = max(1, CHUNK // t.shape[-1])
    for lo in range(0, rows.shape[0], step):
        values = dequantize(t.kind, rows[lo:lo + step], t.shape[-1])
        _raise_unless_finite(f, t, values, "value", lo)


def _raise_unless_finite(f: GGUFFile, t: TensorInfo, values: torch.Tensor, what: str,
                         first_row: int = 0) -> None:
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        row = first_row + int(bad.any(dim=-1).nonzero()[0, 0])
        raise ValueError(f"{f.path}: tensor {t.name} ({t.kind}) has a NaN or infinite {what} "
                         f"in row {row}: a corrupt block; every scale must be finite")
