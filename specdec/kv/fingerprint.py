"""A fingerprint of a model's weights, for caches of what the weights computed (the disk tier).

A cache keyed by the model folder's path alone serves stale KV once the folder's weights change
(a fine-tune saved over them, another model copied in). Hashing whole files costs seconds per GB
at every start, so this takes what changes when a file does, for each weight file of the folder
(sorted by name): its name, size, mtime (ns) and a blake2b of its first and last MiB (the
header, which holds a safetensors' or GGUF's tensor index, and the tail)::

    weights_fingerprint(Path("models/smollm2"))  # -> '3f0c…' (32 hex digits)

Weight files: ``*.safetensors``, ``*.gguf``, ``*.bin``, ``*.pt`` and ``config.json``, directly in
the folder (an HF folder, or the folder a GGUF was converted into, which keeps ``model.gguf``);
a path to one file fingerprints that file alone. The panels earlier versions cached beside a GGUF
(specdec.models.gguf.weights.LEGACY_CACHE_NAMES) are derived from it, not inputs, and are left
out: a folder may still hold them, and a start removes them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
EDGE = 1 << 20  # bytes hashed at each end of a file
DERIVED_PREFIX = "native_panels"  # specdec.models.gguf.weights.LEGACY_CACHE_NAMES


def weights_fingerprint(folder_or_file: Path) -> str:
    """32 hex digits that change when any weight file of the folder (or the file) does."""
    path = Path(folder_or_file)
    files = [path] if path.is_file() else sorted(
        (p for p in path.iterdir() if _is_weights(p)), key=lambda p: p.name)
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(EDGE))
            if st.st_size > EDGE:
                fh.seek(max(EDGE, st.st_size - EDGE))
                h.update(fh.read(EDGE))
    return h.hexdigest()


def _is_weights(p: Path) -> bool:
    named = p.name == "config.json" or p.suffix in WEIGHT_SUFFIXES
    return named and not p.name.startswith(DERIVED_PREFIX) and p.is_file()
