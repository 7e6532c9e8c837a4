"""The GPU bench's learned drafters (tests/gpu/bench_gpu.py, section "learned"): EAGLE-3, MTP
and block diffusion with random weights for a target folder, the dry run's CPU stand-ins, and
the transfer audit of a short run (tests/transfer_audit.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS, TESTS / "drafters"):  # transfer_audit, attention/, drafter_helpers
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def cpu_stand_ins() -> dict:
    """Engine options for the dry run's learned drafters, as tests/test_transfer_audit.py runs
    them: flashinfer's API model (tests/attention/flashinfer_api_model.py) in bf16 and plain
    matmuls, so that the audit sees the GPU path's torch calls (not the compiled CPU kernels,
    which take no tensor the audit marks as the device's, nor the torch backend's KV gathers,
    which a GPU does not make)."""
    from attention import flashinfer_api_model

    from specdec.attention import flashinfer_backend

    sys.modules["flashinfer"] = flashinfer_api_model.module()
    flashinfer_backend.check_supported = lambda spec: None
    return dict(dtype="bfloat16", attention_backend="flashinfer", linear_kernels="plain")


def learned_drafter(name: str, folder: Path, device: str) -> dict:
    """drafter / drafter_args of ``name`` with random weights for the target in ``folder``."""
    from drafter_helpers import random_block_diffusion, random_head

    from specdec.models.loader import load_model

    dtype = torch.bfloat16
    model, cfg, hf = load_model(folder, dtype, device, 1024)
    last = cfg.num_layers - 1
    if name == "eagle3":
        return {"drafter": "eagle3", "drafter_args": {
            "head": random_head(model, cfg, hf, aux_layer_ids=(1, last // 2, last)),
            "depth": 3, "topk": 2}}
    if name == "mtp":
        from specdec.models.heads.mtp import MTPConfig, MTPHeads

        torch.manual_seed(0)
        heads = MTPHeads(MTPConfig.for_target(cfg, 64, 3), dtype).to(device)
        heads.init_from_target(model.head_weight,
                               torch.randperm(cfg.vocab_size)[:64].sort().values.to(device))
        return {"drafter": "mtp", "drafter_args": {"heads": heads}}
    return {"drafter": "block_diffusion",
            "drafter_args": {"model": random_block_diffusion(model, cfg, hf)}}


def audited(llm, prompts, params) -> dict:
    """Every host <-> device transfer of a short run, per step of each kind (the mean), with
    the call sites of the speculative steps' (tests/transfer_audit.py)."""
    from transfer_audit import audit_engine

    with audit_engine(llm.engine) as audit:
        llm.generate(prompts, params)
    out: dict = {}
    for kind in ("plain", "speculative"):
        steps = [s for s in audit.steps if s.kind == kind]
        if steps:
            out[f"{kind}_h2d_per_step"] = round(sum(s.h2d for s in steps) / len(steps), 2)
            out[f"{kind}_d2h_per_step"] = round(sum(s.d2h for s in steps) / len(steps), 2)
    spec = [s for s in audit.steps if s.kind == "speculative"]
    if spec:
        out["sites"] = sorted({f"{e.kind} {e.site}" for e in spec[0].events})
    return out
