"""The compiled CPU kernels (specdec/native/*.c) as Python callables, or None.

``load()`` finds the extension built at install (``specdec._cpu_kernels``), checks its ABI and
this CPU's features, and returns a ``Kernels`` object, or None — with one log line saying why —
when it is missing, stale or cannot run here; callers then take their pure-torch path.

    k = load()
    w = k.prepare(weight)            # [out, in] fp32 / bf16 / fp16 -> panels [P, in, 8]
    y = k.linear(x, w)               # x [T, in] fp32 -> [T, out] fp32, row-invariant
    k.layer(args)                    # one decoder layer in one call (specdec.models.matmul.fused)
    k.layers(array, 0, n, step)      # n layers of one step in one call (the same, in a C loop)

The prepared weights (``Panels``, ``PanelParts``, their C view ``Weight``) are
specdec.native.panels; they are imported here, so ``native.Panels`` is the same class.

The C side sees pointers only, so every tensor is checked here before a call (dims, dtype,
device, contiguity, lengths against the prepared weight, key lists against the cache rows): a
bad argument is a ValueError / TypeError naming the kernel, the shape and what is allowed,
never a read out of bounds. Zero rows are a valid call (an empty result).
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import importlib.util
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

from specdec.native.panels import (  # noqa: F401  (native.Panels etc. for callers)
    FORMATS,
    MAX_PARTS,
    PAIR_BYTES,
    PANEL,
    PARTS,
    Q8_FORMATS,
    SUPER_BLOCK,
    PanelParts,
    Panels,
    Weight,
)

ABI = 16
Q8_ISAS = ("avx2", "avx-vnni", "avx512-vnni", "amx")  # sd_q8_isa's values, by index
FLOAT_ISAS = ("avx2", "avx512")  # sd_float_isa's values, by index
logger = logging.getLogger("specdec")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


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
                ("qkv_input", _P), ("qkv_in", _I), ("moe", _P)]


class MoEArgs(ctypes.Structure):
    """sd_moe (specdec/native/moe.c): a mixture-of-experts layer's MLP (``LayerArgs.moe``
    points at one): its router, each expert's gate|up and down (C arrays of ``Weight``), a
    shared expert, and where the count of experts woken is written."""
    _fields_ = [("n_experts", _I), ("top_k", _I), ("inter", _I), ("norm_topk", _I),
                ("router", Weight), ("gate_up", _P), ("down", _P), ("shared_inter", _I),
                ("shared_gate_up", Weight), ("shared_down", Weight), ("shared_gate", Weight),
                ("woken", _P)]


class StepArgs(ctypes.Structure):
    """sd_step (specdec/native/layer.c): what every layer of one step shares; layer i's cache
    is ``kv_stride`` bytes after layer i - 1's."""
    _fields_ = [("T", _I), *((n, _P) for n in ("x", "cos", "sin", "kv")),
                *((n, _I) for n in ("kv_stride", "kv_rows", "kv_fmt", "page_size")),
                *((n, _P) for n in ("write_index", "key_indptr", "key_index")),
                *((n, _I) for n in ("n_keys", "max_keys", "nthreads")),
                ("qkv_input", _P), ("qkv_in", _I)]


# sd_layers' refusals of a step's rows (layer.c check_rows), by its return code
ROW_ERRORS = {-2: "write_index names a row outside the cache",
              -3: "a key list cannot be read (bounds, max_keys, or a row outside the cache)"}


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    layout = "" if t.is_contiguous() else f", not contiguous (strides {t.stride()})"
    return f"shape {tuple(t.shape)} {t.dtype} on {t.device}{layout}"


def _check(kernel: str, name: str, t, allowed: Callable[[], str],
           dtypes: tuple[torch.dtype, ...], fits: Callable[[torch.Tensor], bool]) -> None:
    """Raise unless ``t`` is a contiguous CPU tensor of one of ``dtypes`` whose dims and sizes
    ``fits``; the message names the kernel, ``name``'s shape and what is ``allowed()`` (made
    only then: a call's checks cost ~1 us)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes:
        raise TypeError(f"{kernel}: {name} of {_describe(t)}; allowed: {allowed()}")
    if not t.is_cpu or not t.is_contiguous() or not fits(t):
        raise ValueError(f"{kernel}: {name} of {_describe(t)}; allowed: {allowed()}")


class Kernels:
    """ctypes bindings of one loaded library (see module docstring)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.sd_linear.argtypes = [_P, _I, _I, _P, ctypes.c_int, _I, _P, _I, ctypes.c_int]
        lib.sd_linear_weight.argtypes = [_P, _I, _I, ctypes.POINTER(Weight), _P, _I,
                                         ctypes.c_int]
        lib.sd_attention.argtypes = [_P, _I, _I, _I, _P, ctypes.c_int, _I, _I, _P, _P, _I, _F,
                                     _P, _P, ctypes.c_int]
        lib.sd_layer.argtypes = lib.sd_layer_scratch.argtypes = [ctypes.POINTER(LayerArgs)]
        lib.sd_layer_scratch.restype = _I
        lib.sd_key_lists.argtypes = [_I, _P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _P]
        lib.sd_key_lists.restype = _I
        lib.sd_write_index.argtypes = [_I, _P, _I, _P]
        lib.sd_layers.argtypes = [_P, _I, ctypes.POINTER(StepArgs)]
        lib.sd_check_keys.argtypes = [_I, _P, _P, _I, _I, _I]
        lib.sd_check_keys.restype = _I
        lib.sd_repack.argtypes = [_P, _I, _I, _I, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int]

    @functools.cached_property
    def build(self) -> str:
        """A digest of the loaded library's bytes: changes with any rebuilt kernel, where the
        ABI number changes only with a signature (what the step costs cached per build need)."""
        return hashlib.blake2b(Path(self.lib._name).read_bytes(), digest_size=8).hexdigest()

    @property
    def q8_isa(self) -> str:
        """The instruction set the 8-bit-activation kernels run here (bitwise the same results
        on every one; ``SPECDEC_NATIVE_ISA=avx2``, ``avx-vnni`` or ``avx512-vnni`` in the
        environment caps it; ``amx`` is the widest)."""
        return Q8_ISAS[self.lib.sd_q8_isa()]

    @property
    def float_isa(self) -> str:
        """The instruction set the float-activation GGUF kernels run here: ``avx512`` where the
        CPU has AVX-512 F/BW/VL/DQ, else ``avx2`` (bitwise the same results;
        ``SPECDEC_NATIVE_ISA=avx2`` or ``avx-vnni`` in the environment caps it)."""
        return FLOAT_ISAS[self.lib.sd_float_isa()]

    @staticmethod
    def prepare(weight: torch.Tensor) -> Panels:
        """weight [out, in] (a dtype in FORMATS) -> its panels (a copy, made once at load)."""
        if weight.dtype not in FORMATS or weight.dim() != 2 or 0 in weight.shape:
            raise ValueError(f"panels need a 2-d weight of {sorted(map(str, FORMATS))} with at "
                             f"least one row and column, got {tuple(weight.shape)} "
                             f"{weight.dtype}")
        if weight.device.type != "cpu":
            raise ValueError(f"panels need a weight on the CPU, got {tuple(weight.shape)} on "
                             f"{weight.device}")
        out, inp = weight.shape
        p = 2 * -(-out // (2 * PANEL))  # an even number: the kernel takes panels in pairs
        padded = weight.new_zeros(p * PANEL, inp)
        padded[:out] = weight
        return Panels(padded.view(p, PANEL, inp).transpose(1, 2).contiguous(), out, inp,
                      FORMATS[weight.dtype], p)

    def linear(self, x: torch.Tensor, w: Panels | PanelParts) -> torch.Tensor:
        """x [..., in] float32 contiguous on the CPU -> [..., out] float32 (x @ weight.T), the
        shapes F.linear takes: [T, in] (T = 0 too), [in], or leading batch dims (flattened to
        rows; a row's result is the same in any of them)."""
        if not isinstance(w, (Panels, PanelParts)):
            raise TypeError(f"sd_linear: w is a {type(w).__name__}, not Panels (Kernels.prepare, "
                            "specdec.models.gguf.blocks.prepare) or PanelParts")
        k, out, p = w.in_features, w.out_features, w.panels
        _check("sd_linear", "x", x, lambda: f"[..., {k}] float32, contiguous, on the CPU (the "
               f"panels of a [{out}, {k}] weight)", dtypes=(torch.float32,),
               fits=lambda x: x.dim() >= 1 and x.shape[-1] == k)
        lead = x.shape[:-1]
        t = math.prod(lead)
        if t == 0:  # nothing to compute (and the kernel's row tiles start at one row)
            return x.new_empty(*lead, out)
        y = torch.empty(t, p * PANEL, dtype=torch.float32)
        threads = torch.get_num_threads()
        if isinstance(w, PanelParts):
            rc = self.lib.sd_linear_weight(x.data_ptr(), t, k, ctypes.byref(w.c_weight),
                                           y.data_ptr(), p * PANEL, threads)
        else:
            rc = self.lib.sd_linear(x.data_ptr(), t, k, w.data.data_ptr(), w.fmt, p,
                                    y.data_ptr(), p * PANEL, threads)
        if rc != 0:
            raise RuntimeError(f"sd_linear refused x {tuple(x.shape)} with panels of a "
                               f"[{out}, {k}] weight (format {w.fmt}, {p} panels)")
        y = y if out == p * PANEL else y[:, :out]
        return y if x.dim() == 2 else y.reshape(*lead, out)

    def attention(self, q: torch.Tensor, kv_rows: torch.Tensor, v_offset: int,
                  key_indptr: torch.Tensor, key_index: torch.Tensor, max_keys: int,
                  scale: float) -> torch.Tensor:
        """q [T, H, D] fp32; kv_rows [R, Hkv, D] fp32 / bf16 / fp16 (K rows; V rows
        ``v_offset`` later);
        key_indptr [T + 1] / key_index int64: the K rows row t attends to, in summation order.
        -> [T, H, D] fp32 (T = 0 too). Every key list must fit max_keys and name K rows
        below R - v_offset (so its V rows exist)."""
        kernel = "sd_attention"
        _check(kernel, "q", q,
               lambda: "[T, H, D] float32 (D a multiple of 8), contiguous, on the CPU",
               dtypes=(torch.float32,),
               fits=lambda q: q.dim() == 3 and q.shape[1] > 0 and q.shape[2] % 8 == 0
               and q.shape[2] > 0)
        t, h, d = q.shape
        _check(kernel, "kv_rows", kv_rows, lambda: f"[R, Hkv, {d}] of "
               f"{sorted(map(str, FORMATS))}, Hkv dividing {h}, contiguous, on the CPU",
               dtypes=tuple(FORMATS),
               fits=lambda kv: kv.dim() == 3 and kv.shape[2] == d and kv.shape[1] > 0
               and h % kv.shape[1] == 0)
        if not 0 <= v_offset <= kv_rows.shape[0] or max_keys < 0:
            raise ValueError(f"{kernel}: v_offset {v_offset} / max_keys {max_keys} with kv_rows "
                             f"of shape {tuple(kv_rows.shape)}: allowed 0 <= v_offset <= "
                             f"{kv_rows.shape[0]}, max_keys >= 0")
        self._check_keys(kernel, key_indptr, key_index, t, max_keys,
                         kv_rows.shape[0] - v_offset)
        out = torch.empty_like(q)
        if t == 0:
            return out
        threads = torch.get_num_threads()
        scratch = torch.empty(threads * max(max_keys, 1), dtype=torch.float32)
        rc = self.lib.sd_attention(q.data_ptr(), t, h, d, kv_rows.data_ptr(),
                                   FORMATS[kv_rows.dtype], kv_rows.shape[1], v_offset,
                                   key_indptr.data_ptr(), key_index.data_ptr(), max_keys, scale,
                                   out.data_ptr(), scratch.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"sd_attention refused q {tuple(q.shape)}, kv_rows "
                               f"{tuple(kv_rows.shape)} {kv_rows.dtype}")
        return out

    def _check_keys(self, kernel: str, indptr: torch.Tensor, index: torch.Tensor, t: int,
                    max_keys: int, rows: int) -> None:
        """Raise unless indptr [t + 1] / index int64 are key lists of at most max_keys keys
        each, every one a row below ``rows`` (sd_check_keys: a scalar pass over them)."""
        _check(kernel, "key_indptr", indptr, lambda: f"[{t + 1}] int64 (T + 1 for q's T = "
               f"{t}), contiguous, on the CPU", dtypes=(torch.int64,),
               fits=lambda p: p.dim() == 1 and p.numel() == t + 1)
        _check(kernel, "key_index", index, lambda: "[N] int64, contiguous, on the CPU",
               dtypes=(torch.int64,), fits=lambda i: i.dim() == 1)
        bad = self.lib.sd_check_keys(t, indptr.data_ptr(), index.data_ptr(), index.numel(),
                                     max_keys, rows)
        if bad >= 0:
            keys = index[int(indptr[bad]):int(indptr[bad + 1])]
            raise ValueError(
                f"{kernel}: row {bad}'s key list (key_indptr[{bad}:{bad + 2}] = "
                f"{indptr[bad:bad + 2].tolist()}, keys {keys[:8].tolist()}"
                f"{' ...' if keys.numel() > 8 else ''}) of key_index {tuple(index.shape)}; "
                f"allowed: key_indptr non-decreasing within 0..{index.numel()}, at most "
                f"max_keys = {max_keys} keys a row, keys in 0..{rows - 1}")

    def key_lists(self, qo_lens: list[int], kv_lens: list[int], kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, page_size: int,
                  masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row of a step, the K cache rows of the keys it sees, ascending (causal, or
        its request's [qo, kv] tree mask): (indptr [T + 1], index) int64. kv_indptr /
        kv_indices: the pages, int32 (specdec.attention.metadata)."""
        return self.key_lists_max(qo_lens, kv_lens, kv_indptr, kv_indices, page_size, masks)[:2]

    def key_lists_max(self, qo_lens: list[int], kv_lens: list[int], kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, page_size: int, masks: list[torch.Tensor | None]
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``key_lists`` and the longest list's length (1 when there are no rows). The lengths
        and pages are checked in C (sd_key_lists), the masks' shapes here; a refusal is
        explained by ``_check_requests``."""
        b = len(qo_lens)
        step = (qo_lens, kv_lens, kv_indptr, kv_indices, page_size, masks)
        if not (len(kv_lens) == b == len(masks) and page_size >= 1
                and _index_array(kv_indptr) and _index_array(kv_indices)
                and kv_indptr.numel() >= b + 1):
            _refuse_requests(*step, "its arguments")
        lens = array.array("q", [*qo_lens, *kv_lens])
        at = lens.buffer_info()[0]
        held, flat = _mask_pointers(*step)
        ptr, idx = _int32(kv_indptr), _int32(kv_indices)
        indptr = torch.empty(max(sum(qo_lens), 0) + 1, dtype=torch.int64)
        longest = array.array("q", [1])
        args = (b, at, at + 8 * b, ptr.data_ptr(), idx.data_ptr(), idx.numel(), page_size,
                flat, indptr.data_ptr())
        n = self.lib.sd_key_lists(*args, None, 0, longest.buffer_info()[0])
        if n < 0:
            _refuse_requests(*step, f"request {-2 - n}" if n < -1 else "page_size")
        index = torch.empty(n, dtype=torch.int64)
        if n and self.lib.sd_key_lists(*args, index.data_ptr(), n, longest.buffer_info()[0]) != n:
            raise RuntimeError("sd_key_lists: the key lists changed between its two passes")
        del held  # the masks converted for the call lived until here
        return indptr, index, longest[0]

    def write_index(self, slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """``kv_write_index`` (specdec.attention.kv_rows) in one call: slots [S] int64 -> the
        [2 * S] int64 cache rows they are written to (K rows, then V rows)."""
        _check("sd_write_index", "slots", slots, lambda: "[S] int64, contiguous, on the CPU",
               dtypes=(torch.int64,), fits=lambda s: s.dim() == 1)
        out = torch.empty(2 * slots.numel(), dtype=torch.int64)
        if self.lib.sd_write_index(slots.numel(), slots.data_ptr(), page_size, out.data_ptr()):
            raise ValueError(f"sd_write_index: page_size {page_size}; allowed: >= 1")
        return out

    def layers(self, layers: ctypes.Array, start: int, n: int, step: StepArgs) -> int:
        """sd_layers (specdec/native/layer.c) over layers[start:start + n] and one step: 0 when
        they ran, else its refusal (nothing written). The structs hold pointers only: the caller
        checks the tensors behind them (specdec.models.matmul.fused)."""
        assert 0 <= start and start + n <= len(layers), (start, n, len(layers))
        return self.lib.sd_layers(ctypes.byref(layers, start * ctypes.sizeof(LayerArgs)), n,
                                  ctypes.byref(step))

    def layer_scratch(self, args: LayerArgs) -> int:
        """Floats of scratch ``layer(args)`` needs (for args.T rows, args.max_keys keys)."""
        return self.lib.sd_layer_scratch(ctypes.byref(args))

    def layer(self, args: LayerArgs) -> None:
        """Run one decoder layer on args.x in place (specdec/native/layer.c). The struct holds
        pointers only: its caller checks the tensors behind them (specdec.models.matmul.fused)."""
        rc = self.lib.sd_layer(ctypes.byref(args))
        if rc != 0:
            raise RuntimeError(f"sd_layer refused its arguments (T {args.T}, hidden "
                               f"{args.hidden}, heads {args.heads}/{args.kv_heads} x "
                               f"{args.head_dim}, inter {args.inter}, qkv_in {args.qkv_in})")


def _check_requests(qo_lens: list[int], kv_lens: list[int], kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, page_size: int,
                    masks: list[torch.Tensor | None]) -> None:
    """Raise unless the arguments of ``key_lists`` describe B requests whose pages exist."""
    kernel, b = "sd_key_lists", len(qo_lens)
    if len(kv_lens) != b or len(masks) != b or page_size < 1:
        raise ValueError(f"{kernel}: {b} qo_lens, {len(kv_lens)} kv_lens, {len(masks)} masks, "
                         f"page_size {page_size}; allowed: one of each per request, "
                         "page_size >= 1")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point():
            raise TypeError(f"{kernel}: {name} of {_describe(t)}; allowed: a 1-d integer tensor")
    if kv_indptr.numel() < b + 1:
        raise ValueError(f"{kernel}: kv_indptr of shape {tuple(kv_indptr.shape)} for {b} "
                         f"requests; allowed: at least [{b + 1}]")
    ptr = kv_indptr[:b + 1].tolist()
    for i, (qo, kv, m) in enumerate(zip(qo_lens, kv_lens, masks)):
        pages = -(-kv // page_size) if kv > 0 else 0
        if not (qo >= 0 and kv >= 0 and 0 <= ptr[i] and ptr[i] + pages <= ptr[i + 1]
                and ptr[i + 1] <= kv_indices.numel()):
            raise ValueError(f"{kernel}: request {i} ({qo} query rows over {kv} keys, pages "
                             f"{ptr[i]}..{ptr[i + 1]} of kv_indices {tuple(kv_indices.shape)}): "
                             f"allowed: lengths >= 0 and {pages} pages of {page_size} within "
                             "kv_indices")
        if m is not None and tuple(m.shape) != (qo, kv):
            raise ValueError(f"{kernel}: request {i}'s mask of shape {tuple(m.shape)}; "
                             f"allowed: [{qo}, {kv}] (query rows, keys)")


def _refuse_requests(qo_lens, kv_lens, kv_indptr, kv_indices, page_size, masks,
                     what: str) -> NoReturn:
    """Raise ``_check_requests``'s explanation of a refusal of ``what`` (a cheaper check, or
    sd_key_lists's, found it)."""
    _check_requests(qo_lens, kv_lens, kv_indptr, kv_indices, page_size, masks)
    raise ValueError(f"sd_key_lists: refused {what} ({len(qo_lens)} requests)")


def _index_array(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point()


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous int32 CPU tensor (itself when it is one)."""
    if t.dtype == torch.int32 and t.is_cpu and t.is_contiguous():
        return t
    return t.to("cpu", torch.int32).contiguous()


def _mask_pointers(qo_lens, kv_lens, kv_indptr, kv_indices, page_size,
                   masks) -> tuple[list[torch.Tensor], int | None]:
    """(the masks as contiguous 1-byte CPU tensors, the address of their pointers: 0 for a
    causal request), or ([], None) when every request is causal."""
    if all(m is None for m in masks):
        return [], None
    held, ptrs = [], array.array("Q", bytes(8 * len(masks)))
    for i, m in enumerate(masks):
        if m is None:
            continue
        if tuple(m.shape) != (qo_lens[i], kv_lens[i]):
            _refuse_requests(qo_lens, kv_lens, kv_indptr, kv_indices, page_size, masks,
                             f"request {i}'s mask")
        if m.dtype not in (torch.bool, torch.uint8) or not m.is_cpu or not m.is_contiguous():
            m = m.to("cpu", torch.bool).contiguous()
        held.append(m)
        ptrs[i] = m.data_ptr()
    held.append(ptrs)
    return held, ptrs.buffer_info()[0]


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
    _warn_if_stale(Path(spec.origin))
    cap = os.environ.get("SPECDEC_NATIVE_ISA")
    if cap is not None and cap not in Q8_ISAS:
        logger.warning("SPECDEC_NATIVE_ISA=%r is not one of %s: ignored (the widest kernels "
                       "this CPU has run)", cap, ", ".join(Q8_ISAS))
    return Kernels(lib)


def _warn_if_stale(built: Path) -> None:
    """Log when a source beside the library (an editable install) is newer than the library:
    nothing rebuilds it but ``pip install -e .``, and the ABI number only catches changed
    signatures, not changed code."""
    sources = Path(__file__).resolve().parent  # the C sources beside this file
    newer = [p.name for p in sorted(sources.glob("*.[ch]"))
             if p.stat().st_mtime > built.stat().st_mtime]
    if newer:
        logger.warning("specdec CPU kernels at %s are older than %s: they run the code they "
                       "were built from (rebuild: pip install -e .)", built, ", ".join(newer))
