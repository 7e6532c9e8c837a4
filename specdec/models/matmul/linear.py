"""CPU linear kernels, chosen by timing them on the machine that runs them.

A batch-1 decode step on CPU is bound by streaming the weights from memory, and MKL's GEMV /
small-M GEMM may stream them with one core. The paths below can keep every core streaming, but
which one wins depends on the CPU: tuned on a 2-core AMD EPYC they halved a SmolLM2 step, while
on a 2-core Intel Xeon the same choice was 2.2x slower than plain `F.linear`. So `LinearKernels`
times every applicable path per (row bucket, weight shape) at start-up, with `F.linear` always
measured and kept unless another path beats it by `MARGIN`, and caches the table per machine.

Every candidate: x [T, in], weight [out, in], bias [out] | None -> [T, out] (x @ weight.T + bias).

    kernels = LinearKernels.tune([(960, 576), (576, 576)], torch.float32, cache_dir=Path(".cache"))
    y = kernels(x, weight)   # dict lookup on (bucket(T), out, in); F.linear when not tuned
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

Candidate = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# timer(name, fn, x, weight, bias) -> seconds for one call; the seam tests inject timings through
Timer = Callable[[str, Candidate, torch.Tensor, torch.Tensor, "torch.Tensor | None"], float]
Entry = tuple[int, int, int]  # (row bucket, out_features, in_features)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# a tuned path must beat F.linear by this fraction of F.linear's time, else noise could pick it
MARGIN = 0.05
# multiply-reduce materialises a weight-sized product: beyond ~16 MB of fp32 (an LM head) it loses
VECDOT_MAX_NUMEL = 1 << 22
# the weight-left product streams the weight once for all rows only while the rows are few
WEIGHT_LEFT_MAX_ROWS = 8
# timing rotates over weight copies filling this much memory, so that the weights come from DRAM
# as in a real step (30 layers' weights evict each other) and not from a warm last-level cache
COLD_POOL_BYTES = 64 << 20
CACHE_FORMAT = 2


def vecdot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Multiply-reduce for one row: x [1, in], weight [out, in] -> [1, out]."""
    out = torch.linalg.vecdot(weight, x).unsqueeze(0)
    return out if bias is None else out + bias


def weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                splits: int = 2) -> torch.Tensor:
    """bmm(weight blocks, x.T): x [T, in], weight [out, in] -> [T, out]; `splits` divides out.

    With the rows as the skinny right operand, MKL streams each weight block once for all rows
    and the `splits` blocks run on separate cores.
    """
    rows, out_features = x.shape[0], weight.shape[0]
    blocks = weight.view(splits, out_features // splits, weight.shape[1])
    out = torch.bmm(blocks, x.t().unsqueeze(0).expand(splits, -1, -1))
    # the product comes out [out, T]: return it row-major, so that the transpose copy is paid
    # (and timed) here rather than by whichever op reads it next
    out = out.reshape(out_features, rows).t()
    out = out.contiguous() if bias is None else out + bias
    return out


def rows_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              splits: int = 2) -> torch.Tensor:
    """bmm(x, weight blocks.T): x [T, in], weight [out, in] -> [T, out]; `splits` divides out."""
    rows, out_features = x.shape[0], weight.shape[0]
    blocks = weight.view(splits, out_features // splits, weight.shape[1])
    out = torch.bmm(x.unsqueeze(0).expand(splits, -1, -1), blocks.transpose(1, 2))
    out = out.transpose(0, 1).reshape(rows, out_features)
    return out if bias is None else out + bias


def block_splits(out_features: int, in_features: int) -> int:
    """Blocks of weight rows for the batched paths: 8 for a large (LM head) weight when 8 divides
    out, else 2 when 2 does; 0 when neither applies."""
    if out_features * in_features > VECDOT_MAX_NUMEL and out_features % 8 == 0:
        return 8
    return 2 if out_features % 2 == 0 else 0


def candidates(rows: int, out_features: int, in_features: int) -> dict[str, Candidate]:
    """The paths that apply to x [rows, in] @ weight [out, in].T, by name; "linear" always first.

    >>> list(candidates(1, 576, 576)), list(candidates(9, 49152, 576))
    (['linear', 'vecdot', 'weight_left', 'rows_left'], ['linear', 'rows_left'])
    """
    found: dict[str, Candidate] = {"linear": F.linear}
    if rows == 1 and out_features * in_features <= VECDOT_MAX_NUMEL:
        found["vecdot"] = vecdot
    splits = block_splits(out_features, in_features)
    if splits and rows <= WEIGHT_LEFT_MAX_ROWS:
        found["weight_left"] = partial(weight_left, splits=splits)
    if splits:
        found["rows_left"] = partial(rows_left, splits=splits)
    return found


def bucket_of(rows: int) -> int:
    """Smallest bucket >= rows (1 -> 1, 3 -> 4, 9 -> 16); rows must be in 1..BUCKETS[-1]."""
    assert 1 <= rows <= BUCKETS[-1], rows
    return 1 << (rows - 1).bit_length()


def choose(seconds: dict[str, float], margin: float = MARGIN) -> str:
    """The fastest candidate if it beats seconds["linear"] by `margin` of it, else "linear".

    >>> choose({"linear": 1.0, "vecdot": 0.96}), choose({"linear": 1.0, "vecdot": 0.95})
    ('linear', 'vecdot')
    """
    best = min(seconds, key=seconds.__getitem__)
    return best if seconds[best] <= (1.0 - margin) * seconds["linear"] else "linear"


def label(entry: Entry) -> str:
    """(bucket, out, in) -> "bucketxoutxin", the key in describe() and the cache file."""
    return "x".join(map(str, entry))


def cache_key(dtype: torch.dtype, threads: int) -> str:
    """What a tuned table is valid for: CPU model, torch version, dtype and thread count."""
    return f"{cpu_model()} | torch {torch.__version__} | {dtype} | {threads} threads"


def cpu_model() -> str:
    """The CPU: /proc/cpuinfo's model name, family/model/stepping, cache size and a hash of its
    flags (a VM may report only "AMD EPYC" for several generations), else platform.processor()."""
    fields = ("model name", "cpu family", "model", "stepping", "cache size", "flags")
    with contextlib.suppress(OSError):  # no /proc (macOS, Windows): fall through
        seen: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in fields and name.strip() not in seen:
                seen[name.strip()] = value.strip()
        if "model name" in seen:
            flags = hashlib.sha256(seen.pop("flags", "").encode()).hexdigest()[:8]
            return " / ".join([*seen.values(), f"flags {flags}"])
    return platform.processor() or platform.machine() or "unknown cpu"


class LinearKernels:
    """(row bucket, out, in) -> the path chosen for it; F.linear for everything else.

    Call it like F.linear on x [T, in]: T in 1..64 uses the choice of the smallest bucket >= T.
    More rows, a non-CPU device, another dtype than tuned, or inputs that require grad always go
    to F.linear. Build it with `plain()` (never tuned) or `tune(...)`.
    """

    def __init__(self, dtype: torch.dtype | None, choices: dict[Entry, str], *, key: str = "",
                 tuned_seconds: float = 0.0, from_cache: bool = False,
                 timings_ms: dict[str, dict[str, float]] | None = None) -> None:
        self.dtype = dtype
        self.choices = dict(choices)
        self.key, self.tuned_seconds, self.from_cache = key, tuned_seconds, from_cache
        self.timings_ms = dict(timings_ms or {})
        # only entries that do not use F.linear, resolved once so that a call is one dict lookup
        self._fns: dict[Entry, Candidate] = {}
        for entry, name in self.choices.items():
            offered = candidates(*entry)
            if name not in offered:
                raise ValueError(f"{name!r} does not apply to {label(entry)}; use one of "
                                 f"{list(offered)}")
            if name != "linear":
                self._fns[entry] = offered[name]

    @classmethod
    def plain(cls) -> LinearKernels:
        """A table that always uses F.linear (models not tuned; tests)."""
        return cls(None, {})

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in], weight [out, in], bias [out] | None -> [T, out]."""
        fns = self._fns  # the checks are ordered cheapest first: this runs ~120 times a step
        if not fns or x.dtype != self.dtype or not x.is_cpu or x.dim() != 2:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        if not 0 < rows <= BUCKETS[-1] or (torch.is_grad_enabled() and (
                x.requires_grad or weight.requires_grad
                or (bias is not None and bias.requires_grad))):
            return F.linear(x, weight, bias)
        out_features, in_features = weight.shape
        fn = fns.get((1 << (rows - 1).bit_length(), out_features, in_features))
        return F.linear(x, weight, bias) if fn is None else fn(x, weight, bias)

    def describe(self) -> dict:
        """{"key", "choices" {"1x576x576": "vecdot", ...}, "tuned_seconds", "from_cache",
        "timings_ms" {"1x576x576": {"linear": 0.21, "vecdot": 0.12, ...}}} for reports."""
        return {
            "key": self.key,
            "choices": {label(e): name for e, name in sorted(self.choices.items())},
            "tuned_seconds": self.tuned_seconds,
            "from_cache": self.from_cache,
            "timings_ms": dict(sorted(self.timings_ms.items(), key=lambda kv: _entry(kv[0]))),
        }

    @classmethod
    def tune(cls, shapes: list[tuple[int, int]], dtype: torch.dtype, *,
             cache_dir: Path | None, budget_s: float = 2.0, threads: int | None = None,
             timer: Timer | None = None) -> LinearKernels:
        """Time every applicable path for every (bucket, (out, in)) in `shapes` with random
        weights of `dtype`, within about `budget_s` seconds, and keep the winners.

        `threads`: torch threads to tune (and later run) with; default the current count. With
        `cache_dir`, the table is read from / written to a JSON file named by `cache_key`; only
        entries missing there are timed. Entries the budget did not reach use F.linear and are
        not cached (a later start times them). `timer` replaces the real timing (tests).
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if budget_s < 0 or (threads is not None and threads < 1):
            raise ValueError(f"need budget_s >= 0 and threads >= 1, got {budget_s}, {threads}")
        if not all(o >= 1 and i >= 1 for o, i in shapes):
            raise ValueError(f"shapes must be (out_features, in_features) >= 1, got {shapes}")
        start = time.perf_counter()
        threads = threads or torch.get_num_threads()
        key = cache_key(dtype, threads)
        path = cache_dir / cache_file_name(key) if cache_dir is not None else None
        choices, timings = read_cache(path, key) if path is not None else ({}, {})
        wanted = dict.fromkeys((b, o, i) for b in BUCKETS for o, i in shapes)
        missing = [e for e in wanted if e not in choices]
        if missing:
            with _torch_threads(threads), torch.inference_mode():
                timed = _Timing(dtype, missing, start + budget_s, timer or time_call).run()
            choices |= {e: choose(ms) for e, ms in timed.items()}
            timings |= {label(e): ms for e, ms in timed.items()}
            if path is not None:
                write_cache(path, key, choices, timings)
        return cls(dtype, choices, key=key, tuned_seconds=time.perf_counter() - start,
                   from_cache=not missing, timings_ms=timings)


def time_call(name: str, fn: Candidate, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> float:
    """Seconds for one call of fn(x, weight, bias) (on CPU the call is synchronous)."""
    t0 = time.perf_counter()
    fn(x, weight, bias)
    return time.perf_counter() - t0


def supported_names(dtype: torch.dtype) -> frozenset[str]:
    """Names of the candidates that run in `dtype` on CPU (probed on a tiny product)."""
    x, weight = torch.ones(1, 16, dtype=dtype), torch.ones(16, 16, dtype=dtype)
    ok = set()
    for name, fn in candidates(1, 16, 16).items():
        try:
            fn(x, weight, None)
        except (RuntimeError, NotImplementedError):  # "not implemented for 'Half'": not offered
            continue
        ok.add(name)
    return frozenset(ok)


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch.set_num_threads(threads) for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Timing:
    """One tuning run. Entries go in order (bucket-major, so with a short budget the few-row
    decode entries are the ones measured), each with an equal share of the budget left: two
    warm-up calls per candidate, then rounds (each candidate once, interleaved so that drift hits
    all alike) until its share is spent or MAX_ROUNDS, and medians. An entry whose predicted cost
    overruns the deadline is skipped, and so are the shape's larger buckets."""

    MAX_ROUNDS = 15

    dtype: torch.dtype
    entries: list[Entry]
    deadline: float  # a time.perf_counter() value
    timer: Timer
    call_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (out, in) -> s, last
    turn: int = 0  # which weight copy of the pool the next call reads
    pool: torch.Tensor = field(init=False, repr=False)  # [n] dtype; weights are views of it
    xs: torch.Tensor = field(init=False, repr=False)  # [64 * widest in] dtype; rows are views

    def __post_init__(self) -> None:
        largest = max(o * i for _, o, i in self.entries)
        n = max(COLD_POOL_BYTES // self.dtype.itemsize, largest)
        tile = torch.randn(1 << 16).to(self.dtype)
        self.pool = tile.repeat(-(-n // tile.numel()))[:n]  # tiled: random enough for timing
        self.xs = torch.randn(BUCKETS[-1] * max(i for _, _, i in self.entries)).to(self.dtype)

    def run(self) -> dict[Entry, dict[str, float]]:
        """-> {entry: {candidate name: median ms}} for the entries that fit the budget."""
        allowed = supported_names(self.dtype)
        results, skipped = {}, set()
        for done, entry in enumerate(self.entries):
            now, shape = time.perf_counter(), entry[1:]
            # 2 warm-up calls and a round of each candidate, at most twice the bucket below's
            if shape in skipped or now + 2 * 3 * self.call_s.get(shape, 0.0) > self.deadline:
                skipped.add(shape)
                continue
            share_end = now + (self.deadline - now) / (len(self.entries) - done)
            names = [n for n in candidates(*entry) if n in allowed]
            results[entry] = self._measure(entry, names, share_end)
        return results

    def _measure(self, entry: Entry, names: list[str], share_end: float) -> dict[str, float]:
        """Warm up, then rounds until share_end (a first one until the deadline) -> median ms."""
        warm = {}
        for name in names:
            self._time(entry, name)
            warm[name] = self._time(entry, name)
        self.call_s[entry[1:]] = round_s = sum(warm.values())
        samples: dict[str, list[float]] = {n: [] for n in names}
        for rounds in range(self.MAX_ROUNDS):
            if time.perf_counter() + round_s > (share_end if rounds else self.deadline):
                break
            t0 = time.perf_counter()
            for name in names:
                samples[name].append(self._time(entry, name))
            round_s = time.perf_counter() - t0
        return {n: 1e3 * statistics.median(s or [warm[n]]) for n, s in samples.items()}

    def _time(self, entry: Entry, name: str) -> float:
        """Time candidate `name` once for `entry`, on the next weight copy of the pool."""
        rows, out_features, in_features = entry
        numel = out_features * in_features
        self.turn = (self.turn + 1) % (self.pool.numel() // numel)
        weight = self.pool[self.turn * numel:(self.turn + 1) * numel].view(out_features, -1)
        x = self.xs[:rows * in_features].view(rows, in_features)
        return self.timer(name, candidates(*entry)[name], x, weight, None)


def cache_file_name(key: str) -> str:
    """The cache file for `key`: linear-<16 hex digits of its sha256>.json."""
    return f"linear-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def read_cache(path: Path, key: str) -> tuple[dict[Entry, str], dict[str, dict[str, float]]]:
    """-> (choices, timings_ms) from `path`; ({}, {}) when it is missing, and, with a warning,
    when it is unreadable, for another key, or names a path that does not apply (retimed)."""
    if not path.exists():
        return {}, {}
    try:
        data = json.loads(path.read_text())
        if data["format"] != CACHE_FORMAT or data["key"] != key:
            raise ValueError(f"format {data['format']!r}, key {data['key']!r}, wanted {key!r}")
        choices = {_entry(lbl): name for lbl, name in data["choices"].items()}
        for entry, name in choices.items():
            if name not in candidates(*entry):
                raise ValueError(f"{name!r} does not apply to {label(entry)}")
        timings = {label(_entry(lbl)): {str(n): float(ms) for n, ms in per.items()}
                   for lbl, per in data["timings_ms"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"linear kernel cache {path} is unusable, retiming: {e!r}", stacklevel=3)
        return {}, {}
    return choices, timings


def write_cache(path: Path, key: str, choices: dict[Entry, str],
                timings_ms: dict[str, dict[str, float]]) -> None:
    """Write the table to `path` atomically (a temporary file in the same folder, replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": CACHE_FORMAT, "key": key,
            "choices": {label(e): n for e, n in sorted(choices.items())},
            "timings_ms": timings_ms}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):  # already replaced onto `path`
            os.unlink(tmp)


def _entry(text: str) -> Entry:
    """"4x960x576" -> (4, 960, 576); ValueError unless a bucket and two positive sizes."""
    bucket, out_features, in_features = (int(v) for v in text.split("x"))
    if bucket not in BUCKETS or out_features < 1 or in_features < 1:
        raise ValueError(f"bad entry {text!r}: want <bucket in {BUCKETS}>x<out>x<in>")
    return bucket, out_features, in_features
