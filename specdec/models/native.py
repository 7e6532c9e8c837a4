"""The compiled CPU kernels (specdec/native/*.c) as Python callables, or None.

``load()`` finds the extension built at install (``specdec._cpu_kernels``), checks its ABI and
this CPU's features, and returns a ``Kernels`` object, or None — with one log line saying why —
when it is missing, stale or cannot run here; callers then take their pure-torch path.

    k = load()
    w = k.prepare(weight)            # [out, in] fp32 / bf16 / fp16 -> panels [P, in, 8]
    y = k.linear(x, w)               # x [T, in] fp32 -> [T, out] fp32, row-invariant
    k.layer(args)                    # one decoder layer in one call (specdec.models.fused)

Panels: output rows 8p .. 8p + 7 of the weight, transposed, so that a panel streams once for
all rows of a call; an even number of them. Example: a [10, 3] weight becomes 2 panels
[2, 3, 8] (rows 10..15 zero); a [20, 3] one 4 panels (rows 20..31 zero).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

ABI = 5
PANEL = 8
Q8_ISAS = ("avx2", "avx-vnni", "avx512-vnni")  # sd_q8_isa's values, by index
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
logger = logging.getLogger("specdec")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class Panels:
    """A weight in the kernel's layout: float formats [panels, in, 8] in the weight's dtype;
    GGUF formats [panels / 2, in / 32, block bytes] uint8 (specdec.models.gguf_weights)."""
    data: torch.Tensor
    out_features: int
    in_features: int
    fmt: int  # the kernel's format code: FORMATS[dtype], or gguf_weights.FORMATS[kind]
    panels: int  # of 8 output rows, an even number

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class Weight(ctypes.Structure):
    """sd_weight (kernels.h): one prepared weight as the C side sees it."""
    _fields_ = [("data", _P), ("fmt", _I), ("panels", _I), ("out", _I), ("bias", _P)]

    @classmethod
    def of(cls, w: Panels, bias: torch.Tensor | None = None) -> Weight:
        """The C view of ``w`` (and an fp32 contiguous ``bias``, kept alive by the caller)."""
        return cls(w.data.data_ptr(), w.fmt, w.panels, w.out_features,
                   None if bias is None else bias.data_ptr())


class LayerArgs(ctypes.Structure):
    """sd_layer_args (specdec/native/layer.c): one decoder layer's weights and one step."""
    _fields_ = [*((n, _I) for n in ("T", "hidden", "heads", "kv_heads", "head_dim", "inter")),
                ("eps", _F), ("scale", _F),
                *((n, Weight) for n in ("qkv", "o", "gate_up", "down")),
                *((n, _P) for n in ("input_norm", "post_norm", "q_norm", "k_norm", "x", "cos",
                                    "sin", "kv")),
                ("kv_fmt", _I), ("page_size", _I),
                *((n, _P) for n in ("write_index", "key_indptr", "key_index")),
                ("max_keys", _I), ("scratch", _P), ("nthreads", _I),
                ("qkv_input", _P), ("qkv_in", _I)]


class Kernels:
    """ctypes bindings of one loaded library (see module docstring)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.sd_linear.argtypes = [_P, _I, _I, _P, ctypes.c_int, _I, _P, _I, ctypes.c_int]
        lib.sd_attention.argtypes = [_P, _I, _I, _I, _P, ctypes.c_int, _I, _I, _P, _P, _I, _F,
                                     _P, _P, ctypes.c_int]
        lib.sd_layer.argtypes = lib.sd_layer_scratch.argtypes = [ctypes.POINTER(LayerArgs)]
        lib.sd_layer_scratch.restype = _I
        lib.sd_key_lists.argtypes = [_I, _P, _P, _P, _P, _I, _P, _P, _P, _P]
        lib.sd_key_lists.restype = _I

    @property
    def q8_isa(self) -> str:
        """The instruction set the 8-bit-activation kernels run here (bitwise the same results
        on every one; ``SPECDEC_NATIVE_ISA=avx2`` or ``avx-vnni`` in the environment caps it)."""
        return Q8_ISAS[self.lib.sd_q8_isa()]

    @staticmethod
    def prepare(weight: torch.Tensor) -> Panels:
        """weight [out, in] (a dtype in FORMATS) -> its panels (a copy, made once at load)."""
        if weight.dtype not in FORMATS or weight.dim() != 2:
            raise ValueError(f"panels need a 2-d weight of {sorted(map(str, FORMATS))}, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        out, inp = weight.shape
        p = 2 * -(-out // (2 * PANEL))  # an even number: the kernel takes panels in pairs
        padded = weight.new_zeros(p * PANEL, inp)
        padded[:out] = weight
        return Panels(padded.view(p, PANEL, inp).transpose(1, 2).contiguous(), out, inp,
                      FORMATS[weight.dtype], p)

    def linear(self, x: torch.Tensor, w: Panels) -> torch.Tensor:
        """x [T, in] float32 contiguous -> [T, out] float32 (x @ weight.T)."""
        t, k = x.shape
        assert x.dtype == torch.float32 and x.is_contiguous() and k == w.in_features
        p = w.panels
        y = torch.empty(t, p * PANEL, dtype=torch.float32)
        rc = self.lib.sd_linear(x.data_ptr(), t, k, w.data.data_ptr(), w.fmt,
                                p, y.data_ptr(), p * PANEL, torch.get_num_threads())
        assert rc == 0, "sd_linear refused its arguments"
        return y if w.out_features == p * PANEL else y[:, :w.out_features]

    def attention(self, q: torch.Tensor, kv_rows: torch.Tensor, v_offset: int,
                  key_indptr: torch.Tensor, key_index: torch.Tensor, max_keys: int,
                  scale: float) -> torch.Tensor:
        """q [T, H, D] fp32; kv_rows [R, Hkv, D] fp32 / bf16 / fp16 (K rows; V rows
        ``v_offset`` later);
        key_indptr [T + 1] / key_index int64: the K rows row t attends to, in summation order.
        -> [T, H, D] fp32."""
        t, h, d = q.shape
        out = torch.empty_like(q)
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * max(max_keys, 1), dtype=torch.float32)
        assert q.dtype == torch.float32 and q.is_contiguous() and kv_rows.is_contiguous()
        rc = self.lib.sd_attention(q.data_ptr(), t, h, d, kv_rows.data_ptr(),
                                   FORMATS[kv_rows.dtype], kv_rows.shape[1], v_offset, key_indptr.data_ptr(), key_index.data_ptr(),
                                   max_keys, scale, out.data_ptr(), scratch.data_ptr(), threads)
        assert rc == 0, "sd_attention refused its arguments"
        return out

    def key_lists(self, qo_lens: list[int], kv_lens: list[int], kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, page_size: int,
                  masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row of a step, the K cache rows of the keys it sees, ascending (causal, or
        its request's [qo, kv] tree mask): (indptr [T + 1], index) int64. kv_indptr /
        kv_indices: the pages, int32 (specdec.attention.metadata)."""
        qo = torch.tensor(qo_lens, dtype=torch.int64)
        kv = torch.tensor(kv_lens, dtype=torch.int64)
        offsets, given, at = [], [], 0
        for m in masks:
            offsets.append(-1 if m is None else at)
            if m is not None:
                given.append(m.reshape(-1))
                at += m.numel()
        flat = (torch.cat(given).to(torch.uint8) if given else torch.zeros(1, dtype=torch.uint8))
        offsets_t = torch.tensor(offsets, dtype=torch.int64)
        ptr, idx = kv_indptr.to(torch.int32).contiguous(), kv_indices.to(torch.int32).contiguous()
        counts = torch.empty(int(qo.sum()), dtype=torch.int64)
        args = (len(qo_lens), qo.data_ptr(), kv.data_ptr(), ptr.data_ptr(), idx.data_ptr(),
                page_size, offsets_t.data_ptr(), flat.data_ptr(), counts.data_ptr())
        index = torch.empty(self.lib.sd_key_lists(*args, None), dtype=torch.int64)
        self.lib.sd_key_lists(*args, index.data_ptr())
        indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=indptr[1:])
        return indptr, index

    def layer_scratch(self, args: LayerArgs) -> int:
        """Floats of scratch ``layer(args)`` needs (for args.T rows, args.max_keys keys)."""
        return self.lib.sd_layer_scratch(ctypes.byref(args))

    def layer(self, args: LayerArgs) -> None:
        """Run one decoder layer on args.x in place (specdec/native/layer.c)."""
        rc = self.lib.sd_layer(ctypes.byref(args))
        assert rc == 0, "sd_layer refused its arguments"


@functools.cache  # the process's one handle on the library (and one log line)
def load() -> Kernels | None:
    """The compiled kernels, or None, said once in the log with the reason."""
    spec = importlib.util.find_spec("specdec._cpu_kernels")
    if spec is None or spec.origin is None:
        logger.info("specdec CPU kernels not built (reinstall with a C compiler): using the "
                    "pure-torch path, which is not row-invariant")
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        abi, features = lib.sd_abi_version(), lib.sd_cpu_features()
    except (OSError, AttributeError) as e:
        logger.warning("specdec CPU kernels at %s cannot be loaded (%s): using the pure-torch "
                       "path", spec.origin, e)
        return None
    if abi != ABI:
        logger.warning("specdec CPU kernels at %s are ABI %s, this specdec expects %s (rebuild: "
                       "pip install -e .): using the pure-torch path", spec.origin, abi, ABI)
        return None
    if not features & 1:
        logger.info("this CPU has no AVX2/FMA: using the pure-torch path")
        return None
    cap = os.environ.get("SPECDEC_NATIVE_ISA")
    if cap is not None and cap not in Q8_ISAS[:-1]:
        logger.warning("SPECDEC_NATIVE_ISA=%r is not one of %s: ignored (the widest kernels "
                       "this CPU has run)", cap, ", ".join(Q8_ISAS[:-1]))
    return Kernels(lib)
