"""Tokenizer loading (transformers); test models may come without one."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has no tokenizer files (token-id prompts only)."""
    if not any((Path(folder) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ValueError(f"could not load the tokenizer in {folder}: {e}") from e
