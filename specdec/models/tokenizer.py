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


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat formatted with the tokenizer's template plus the generation prompt;
    ValueError for malformed messages or a tokenizer without a template."""
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m
                               for m in messages):
        raise ValueError("chat messages need 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
