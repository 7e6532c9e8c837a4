"""The float-activation GGUF kernels on the AVX2 path (``SPECDEC_NATIVE_ISA=avx2``): a base
commit's kernels beside the work tree's, in one run, interleaved, medians of repeats; and
plain decoding's tokens/s with each, in subprocesses taken in turn.

    .venv/bin/python docs/bench/avx2_float_kernels.py [--base HEAD] [--rows 1,2,3]
        [--threads 2] [--repeats 9] [--rounds 4] [--tokens 128] [--no-e2e] [--no-kernels]

Both libraries are compiled here from specdec/native/*.c (the base's from git, ``--base``;
the work tree's as it is) with setup.py's flags, and loaded side by side (ctypes keeps their
symbols apart), so no rebuild of the installed extension is needed and old and new see the
same machine at the same moments.

Kernels (random blocks, specdec.bench.random_blocks, prepared as the engine prepares them):

- ``hot``: one matrix of each shape, called again and again: it stays in L2, so the time is
  the kernel's compute (plus ~10 us of call: ctypes, the OpenMP team; shown as ``call``).
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

The port model (AVX2 on AMD Zen 3 / Zen 4, 256-bit ops; measured with independent chains on a
Zen 4: FMA and vmulps on 2 pipes, vcvtdq2ps / vpsrlvd on 2 others, vpmovsx/zx and shuffles on
2 pipes that overlap one of each, logic ops on all 4; broadcasts from memory on the load
ports only). Per 8 weights and R rows: Q4_1 / Q4_K a 32-bit broadcast, vpsrlvd, vpand,
vcvtdq2ps, the dequantizing fma, R fmas: 5 + (R - 1) ops on the 4 pipes, the fma pipes
(1 + R) / 2 cycles, so max(1.25, 1.5, 2.0) = 1.25 / 1.5 / 2.0 cycles at R = 1 / 2 / 3;
Q8_0 / Q6_K vpmovsxbd, vcvtdq2ps, vmulps, R fmas: max(4 / 4, (1 + R) / 2) = 1.0 / 1.5 /
2.0 (Q6_K adds its 6-bit unpacking, ~1.6 logic ops per 8 weights: 1.4 at R = 1).
Ratios only mean something within one run: say which CPU.
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
SOURCES = ("cpu_kernels", "linear", "linear_q8", "attention", "layer", "suffix")
# setup.py's flags (no contraction of a * b + c into an fma the C code does not ask for)
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-std=c11", "-fPIC"]
# cycles per 8 weights at 1, 2, 3 rows (the port model in the docstring)
CYCLES = {"Q4_1": (1.25, 1.5, 2.0), "Q4_K": (1.25, 1.5, 2.0), "Q8_0": (1.0, 1.5, 2.0),
          "Q6_K": (1.4, 1.6, 2.0)}
CLOCK_C = r"""
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) { /* a chain of 1-cycle adds: adds per second = the core clock */
    double best = 1e9;
    for (int r = 0; r < 7; r++) {
        long n = 2000000; double t0 = now();
        __asm__ volatile("1:\n\t.rept 100\n\tadd $1, %%rax\n\t.endr\n\tdec %0\n\tjnz 1b"
                         : "+r"(n) :: "rax", "cc");
        double t = now() - t0; if (t < best) best = t;
    }
    printf("%f\n", 2e8 / best / 1e9);
    return 0;
}
"""


def build(tmp: Path, name: str, base: str | None) -> Path:
    """The kernels' library from the work tree (base None) or from git commit ``base``."""
    src = tmp / name
    src.mkdir()
    for f in [*(f"{s}.c" for s in SOURCES), "kernels.h"]:
        path = f"specdec/native/{f}"
        text = (subprocess.run(["git", "show", f"{base}:{path}"], cwd=ROOT, check=True,
                               capture_output=True).stdout if base else (ROOT / path).read_bytes())
        (src / f).write_bytes(text)
    inc = sysconfig.get_paths()["include"]
    procs = [subprocess.Popen(["gcc", *CFLAGS, f"-I{inc}", "-c", str(src / f"{s}.c"), "-o",
                               str(src / f"{s}.o")]) for s in SOURCES]
    assert all(p.wait() == 0 for p in procs), f"compiling {name} failed"
    lib = tmp / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fopenmp", *(str(src / f"{s}.o") for s in SOURCES),
                    "-o", str(lib)], check=True)
    return lib


def clock_ghz(tmp: Path) -> float:
    (tmp / "clock.c").write_text(CLOCK_C)
    subprocess.run(["gcc", "-O2", str(tmp / "clock.c"), "-o", str(tmp / "clock")], check=True)
    return max(float(subprocess.run([str(tmp / "clock")], capture_output=True, text=True,
                                    check=True).stdout) for _ in range(3))


def blocks(kind: str, out: int, inp: int, seed: int):
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from specdec.bench.random_blocks import random_blocks
    from specdec.models import gguf_blocks as gb

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


def time_kernels(libs: dict, args, ghz: float, bw: float) -> list[dict]:
    import torch

    from specdec.models import native

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
            compute = out * inp / 8 * CYCLES[kind][min(r, 3) - 1] / (ghz * 1e9) / args.threads
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
from specdec.models import native
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

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        libs = {"base": build(tmp, "base", args.base), "new": build(tmp, "new", None)}
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "?")
        ghz, bw = clock_ghz(tmp), bandwidth_gbs()
        print(f"CPU {cpu}, AVX2 path; clock {ghz:.2f} GHz (a 1-cycle add chain), stream "
              f"bandwidth {bw:.1f} GB/s; base = {args.base}, new = the work tree")
        result = {"cpu": cpu, "ghz": ghz, "bandwidth_gbs": bw, "base": args.base}
        if not args.no_kernels:
            result["kernels"] = time_kernels(libs, args, ghz, bw)
        if not args.no_e2e:
            result["e2e"] = end_to_end(libs, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
