"""The GPU bench's own logic, dry-run on the CPU (tiny shape, no kernels timed), so that a change
elsewhere cannot break the script that GPU time is spent on: every section runs and reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_gpu_dry_run_on_the_cpu(tmp_path):
    script = Path(__file__).with_name("bench_gpu.py")
    out = tmp_path / "out"
    # one thread: the tiny shape's ops are too small to share, and on two busy cores each op
    # waits on an OpenMP barrier (the dry run measured 38-54 s with two threads, 12-15 s with one)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--shapes", "tiny-gpu", "--quick",
         "--tokens", "8", "--out", str(out), "--models", str(tmp_path / "models")],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())["tiny-gpu"]
    for section in ("plain", "hf_b1", "step_costs", "speculation", "learned"):
        assert "error" not in report[section], report[section]
    assert report["plain"]["graphs_b1_tok_s"] > 0 and report["hf_b1"]["tok_s"] > 0
    assert report["step_costs"]["graphs_b8_r16_ms"] > 0
    spec = report["speculation"]
    assert spec["b1_tau3.0"]["token_match"] == 1.0 and spec["b1_tau3.0"]["measured_tau"] > 1.5
    # every run says how its steps ran: graphed / eager, copies and reads per step
    steps = spec["b1_tau3.0"]["steps"]["speculative"]
    assert {"graphed_steps", "eager_steps", "h2d_copies_per_step",
            "d2h_reads_per_step"} <= set(steps)
    assert steps["d2h_reads_per_step"] == 1.0 and steps["h2d_copies_per_step"] <= 2
    assert "fast_b1_tau3.0" in spec and "invariant_over_fast_b1" in report["plain"]
    assert "speculation at tau 3" in (out / "bench.md").read_text()
    # the learned drafters (random weights) run exact, and the audit counts each one's
    # transfers per speculative step (the drafters' own included: tests/transfer_audit.py)
    for name in ("eagle3", "mtp", "block_diffusion"):
        run = report["learned"][name]
        assert run["token_match"] == 1.0, name
        audit = run["audit"]
        assert audit["speculative_d2h_per_step"] >= 1 and audit["speculative_h2d_per_step"] >= 1
        assert any("d2h" in site for site in audit["sites"]), audit
        # the targets where met (docs/gpu.md says what is not): MTP and block diffusion
        # read once a step; MTP copies twice (three times the first step of a tree shape)
        if name != "eagle3":
            assert audit["speculative_d2h_per_step"] == 1.0, (name, audit)
        if name == "mtp":
            assert audit["plain_h2d_per_step"] == 2 and audit["speculative_h2d_per_step"] <= 2.5
    assert "eagle3 (random weights) b1" in (out / "bench.md").read_text()
