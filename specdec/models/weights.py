"""The engine's weights made ready to run, once at build: ``prepare_weights``.

    the target: a GGUF's own blocks (gguf/weights.py), a safetensors checkpoint's own bf16 /
        fp16 bytes or its blocks quantized at load (checkpoints/weights.py), or, where the
        kernels cannot run them, its matrices dequantized once
    -> the draft models' matrices quantized (heads/weights.py)
    -> the matmul hook that runs them all, installed on every model (matmul/choice.py), and on
       CUDA the decoders' one-kernel-per-step layers (decoder/layer_ops.py)

    prepared = prepare_weights(config, target, folder, runner_models, matmul_models)
    prepared.weights, prepared.activations   # e.g. "native", "q8" for a Q4_K_M file on a CPU
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec import native
from specdec.models.aliases import GGUF_NAME
from specdec.models.checkpoints.weights import checkpoint_panels, from_checkpoint
from specdec.models.gguf.block_weight import BlockWeight
from specdec.models.gguf.model import materialize
from specdec.models.gguf.weights import native_panels
from specdec.models.heads.weights import draft_panels, mode_of
from specdec.models.matmul.choice import install_kernels

if TYPE_CHECKING:  # specdec.config reads its choices from this package
    from specdec.config import EngineConfig


@dataclass(frozen=True)
class PreparedWeights:
    """What ``prepare_weights`` made of the engine's models."""

    # the target's: "native" (a GGUF's blocks, a bf16 / fp16 checkpoint's own bytes),
    # "dequantized" (float32 copies), or the quantize mode its blocks were made in ("q8_0" ...)
    weights: str
    draft_weights: str  # "none" | "float" | a quantized mode (heads/weights.py)
    # what the target's blocks multiply: "float" | "q8" (EngineConfig.activations, "auto"
    # resolved by what the weights turned out to be)
    activations: str
    kernels: object  # the matmul hook installed on every model (matmul/choice.py)


def prepare_weights(config: EngineConfig, target, folder: Path, runner_models: list,
                    matmul_models: list = ()) -> PreparedWeights:
    """The target's GGUF blocks (``config.weights``), the draft models' quantized matrices
    (``draft_weights``) and the kernels that run them (``linear_kernels``), installed on
    ``target`` (loaded from ``folder``), on the drafter runners' models (``runner_models``,
    the target among them or not) and on the drafter's ``matmul_models`` (e.g. MTP heads)."""
    device = torch.device(config.device)
    drafts = _draft_models(target, runner_models, matmul_models)
    activations = _resolve_activations(config, target, folder)
    adopted, activations = _native_weights(config, target, folder, runner_models, activations)
    quantized = _draft_weights(config, drafts, adopted, activations)
    models = [target, *runner_models, *matmul_models]
    kernels = install_kernels(models, config.linear_kernels, config.torch_dtype, device,
                              adopted + quantized)
    install_layer_ops(models, device)
    return PreparedWeights(
        weights=(config.quantize or "native") if adopted else "dequantized",
        draft_weights="none" if not drafts else mode_of(quantized) if quantized else "float",
        activations=activations, kernels=kernels)


def check_quantize(config: EngineConfig) -> None:
    """ValueError when ``config.quantize`` cannot run here: said before the minutes
    quantizing takes."""
    reason = kernels_refusal(config)
    if reason is not None:
        raise ValueError(f"quantize={config.quantize!r} cannot run here: {reason}")


def kernels_refusal(config: EngineConfig) -> str | None:
    """Why the compiled kernels cannot run a model's float32 matrices here (None: they can)."""
    if config.torch_dtype != torch.float32:
        return f"they compute in float32, not {str(config.torch_dtype).removeprefix('torch.')}"
    if (torch.device(config.device).type != "cpu" or config.linear_kernels != "invariant"
            or native.load() is None):
        return "they need the compiled CPU kernels (linear_kernels='invariant' on a CPU)"
    return None


def install_layer_ops(models: list, device: torch.device) -> None:
    """On CUDA the decoders run a layer as one kernel per step (specdec.models.decoder.
    layer_ops)."""
    if device.type != "cuda":
        return
    for m in models:
        if hasattr(m, "layer_ops"):
            m.layer_ops = True


def _resolve_activations(config: EngineConfig, target, folder: Path) -> str:
    """``EngineConfig.activations``, "auto" resolved by one rule: "q8" wherever the target is to
    compute with quantized blocks in the compiled kernels, what llama.cpp computes for such
    weights; "float" wherever it computes with float matrices. Quantized blocks are a GGUF's
    (the model loaded from the file, or fp32 weights with a ``model.gguf`` beside them whose
    blocks dequantize to them bitwise: the kernels run the file's blocks) or the ones
    ``quantize`` makes of a checkpoint; float matrices are an fp32 / bf16 / fp16 checkpoint as
    stored, a float GGUF, dequantized weights, other dtypes and devices. Where the blocks then
    cannot run, "auto" falls back to "float" with the weights (``_native_weights``)."""
    c = config
    if c.activations != "auto":
        return c.activations
    if c.weights == "dequantized" or kernels_refusal(c) is not None:
        return "float"
    if from_checkpoint(target):
        return "q8" if c.quantize is not None else "float"
    blocks = any(isinstance(w, BlockWeight) for w in target.matrices())
    return "q8" if blocks or (Path(folder) / GGUF_NAME).exists() else "float"


def _native_weights(config: EngineConfig, target, folder: Path, runner_models: list,
                    activations: str) -> tuple[list, str]:
    """The panels ``EngineConfig.weights`` gives the target: a safetensors checkpoint's own
    bf16 / fp16 bytes or its blocks quantized at load (specdec.models.checkpoints.weights), or
    a GGUF's blocks (specdec.models.gguf.weights); without them its BlockWeights, if any, are
    dequantized once. Unless it says "dequantized", a draft model loaded from a GGUF too (as
    "auto": where they can run). With the activations, "auto" back to "float" where the
    target's blocks did not become panels."""
    c, dtype, device = config, config.torch_dtype, torch.device(config.device)
    if from_checkpoint(target):  # a checkpoint's own bytes, or blocks quantized at load
        adopted = checkpoint_panels(target, c.weights, activations, kernels_refusal(c))
    else:
        adopted = native_panels(target, folder / GGUF_NAME, c.weights, dtype, device,
                                c.linear_kernels, activations, strict=c.activations == "q8")
    if not adopted:
        materialize(target)  # its blocks, if any, cannot run here: fp32 matrices instead
        if c.activations == "auto":
            activations = "float"
    for m in runner_models:
        if m is target or getattr(m, "source_folder", None) is None:
            continue
        panels = [] if c.weights == "dequantized" else native_panels(
            m, m.source_folder / GGUF_NAME, "auto", dtype, device, c.linear_kernels,
            activations, strict=False)
        if not panels:
            materialize(m)
        adopted += panels
    return adopted, activations


def _draft_models(target, runner_models: list, matmul_models: list) -> list:
    """The models a drafter computes with besides the target (its runners' models, e.g. an
    EAGLE-3 head, and its ``matmul_models``, e.g. MTP heads)."""
    models = [m for m in runner_models if m is not target]
    return list(dict.fromkeys([*models, *matmul_models]))


def _draft_weights(config: EngineConfig, models: list, adopted: list, activations: str) -> list:
    """Quantized panels (``EngineConfig.draft_weights``, specdec.models.heads.weights) for
    the draft models whose matrices have no panels yet (a draft model from a GGUF computes
    with the file's own blocks)."""
    have = {id(w) for w, _ in adopted}
    models = [m for m in models if not any(id(w) in have for w in m.matrices())]
    return draft_panels(models, config.draft_weights, config.torch_dtype,
                        torch.device(config.device), config.linear_kernels, activations)
