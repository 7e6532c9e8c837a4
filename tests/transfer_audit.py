"""Every host <-> device transfer and sync of an engine's step, counted on a CPU (issue #53).

On a CPU every tensor is on "cpu", so ``TransferAudit`` tells device data from host data by
provenance: a TorchFunctionMode that keeps the set of tensors that would be on the device.
It is seeded with what an engine keeps there (``audit_engine``: every parameter, buffer and
tensor attribute of the target and drafter models, the KV caches, the runners' staged device
buffers, the attention backends' tensors), and every torch call adds to it:

- an op with a device tensor among its inputs makes device outputs (an in-place op or ``out=``
  makes its destination one); so does a factory given a ``device=`` (``torch.zeros(..,
  device=d)``) or a ``*_like`` / ``new_*`` of a device tensor;
- host -> device copies (``h2d``): ``torch.tensor`` / ``as_tensor`` / ``asarray`` of host data
  with a ``device=``, ``t.to(device)`` / ``.cuda()`` of a host tensor, ``copy_`` from a host
  source into a device one, indexing or assigning into a device tensor with a host index or
  host values (a Python list, a host tensor of more than one element), ``new_tensor``, and
  one per ``Staging.stage`` (the runners' one copy of a forward's inputs, written through numpy
  on a CPU, which no torch call sees);
- device -> host reads and syncs (``d2h``): ``.tolist()``, ``.item()``, ``.numpy()``,
  ``__array__``, ``bool()`` / ``int()`` / ``float()`` / ``index()`` / ``repr`` of a device
  tensor, ``.cpu()`` / ``.to("cpu")``, ``copy_`` from a device source into a host one,
  ``nonzero`` / ``masked_select`` / ``unique`` / ``equal`` / ``allclose`` / ``argwhere`` and a
  boolean-mask index of a device tensor (their result's size needs the device's answer).

Which ``device`` means the host: the engine spells a host move ``.cpu()`` or ``"cpu"`` (a
string), a device move ``.to(<torch.device>)`` (a runner's or a tensor's device); so do
factories (``device="cpu"`` makes host tensors, ``device=torch.device(...)`` device ones).

Where the CPU path would differ from CUDA's, the audit makes it take CUDA's: a device tensor's
``is_cpu`` is False (the verifiers' ``host_copy`` then reads it in one ``.cpu()``, and the
compiled CPU kernels' checks decline it, so a forward runs as torch ops, as on CUDA), and a
``.cpu()`` / ``.to(device)`` that torch would answer with the tensor itself returns a copy (the
copy a GPU makes), so that a read result is host data and a sent one device data.

Each counted transfer keeps the Python call site that made it (the first frame outside torch
and this file), for debugging: ``audit.sites("d2h")``.

    with audit_engine(llm.engine) as audit:
        llm.generate(prompts, params)
    audit.steps        # per engine.step(): StepAudit(kind, h2d, d2h, events)
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset({"tolist", "item", "numpy", "__array__", "__bool__", "__int__", "__float__",
                   "__index__", "__repr__", "__format__", "nonzero", "masked_select", "unique",
                   "unique_consecutive", "argwhere", "equal", "allclose"})
SEND_DATA = frozenset({"tensor", "as_tensor", "asarray"})  # factories that copy host data
MOVES = frozenset({"to", "cuda", "cpu"})
INDEX_OPS = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(torch.__file__)


@dataclass
class Transfer:
    kind: str  # "h2d" or "d2h"
    op: str  # the torch call that made it
    site: str  # file:line (function) of the code that called it


class _Counts:
    """h2d copies and d2h reads among ``self.events``."""

    events: list[Transfer]

    @property
    def h2d(self) -> int:
        return sum(e.kind == "h2d" for e in self.events)

    @property
    def d2h(self) -> int:
        return sum(e.kind == "d2h" for e in self.events)


@dataclass
class StepAudit(_Counts):
    kind: str  # "prefill" (the step fed prompt tokens), "speculative" (drafts), "plain"
    events: list[Transfer] = field(default_factory=list)



def _host_device(d) -> bool:
    """Whether a ``device`` argument names the host (the string spelling; see the docstring)."""
    return isinstance(d, str) and d.split(":")[0] == "cpu"


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _flat_out(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):  # (also named tuples: topk, sort, max)
        return [x for x in out if isinstance(x, torch.Tensor)]
    return []


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of Tensor (is_cpu, data, T, ...)
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    return name


class TransferAudit(_Counts, TorchFunctionMode):
    """Counts host <-> device transfers by provenance (module docstring). ``mark`` seeds device
    tensors; ``events`` are every transfer counted while the mode was on."""

    def __init__(self, opaque: tuple[str, ...] = ()) -> None:
        """``opaque``: files whose code stands for a device kernel (flashinfer's API model):
        what runs inside them is the kernel's business, not a transfer."""
        super().__init__()
        self.opaque = tuple(os.path.abspath(f) for f in opaque)
        self._device: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary())
        self.events: list[Transfer] = []
        self._staging = None
        # torch.device objects read off host tensors (``t.device``): a move or factory to one
        # of them stays on the host (kept alive while the audit runs, so their ids stay theirs)
        self._host_devices: dict[int, torch.device] = {}

    # ---- provenance --------------------------------------------------------------------------

    def mark(self, *tensors: torch.Tensor) -> None:
        """Seed: these tensors are on the device."""
        for t in tensors:
            self._device[id(t)] = t

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._device.get(id(t)) is t

    def count(self, kind: str, op: str) -> None:
        site = _site(self.opaque)
        if site is not None:
            self.events.append(Transfer(kind, op, site))

    def sites(self, kind: str | None = None) -> Counter:
        """How many transfers (of ``kind``, or both) each call site made."""
        return Counter(f"{e.kind} {e.op} {e.site}" for e in self.events
                       if kind is None or e.kind == kind)


    # ---- the mode ----------------------------------------------------------------------------

    def __enter__(self):
        from specdec.engine.staging import Staging

        stage, audit = Staging.stage, self

        def counted_stage(staging, arrays):  # one h2d copy, written through numpy on a CPU
            audit.count("h2d", "Staging.stage")
            return stage(staging, arrays)

        self._staging = (Staging, stage)
        Staging.stage = counted_stage
        return super().__enter__()

    def __exit__(self, *exc):
        cls, stage = self._staging
        cls.stage = stage
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == ".is_cpu" and self.on_device(args[0]):
            return False
        if name == ".device":
            out = func(*args, **kwargs)
            if not self.on_device(args[0]):
                self._host_devices[id(out)] = out
            return out
        if name in MOVES:
            return self._move(func, name, args, kwargs)
        inputs = _tensors(args, kwargs)
        device_in = any(self.on_device(t) for t in inputs)
        self._before(name, args, kwargs, inputs, device_in)
        out = func(*args, **kwargs)
        to_device = self._device_arg(kwargs.get("device"))
        if device_in or (name not in SEND_DATA and to_device):
            self._mark_out(name, args, kwargs, out)
        elif name in SEND_DATA and to_device:
            self.mark(*_flat_out(out))
        return out

    def _before(self, name, args, kwargs, inputs, device_in) -> None:
        """Count what ``name`` moves before it runs (see the module docstring)."""
        first = args[0] if args else None
        if name in READS and device_in:
            self.count("d2h", name)
        elif name in SEND_DATA and self._device_arg(kwargs.get("device")) and not device_in:
            self.count("h2d", name)
        elif name == "new_tensor" and self.on_device(first):
            self.count("h2d", name)
        elif name == "copy_" and len(args) > 1:
            dst, src = self.on_device(args[0]), self.on_device(args[1])
            if dst != src and isinstance(args[1], torch.Tensor):
                self.count("h2d" if dst else "d2h", name)
        elif name in INDEX_OPS and isinstance(first, torch.Tensor):
            self._index(name, args)

    def _index(self, name: str, args) -> None:
        """Indexing a device tensor: a host index or host values go to the device first; a
        boolean mask's result size is the device's answer (a sync). Assigning device values
        into a host tensor reads them."""
        dst = self.on_device(args[0])
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, (tuple, list)) and not _is_list_index(index) \
            else (index,)
        if dst:
            sent = any(_host_data(p, self) for p in parts)
            if name != "__getitem__" and len(args) > 2 and _host_data(args[2], self):
                sent = True
            if sent:
                self.count("h2d", name)
            if name == "__getitem__" and any(isinstance(p, torch.Tensor)
                                             and p.dtype == torch.bool for p in parts):
                self.count("d2h", "boolean index")
        elif name == "__setitem__" and len(args) > 2 and self.on_device(args[2]):
            self.count("d2h", name)

    def _mark_out(self, name, args, kwargs, out) -> None:
        self.mark(*_flat_out(out))
        if name.endswith("_") and not name.endswith("__") and args \
                and isinstance(args[0], torch.Tensor):
            self.mark(args[0])  # an in-place op's destination
        if name == "__setitem__" and args and isinstance(args[0], torch.Tensor):
            self.mark(args[0])
        if isinstance(kwargs.get("out"), torch.Tensor):
            self.mark(kwargs["out"])

    def _move(self, func, name, args, kwargs):
        """``.cpu()``, ``.cuda()``, ``.to(...)``: a read when a device tensor goes to the host,
        a send when a host tensor goes to the device (each a copy, as on a GPU); else what
        ``to`` does (a dtype change keeps the tensor's side)."""
        t = args[0]
        target = self._move_target(name, args[1:], kwargs)
        out = func(*args, **kwargs)
        on = self.on_device(t)
        if target == "host" and on:
            self.count("d2h", name)
            return out.clone() if out is t else out
        if target == "device" and not on:
            self.count("h2d", name)
            out = out.clone() if out is t else out
            self.mark(out)
            return out
        if on:
            self.mark(*_flat_out(out))
        return out


    def _device_arg(self, d) -> bool:
        """Whether a ``device=`` names the device: not None, not spelled "cpu", not read off a
        host tensor."""
        return d is not None and not _host_device(d) and id(d) not in self._host_devices

    def _move_target(self, name: str, rest, kwargs) -> str | None:
        """"host", "device", or None (``to`` a dtype only)."""
        if name == "cpu":
            return "host"
        if name == "cuda":
            return "device"
        d = kwargs.get("device")
        for a in rest:
            if isinstance(a, (str, torch.device)):
                d = a
            elif isinstance(a, torch.Tensor):  # .to(other): other's side
                return "device" if self.on_device(a) else "host"
        if d is None:
            return None
        return "device" if self._device_arg(d) else "host"


def _is_list_index(index) -> bool:
    return isinstance(index, list) and all(isinstance(i, int) for i in index)


def _host_data(x, audit: TransferAudit) -> bool:
    """Whether ``x`` (an index or values) is host data a device op must copy first: a Python
    list of ints, or a host tensor of more than one element (a 0-d one goes as a scalar)."""
    if isinstance(x, list):
        return True
    return isinstance(x, torch.Tensor) and not audit.on_device(x) and x.dim() > 0


def _site(opaque: tuple[str, ...]) -> str | None:
    """file:line (function) of the first caller outside torch and this file; None when the
    call came from inside an ``opaque`` file."""
    f, site = sys._getframe(2), None
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path in opaque:
            return None
        if site is None and path != _HERE and not path.startswith(_TORCH) \
                and "contextlib" not in path:
            site = f"{_short(path)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return site or "?"


def _short(path: str) -> str:
    for root in ("/specdec/", "/drafters/", "/verifiers/", "/controllers/", "/tests/"):
        i = path.rfind(root)
        if i >= 0:
            return path[i + 1:]
    return path


# ---- an engine under the audit ---------------------------------------------------------------


def device_tensors(engine) -> list[torch.Tensor]:
    """What an engine keeps on its device: the runners' models, KV caches, staged buffers and
    attention backends' tensors, and every model the drafter holds (MTP's heads have no
    runner)."""
    parts = engine.parts
    found: dict[int, torch.Tensor] = {}
    for runner in (parts.runner, *parts.drafter_runners):
        _collect(runner.model, found)
        found[id(runner.kv.cache.tensor)] = runner.kv.cache.tensor
        buf = runner.staging._device_buf
        found[id(buf)] = buf
        for view in runner.staging._views.values():  # views made before the audit began
            found[id(view)] = view
        _collect(runner.backend, found, depth=1)
    _collect(parts.drafter, found, modules_only=True)
    return list(found.values())


def _collect(obj, found: dict, depth: int = 3, modules_only: bool = False, seen=None) -> None:
    """Tensors of ``obj``: an nn.Module's parameters, buffers and tensor attributes (of it and
    its submodules); other objects' attributes, ``depth`` levels down (``modules_only``: only
    the modules found there, not the plain tensors: a drafter's host state)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                found[id(t)] = t
            _attrs(m, found, seen, 2)
        return
    if isinstance(obj, torch.Tensor):
        if not modules_only:
            found[id(obj)] = obj
        return
    if depth <= 0 or not hasattr(obj, "__dict__"):
        return
    for v in vars(obj).values():
        items = v if isinstance(v, (list, tuple)) else (v,)
        for x in items:
            if isinstance(x, (torch.nn.Module, torch.Tensor)) or hasattr(x, "__dict__"):
                _collect(x, found, depth - 1, modules_only, seen)


def _attrs(m, found: dict, seen: set, depth: int) -> None:
    """A module's plain tensor attributes and those of its non-module helpers (a RoPE table)."""
    for v in vars(m).values():
        if isinstance(v, torch.Tensor):
            found[id(v)] = v
        elif depth > 0 and not isinstance(v, torch.nn.Module) and hasattr(v, "__dict__") \
                and not isinstance(v, type) and id(v) not in seen:
            seen.add(id(v))
            _attrs(v, found, seen, depth - 1)


@contextlib.contextmanager
def audit_engine(engine):
    """The audit over ``engine``'s steps: seeded with its device tensors, and per
    ``engine.step()`` a StepAudit in ``audit.steps`` (the instance's step wrapped; the class
    untouched). Where flashinfer is its API model (tests/attention/flashinfer_api_model.py),
    the model's code is the kernel (opaque) and each wrapper's ``plan()`` counts one h2d: the
    real plan() sends its index arrays and plan info to the device, from a pinned buffer."""
    model = sys.modules.get("flashinfer")
    fake = getattr(model, "__version__", "") == "model"
    audit = TransferAudit(opaque=(sys.modules[model.BatchPrefillWithPagedKVCacheWrapper
                                              .__module__].__file__,) if fake else ())
    audit.mark(*device_tensors(engine))
    audit.steps = []
    step = engine.step

    def audited_step():
        start = len(audit.events)
        result = step()
        s = result.stats
        kind = ("prefill" if s.num_prefill_tokens else
                "speculative" if s.num_draft_nodes else "plain")
        audit.steps.append(StepAudit(kind, audit.events[start:]))
        return result

    engine.step = audited_step
    plans = []
    if fake:
        for cls in (model.BatchPrefillWithPagedKVCacheWrapper,
                    model.BatchDecodeWithPagedKVCacheWrapper):
            plans.append((cls, cls.__dict__["plan"]))
            cls.plan = _counted_plan(audit, cls.__dict__["plan"])
    try:
        with audit:
            yield audit
    finally:
        del engine.step
        for cls, plan in plans:
            cls.plan = plan


def _counted_plan(audit: TransferAudit, plan):
    def counted(wrapper, *args, **kwargs):
        audit.events.append(Transfer("h2d", "flashinfer plan", _site(())))
        return plan(wrapper, *args, **kwargs)
    return counted
