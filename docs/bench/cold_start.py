"""Start-up of a model: cold start time, peak resident memory, time to first token.

    .venv/bin/python docs/bench/cold_start.py --model runs/smollm2-1.7b-q4_k_m.gguf \\
        [--activations q8] [--weights auto] [--keep-page-cache] [--json OUT]

Each start runs in a fresh process (so its memory is its own) and prints what it measured:
seconds from the process's start to ``LLM(...)`` returning (imports included), peak resident
memory (``VmHWM``) after loading and after a first request, the resident memory left, the time
to the first token of one MT-Bench-sized prompt and the decode rate of 32 tokens after it.

Two starts: **cold**, with an empty ``SPECDEC_CACHE`` (no converted folder, kernel table or step
costs from earlier runs) and the model's files dropped from the page cache first
(``posix_fadvise(DONTNEED)``, which needs no privileges; ``--keep-page-cache`` skips it), and
**warm**, a second process on the cache and page cache the first one left. Beside them the
model file's size and the KV budget, and peak RSS / (file + KV) (issue 35's target: <= 1.15).

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--model`` a tiny GGUF with a chat
template, ``--max-model-len 256 --keep-page-cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
          "cultural experiences and must-see attractions.")


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def process_start() -> float:
    """This process's start (epoch seconds): /proc/self/stat's start time after boot."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, after the (comm)
    btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                 if line.startswith("btime "))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def child(a: argparse.Namespace, t_start: float) -> dict:
    """One start, in this process: what the parent prints."""
    from specdec import LLM, SamplingParams
    from specdec.models.tokenizer import chat_token_ids

    t_import = time.time() - t_start
    llm = LLM(model=a.model, activations=a.activations, weights=a.weights,
              max_model_len=a.max_model_len)
    ready = time.time() - t_start
    loaded = {"hwm_mb": _status_kb("VmHWM") / 1024, "rss_mb": _status_kb("VmRSS") / 1024}
    ids = chat_token_ids(llm.tokenizer, [{"role": "user", "content": PROMPT}])
    t0 = time.perf_counter()
    (first,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    ttft = time.perf_counter() - t0
    (more,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))
    decode = 1.0 / more.metrics.tpot  # the engine's time per output token after the first
    eng = llm.engine
    return {"import_s": t_import, "ready_s": ready, "prompt_tokens": len(ids),
            "ttft_s": ttft, "ttft_engine_s": first.metrics.ttft, "decode_tokens_per_s": decode,
            "loaded": loaded, "hwm_mb": _status_kb("VmHWM") / 1024,
            "rss_mb": _status_kb("VmRSS") / 1024, "weights": eng.parts.weights,
            "activations": eng.parts.activations,
            "kv_bytes": sum(s.bytes for s in eng.parts.kv_split.shares),
            "weight_bytes_per_forward": eng.parts.weight_bytes_per_forward}


def model_files(model: str) -> list[Path]:
    """The files a start reads: the .gguf, or a folder's files."""
    path = Path(model)
    if path.is_file():
        return [path]
    if path.is_dir():
        return [f for f in path.iterdir() if f.is_file()]
    return []  # an alias: its files live in the cache, which a cold start empties anyway


def drop_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start(a: argparse.Namespace, cache: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", a.model, "--activations",
           a.activations, "--weights", a.weights, "--max-model-len", str(a.max_model_len)]
    env = {**os.environ, "SPECDEC_CACHE": cache}
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the start failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.time() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--activations", default="float", choices=("float", "q8"))
    p.add_argument("--weights", default="auto")
    p.add_argument("--keep-page-cache", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a, process_start())))
        return
    files = model_files(a.model)
    size = sum(f.stat().st_size for f in files if f.suffix == ".gguf")
    out = {"model": a.model, "gguf_bytes": size, "activations": a.activations}
    with tempfile.TemporaryDirectory(prefix="cold-start-cache-") as cache:
        if not a.keep_page_cache:
            drop_page_cache(files)
        out["cold"] = start(a, cache)
        out["warm"] = start(a, cache)
    for kind in ("cold", "warm"):
        r = out[kind]
        bound = (size + r["kv_bytes"]) / 2**20
        r["peak_over_file_plus_kv"] = r["hwm_mb"] / bound if size else None
        print(f"{kind}: ready in {r['ready_s']:.1f} s (imports {r['import_s']:.1f} s), peak RSS "
              f"{r['hwm_mb']:.0f} MB at load {r['loaded']['hwm_mb']:.0f} MB, RSS {r['rss_mb']:.0f} "
              f"MB; GGUF {size / 2**20:.0f} MB + KV {r['kv_bytes'] / 2**20:.0f} MB: peak / "
              f"(file + KV) = {r['peak_over_file_plus_kv'] or float('nan'):.2f}; TTFT "
              f"{1e3 * r['ttft_s']:.0f} ms ({r['prompt_tokens']} prompt tokens), decode "
              f"{r['decode_tokens_per_s']:.1f} tok/s ({r['weights']}, {r['activations']})",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")

if __name__ == "__main__":
    main()
