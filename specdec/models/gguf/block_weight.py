"""A weight matrix that is a GGUF file's blocks, dequantized only where an op needs values.

A model loaded from a GGUF keeps no fp32 copy of its matrices: each is a ``BlockWeight``, a
float32 tensor of the matrix's shape whose values are the file's blocks (memory-mapped, see
file.py), in one or more parts (q|k|v and gate|up are fused by the decoder; llama's q and k
rows are put back in transformers' order). The compiled kernels run its panels (prepared from
``runs()``: one ``Blocks`` per run of parts of one type, so that a fused matrix whose tensors
differ in type, a Q4_K_M file's Q4_K q|k and Q6_K v, runs in parts; looked up by the weight:
``PreparedLinears.adopt``); anything else that touches
the values gets them dequantized on the spot, bitwise gguf-py's (so bitwise the fp32 weights
transformers makes of the file):

    w = BlockWeight([Part(blocks, order=None)], "blk.0.ffn_down.weight", file)
    F.embedding(ids, w)        # dequantizes only the rows of ``ids``
    F.linear(x, w)             # any other op: the whole matrix, for this op only (logged once)
    w.double(), w.to("cuda")   # real tensors
    w.add_(1)                  # TypeError: the blocks are read-only

``dequantize(kind, rows, in_features)`` covers every type gguf-py reads: the kernels' own ones
through ``gguf_blocks.dequantize``, others through gguf-py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from specdec.models.gguf import blocks as gguf_blocks
from specdec.models.gguf.blocks import Blocks

logger = logging.getLogger("specdec")
aten = torch.ops.aten


def dequantize(kind: str, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """rows [n, bytes per row] uint8 of type ``kind`` -> [n, in_features] float32, bitwise what
    gguf-py's dequantization gives."""
    n = rows.shape[0]
    if kind in gguf_blocks.BLOCK_BYTES:
        return gguf_blocks.dequantize(Blocks(kind, rows, in_features))
    floats = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if kind in floats:
        return rows.contiguous().view(floats[kind]).reshape(n, in_features).float()
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(rows.contiguous().numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(values.reshape(n, in_features)).float()


@dataclass(frozen=True)
class Part:
    """Rows of one file tensor: ``blocks`` as stored, ``order`` [rows] int64 (row r of the part
    is stored row order[r]) or None, ``name`` the file's name of the tensor."""
    blocks: Blocks
    order: torch.Tensor | None = None
    name: str = ""

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[rows or all, in] float32 (``rows`` indexes the part's own row order)."""
        stored = self.order if rows is None else (rows if self.order is None
                                                  else self.order[rows])
        data = self.blocks.rows if stored is None else self.blocks.rows[stored]
        return dequantize(self.blocks.kind, data, self.blocks.in_features)

    def ordered_rows(self) -> torch.Tensor:
        return self.blocks.rows if self.order is None else self.blocks.rows[self.order]


class BlockWeight(torch.Tensor):
    """[out, in] float32 on the CPU whose values are GGUF blocks (see module docstring)."""

    parts: tuple[Part, ...]
    tensor_name: str  # the file's tensor(s)
    file: object  # the GGUFFile the blocks map (gguf/file.py)

    @staticmethod
    def __new__(cls, parts: list[Part], name: str, file=None, _shared: dict | None = None):
        ins = {p.blocks.in_features for p in parts}
        assert len(ins) == 1, f"{name}: parts of different widths {ins}"
        out = sum(p.blocks.out_features if p.order is None else p.order.numel() for p in parts)
        t = torch.Tensor._make_wrapper_subclass(cls, (out, ins.pop()), dtype=torch.float32,
                                                device="cpu", requires_grad=False)
        t.parts, t.tensor_name, t.file = tuple(parts), name, file
        # shared by views (detach): what PreparedLinears keys panels by, what was logged
        t._shared = _shared if _shared is not None else {"logged": False}
        return t

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    @property
    def key(self) -> int:
        """The same for this weight and its detached views."""
        return id(self._shared)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.blocks.kind for p in self.parts))

    @property
    def stored_bytes(self) -> int:
        return sum(p.blocks.nbytes for p in self.parts)

    def blocks(self) -> Blocks:
        """The whole matrix as one ``Blocks`` (a copy where it has several parts or a row
        order); ValueError naming the tensors when its parts are of different types (``runs``
        gives such a matrix as one ``Blocks`` per type)."""
        if len(self.kinds) != 1:
            raise ValueError(f"{self.tensor_name} fuses tensors of different types "
                             f"{list(self.kinds)}; one Blocks holds one type (runs() gives one "
                             "per run of parts of a type)")
        return self.runs()[0]

    def runs(self) -> list[Blocks]:
        """The matrix as consecutive row ranges of one type each, in row order: each run of
        adjacent parts of the same type as one ``Blocks`` (a copy where it joins parts or has
        a row order). One for a matrix of one type; a Q4_K_M file's q|k|v whose v is Q6_K:
        [q|k Q4_K, v Q6_K]. What the kernels prepare as parts (native.PanelParts)."""
        runs: list[tuple[str, list[torch.Tensor]]] = []
        for p in self.parts:
            if runs and runs[-1][0] == p.blocks.kind:
                runs[-1][1].append(p.ordered_rows())
            else:
                runs.append((p.blocks.kind, [p.ordered_rows()]))
        return [Blocks(kind, rows[0] if len(rows) == 1 else torch.cat(rows), self.shape[1])
                for kind, rows in runs]

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32, a new tensor."""
        values = [p.values() for p in self.parts]
        return values[0] if len(values) == 1 else torch.cat(values)

    def rows_of(self, index: torch.Tensor) -> torch.Tensor:
        """[*index.shape, in] float32: only the rows asked for are dequantized."""
        flat = index.reshape(-1).long()
        if len(self.parts) == 1:
            got = self.parts[0].values(flat)
        else:
            got = self.dequantize()[flat]
        return got.reshape(*index.shape, self.shape[1])

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"BlockWeight({self.tensor_name}, {list(self.shape)}, {'+'.join(self.kinds)}, "
                f"{self.stored_bytes} bytes)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            w = args[0]
            return BlockWeight(list(w.parts), w.tensor_name, w.file, w._shared)
        if func is aten.embedding.default:
            return args[0].rows_of(args[1])
        if func is aten.index_select.default and args[1] == 0:
            return args[0].rows_of(args[2])
        written = [a for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write
                   and isinstance(args[i] if i < len(args) else kwargs.get(a.name), BlockWeight)]
        if written:
            w = args[0] if isinstance(args[0], BlockWeight) else kwargs[written[0].name]
            raise TypeError(f"{func} would write into {w.tensor_name}, a GGUF file's blocks "
                            "(read-only); load the model with its weights dequantized "
                            "(gguf_model.materialize) to change them")

        def values(a):
            if not isinstance(a, BlockWeight):
                return a
            if not a._shared["logged"]:
                a._shared["logged"] = True
                logger.info("weights: %s dequantized on demand for %s (its blocks are what the "
                            "model keeps)", a.tensor_name, func)
            return a.dequantize()

        return func(*tree_map(values, args), **tree_map(values, kwargs))
