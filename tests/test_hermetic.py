"""The suite is hermetic: this run's cache (kernel tables, step costs, converted models) is a
folder of its own, empty when the run began, and the one subprocesses see: never the user's
``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specdec.models.aliases import cache_dir


def test_the_suite_cache_is_its_own(suite_cache):
    folder, before, start, own = suite_cache
    assert cache_dir() == folder and os.environ["SPECDEC_CACHE"] == str(folder)
    assert folder != Path.home() / ".cache" / "specdec"
    if own:  # (a pytest run started by a test shares its parent run's folder)
        assert before is None or Path(before) != folder
        assert folder.name.startswith("specdec-suite-cache-")
    # nothing in it predates this run: it was empty, and holds only what the suite made
    old = [p for p in folder.rglob("*") if p.stat().st_mtime < start - 2]
    assert not old, f"{folder} holds files from before this run: {old[:5]}"


def test_subprocesses_see_the_suite_cache(suite_cache):
    code = "from specdec.models.aliases import cache_dir; print(cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == str(suite_cache[0])


def test_property_tests_have_no_deadline():
    """A slow or busy machine must not fail a property test by timing (tests/conftest.py)."""
    from hypothesis import settings

    assert settings.default.deadline is None
