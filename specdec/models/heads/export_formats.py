"""Which serving engines load the drafter folders specdec writes, and the error when one cannot.

A drafter is exported once, as one folder; specdec always loads it, and for the kinds whose
layout vLLM's or SGLang's loaders read, the same files load there.
``tests/training/test_export_loaders.py`` replays those loaders against the exporter's files, and
checks README.md's "who loads what" table against this one.

    check_formats("eagle3", ["vllm", "sglang"])   # -> ("specdec", "vllm", "sglang")
    check_formats("block_diffusion", ["vllm"])    # ValueError naming both
"""

from __future__ import annotations

FORMATS = ("specdec", "vllm", "sglang")

# (drafter kind, engine) -> why that engine cannot load the kind's export; a pair not here loads.
CANNOT = {
    ("mtp", "sglang"): "SGLang has no Medusa loader",
    ("block_diffusion", "vllm"): (
        "vLLM's DFlash loader (qwen3_dflash.py) reads Qwen3 layers with q/k norms, a "
        "mask_token_id row of the target's embedding and a d2t map, and stops at specdec's "
        "token_map; specdec's block drafter has Llama layers, learned mask embeddings per block "
        "position and the anchor's state in every block row"),
    ("block_diffusion", "sglang"): (
        "SGLang's DFlash loader (dflash.py) needs a real mask_token_id, reads no lm_head, "
        "token_map or mask_embedding and would leave q/k norms at their init values; specdec's "
        "block drafter has Llama layers, learned mask embeddings and the anchor's state"),
}
KINDS = ("eagle3", "mtp", "block_diffusion")


def loads(kind: str, engine: str) -> bool:
    """Whether ``engine`` (one of FORMATS) loads the export of drafter ``kind``."""
    assert kind in KINDS and engine in FORMATS, (kind, engine)
    return (kind, engine) not in CANNOT


def check_formats(kind: str, formats) -> tuple[str, ...]:
    """("specdec", *formats) with duplicates removed, checked: ValueError naming the drafter and
    the format when a format is unknown or cannot hold this drafter."""
    if kind not in KINDS:
        raise ValueError(f"drafter kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if isinstance(formats, str):
        raise TypeError(f"formats must be a list of format names, got the string {formats!r}")
    out = ["specdec"]
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"cannot export the {kind} drafter for {f!r}: known formats are "
                             f"{', '.join(FORMATS)}")
        if not loads(kind, f):
            raise ValueError(f"cannot export the {kind} drafter for {f}: "
                             f"{CANNOT[(kind, f)]}. Export it for specdec only")
        if f not in out:
            out.append(f)
    return tuple(out)
