"""The disk tier under kill -9 and a second process: a writer killed at any moment (at random,
once for certain in the middle of a page, once while the file is made, once while it grows) leaves a file that opens
again and whose every page reads back as the exact bytes written for its key or not at all,
never wrong; a tier another process holds open is an error naming the path, and the lock goes
with the process that held it."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdec.kv.tier import SLOT_HEADER, DiskTier

PAGE = 256 << 10  # bytes: a page's copy and crc32 take most of a write, where a kill tears it
SLOTS = 8
KEYS = 24  # three keys a slot: slots are overwritten all the time

# The writer: a subprocess that imports torch once, then for each of its rounds forks a process
# that puts pages, whose bytes the parent can recompute from their keys, into its own tier file in
# a random order until the parent kills it (it says "started PID"), and says how that process
# ended. "mid" stops for good inside the 40th put, after the page's bytes are in its slot and
# before its key, crc and valid flag are ("mid-write PID"); "make" stops for good while the tier
# file is made, once its header is reserved ("making PID"); "grow" once the file's first slots
# are reserved, before a page is written to them ("growing PID"); "hold" puts SLOTS pages and waits.
WRITER = r"""
import hashlib, os, random, sys, time
import torch
import specdec.kv.tier as tier_module
from specdec.kv.tier import DiskTier

folder, page, slots, keys, *modes = sys.argv[1:]
page, slots, keys = int(page), int(slots), int(keys)
names = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(keys)]
pages = {k: torch.frombuffer(bytearray(hashlib.shake_256(k).digest(page)), dtype=torch.uint8)
         for k in names}


def write(path, mode, seed):
    deadline = time.monotonic() + 20  # an orphan (the test died) ends by itself
    if mode in ("make", "grow"):
        fallocate = os.posix_fallocate

        def stalled(fd, offset, length):  # the file made (or grown) and reserved, no more
            fallocate(fd, offset, length)
            if mode == "grow" and offset == 0:
                return
            print("making" if mode == "make" else "growing", os.getpid(), flush=True)
            time.sleep(20)
            os._exit(3)

        os.posix_fallocate = stalled
    tier = DiskTier(path, page, slots * DiskTier.stride_for(page), "crash test")
    if mode == "mid":
        crc32, calls = tier_module.zlib.crc32, [0]

        def stalled(data):  # the crc is computed between a page's bytes and its commit
            calls[0] += 1
            if calls[0] == 40:
                print("mid-write", os.getpid(), flush=True)
                time.sleep(20)
                os._exit(3)
            return crc32(data)

        tier_module.zlib = type("Z", (), {"crc32": staticmethod(stalled)})
    print("started", os.getpid(), flush=True)
    rng = random.Random(seed)
    for n in range(10**9):
        if mode == "hold" and n == slots:
            print("holding", os.getpid(), flush=True)
            time.sleep(20)
        if time.monotonic() > deadline:
            os._exit(3)
        k = names[n % keys] if mode == "hold" else names[rng.randrange(keys)]
        tier.put(k, pages[k])


for r, mode in enumerate(modes):
    pid = os.fork()
    if pid == 0:
        write(f"{folder}/kv{r}.tier", mode, r)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    print("ended", -os.WTERMSIG(status) if os.WIFSIGNALED(status) else status, flush=True)
"""


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _content(key: bytes) -> bytes:
    return hashlib.shake_256(key).digest(PAGE)


def _writer(folder, *modes: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(folder), str(PAGE), str(SLOTS), str(KEYS), *modes]
    return subprocess.Popen([sys.executable, "-c", WRITER, *args], stdout=subprocess.PIPE,
                            text=True, env=env)


def _wait_for(proc: subprocess.Popen, word: str) -> int:
    """The number after ``word`` in the writer's next line."""
    got = proc.stdout.readline().split()
    if got[:1] != [word]:
        proc.kill()
        pytest.fail(f"the writer said {got!r}, not {word!r} (exit {proc.wait()})")
    return int(got[1])


def _check_every_page(path) -> tuple[int, int]:
    """Reopen the tier: each key's page is its exact bytes or missing. (served, torn slots)."""
    tier = DiskTier(path, PAGE, SLOTS * DiskTier.stride_for(PAGE), "crash test")
    torn = sum(1 for s in range(tier.allocated)  # a write under way when killed: state 0, data in place
               if SLOT_HEADER.unpack_from(tier._mm, tier._offset(s))[0] == 0
               and any(tier._mm[tier._offset(s) + SLOT_HEADER.size:][:64]))
    served = 0
    for i in range(KEYS):
        out = torch.zeros(PAGE, dtype=torch.uint8)
        if tier.get(_key(i), out):
            assert out.numpy().tobytes() == _content(_key(i)), f"key {i}: wrong bytes served"
            served += 1
        else:
            assert not out.any(), f"key {i}: a refused page was copied out"
    tier.close()
    return served, torn


def test_a_writer_killed_at_any_moment_never_leaves_a_wrong_page(tmp_path):
    rng = random.Random(0)
    modes = ["mid", "make", "grow", "random", "random", "random", "random"]
    writer = _writer(tmp_path, *modes)
    try:
        for mode in modes:
            pid = _wait_for(writer, "making" if mode == "make" else "started")
            if mode in ("mid", "grow"):
                pid = _wait_for(writer, "mid-write" if mode == "mid" else "growing")
            else:
                time.sleep(rng.uniform(0.0, 0.1))
            os.kill(pid, signal.SIGKILL)
            assert _wait_for(writer, "ended") == -signal.SIGKILL
        assert writer.wait(timeout=30) == 0
    finally:
        writer.kill()
        writer.wait()
    results = [_check_every_page(tmp_path / f"kv{r}.tier") for r in range(len(modes))]
    assert results[0][1] >= 1, "the mid-write kill must leave a torn slot to refuse"
    assert results[1] == (0, 0)  # a file killed while made is ours: opened again, empty
    assert results[2] == (0, 0)  # killed while it grew: its new slots are empty
    assert sum(served for served, _ in results) > 0, "no page survived to be checked"


def test_a_tier_another_process_holds_is_refused_until_it_exits(tmp_path):
    path = tmp_path / "kv0.tier"
    writer = _writer(tmp_path, "hold")
    try:
        _wait_for(writer, "started")
        pid = _wait_for(writer, "holding")
        size = path.stat().st_size
        with pytest.raises(ValueError, match=f"kv_tier_path '{path}' is in use by another "
                                             "specdec engine"):
            DiskTier(path, PAGE, 2 * SLOTS * DiskTier.stride_for(PAGE), "another model")
        assert path.stat().st_size == size
        os.kill(pid, signal.SIGKILL)  # kill -9: the kernel drops a dead process's lock
        assert _wait_for(writer, "ended") == -signal.SIGKILL
    finally:
        writer.kill()
        writer.wait()
    served, _ = _check_every_page(path)
    assert served == SLOTS  # what the holder wrote, intact
