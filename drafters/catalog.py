"""Drafters shipped in the package (``drafters/shipped/<folder>``), by drafter kind, the model
alias they were trained for, and variant. ``drafter="eagle3"`` (or mtp, block_diffusion) on
that alias loads them with no path."""

from __future__ import annotations

from pathlib import Path

SHIPPED: dict[str, dict[str, dict[str, str]]] = {
    "eagle3": {"smollm2-135m-instruct": {"all": "eagle3-smollm2-135m-instruct-all",
                                         "general": "eagle3-smollm2-135m-instruct-general",
                                         "code": "eagle3-smollm2-135m-instruct-code"}},
    "mtp": {"smollm2-135m-instruct": {"general": "mtp-smollm2-135m-instruct-general"}},
    "block_diffusion": {
        "smollm2-135m-instruct": {"general": "block-diffusion-smollm2-135m-instruct-general"}},
}


def shipped_folder(kind: str, model_path: str, variant: str = "general") -> Path | None:
    """The shipped ``kind`` drafter of that variant for the target at ``model_path`` when it is
    a model alias that has one (ValueError for an unknown variant); None otherwise."""
    from specdec.models.aliases import cache_dir

    here = Path(model_path).resolve()
    for alias, variants in SHIPPED[kind].items():
        if here != (cache_dir() / "models" / alias).resolve():
            continue
        if variant not in variants:
            raise ValueError(f"{kind} drafter_args.variant must be one of {sorted(variants)} "
                             f"for {alias}, got {variant!r}")
        folder = Path(__file__).parent / "shipped" / variants[variant]
        return folder if folder.is_dir() else None
    return None


def checkpoint_folder(kind: str, path: str | None, model_path: str, form: str,
                      variant: str = "general") -> Path:
    """``path`` when given, else the drafter of ``kind`` shipped for the target at
    ``model_path``; ValueError naming ``drafter_args.path`` and the ``form`` it wants (e.g. "a
    folder in the EAGLE-3 format") when there is neither."""
    if path is not None:
        return Path(path).expanduser()
    folder = shipped_folder(kind, model_path, variant)
    if folder is None:
        raise ValueError(f"{kind} needs drafter_args.path: {form} (config.json + "
                         f"model.safetensors), e.g. one made by `specdec train {kind}`; none is "
                         f"shipped for {model_path}")
    return folder
