"""transformers' reading of a GGUF file's metadata, answered from specdec's header reader.

transformers makes the config and the tokenizer of a GGUF file (aliases.write_metadata_files)
from its metadata, read twice over: ``load_gguf_checkpoint`` builds gguf-py's ``GGUFReader``
(every one of SmolLM2's 98k vocabulary and merge strings becomes numpy arrays: 5.4 s on a slow
core), once for ``AutoConfig`` and again inside ``AutoTokenizer``; ``read_gguf_metadata`` slices
a numpy memmap per string for the tokenizer. Here both answer for one file from ``open_gguf``'s
header (its big arrays read on demand, 0.03 s):

    f = open_gguf(path)
    with reading_from_header(f):
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

All the rest stays transformers': the config and tokenizer classes it picks, its mapping tables
(``GGUF_TO_TRANSFORMERS_MAPPING``, ``GGUF_CONFIG_DEFAULTS_MAPPING``), its tokenizer converters,
special tokens and chat template, so a transformers upgrade is followed. ``checkpoint_metadata``
redoes the generic part of ``load_gguf_checkpoint`` only: a file it special-cases (``special_case``:
a llama file named "mistral", t5, the MoE ones, stablelm, gemma3/4, lfm2, falcon, bloom, an
architecture it does not map) is read by transformers itself, as is one whose header holds what
the fast reader does not read the same way (``unreadable``); why is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterator
from contextlib import contextmanager
from pathlib import Path

from specdec.models.gguf.file import GGUFFile

logger = logging.getLogger("specdec")

_STRING, _ARRAY = 8, 9  # metadata value types (gguf.GGUFValueType)
# substrings of general.architecture that load_gguf_checkpoint treats apart from its generic path
SPECIAL_ARCHITECTURES = ("t5", "qwen2moe", "qwen3moe", "gpt_oss", "gpt-oss", "minimax-m2",
                         "stablelm", "gemma3", "gemma4", "lfm2", "falcon", "bloom")


def _skipped(value) -> bool:
    """The header's placeholder for an array it did not keep: ``("array", type, count)``."""
    return isinstance(value, tuple) and value[:1] == ("array",)


def unreadable(f: GGUFFile) -> str | None:
    """Why the header cannot stand in for transformers' readers of ``f`` (None: it can): an
    array of arrays (they read none) or a string the header decoded with replacements (they
    decode strictly)."""
    for key, value in f.metadata.items():
        if _skipped(value) and value[1] == _ARRAY:
            return f"metadata {key!r} is an array of arrays"
        if isinstance(value, str) and "\ufffd" in value:
            return f"metadata {key!r} is not plain UTF-8"
    return None


def reader_metadata(f: GGUFFile, string_arrays: Container[str] = ()) -> tuple[dict, tuple]:
    """What transformers' ``read_gguf_metadata(f.path, string_arrays)`` returns: every key's
    value (numeric arrays in full, a string array as its length unless ``string_arrays`` names
    it) and the tensors' names, in the file's order."""
    out = {}
    for key, value in f.metadata.items():
        if _skipped(value):
            value = value[2] if value[1] == _STRING and key not in string_arrays else f.array(key)
        out[key] = value
    return out, tuple(f.tensors)


def special_case(f: GGUFFile) -> str | None:
    """Why ``load_gguf_checkpoint`` reads ``f`` otherwise than by its generic mapping (None: it
    does not)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = f.architecture
    for name in SPECIAL_ARCHITECTURES:
        if name in arch:
            return f"transformers special-cases {name!r} architectures"
    if "llama" in arch and f.metadata.get("general.name") == "mistral":
        return "transformers reads a llama file named 'mistral' as mistral"
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        return f"transformers maps no GGUF architecture {arch!r}"
    return None


def checkpoint_metadata(f: GGUFFile) -> dict | None:
    """What transformers' ``load_gguf_checkpoint(f.path, return_tensors=False)`` returns (the
    ``ignore``, ``config``, ``tokenizer`` and ``tokenizer_config`` dicts, through its own
    mapping tables), or None, logging why, for a file it special-cases or the header cannot
    stand in for."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    reason = special_case(f) or unreadable(f)
    if reason is not None:
        logger.info("%s: config read by transformers' GGUFReader: %s", f.path, reason)
        return None
    parsed: dict[str, dict] = {group: {} for group in GGUF_TO_TRANSFORMERS_MAPPING}
    config = parsed["config"]
    config["tie_word_embeddings"] = "output.weight" not in f.tensors
    for key, default in GGUF_CONFIG_DEFAULTS_MAPPING.get(f.architecture, {}).items():
        config.setdefault(key, default)
    # GGUFReader's fields: the header's counts, then every key; a value of one element is bare
    fields = {"GGUF.version": f.version, "GGUF.tensor_count": len(f.tensors),
              "GGUF.kv_count": len(f.metadata), **f.metadata}
    for key, value in fields.items():
        if _skipped(value):
            value = f.array(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        prefix, _, rest = key.partition(".")
        for group, renames in GGUF_TO_TRANSFORMERS_MAPPING.items():
            renamed = renames.get(prefix, {}).get(rest, -1)
            if renamed not in (-1, None):
                parsed[group][renamed] = value
    if "vocab_size" not in config and "tokens" in parsed["tokenizer"]:
        config["vocab_size"] = len(parsed["tokenizer"]["tokens"])
    return parsed


@contextmanager
def reading_from_header(f: GGUFFile) -> Iterator[None]:
    """While inside, transformers' ``read_gguf_metadata`` and ``load_gguf_checkpoint`` (without
    tensors) of ``f``'s file answer from its header (``reader_metadata``,
    ``checkpoint_metadata``); of another file, with tensors, or where those return None, they
    are transformers' own. Each answer is a new dict (callers may change them), as theirs are.
    Where a transformers version stops reading through these module attributes, this simply
    does not apply. The attributes are module-wide while inside: callers in other threads get
    the same answers (their files pass through), and contexts nest but must not interleave."""
    import transformers.integrations.gguf as tf_gguf
    import transformers.integrations.gguf.reader as tf_reader
    import transformers.modeling_gguf_pytorch_utils as tf_checkpoint

    target = f.path.resolve()
    original_read = tf_reader.read_gguf_metadata
    original_load = tf_checkpoint.load_gguf_checkpoint
    reason = unreadable(f)
    if reason is not None:
        logger.info("%s: metadata read by transformers' readers: %s", f.path, reason)
    checkpoint: list[dict | None] = []  # made on first use: AutoConfig may never ask

    def ours(gguf_path) -> bool:
        return reason is None and Path(gguf_path).resolve() == target

    def read(gguf_path, string_arrays=()):
        if ours(gguf_path):
            return reader_metadata(f, string_arrays)
        return original_read(gguf_path, string_arrays)

    def load(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if not return_tensors and ours(gguf_checkpoint_path):
            if not checkpoint:
                checkpoint.append(checkpoint_metadata(f))
            if checkpoint[0] is not None:
                return {group: dict(values) for group, values in checkpoint[0].items()}
        return original_load(gguf_checkpoint_path, return_tensors, *args, **kwargs)

    patches = [(tf_gguf, "read_gguf_metadata", read), (tf_reader, "read_gguf_metadata", read),
               (tf_checkpoint, "load_gguf_checkpoint", load)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, replacement in patches:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
