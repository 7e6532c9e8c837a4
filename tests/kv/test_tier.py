"""The disk tier: pages round-trip, slots are reused least recently used first, a torn or
corrupted slot is detected and never served, a valid file is reopened; the path is the user's:
a foreign file is refused and left byte for byte, a tier file in use is locked, the file grows
with its pages (each step reserved before it is written; a full disk stops the growth), and
every bad path is an error naming it; the namespace fingerprints the weights. End to end, an
engine whose KV is too small for its prompts serves evicted pages from the tier with exactly the
tokens it computes without one; a request's full pages are written through when it ends, so a
new engine on the file reuses them; and an engine restarted on the tier after its folder's
weights changed serves none of them.
(Killed writers and two processes: test_tier_crash.py.)"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import random
import shutil

import pytest
import torch
from conftest import make_tiny_model

from specdec import LLM, SamplingParams
from specdec.kv.fingerprint import weights_fingerprint
from specdec.kv.host_tier import HostTier
from specdec.kv.tier import FILE_HEADER, MAGIC, SLOT_HEADER, VERSION, DiskTier

SHAPE = (2, 2, 4, 3, 8)  # layers, K/V, page size, heads, head dim
PAGE_BYTES = torch.zeros(SHAPE).numel() * 4


def _page(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _tier(path, slots: int = 3, namespace: str = "m") -> DiskTier:
    return DiskTier(path, PAGE_BYTES, slots * DiskTier.stride_for(PAGE_BYTES), namespace)


def test_round_trip_and_least_recently_used_slot_reused(tmp_path):
    tier = _tier(tmp_path / "kv.tier")
    for i in range(3):
        tier.put(bytes([i]) * 16, _page(i))
    out = torch.empty(SHAPE)
    assert tier.get(b"\x00" * 16, out) and torch.equal(out, _page(0))  # 0 used: 1 is oldest
    tier.put(b"\x03" * 16, _page(3))
    assert b"\x01" * 16 not in tier and len(tier) == 3
    for i in (0, 2, 3):
        assert tier.get(bytes([i]) * 16, out) and torch.equal(out, _page(i))
    assert not tier.get(b"\x09" * 16, out)
    assert (tier.hits, tier.stores, tier.torn) == (4, 4, 0)


@pytest.mark.parametrize("where", ["data", "state", "key"])
def test_a_torn_or_corrupted_slot_is_dropped_never_served(tmp_path, where):
    tier = _tier(tmp_path / "kv.tier")
    key = b"\x05" * 16
    tier.put(key, _page(5))
    slot = tier._index[key]
    off = FILE_HEADER + slot * tier.stride
    if where == "data":  # a flipped byte in the page
        tier._mm[off + SLOT_HEADER.size + 100] ^= 0xFF
    elif where == "state":  # a write that never finished
        tier._mm[off] = 0
    else:
        tier._mm[off + 8] ^= 0xFF
    out = torch.zeros(SHAPE)
    assert not tier.get(key, out)
    assert torch.equal(out, torch.zeros(SHAPE)), "a rejected page must not be copied out"
    assert tier.torn == 1 and key not in tier


def test_reopened_file_keeps_valid_pages_and_another_namespace_replaces_it(tmp_path):
    path = tmp_path / "kv.tier"
    tier = _tier(path)
    tier.put(b"\x01" * 16, _page(1))
    tier.put(b"\x02" * 16, _page(2))
    off = FILE_HEADER + tier._index[b"\x02" * 16] * tier.stride
    tier._mm[off] = 0  # torn
    tier.close()
    tier.close()  # twice is fine; a closed tier says so, not a raw mmap error
    for use in (lambda: tier.put(b"\x03" * 16, _page(3)),
                lambda: tier.get(b"\x01" * 16, torch.empty(SHAPE))):
        with pytest.raises(ValueError, match=r"kv\.tier' was closed"):
            use()
    again = _tier(path)
    out = torch.empty(SHAPE)
    assert len(again) == 1 and again.get(b"\x01" * 16, out) and torch.equal(out, _page(1))
    again.close()
    other = _tier(path, namespace="another model")
    assert len(other) == 0


def test_unwritable_path_is_an_error_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = blocker / "kv.tier"  # a file cannot be a folder
    with pytest.raises(ValueError, match="kv_tier_path .*a_file/kv.tier"):
        DiskTier(bad, PAGE_BYTES, 1 << 20, "m")
    with pytest.raises(ValueError, match="holds no page"):
        DiskTier(tmp_path / "small", PAGE_BYTES, 100, "m")


def test_engine_rejects_an_unwritable_tier_path_at_start(tiny_llama, tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_tier_path"):
        LLM(model=str(tiny_llama), kv_tier_path=str(blocker / "t"))
    with pytest.raises(ValueError, match=f"kv_tier_path '{blocker}' exists and is not a specdec"):
        LLM(model=str(tiny_llama), kv_tier_path=str(blocker))
    assert blocker.read_text() == "x"
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(model=str(tiny_llama), kv_tier_path=str(tmp_path / "t"), enable_prefix_caching=False)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(90) for _ in range(length)] for _ in range(n)]


def test_pages_evicted_to_the_tier_come_back_with_the_same_tokens(tiny_llama, tmp_path):
    """12 pages of 4 slots: each 40-token prompt fills most of them, so every later prompt
    evicts the earlier ones' pages; the second pass finds them in the tier."""
    prompts = _prompts(3, 40, 0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(model=str(tiny_llama), dtype="float64", page_size=4, num_pages=12,
                  max_model_len=48)

    def two_passes(llm):
        first = llm.generate(prompts, params)  # one at a time would be the same: 12 pages
        return [o.token_ids for o in first] + [o.token_ids for o in
                                                [llm.generate(p, params)[0] for p in prompts]]

    want = two_passes(LLM(enable_prefix_caching=False, **common))
    llm = LLM(kv_tier_path=str(tmp_path / "kv.tier"), **common)
    assert two_passes(llm) == want
    tier = llm.engine.parts.tier
    assert tier.stores > 0 and tier.hits > 0 and llm.engine.totals.tier_hits == tier.hits
    assert llm.engine.kv.num_free_pages == 12

    # corrupt every stored page: the third pass detects it, recomputes, same tokens
    for slot in tier._index.values():
        tier._mm[FILE_HEADER + slot * tier.stride + SLOT_HEADER.size + 7] ^= 0x55
    hits = tier.hits
    again = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert again == want[3:]
    assert tier.torn > 0 and tier.hits == hits


def test_a_new_engine_on_the_file_reuses_a_finished_requests_pages(tiny_llama, tmp_path):
    """Write-through: nothing was evicted (the KV holds everything), yet engine B, started on
    the tier engine A used, reuses the prompt's full pages and emits A's (and plain) tokens."""
    prompt = _prompts(1, 37, 2)[0]  # 9 full pages of 4, the last token computed again
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(model=str(tiny_llama), dtype="float64", page_size=4, num_pages=64,
                  max_model_len=64)
    want = LLM(enable_prefix_caching=False, **common).generate(prompt, params)[0].token_ids
    path = tmp_path / "kv.tier"
    with LLM(kv_tier_path=str(path), **common) as a:
        assert a.generate(prompt, params)[0].token_ids == want
        assert a.engine.kv.pool.num_evicted == 0 and a.engine.parts.tier.stores >= 9
    with LLM(kv_tier_path=str(path), **common) as b:
        out = b.generate(prompt, params)[0]
        assert out.token_ids == want
        assert out.metrics.num_cached_tokens == 36 and b.engine.parts.tier.hits == 9
        assert b.engine.totals.cached_tokens == 36


def test_host_tier_round_trip_and_least_recently_used_slot_reused():
    tier = HostTier(PAGE_BYTES, 2 * PAGE_BYTES, torch.device("cpu"))
    tier.put(b"a" * 16, _page(0))
    tier.put(b"b" * 16, _page(1))
    out = torch.empty(SHAPE)
    assert tier.get(b"a" * 16, out) and torch.equal(out, _page(0))
    tier.put(b"c" * 16, _page(2))  # b was the least recently used
    assert b"b" * 16 not in tier and not tier.get(b"b" * 16, out)
    assert tier.get(b"c" * 16, out) and torch.equal(out, _page(2))
    with pytest.raises(ValueError, match="holds no page"):
        HostTier(PAGE_BYTES, PAGE_BYTES - 1, torch.device("cpu"))


def test_one_second_tier_at_a_time(tmp_path):
    from specdec.config import EngineConfig

    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_tier_path=str(tmp_path / "t"), kv_host_tier_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_host_tier_bytes must be an int >= 1"):
        EngineConfig(kv_host_tier_bytes=0)


# ---- the path is the user's: refuse what is not ours, lock, reserve -----------------------------

def _size(slots: int = 3) -> int:
    return FILE_HEADER + slots * DiskTier.stride_for(PAGE_BYTES)


@pytest.mark.parametrize("content", [b"my notes\n" * 500, bytes(_size()), MAGIC[:-1]])
def test_a_foreign_file_is_refused_and_left_byte_for_byte(tmp_path, content):
    """A text file, zeros of exactly the tier's size, a near-miss of the magic: not ours."""
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    with pytest.raises(ValueError, match=f"{path}.* is not a specdec KV tier file .*will not be "
                                         "overwritten"):
        _tier(path)
    assert path.read_bytes() == content and path.stat().st_mtime_ns == 2_000_000_000
    _tier(tmp_path / "next.tier").close()  # and nothing was left locked or mapped


def test_an_empty_file_is_made_a_tier(tmp_path):
    path = tmp_path / "kv.tier"
    path.touch()
    tier = _tier(path)
    tier.put(b"\x01" * 16, _page(1))
    tier.close()
    assert path.stat().st_size == _size() and path.read_bytes().startswith(MAGIC)


@pytest.mark.parametrize("change", ["version", "slots", "namespace"])
def test_a_tier_file_of_another_version_geometry_or_namespace_is_reinitialised(tmp_path, caplog,
                                                                              change):
    path = tmp_path / "kv.tier"
    tier = _tier(path)
    tier.put(b"\x01" * 16, _page(1))
    tier.close()
    slots, namespace = 3, "m"
    if change == "version":
        with open(path, "r+b") as f:
            f.seek(len(MAGIC))
            f.write((VERSION - 1).to_bytes(4, "little"))
    elif change == "slots":
        slots = 2
    else:
        namespace = "other weights"
    with caplog.at_level(logging.INFO, logger="specdec"):
        again = _tier(path, slots, namespace)
    assert len(again) == 0 and not again.get(b"\x01" * 16, torch.empty(SHAPE))
    assert path.stat().st_size == FILE_HEADER  # made anew: the header, no page yet
    said = [r.getMessage() for r in caplog.records if "re-initialised" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0]
    assert {"version": f"format version {VERSION - 1}", "slots": "geometry",
            "namespace": "namespace"}[change] in said[0]


def test_a_second_tier_on_one_path_is_refused_until_the_first_is_closed(tmp_path):
    path = tmp_path / "kv.tier"
    first = _tier(path)
    first.put(b"\x01" * 16, _page(1))
    for slots, namespace in ((3, "m"), (2, "another model")):  # same file, or one it would replace
        with pytest.raises(ValueError, match=f"{path}.* is in use by another specdec engine"):
            _tier(path, slots, namespace)
    out = torch.empty(SHAPE)
    assert path.stat().st_size == _size() and first.get(b"\x01" * 16, out)
    assert torch.equal(out, _page(1))
    first.close()
    again = _tier(path)
    assert again.get(b"\x01" * 16, out) and torch.equal(out, _page(1))
    again.close()


def test_a_file_another_process_has_locked_is_refused_and_untouched(tmp_path):
    path = tmp_path / "kv.tier"
    path.write_bytes(b"")
    with open(path, "rb") as f:  # another open file description: what another process holds
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=f"{path}.* is in use"):
            _tier(path)
    assert path.read_bytes() == b""


def test_the_file_grows_with_its_pages_each_step_reserved_before_it_is_written(tmp_path,
                                                                                 monkeypatch):
    """A tier of 2 GiB that holds three pages is a file of three slots, not 2 GiB: it starts as
    its header and grows (here a slot at a time) as pages are stored, every block allocated
    before a page is written through the mapping (a sparse file meets a full disk as SIGBUS);
    at its limit the least recently used slot makes room."""
    import specdec.kv.tier as tier_module

    monkeypatch.setattr(tier_module, "GROW_BYTES", 1)  # one slot per step
    path = tmp_path / "kv.tier"
    tier = _tier(path, slots=4)
    assert path.stat().st_size == FILE_HEADER and tier.allocated == 0
    for i in range(3):
        tier.put(bytes([i]) * 16, _page(i))
        st = path.stat()
        assert st.st_size == _size(i + 1) and st.st_blocks * 512 >= st.st_size
    tier.close()
    again = _tier(path, slots=4)  # kept: three slots, one more allowed
    assert again.allocated == 3 and len(again) == 3
    for i in (3, 4):
        again.put(bytes([i]) * 16, _page(i))
    assert path.stat().st_size == _size(4) and len(again) == 4 and b"\x00" * 16 not in again
    out = torch.empty(SHAPE)
    assert again.get(b"\x04" * 16, out) and torch.equal(out, _page(4))
    again.close()
    big = DiskTier(tmp_path / "big.tier", PAGE_BYTES, 2 << 30, "m")
    big.put(b"\x01" * 16, _page(1))
    assert (tmp_path / "big.tier").stat().st_size <= FILE_HEADER + tier_module.GROW_BYTES + 4096
    big.close()


def test_a_growth_cut_short_by_a_kill_loses_only_its_partial_slot(tmp_path):
    path = tmp_path / "kv.tier"
    tier = _tier(path, slots=3)
    tier.put(b"\x01" * 16, _page(1))
    tier.close()
    with open(path, "r+b") as f:  # a partial slot past the three: zeros written, then killed
        f.truncate(_size(3) + 1000)
    again = _tier(path, slots=3)
    out = torch.empty(SHAPE)
    assert again.allocated == 3 and again.get(b"\x01" * 16, out) and torch.equal(out, _page(1))
    assert path.stat().st_size == _size(3)
    again.close()


@pytest.mark.parametrize("existed", [False, True])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_a_disk_without_room_for_the_header_is_an_error_at_start_and_nothing_is_left(
        tmp_path, monkeypatch, existed, code):
    path = tmp_path / "kv.tier"
    if existed:
        path.touch()

    def full(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ValueError, match=f"{path}.*cannot reserve {FILE_HEADER} bytes.*"
                                         f"{os.strerror(code)}"):
        _tier(path, slots=8)
    assert path.exists() == existed and (not existed or path.stat().st_size == 0)
    monkeypatch.undo()
    _tier(path).close()  # the lock went with the error


def test_a_disk_that_fills_up_stops_the_growth_and_the_tier_goes_on(tmp_path, monkeypatch,
                                                                   caplog):
    """No SIGBUS and no error: the file keeps what it holds (said once), its least recently
    used slot makes room from then on; with no slot at all a page is simply not stored."""
    import specdec.kv.tier as tier_module

    monkeypatch.setattr(tier_module, "GROW_BYTES", 1)
    real = os.posix_fallocate
    room = {"slots": 2}

    def filling(fd, offset, length):
        if offset >= _size(room["slots"]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", filling)
    path = tmp_path / "kv.tier"
    tier = _tier(path, slots=8)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        for i in range(4):
            tier.put(bytes([i]) * 16, _page(i))
    assert path.stat().st_size == _size(2) and tier.allocated == 2 and len(tier) == 2
    out = torch.empty(SHAPE)
    assert tier.get(b"\x03" * 16, out) and torch.equal(out, _page(3))
    said = [r.getMessage() for r in caplog.records if "disk is full" in r.getMessage()]
    assert len(said) == 1 and "2 pages" in said[0]
    tier.close()
    room["slots"] = 0
    empty = _tier(tmp_path / "empty.tier", slots=8)
    empty.put(b"\x01" * 16, _page(1))
    assert len(empty) == 0 and not empty.get(b"\x01" * 16, out)
    empty.close()


def test_without_fallocate_the_new_bytes_are_written(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    path = tmp_path / "kv.tier"
    tier = _tier(path, slots=40)
    tier.put(b"\x02" * 16, _page(2))
    st = path.stat()
    assert st.st_size == _size(40) and st.st_blocks * 512 >= st.st_size
    tier.close()
    again = _tier(path, slots=40)  # kept: its slots are not zeroed again
    out = torch.empty(SHAPE)
    assert again.get(b"\x02" * 16, out) and torch.equal(out, _page(2))
    again.close()


def test_a_missing_folder_is_an_error_naming_it_and_nothing_is_made(tmp_path):
    path = tmp_path / "no" / "such" / "kv.tier"
    with pytest.raises(ValueError, match=f"folder '{tmp_path / 'no' / 'such'}' does not exist"):
        _tier(path)
    assert not (tmp_path / "no").exists()


def _fifo(path):
    os.mkfifo(path)


def _dir(path):
    path.mkdir()


def _read_only_dir(path):
    path.parent.chmod(0o500)


@pytest.mark.parametrize("make, reason", [
    (_dir, "Is a directory"), (_fifo, "not a regular file"),
    pytest.param(_read_only_dir, "Permission denied", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root writes into a read-only folder")),
])
def test_a_path_that_is_not_a_writable_file_is_an_error_naming_it(tmp_path, make, reason):
    folder = tmp_path / "d"
    folder.mkdir()
    path = folder / "kv.tier"
    make(path)
    try:
        with pytest.raises(ValueError, match=f"kv_tier_path '{path}'.*{reason}"):
            _tier(path)
    finally:
        folder.chmod(0o700)
    assert sorted(p.name for p in folder.iterdir()) == ([] if make is _read_only_dir else
                                                        ["kv.tier"])


# ---- the namespace fingerprints the weights ------------------------------------------------------

def test_the_fingerprint_follows_the_weight_files_bytes_size_and_mtime(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))  # 3 MiB: a middle the fingerprint does not read
    (folder / "config.json").write_text("{}")
    base = weights_fingerprint(folder)
    assert weights_fingerprint(folder) == base and len(base) == 32

    def changed(offset: int) -> str:
        st = weights.stat()
        with open(weights, "r+b") as f:  # same size, same mtime: only the bytes differ
            f.seek(offset)
            f.write(b"\x01")
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        return weights_fingerprint(folder)

    first, last = changed(10), changed((3 << 20) - 1)
    assert len({base, first, last}) == 3
    os.utime(weights, ns=(1, 2))
    assert weights_fingerprint(folder) != last
    (folder / "config.json").write_text('{"x": 1}')
    assert weights_fingerprint(folder) != last
    # not weights: the tokenizer, and the panels earlier versions derived from a GGUF there
    now = weights_fingerprint(folder)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "native_panels.safetensors").write_bytes(b"x")
    assert weights_fingerprint(folder) == now
    assert weights_fingerprint(weights) != now  # a file alone


def test_the_derived_panel_caches_are_the_ones_the_fingerprint_leaves_out():
    """Earlier versions cached panels beside a GGUF; a folder may still hold them."""
    from specdec.kv.fingerprint import DERIVED_PREFIX
    from specdec.models.gguf.weights import LEGACY_CACHE_NAMES

    assert all(name.startswith(DERIVED_PREFIX) for name in LEGACY_CACHE_NAMES.values())


def test_an_engine_restarted_after_its_weights_changed_serves_nothing_from_the_tier(tmp_path,
                                                                                   tiny_llama):
    """The issue's story: fill a tier, overwrite the folder with other weights of the same
    shapes, restart on the tier: no tier hit, and the new weights' own greedy tokens."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    prompts = _prompts(3, 40, 1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(model=str(folder), dtype="float64", page_size=4, num_pages=12,
                  max_model_len=48, kv_tier_path=str(tmp_path / "kv.tier"))

    def run(llm):
        return [llm.generate(p, params)[0].token_ids for p in prompts]

    first = LLM(**common)
    old = run(first)
    assert first.engine.parts.tier.stores > 0
    first.engine.parts.tier.close()
    make_tiny_model(folder, "llama", seed=1)  # same files, same sizes, other weights
    want = run(LLM(**{**common, "kv_tier_path": None, "enable_prefix_caching": False}))
    assert want != old, "the other weights must give other tokens for this test to mean much"
    again = LLM(**common)
    assert run(again) == want
    assert again.engine.parts.tier.hits == 0 and again.engine.totals.tier_hits == 0
    assert len(again.engine.parts.tier) > 0  # it did store the new pages
