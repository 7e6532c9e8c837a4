"""A GGUF's mixture-of-experts layers as llama.cpp writes them: which files are mixtures of
experts (qwen3moe, qwen2moe, and llama files with experts: Mixtral), which llama.cpp MoE
architectures the decoder refuses and why, the routing metadata it checks, the config fields
transformers' GGUF reading misses, and each layer's router, stacked experts
(``ffn_{gate,up,down}_exps``, one ``Part`` per expert: a view of its slice of the file's
blocks) and shared expert (``ffn_*_shexp``). specdec/models/gguf/model.py reads the rest.
"""

from __future__ import annotations

from specdec.models.decoder.config import ModelConfig
from specdec.models.gguf.block_weight import Part
from specdec.models.gguf.blocks import Blocks
from specdec.models.gguf.file import GGUFFile

# mixture-of-experts architectures: all of a file's layers route to experts ("llama": a file
# whose metadata count experts, i.e. Mixtral, which llama.cpp writes as llama)
MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama")
# llama.cpp's MoE architectures the decoder does not compute, with what they need
UNSUPPORTED_MOE = {
    "gpt-oss": "attention sinks and MXFP4 experts",
    "deepseek2": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek": "DeepSeek's shared experts and dense first layers",
    "olmoe": "OLMoE's q/k norms over the whole projection",
    "qwen3next": "its linear-attention (gated DeltaNet) layers",
    "qwen35moe": "its linear-attention (gated DeltaNet) layers",
    "phimoe": "PhiMoE's sparsemixer routing",
    "granitemoe": "Granite's scaled residuals and logits",
    "dbrx": "DBRX's clipped q|k|v and LayerNorm",
    "grok": "Grok's attention softcapping",
    "glm4moe": "sigmoid routing with a correction bias",
}


def is_moe(f: GGUFFile) -> bool:
    """Whether the file's layers are mixtures of experts (an MoE architecture, or a llama file
    whose metadata count experts or whose first layer has a router: Mixtral)."""
    a = f.architecture
    if a not in MOE_ARCHITECTURES:
        return False
    if a != "llama":
        return True
    return bool(f.metadata.get("llama.expert_count")) or "blk.0.ffn_gate_inp.weight" in f.tensors


def check_moe(f: GGUFFile) -> None:
    """ValueError naming the file unless its experts route as the decoder computes: softmax
    gating (``expert_gating_func`` absent or 1), unscaled weights (``expert_weights_scale``
    absent or 1), k of E experts, and experts stacked per layer (``ffn_*_exps``; the old
    one-tensor-per-expert layout is refused by name)."""
    a, m = f.architecture, f.metadata
    where = f"{f.path} ({a}, a mixture of experts)"
    count, used = m.get(f"{a}.expert_count"), m.get(f"{a}.expert_used_count")
    if not isinstance(count, int) or not isinstance(used, int) or not 0 < used <= count:
        raise ValueError(f"{where}: metadata {a}.expert_count {count!r} and "
                         f"{a}.expert_used_count {used!r} must be 1 <= used <= count")
    gating = m.get(f"{a}.expert_gating_func")
    if gating not in (None, 1):
        raise ValueError(f"{where}: {a}.expert_gating_func {gating} (not 1, softmax); the "
                         "decoder routes by a softmax over the experts")
    scale = m.get(f"{a}.expert_weights_scale")
    if scale not in (None, 1, 1.0):
        raise ValueError(f"{where}: {a}.expert_weights_scale {scale}; the decoder does not "
                         "scale the routing weights")
    if "blk.0.ffn_gate.0.weight" in f.tensors:
        raise ValueError(f"{where}: its experts are one tensor each (blk.N.ffn_gate.J.weight, "
                         "llama.cpp's layout before 2024); LlamaDecoder reads stacked experts "
                         "(blk.N.ffn_gate_exps.weight): convert the model again")


def moe_config(f: GGUFFile) -> dict:
    """The mixture-of-experts fields of transformers' config for the file ({} for a dense
    one), which transformers' GGUF reading misses or gets from its class defaults:
    qwen3moe / qwen2moe ``moe_intermediate_size`` (``expert_feed_forward_length``),
    qwen2moe's ``shared_expert_intermediate_size``, their routing (llama.cpp renormalises the
    k weights for qwen3moe, not for qwen2moe: ``norm_topk_prob``), every layer sparse; llama
    with experts: Mixtral's ``num_local_experts`` of ``feed_forward_length``."""
    if not is_moe(f):
        return {}
    a, m = f.architecture, f.metadata
    count, used = m[f"{a}.expert_count"], m[f"{a}.expert_used_count"]
    if a == "llama":
        return {"model_type": "mixtral", "num_local_experts": count,
                "num_experts_per_tok": used}
    out = {"num_experts": count, "num_experts_per_tok": used,
           "moe_intermediate_size": m[f"{a}.expert_feed_forward_length"],
           "norm_topk_prob": a == "qwen3moe", "decoder_sparse_step": 1, "mlp_only_layers": []}
    if a == "qwen2moe":
        out["shared_expert_intermediate_size"] = m.get(
            f"{a}.expert_shared_feed_forward_length", 0)
    return out


def expert_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s mixture-of-experts tensors by GGUF name, shapes in torch order (llama.cpp's
    ``ffn_gate_inp`` {hidden, experts}, ``ffn_gate_exps`` {hidden, width, experts}, ...;
    ``ffn_gate_inp_shexp`` {hidden}, which a converter may also store as [1, hidden])."""
    p, h, e, w = f"blk.{i}.", cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out = {p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, w, h),
           p + "ffn_up_exps.weight": (e, w, h), p + "ffn_down_exps.weight": (e, h, w)}
    s = cfg.shared_expert_intermediate_size
    if s:
        out.update({p + "ffn_gate_shexp.weight": (s, h), p + "ffn_up_shexp.weight": (s, h),
                    p + "ffn_down_shexp.weight": (h, s), p + "ffn_gate_inp_shexp.weight": (h,)})
    return out


def _whole(f: GGUFFile, name: str) -> Part:
    """A 2-D tensor of the file as one ``Part`` (routers and the shared expert: no rows
    permuted)."""
    t = f.tensors[name]
    return Part(Blocks(t.kind, f.rows(name), t.shape[-1]), None, name)


def _expert_parts(f: GGUFFile, name: str, experts: int) -> list[Part]:
    """A 3-D tensor of ``experts`` stacked matrices as one ``Part`` per expert: a view of its
    slice of the file's blocks (rows [j * out, (j + 1) * out) of the stacked rows)."""
    t = f.tensors[name]
    rows, out = f.rows(name), t.shape[-2]
    return [Part(Blocks(t.kind, rows[j * out:(j + 1) * out], t.shape[-1]), None,
                 f"{name}[{j}]") for j in range(experts)]


def expert_matrices(f: GGUFFile, cfg: ModelConfig, i: int) -> dict[str, list[Part]]:
    """Layer ``i``'s ``MoEMLP.named_matrices`` (``router``, ``experts.{j}.{gate_up,down}``,
    ``shared.{gate_up,down}``, ``shared_gate``) as parts of the file's tensors, gate rows
    before up rows."""
    p, e = f"blk.{i}.", cfg.num_experts
    out = {"router": [_whole(f, p + "ffn_gate_inp.weight")]}
    gate, up, down = (_expert_parts(f, p + f"ffn_{x}_exps.weight", e)
                      for x in ("gate", "up", "down"))
    for j in range(e):
        out[f"experts.{j}.gate_up"] = [gate[j], up[j]]
        out[f"experts.{j}.down"] = [down[j]]
    if cfg.shared_expert_intermediate_size:
        out["shared.gate_up"] = [_whole(f, p + "ffn_gate_shexp.weight"),
                                 _whole(f, p + "ffn_up_shexp.weight")]
        out["shared.down"] = [_whole(f, p + "ffn_down_shexp.weight")]
        out["shared_gate"] = [_whole(f, p + "ffn_gate_inp_shexp.weight")]  # [1, hidden]
    return out
