"""What a GGUF load leaves on disk (issue 46): under ``SPECDEC_CACHE`` only its metadata's small
files (config.json, the tokenizer's) and a link to the file, never a copy of its weights (the
panels are made at load: specdec/models/gguf/repack.py), in either activation mode; a changed file's
earlier folder is removed, and so are the panel caches earlier versions wrote."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from gguf_helpers import TinyShape, write_tiny_gguf
from native_helpers import needs_kernels

from specdec import LLM
from specdec.models.aliases import gguf_folder, write_metadata_files

SHAPE = TinyShape(layers=2, hidden=512, intermediate=1024, heads=8, kv_heads=2)  # ~2.9 MB
SHARE = 0.05  # of the file's size: what a load may write
OLD_NAMES = ("native_panels.safetensors", "native_panels_q8.safetensors")  # earlier versions'


def _written(cache: Path) -> dict[str, int]:
    """Every file under ``cache`` (links not followed) -> its bytes."""
    return {str(p.relative_to(cache)): p.lstat().st_size for p in cache.rglob("*")
            if p.is_file() or p.is_symlink()}


def _gguf(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_gguf(path, kind="Q4_1", shape=SHAPE, quantize=False, seed=seed,
                           kinds={"token_embd.weight": "Q8_0"})


@needs_kernels
def test_a_gguf_load_writes_no_copy_of_its_weights(cache, tmp_path):
    path = _gguf(tmp_path / "user" / "m.gguf")
    for activations in ("float", "q8"):
        llm = LLM(model=str(path), weights="native", activations=activations,
                  max_model_len=64, num_pages=8)
        assert (llm.engine.parts.weights, llm.engine.parts.activations) == ("native", activations)
    written = _written(cache)
    assert sum(written.values()) <= SHARE * path.stat().st_size, written
    assert not any(Path(name).name.startswith("native_panels") for name in written)
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.gguf"]  # nothing beside it


@needs_kernels
def test_a_changed_file_replaces_its_folder(cache, tmp_path):
    path = _gguf(tmp_path / "user" / "m.gguf")
    LLM(model=str(path), weights="native", max_model_len=64, num_pages=8)
    first = {p.name for p in (cache / "gguf").iterdir() if p.is_dir()}
    _gguf(path, seed=1)  # the same path, new contents
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    other = _gguf(tmp_path / "user" / "other.gguf")  # another file keeps its folder
    LLM(model=str(other), weights="native", max_model_len=64, num_pages=8)
    LLM(model=str(path), weights="native", max_model_len=64, num_pages=8)
    now = {p.name for p in (cache / "gguf").iterdir() if p.is_dir()}
    assert len(first) == 1 and len(now) == 2 and not first & now
    written = _written(cache)
    assert sum(written.values()) <= 2 * SHARE * path.stat().st_size, written


@needs_kernels
@pytest.mark.parametrize("where", ["alias", "user file", "folder elsewhere"])
def test_panels_an_earlier_version_cached_are_removed(where, cache, tmp_path):
    """Earlier versions cached the panels (the file's size, per activation mode) beside the
    file in specdec's cache (an alias's folder, a user's file's folder), or under panels/ for
    a folder elsewhere."""
    if where == "user file":
        model = _gguf(tmp_path / "user" / "m.gguf")
        folder = gguf_folder(model)
    else:
        base = cache / "models" if where == "alias" else tmp_path / "user"
        path = _gguf(base / "tiny" / "model.gguf")
        write_metadata_files(path, path.parent)
        model = folder = path.parent
        if where == "folder elsewhere":
            digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=8).hexdigest()
            folder = cache / "panels" / digest
    stale = [folder / name for name in OLD_NAMES]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes(1 << 16))
    LLM(model=str(model), weights="native", max_model_len=64, num_pages=8)
    assert not any(p.exists() for p in stale)
    assert not (cache / "panels").exists() or not any((cache / "panels").iterdir())
