"""The GPU check's time limits (tests/gpu/run.sh) fit its slot: one device call of at most 600 s
in a 15-minute budget, with time left for a rerun. Read from the script's defaults, and its
``limit`` function run in bash."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = (HERE / "run.sh").read_text()


def default(name: str) -> int:
    (value,) = re.findall(r"\$\{" + name + r":-(\d+)\}", SCRIPT)
    return int(value)


def test_the_default_phases_fit_nine_minutes():
    assert re.search(r'PHASES=\$\{PHASES:-jit tests bench\}', SCRIPT), "real is a call of its own"
    budget = default("BUDGET")
    assert budget <= 540
    assert default("JIT_TIMEOUT") + default("TESTS_TIMEOUT") + default("BENCH_TIMEOUT") <= budget
    # no single test may outlast its phase (the smoke test has a limit of its own)
    smoke = int(re.search(r"@pytest.mark.timeout\((\d+)\)",
                          (HERE / "test_gpu.py").read_text()).group(1))
    assert max(smoke, default("TEST_TIMEOUT")) < default("TESTS_TIMEOUT")


def test_a_phase_gets_what_is_left_of_the_budget():
    start = re.search(r"^limit\(\) \{.*\}$", SCRIPT, re.M).group(0)
    run = lambda elapsed, cap: int(subprocess.run(  # noqa: E731
        ["bash", "-c", f"BUDGET=540; START=$(( $(date +%s) - {elapsed} )); {start}; limit {cap}"],
        capture_output=True, text=True, check=True).stdout)
    assert run(0, 120) == 120
    assert abs(run(450, 170) - 80) <= 1  # 540 - 450 - 10 left
    assert run(600, 170) == 1  # past the budget: the phase starts and stops at once
