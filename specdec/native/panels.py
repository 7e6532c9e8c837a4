"""Prepared weights as the compiled kernels take them (specdec/native/kernels.h), and their C
view: ``Panels`` (one weight in one format), ``PanelParts`` (one fused matrix whose row ranges
have different formats) and ``Weight`` (sd_weight). Checked on construction, so a kernel never
reads out of bounds; specdec.native runs them.

Panels: output rows 8p .. 8p + 7 of the weight, transposed, so that a panel streams once for
all rows of a call; an even number of them. Example: a [10, 3] weight becomes 2 panels
[2, 3, 8] (rows 10..15 zero); a [20, 3] one 4 panels (rows 20..31 zero).

PanelParts: one fused matrix (q|k|v, gate|up) as consecutive row ranges each in its own format
(a Q4_K_M file's Q4_K q|k and Q6_K v): the C side computes each part into its own output
columns, so every part but the last must be whole pairs of panels (out % 16 == 0), else its
padding rows would take the next part's columns. ``k.linear(x, PanelParts((qk, v)))`` is
bitwise ``torch.cat([k.linear(x, qk), k.linear(x, v)], 1)``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_P, _I = ctypes.c_void_p, ctypes.c_int64
PANEL = 8
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# bytes of one block (16 output rows x 32 inputs) of a panel pair, per GGUF format code
# (kernels.h: SD_Q4_1, SD_Q8_0, SD_Q4_F, SD_Q5_F, SD_I8_F16, SD_Q4_K, SD_Q6_K, SD_Q5_K, and their
# 8-bit-activation layouts SD_*_Q8; specdec.models.gguf.blocks.FORMATS /
# q8_activations.FORMATS); the super-block formats (SUPER_BLOCK: in_features % 256 == 0) a
# super-block's bytes / 8
PAIR_BYTES = {3: 320, 4: 544, 5: 320, 6: 544, 7: 384, 8: 640, 9: 640, 10: 384, 11: 640,
              12: 640, 13: 296, 14: 420, 15: 296, 16: 420, 17: 360, 18: 360}
# the codes laid out for 8-bit activations (kernels.h sd_is_q8)
Q8_FORMATS = (5, 6, 10, 11, 12, 15, 16, 18)
PARTS, MAX_PARTS = -1, 8  # kernels.h: SD_PARTS (the format of a weight in parts), SD_MAX_PARTS
SUPER_BLOCK = frozenset({13, 14, 15, 16, 17, 18})


@dataclass(frozen=True)
class Panels:
    """A weight in the kernel's layout: float formats [panels, in, 8] in the weight's dtype;
    GGUF formats [panels / 2, in / 32, block bytes] uint8 (specdec.models.gguf.weights)."""
    data: torch.Tensor
    out_features: int
    in_features: int
    fmt: int  # the kernel's format code: FORMATS[dtype], or gguf_blocks.FORMATS[kind]
    panels: int  # of 8 output rows, an even number

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            data = (f"{tuple(self.data.shape)} {self.data.dtype}"
                    if isinstance(self.data, torch.Tensor) else type(self.data).__name__)
            raise ValueError(f"Panels of a [{self.out_features}, {self.in_features}] weight "
                             f"(format {self.fmt}, {self.panels} panels, data {data}): {problem}")

    def _problem(self) -> str | None:
        """What makes these panels unreadable by the kernels (they would read out of bounds),
        or None."""
        d, out, inp, p = self.data, self.out_features, self.in_features, self.panels
        if not isinstance(d, torch.Tensor):
            return "data must be a tensor"
        if inp < 1 or out < 1:
            return "the kernels need at least one input and one output feature"
        if p < 2 or p % 2 or out > PANEL * p:
            return f"needs an even number (>= 2) of panels of {PANEL} rows covering {out} rows"
        if d.device.type != "cpu" or not d.is_contiguous():
            return "data must be contiguous on the CPU"
        dtypes = {code: dt for dt, code in FORMATS.items()}
        if self.fmt in dtypes:
            want, numel = dtypes[self.fmt], p * inp * PANEL
        elif self.fmt in PAIR_BYTES:
            if inp % 32:
                return "a GGUF format needs in_features % 32 == 0"
            if self.fmt in SUPER_BLOCK and inp % 256:
                return "a K-quant super-block format needs in_features % 256 == 0"
            want, numel = torch.uint8, p // 2 * (inp // 32) * PAIR_BYTES[self.fmt]
        else:
            return f"format {self.fmt} is not one of {sorted({*dtypes, *PAIR_BYTES})}"
        if d.dtype != want or d.numel() != numel:
            return f"data must hold {numel} elements of {want}"
        return None

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True, eq=False)
class PanelParts:
    """One weight as consecutive row ranges of different formats (module docstring): the
    interface of ``Panels`` (out_features = the parts' sum, in_features, fmt = PARTS, panels =
    the parts' sum, nbytes), and ``parts``. It owns the C view of its parts (``c_weight``), so
    a struct pointing at them stays valid while these panels are alive."""
    parts: tuple[Panels, ...]

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            shapes = ", ".join(f"[{p.out_features}, {p.in_features}] format {p.fmt}"
                               if isinstance(p, Panels) else type(p).__name__
                               for p in self.parts) if isinstance(self.parts, tuple) else "?"
            raise ValueError(f"PanelParts of ({shapes}): {problem}")
        items = [Weight.of(p) for p in self.parts]
        array = (Weight * len(items))(*items)
        object.__setattr__(self, "_array", array)  # the parts the struct points at
        object.__setattr__(self, "c_weight", Weight(
            None, PARTS, self.panels, self.out_features, None, ctypes.addressof(array),
            len(items)))

    def _problem(self) -> str | None:
        ps = self.parts
        if not isinstance(ps, tuple) or not all(type(p) is Panels for p in ps):
            return "parts must be a tuple of Panels (no PanelParts inside)"
        if not 1 <= len(ps) <= MAX_PARTS:
            return f"needs 1 to {MAX_PARTS} parts, got {len(ps)}"
        if len({p.in_features for p in ps}) != 1:
            return "every part needs the same in_features"
        if len({p.fmt in Q8_FORMATS for p in ps}) != 1:
            return "the parts must all be laid out for 8-bit activations, or none"
        for i, p in enumerate(ps[:-1]):
            if p.out_features != PANEL * p.panels:
                return (f"part {i} has {p.out_features} rows, not whole pairs of {PANEL}-row "
                        f"panels (a multiple of {2 * PANEL}): the next part's columns would not "
                        "start at its first row")
        return None

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def fmt(self) -> int:
        return PARTS

    @property
    def panels(self) -> int:
        return sum(p.panels for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Weight(ctypes.Structure):
    """sd_weight (kernels.h): one prepared weight as the C side sees it."""
    _fields_ = [("data", _P), ("fmt", _I), ("panels", _I), ("out", _I), ("bias", _P),
                ("parts", _P), ("nparts", _I)]

    @classmethod
    def of(cls, w: Panels | PanelParts, bias: torch.Tensor | None = None) -> Weight:
        """The C view of ``w`` (and an fp32 contiguous ``bias``, kept alive by the caller; the
        parts of a ``PanelParts`` are kept alive by it)."""
        b = None if bias is None else bias.data_ptr()
        if isinstance(w, PanelParts):
            c = w.c_weight
            return cls(None, PARTS, c.panels, c.out, b, c.parts, c.nparts)
        return cls(w.data.data_ptr(), w.fmt, w.panels, w.out_features, b)
