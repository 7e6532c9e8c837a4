"""Blocks quantized at load, cached: ``quantize`` costs minutes on a large model (Q4_K ~5 M
weights a second on one core), reading them back costs a mapping.

One safetensors file per (checkpoint, quantize mode) in specdec's cache (``SPECDEC_CACHE``,
under ``quantized/``; never beside the user's files), named by a digest of the mode, the
quantizer's ``LAYOUT`` and every weights file's resolved path, size and mtime, which its
metadata repeats (``key``). A file is written under a temporary name and renamed into place,
so a reader sees a whole file or none; a changed checkpoint gets a new name, and the file made
from its earlier version (same paths and mode, another size, mtime or layout) is removed then,
so the cache holds one file per checkpoint and mode: its quantized blocks (Q8_0 ~1.06, Q4_K
~0.56 bytes a weight). A cache that cannot be written is logged and skipped. Each tensor
is a part's blocks [out, row bytes] uint8 under the part's HF name; the mapped file's pages are
dropped once the panels are made, so a start holds the panels, not the blocks too.

    cached = read(files, "q4_k")                     # CheckpointFiles of the blocks, or None
    cached = write(files, "q4_k", {name: rows})      # the same after writing (None: not written)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from pathlib import Path

import torch

from specdec.models.checkpoints.safetensors_file import CheckpointFiles, open_safetensors

LAYOUT = 1  # of specdec.models.checkpoints.quantize's blocks: a change there must bump it
logger = logging.getLogger("specdec")


def key_of(files: CheckpointFiles, quantize: str) -> str:
    ident = [quantize, LAYOUT] + [
        [str(f.path.resolve()), f.path.stat().st_size, f.path.stat().st_mtime_ns]
        for f in files.files]
    return json.dumps(ident)


def cache_path(key: str) -> Path:
    from specdec.models.aliases import cache_dir

    digest = hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
    return cache_dir() / "quantized" / f"{digest}.safetensors"


def read(files: CheckpointFiles, quantize: str) -> CheckpointFiles | None:
    """The cached blocks of ``files`` under ``quantize``, mapped, or None (none cached, or a
    file that is not ours: logged)."""
    key = key_of(files, quantize)
    path = cache_path(key)
    if not path.exists():
        return None
    try:
        f = open_safetensors(path)
    except ValueError as e:
        logger.info("weights: ignoring the quantized cache %s (%s)", path, e)
        return None
    return CheckpointFiles([f]) if f.metadata.get("key") == key else None


def write(files: CheckpointFiles, quantize: str, rows: dict[str, torch.Tensor]
          ) -> CheckpointFiles | None:
    """Cache ``rows`` (HF name -> blocks) atomically and return them mapped from the cache;
    None (logged) where the cache cannot be written."""
    from safetensors.torch import save_file

    key = key_of(files, quantize)
    path = cache_path(key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(rows, tmp, metadata={"key": key})
        os.replace(tmp, path)
    except OSError as e:
        logger.info("weights: quantized blocks not cached in %s (%s)", path.parent, e)
        if tmp.exists():  # False too where the folder could not be made
            tmp.unlink()
        return None
    _remove_older(key, path)
    return read(files, quantize)


def _remove_older(key: str, keep: Path) -> None:
    """Remove the cache's files made under ``key``'s mode from the same paths as ``key`` but
    other sizes, mtimes or layout: an earlier version of the checkpoint (a reader that has one
    mapped keeps it until it unmaps it). Files that are not ours are left alone."""
    mode, paths = json.loads(key)[0], [f[0] for f in json.loads(key)[2:]]
    for other in keep.parent.glob("*.safetensors"):
        if other == keep:
            continue
        try:
            ident = json.loads(open_safetensors(other).metadata.get("key", "null"))
            same = ident[0] == mode and [f[0] for f in ident[2:]] == paths
        except (ValueError, TypeError, IndexError, KeyError):  # not a file of ours
            continue
        if same:
            try:
                other.unlink()
            except OSError as e:
                logger.info("weights: could not remove the stale quantized cache %s (%s)",
                            other, e)
