"""Bodies the sharded-model tests run on every rank (rank 0 in the test's process, the others
spawned: module-level, so that spawn pickles them by name).

``model_checks(group, cases)``: for each (folder, dtype, kernels) every rank loads the model,
shards it (``shard_decoder`` with the group's exact all-reduce), installs the matmul kernels
(``kernels``: "plain" F.linear, or "invariant", the compiled row-invariant CPU kernels, whose
layer call a shard refuses) and runs the same forwards -- the dense
one (``forward_dense``) and the paged one (torch attention backend, a KV cache sized from the
rank's ``model.cfg``) -- asserting on every rank that the ranks' hidden states and logits are
bitwise the same (all-gathered) and that a row's result is bitwise the same alone or among
other rows; rank 0 also runs the unsharded model and reports the differences to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.distributed import TPGroup, plan_tensor_parallel
from specdec.distributed.shard_model import shard_decoder
from specdec.kv.cache import KVCache
from specdec.models.loader import load_model
from specdec.models.matmul.choice import install_kernels

PAGE = 4
PAGES = 32
MAX_POSITIONS = 128
# the dense batch: 2 rows of 7, the second left-padded by 2
DENSE_IDS = [[5, 17, 3, 88, 41, 9, 60], [0, 0, 12, 7, 7, 33, 2]]
DENSE_MASK = [[1] * 7, [0, 0, 1, 1, 1, 1, 1]]
# the paged batch: A alone, then A among B and C (A in the middle)
SEQ_A = [11, 12, 13, 14, 15, 16]
SEQ_B = [21, 22, 23]
SEQ_C = [31, 32, 33, 34, 35, 36, 37, 38, 39]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 8: torch.int64}[t.element_size()])


def paged(model, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``seqs`` together into a fresh KV cache (sized from ``model.cfg``: a rank's KV
    heads), then decode one more token per sequence: (prefill hidden [T, H], decode hidden
    [len(seqs), H])."""
    cfg = model.cfg
    dtype = model.embed.dtype
    cache = KVCache(cfg.num_layers, PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    pages, nxt = [], 0
    for s in seqs:
        n = -(-(len(s) + 1) // PAGE)
        pages.append(list(range(nxt, nxt + n)))
        nxt += n
    lens = [len(s) for s in seqs]
    backend = TorchAttentionBackend()
    backend.plan(build_metadata(pages, lens, lens, PAGE))
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for s in seqs for p in range(len(s))])
    with torch.inference_mode():
        pre = model(ids, pos, backend, cache).hidden
        backend = TorchAttentionBackend()
        backend.plan(build_metadata(pages, [n + 1 for n in lens], [1] * len(seqs), PAGE))
        dec = model(torch.tensor([s[-1] + 1 for s in seqs]), torch.tensor(lens), backend,
                    cache).hidden
    return pre, dec


def run_case(model, group: TPGroup | None) -> dict[str, torch.Tensor]:
    """Every output the checks compare, by name (the same forwards on every rank)."""
    ids = torch.tensor(DENSE_IDS)
    mask = torch.tensor(DENSE_MASK)
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        out["embedded"] = F.embedding(ids, model.embed)
        dense = model.forward_dense(ids, mask, capture_layers=(0,))
        out["dense_layer0"] = dense.layer_hidden[0]
        out["dense_hidden"] = dense.hidden
        out["dense_logits"] = model.compute_logits(dense.hidden.reshape(-1, dense.hidden.shape[-1]))
    alone_pre, alone_dec = paged(model, [SEQ_A])
    among_pre, among_dec = paged(model, [SEQ_B, SEQ_A, SEQ_C])
    a0 = len(SEQ_B)
    out["paged_hidden"] = among_pre
    out["paged_decode"] = among_dec
    with torch.inference_mode():
        out["paged_logits"] = model.compute_logits(among_dec)
    out["alone_pre"], out["alone_dec"] = alone_pre, alone_dec
    out["among_pre_a"] = among_pre[a0:a0 + len(SEQ_A)]
    out["among_dec_a"] = among_dec[1:2]
    # the one-kernel-per-step path (layer_ops: CUDA runners'; torch ops on a CPU, bitwise the
    # layer loop's) reduces at the same two places
    model.layer_ops = True
    try:
        out["ops_pre"], out["ops_dec"] = paged(model, [SEQ_B, SEQ_A, SEQ_C])
    finally:
        model.layer_ops = False
    return out


def load(folder: str, dtype: torch.dtype, kernels: str, group: TPGroup | None = None):
    """(model, plan): the model, sharded for ``group``'s rank (None: whole, plan None), then
    its kernels installed (after sharding: they prepare the weights the model holds)."""
    model, cfg, _ = load_model(folder, dtype, "cpu", MAX_POSITIONS)
    plan = None
    if group is not None:
        plan = plan_tensor_parallel(cfg, group.world_size)
        shard_decoder(model, plan, group.rank, group.all_reduce)
    if kernels != "plain":
        install_kernels([model], kernels, dtype, torch.device("cpu"))
    return model, plan


def _down(layer) -> torch.Tensor:
    """The layer's down weight: its dense MLP's, or its first expert's (a mixture of experts)."""
    return layer.down_weight if layer.moe is None else layer.moe.experts[0].down_weight


def model_checks(group: TPGroup, cases: list[tuple[str, str, str]]) -> dict:
    """See the module docstring; returns rank 0's report: per case, the largest difference of
    each output to the unsharded model's, and what the rank's model looked like."""
    torch.set_num_threads(1)
    rank, ws = group.rank, group.world_size
    report: dict = {}
    for folder, dtype_name, kernels in cases:
        dtype = getattr(torch, dtype_name)
        model, plan = load(folder, dtype, kernels, group)
        got = run_case(model, group)
        # row invariance at TP N: A's rows alone == A's rows among B and C, bitwise
        assert torch.equal(bits(got["ops_pre"]), bits(got["paged_hidden"])) and torch.equal(
            bits(got["ops_dec"]), bits(got["paged_decode"])), "layer_ops: not the loop's bits"
        invariant = {
            "prefill": torch.equal(bits(got["alone_pre"]), bits(got["among_pre_a"])),
            "decode": torch.equal(bits(got["alone_dec"]), bits(got["among_dec_a"])),
        }
        # every rank the same bits
        for name in ("dense_hidden", "dense_logits", "paged_hidden", "paged_decode",
                     "paged_logits"):
            everyone = group.all_gather(bits(got[name]))
            assert all(torch.equal(everyone[r], everyone[0]) for r in range(ws)), \
                f"{folder} {dtype_name} {kernels} {name}: the ranks' bits differ"
        entry = {"invariant": invariant, "num_heads": model.cfg.num_heads,
                 "num_kv_heads": model.cfg.num_kv_heads,
                 "intermediate_size": model.cfg.intermediate_size,
                 "kv_replicated": plan.kv_replicated, "tp_size": model.tp_size,
                 "full_heads": model.full_cfg.num_heads,
                 "qkv_shape": tuple(model.layers[0].qkv_weight.shape),
                 "o_shape": tuple(model.layers[0].o_weight.shape),
                 "down_shape": tuple(_down(model.layers[0]).shape),
                 "o_contiguous": model.layers[0].o_weight.is_contiguous(),
                 "refusal": model.compiled_refusal(), "fused": model.fused is not None}
        if model.cfg.is_moe:
            moe = model.layers[0].moe
            entry["moe"] = {
                "gate_up_shape": tuple(moe.experts[0].gate_up_weight.shape),
                "router_shape": tuple(moe.router_weight.shape),
                "shared_shapes": None if moe.shared is None else (
                    tuple(moe.shared.gate_up_weight.shape),
                    tuple(moe.shared.down_weight.shape), tuple(moe.shared_gate_weight.shape)),
                "widths": (model.cfg.moe_intermediate_size,
                           model.cfg.shared_expert_intermediate_size),
                "woken": model.experts_woken()}
        if rank == 0:
            full, _ = load(folder, dtype, kernels)
            ref = run_case(full, None)
            entry["embedded_equal"] = torch.equal(got["embedded"], ref["embedded"])
            entry["diff"] = {name: (got[name] - ref[name]).abs().max().item()
                             for name in ("dense_layer0", "dense_hidden", "dense_logits",
                                          "paged_hidden", "paged_decode", "paged_logits")}
            entry["scale"] = {name: ref[name].abs().max().item() for name in entry["diff"]}
            entry["full_invariant"] = {
                "prefill": torch.equal(bits(ref["alone_pre"]), bits(ref["among_pre_a"])),
                "decode": torch.equal(bits(ref["alone_dec"]), bits(ref["among_dec_a"]))}
        report[(folder, dtype_name, kernels)] = entry
        del model
    group.barrier()
    return report


def run_model_checks(rank: int, world_size: int, address: str, timeout_s: float,
                     cases: list[tuple[str, str, str]]) -> None:
    with TPGroup.init(rank, world_size, init_method=address, backend="gloo",
                      timeout_s=timeout_s) as group:
        model_checks(group, cases)
