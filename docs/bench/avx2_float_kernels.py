"""The float-activation GGUF kernels on the AVX2 path (``SPECDEC_NATIVE_ISA=avx2``): a base
commit's kernels beside the work tree's, in one run, interleaved, medians of repeats; and
plain decoding's tokens/s with each, in subprocesses taken in turn.

    .venv/bin/python docs/bench/avx2_float_kernels.py [--base COMMIT] [--rows 1,2,3]
        [--threads 2] [--repeats 9] [--rounds 4] [--tokens 128] [--no-e2e] [--no-kernels]

(issue 45's change: ``--base c68e8c8``, the kernels before it.)

Both libraries are compiled here from specdec/native/*.c (the base's from git, ``--base``;
the work tree's as it is) with setup.py's flags, and loaded side by side (ctypes keeps their
symbols apart), so no rebuild of the installed extension is needed and old and new see the
same machine at the same moments.

Kernels (random blocks, specdec.bench.random_blocks, prepared as the engine prepares them):

- ``hot``: one matrix of each shape, called again and again: it stays in L2, so the time is
  the kernel's compute (plus ~5-10 us of call: ctypes, the OpenMP team; shown as ``call``).
- ``token``: every matrix a decode step streams, one call per (format, inputs) with the step's
  matrices of that kind stacked into one (the same panel pairs and k-steps per pair, no call
  overhead per layer), taken in turn as a step takes them: the weights come from DRAM.
  SmolLM2-135M: 30 x (q|k|v 960 + o 576 + gate|up 3072) x 576 Q4_1, 30 x 576 x 1536 Q4_1,
  the tied head 49152 x 576 Q8_0. SmolLM2-1.7B, Q4_K_M (specdec/bench/quant_mix.py: Q6_K
  attn_v and ffn_down in 12 of 24 layers, Q6_K head): the Q4_K and Q6_K matrices of K 2048
  and of K 8192 stacked by kind.

Beside each: the compute-bound time (weights x cycles per 8 weights / 8 / clock / threads,
the cycles from the port model below, the clock measured here by a 1-cycle add chain) and the
memory-bound time (bytes / the stream bandwidth measured here).

End to end: ``LLM(model="smollm2-135m-instruct", activations="float", drafter=None)``, greedy,
``--tokens`` new tokens after a one-token prompt, decode tokens/s (the first token's time
excluded), one subprocess per (round, library), base and work tree alternating; the model is
fetched once into ``$SPECDEC_CACHE`` (set it to one folder for every run).

The port model, measured here first (``ports``: each mix's instructions in a loop, cycles per
8 weights on one core). AVX2 on AMD Zen 4 (Zen 3 has the same 4 FP pipes): fmas and vmulps
on 2 pipes (FP0/1), vcvtdq2ps and the shifts on 2 others (FP2/3), vpmovsx/zx and shuffles on
FP1/2, logic ops on all 4; vpmaddubsw, vpmaddwd, vpsignb on the fma pipes; vector loads 2 a
cycle (a broadcast from memory takes a load port only). Per 8 weights and R rows:

- Q4_1 / Q4_K: a broadcast, vpsrlvd, vpand, vcvtdq2ps, the dequantizing fma, R fmas: 4 + R
  ops on 4 pipes, 1 + R of them fmas: 1.25 cycles at R = 1 (all four pipes bind), 1.5 and 2.0
  at R = 2, 3 (the fma pipes bind);
- Q8_0 (Q6_K's step too): vpmovsxbd, vcvtdq2ps, vmulps, R fmas: counted 1.0 / 1.5 / 2.0,
  measured 1.18 / 1.67 / 2.29 (the shuffle takes an fma pipe part of the time); Q6_K adds its
  6-bit unpacking, ~21 logic ops a 128 weights (+0.33);
- chained (each group's load -> unpack -> convert -> dequantize -> fma), one row: Q4 1.47,
  Q8_0 1.41: what the out-of-order core makes of the mixes;
- llama.cpp's AVX2 int8 blocks, one row: Q4_1 x Q8_1 0.55, Q8_0 x Q8_0 0.75.

The compute-bound column takes the measured mixes. Ratios only mean something within one run:
say which CPU.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``SPECDEC_BENCH_QUICK=1
--no-e2e``: the port model and the bandwidth only; the two -O3 builds of the kernels and their
timings (~50 s of compiling) are skipped, and it says so.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# setup.py's flags (no contraction of a * b + c into an fma the C code does not ask for)
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c11", "-fPIC"]
# Q6_K's 6-bit unpacking: ~21 logic ops a sub-block's 128 bytes, on any of the 4 pipes
Q6K_UNPACK = 21 / 16 / 4  # cycles per 8 weights
# the port model's mixes, as instructions of a 256-bit AVX2 loop: per 8 weights (one group),
# each op of its own (no dependency but the fma accumulators, 8 chains): what the ports allow
MIXES = {
    "vfmadd231ps alone": ["FMA"],
    "vpsrlvd + vcvtdq2ps (the same 2 pipes?)": ["SRLV", "CVT"],
    "vfmadd231ps + vpmovsxbd (3 pipes?)": ["FMA", "SXBD"],
    "Q4_1 / Q4_K, 1 row: srlv and cvt fma fma": ["BCD", "SRLV", "AND", "CVT", "MUL", "FMA"],
    "Q4_1 / Q4_K, 2 rows": ["BCD", "SRLV", "AND", "CVT", "MUL", "FMA", "FMA"],
    "Q4_1 / Q4_K, 3 rows": ["BCD", "SRLV", "AND", "CVT", "MUL", "FMA", "FMA", "FMA"],
    "Q8_0, 1 row: sxbd cvt mul fma": ["SXBDM", "CVT", "MUL", "FMA"],
    "Q8_0, 2 rows": ["SXBDM", "CVT", "MUL", "FMA", "FMA"],
    "Q8_0, 3 rows": ["SXBDM", "CVT", "MUL", "FMA", "FMA", "FMA"],
    # llama.cpp's AVX2 block dot products (ggml-cpu x86 quants.c), one row, per 32 weights / 4
    "llama.cpp Q4_1 x Q8_1 block / 4": ["SRLW", "INS", "AND", "MADDUBS", "MADDWD", "CVT", "FMA",
                                        "MUL"],
    "llama.cpp Q8_0 x Q8_0 block / 4": ["SIGN", "SIGN", "MADDUBS", "MADDWD", "CVT", "FMA", "MUL"],
}
BLOCK_MIXES = ("llama.cpp",)  # mixes per 32 weights
OPS = {"FMA": "vfmadd231ps %%ymm1, %%ymm2, %%ymm{a}", "MUL": "vmulps %%ymm1, %%ymm2, %%ymm{t}",
       "SRLV": "vpsrlvd %%ymm1, %%ymm2, %%ymm{t}", "AND": "vpand %%ymm1, %%ymm2, %%ymm{t}",
       "CVT": "vcvtdq2ps %%ymm2, %%ymm{t}", "SXBD": "vpmovsxbd %%xmm2, %%ymm{t}",
       "SXBDM": "vpmovsxbd 8(%1), %%ymm{t}", "BCD": "vpbroadcastd 4(%1), %%ymm{t}",
       "SRLW": "vpsrlw $4, %%ymm2, %%ymm{t}", "INS": "vinserti128 $1, %%xmm1, %%ymm2, %%ymm{t}",
       "MADDUBS": "vpmaddubsw %%ymm1, %%ymm2, %%ymm{t}",
       "MADDWD": "vpmaddwd %%ymm1, %%ymm2, %%ymm{t}", "SIGN": "vpsignb %%ymm1, %%ymm2, %%ymm{t}"}
# the same with each group's dependency chain (load -> unpack -> convert -> dequantize -> fma):
# what an out-of-order core makes of it
CHAINS = {
    "Q4_1 / Q4_K, 1 row, chained": "vpbroadcastd {o}(%1), %%ymm{t}\n vpsrlvd %%ymm1, %%ymm{t}, "
    "%%ymm{t}\n vpand %%ymm2, %%ymm{t}, %%ymm{t}\n vcvtdq2ps %%ymm{t}, %%ymm{t}\n vfmadd132ps "
    "%%ymm3, %%ymm4, %%ymm{t}\n vfmadd231ps %%ymm{t}, %%ymm5, %%ymm{a}\n",
    "Q8_0, 1 row, chained": "vpmovsxbd {o}(%1), %%ymm{t}\n vcvtdq2ps %%ymm{t}, %%ymm{t}\n "
    "vmulps %%ymm3, %%ymm{t}, %%ymm{t}\n vfmadd231ps %%ymm{t}, %%ymm5, %%ymm{a}\n"}
PORTS_C = r"""
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + 1e-9 * t.tv_nsec; }
static float buf[1024] __attribute__((aligned(64)));
static double ghz;
#define ZERO(i) "vxorps %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n"
#define LOOP(NAME, GROUPS, BODY) { double best = 1e9;                                          \
    for (int r = 0; r < 200; r++) { long n = 2000; double t0 = now();                         \
        __asm__ volatile(ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7)        \
                         ZERO(8) ZERO(9) ZERO(10) ZERO(11) ZERO(12) ZERO(13) ZERO(14) ZERO(15)  \
                         "1:\n" BODY "dec %0\n jnz 1b" : "+r"(n) : "r"(buf) : "cc", "memory",  \
                         "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
                         "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");         \
        double t = now() - t0; if (t < best) best = t; }                                       \
    printf("%s\t%f\n", NAME, best * ghz * 1e9 / 2000 / (GROUPS)); }
int main(void) {
    double best = 1e9; /* a chain of 1-cycle adds, the fastest of many short runs: the clock */
    for (int r = 0; r < 300; r++) {
        long n = 20000; double t0 = now();
        __asm__ volatile("1:\n\t.rept 100\n\tadd $1, %%rax\n\t.endr\n\tdec %0\n\tjnz 1b"
                         : "+r"(n) :: "rax", "cc");
        double t = now() - t0; if (t < best) best = t;
    }
    ghz = 2e6 / best / 1e9;
    printf("clock\t%f\n", ghz);
@LOOPS@
    return 0;
}
"""


def ports_c() -> str:
    """PORTS_C with a loop per mix (8 groups an iteration) and per chain (4 groups)."""
    loops = []
    for name, ops in MIXES.items():
        body, acc, tmp = [], 0, 0
        for _ in range(8):
            for op in ops:
                if op == "FMA":
                    body.append(OPS[op].format(a=8 + acc % 8))
                    acc += 1
                else:
                    body.append(OPS[op].format(t=3 + tmp % 5))
                    tmp += 1
        groups = 8 * (4 if name.startswith(BLOCK_MIXES) else 1)
        loops.append(f'    LOOP("{name}", {groups}, "' + "\\n".join(body) + '\\n")')
    for name, group in CHAINS.items():  # 4 groups, 4 accumulators, the x broadcast once
        body = "vbroadcastss 256(%1), %%ymm5\\n" + "".join(
            group.format(o=8 * i, t=6 + i, a=12 + i).replace("\n", "\\n") for i in range(4))
        loops.append(f'    LOOP("{name}", 4, "{body}")')
    return PORTS_C.replace("@LOOPS@", "\n".join(loops))


def ports(tmp: Path) -> dict[str, float]:
    """{'clock': GHz, mix: cycles per 8 weights} measured here (one core)."""
    (tmp / "ports.c").write_text(ports_c())
    subprocess.run(["gcc", "-O2", str(tmp / "ports.c"), "-o", str(tmp / "ports")], check=True)
    out = subprocess.run([str(tmp / "ports")], capture_output=True, text=True, check=True)
    return {k: float(v) for k, v in (line.split("\t") for line in out.stdout.splitlines())}


def native_files(base: str | None) -> list[str]:
    """The C sources and headers of specdec/native in the work tree (base None) or at ``base``
    (every one: a source added later is linked too)."""
    if base is None:
        names = [p.name for p in (ROOT / "specdec" / "native").iterdir()]
    else:
        names = [Path(n).name for n in subprocess.run(
            ["git", "ls-tree", "--name-only", f"{base}:specdec/native"], cwd=ROOT, check=True,
            capture_output=True, text=True).stdout.split()]
    return sorted(n for n in names if n.endswith((".c", ".h")))


def build(tmp: Path, name: str, base: str | None) -> Path:
    """The kernels' library from the work tree (base None) or from git commit ``base``."""
    src = tmp / name
    src.mkdir()
    files = native_files(base)
    sources = [f[:-2] for f in files if f.endswith(".c")]
    for f in files:
        path = f"specdec/native/{f}"
        text = (subprocess.run(["git", "show", f"{base}:{path}"], cwd=ROOT, check=True,
                               capture_output=True).stdout if base else (ROOT / path).read_bytes())
        (src / f).write_bytes(text)
    inc = sysconfig.get_paths()["include"]
    procs = [subprocess.Popen(["gcc", *CFLAGS, f"-I{inc}", "-c", str(src / f"{s}.c"), "-o",
                               str(src / f"{s}.o")]) for s in sources]
    assert all(p.wait() == 0 for p in procs), f"compiling {name} failed"
    lib = tmp / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fopenmp", *(str(src / f"{s}.o") for s in sources),
                    "-o", str(lib)], check=True)
    return lib


def blocks(kind: str, out: int, inp: int, seed: int):
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from specdec.bench.random_blocks import random_blocks
    from specdec.models.gguf import blocks as gb

    rows = random_blocks(np.random.default_rng(seed), GGMLQuantizationType[kind], out, inp,
                         0.02)
    return gb.prepare(gb.Blocks(kind, torch.from_numpy(rows), inp))


# (kind, out, in): one matrix of each shape the brief names (hot), and a step's matrices
# stacked by (kind, in) (token)
HOT = {"smollm2-135m": [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576),
                        ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)],
       "smollm2-1.7b": [("Q4_K", 2048, 2048), ("Q4_K", 8192, 2048), ("Q4_K", 2048, 8192),
                        ("Q6_K", 2048, 2048), ("Q6_K", 2048, 8192)]}
TOKEN = {"smollm2-135m": [("Q4_1", 30 * (960 + 576 + 3072), 576), ("Q4_1", 30 * 576, 1536),
                          ("Q8_0", 49152, 576)],
         # 24 layers: q, k, o, gate, up Q4_K; v and down Q6_K in 12 layers, Q4_K in 12
         "smollm2-1.7b": [("Q4_K", 24 * 3 * 2048 + 12 * 2048 + 24 * 2 * 8192, 2048),
                          ("Q6_K", 12 * 2048 + 49152, 2048), ("Q4_K", 12 * 2048, 8192),
                          ("Q6_K", 12 * 2048, 8192)]}


def cycles(mix: dict[str, float]) -> dict[str, tuple[float, ...]]:
    """Cycles per 8 weights at 1, 2, 3 rows of each format: its measured mix (ports)."""
    q4 = tuple(mix[f"Q4_1 / Q4_K, {r}"] for r in ("1 row: srlv and cvt fma fma", "2 rows",
                                                  "3 rows"))
    q8 = tuple(mix[f"Q8_0, {r}"] for r in ("1 row: sxbd cvt mul fma", "2 rows", "3 rows"))
    return {"Q4_1": q4, "Q4_K": q4, "Q8_0": q8, "Q6_K": tuple(c + Q6K_UNPACK for c in q8)}


def time_kernels(libs: dict, args, ghz: float, bw: float, per8: dict) -> list[dict]:
    import torch

    from specdec import native

    kernels = {name: native.Kernels(ctypes.CDLL(str(path))) for name, path in libs.items()}
    assert all(k.float_isa == "avx2" for k in kernels.values())
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    cases = []  # (model, mode, kind, out, inp, panels)
    for model in args.models.split(","):
        for i, (kind, out, inp) in enumerate(HOT[model]):
            cases.append((model, "hot", kind, out, inp, blocks(kind, out, inp, i)))
        for i, (kind, out, inp) in enumerate(TOKEN[model]):
            cases.append((model, "token", kind, out, inp, blocks(kind, out, inp, 100 + i)))
    small, xs = blocks("Q4_1", 16, 32, 0), torch.randn(1, 32)  # the cost of a call itself
    x = {(inp, r): torch.randn(r, inp) for *_, inp, _ in cases for r in rows}
    # every (case, rows, library) timed once a round, rounds interleaved; a hot case is the
    # median of 20 calls after a warm one, a token case one call of a step's sequence
    times: dict = {}
    for _ in range(args.repeats):
        for r in rows:
            for name, k in kernels.items():
                for _ in range(50):
                    k.linear(xs, small)
                t0 = time.perf_counter()
                for _ in range(200):
                    k.linear(xs, small)
                times.setdefault(("call", r, name), []).append((time.perf_counter() - t0) / 200)
                for model, mode, kind, out, inp, p in cases:
                    xr = x[(inp, r)]
                    if mode == "hot":
                        k.linear(xr, p)
                        ts = []
                        for _ in range(20):
                            t0 = time.perf_counter()
                            k.linear(xr, p)
                            ts.append(time.perf_counter() - t0)
                        t = statistics.median(ts)
                    else:
                        t0 = time.perf_counter()
                        k.linear(xr, p)
                        t = time.perf_counter() - t0
                    times.setdefault((model, mode, kind, out, inp, r, name), []).append(t)
    out_rows = []
    names = list(kernels)
    for r in rows:
        call = {n: statistics.median(times[("call", r, n)]) for n in names}
        print(f"\n{r} row(s), {args.threads} threads; a call of a 16 x 32 matrix: "
              + ", ".join(f"{n} {1e6 * call[n]:.1f} us" for n in names))
        print(f"{'model':13} {'mode':5} {'kind':4} {'matrix':>12} {'MB':>7}  "
              + "  ".join(f"{n + ' ms':>9}" for n in names)
              + f"  {names[0]}/{names[-1]}  compute ms  memory ms  {names[-1]}/compute")
        for model, mode, kind, out, inp, p in cases:
            med = {n: statistics.median(times[(model, mode, kind, out, inp, r, n)])
                   for n in names}
            mb = p.nbytes / 1e6
            compute = out * inp / 8 * per8[kind][min(r, 3) - 1] / (ghz * 1e9) / args.threads
            memory = p.nbytes / (bw * 1e9)
            print(f"{model:13} {mode:5} {kind:4} {f'{out}x{inp}':>12} {mb:7.2f}  "
                  + "  ".join(f"{1e3 * med[n]:9.3f}" for n in names)
                  + f"  {med[names[0]] / med[names[-1]]:8.2f}  {1e3 * compute:10.3f}  "
                  f"{1e3 * memory:9.3f}  {med[names[-1]] / compute:8.2f}")
            out_rows.append({"model": model, "mode": mode, "kind": kind, "out": out, "in": inp,
                             "rows": r, "ms": {n: 1e3 * med[n] for n in names},
                             "compute_ms": 1e3 * compute, "memory_ms": 1e3 * memory})
        for model in args.models.split(","):
            tot = {n: sum(o["ms"][n] for o in out_rows if o["model"] == model
                          and o["mode"] == "token" and o["rows"] == r) for n in names}
            comp = sum(o["compute_ms"] for o in out_rows if o["model"] == model
                       and o["mode"] == "token" and o["rows"] == r)
            mem = sum(o["memory_ms"] for o in out_rows if o["model"] == model
                      and o["mode"] == "token" and o["rows"] == r)
            print(f"{model}, a step's matrices: " + ", ".join(f"{n} {v:.2f} ms"
                                                              for n, v in tot.items())
                  + f"; compute-bound {comp:.2f} ms, memory-bound {mem:.2f} ms")
    return out_rows


E2E = r"""
import ctypes, functools, json, sys, time
from specdec import native
lib = native.Kernels(ctypes.CDLL(sys.argv[1]))
native.load = functools.cache(lambda: lib)
import torch
torch.set_num_threads(int(sys.argv[3]))
from specdec import LLM, SamplingParams
llm = LLM(model="smollm2-135m-instruct", activations="float", drafter=None)
assert native.load().float_isa == "avx2"
tokens = int(sys.argv[2])
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
bos = llm.tokenizer.bos_token_id
prompt = [bos if bos is not None else 0]
llm.generate([prompt], params)
rates = []
for _ in range(3):
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    s = time.perf_counter() - t0
    ttft = out.metrics.ttft if out.metrics and out.metrics.ttft else 0.0
    rates.append((len(out.token_ids) - 1) / (s - ttft))
print(json.dumps({"tok_s": sorted(rates)[1], "tokens": list(out.token_ids)}))
"""


def end_to_end(libs: dict, args) -> dict:
    rates: dict = {n: [] for n in libs}
    outputs = {}
    env = dict(os.environ, SPECDEC_NATIVE_ISA="avx2")
    for _ in range(args.rounds):
        for name, path in libs.items():
            out = subprocess.run([sys.executable, "-c", E2E, str(path), str(args.tokens),
                                  str(args.threads)], env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{name}: {out.stderr[-2000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            rates[name].append(res["tok_s"])
            outputs.setdefault(name, res["tokens"])
    names = list(libs)
    print(f"\nplain decoding, SmolLM2-135M float, {args.tokens} tokens, {args.threads} threads, "
          f"AVX2; tok/s per round (median of 3 generations):")
    for n in names:
        print(f"  {n}: " + " ".join(f"{v:.1f}" for v in rates[n])
              + f"  median {statistics.median(rates[n]):.1f}")
    print(f"  {names[-1]} / {names[0]}: "
          f"{statistics.median(rates[names[-1]]) / statistics.median(rates[names[0]]):.3f} x; "
          f"the same tokens: {len({tuple(v) for v in outputs.values()}) == 1}")
    return {n: rates[n] for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git commit whose kernels are 'base'")
    ap.add_argument("--rows", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=4, help="end-to-end rounds")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="smollm2-135m,smollm2-1.7b")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["SPECDEC_NATIVE_ISA"] = "avx2"  # read once per library, at its first call
    from specdec.bench.physics import bandwidth_gbs

    quick = os.environ.get("SPECDEC_BENCH_QUICK") == "1"
    if quick:
        args.no_kernels = True
        print("skipped (quick form): the kernel builds and their timings", flush=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        libs = ({} if args.no_kernels and args.no_e2e else
                {"base": build(tmp, "base", args.base), "new": build(tmp, "new", None)})
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "?")
        mix, bw = ports(tmp), bandwidth_gbs()
        ghz = mix.pop("clock")
        print(f"CPU {cpu}, AVX2 path; clock {ghz:.2f} GHz (a 1-cycle add chain), stream "
              f"bandwidth {bw:.1f} GB/s; base = {args.base}, new = the work tree")
        print("cycles per 8 weights, one core (independent ops but the fma chains: the ports; "
              "chained: each group's load -> fma):")
        for name, c in mix.items():
            print(f"  {name:44} {c:6.3f}")
        result = {"cpu": cpu, "ghz": ghz, "bandwidth_gbs": bw, "base": args.base, "ports": mix}
        if not args.no_kernels:
            result["kernels"] = time_kernels(libs, args, ghz, bw, cycles(mix))
        if not args.no_e2e:
            result["e2e"] = end_to_end(libs, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
