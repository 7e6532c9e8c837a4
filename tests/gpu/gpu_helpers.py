"""Shared by the GPU tests and the GPU bench: random paged attention steps, random-weight models
in real shapes, and the report the GPU run leaves under $OUT (nothing here needs a GPU to import).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.attention.metadata import AttentionMetadata, build_metadata
from specdec.tree import DraftTree, step_mask

# Real shapes with random weights: speed does not depend on the weights (acceptance, which does,
# is measured on the CPU with the real model).
SHAPES = {
    # SmolLM2-135M-Instruct
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    # Llama-3.2-1B (plain RoPE: the llama3 frequency scaling does not change the cost)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    # small enough for the correctness tests, head_dim 64 as flashinfer's kernels want, 4
    # layers as EAGLE-3's default feature layers want
    "tiny-gpu": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                     rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
}


def make_model(folder: Path, shape: str, seed: int = 0) -> Path:
    """A random-weight Llama folder (config.json + safetensors, bf16) in one of SHAPES; made on
    the GPU when there is one (fast init), reused when it exists."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    vocab = SHAPES[shape]["vocab_size"]
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, bos_token_id=0,
                         eos_token_id=vocab - 1, pad_token_id=None)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@dataclass
class Step:
    """One random paged attention step: its metadata and the inputs of one layer."""

    md: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    kinds: list[str]  # per request: "prefill", "chunk", "decode" or "tree"


def random_step(gen: torch.Generator, kinds: list[str], num_pages: int, page_size: int,
                heads: tuple[int, int, int], device, dtype, chain: bool = False) -> Step:
    """Requests of the given kinds over shuffled pages: a whole prompt (qo = kv), a chunk after
    cached tokens (qo < kv), a decode row, or a decode row plus a random draft tree (a chain
    when ``chain``); the trees get their masks, the others None (causal)."""
    h, hkv, d = heads
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, kv_lens, qo_lens, masks = [], [], [], []
    for kind in kinds:
        cached = int(torch.randint(1, 5 * page_size, (1,), generator=gen))
        if kind == "prefill":
            qo, kv, mask = cached, cached, None
        elif kind == "chunk":
            qo = int(torch.randint(2, 3 * page_size, (1,), generator=gen))
            qo, kv, mask = qo, cached + qo, None
        elif kind == "decode":
            qo, kv, mask = 1, cached + 1, None
        else:
            tree = _random_tree(gen, int(torch.randint(1, 12, (1,), generator=gen)), chain)
            n = tree.num_nodes
            qo, kv = 1 + n, cached + 1 + n
            mask = step_mask(tree, cached, cached + 1)
        pages = -(-kv // page_size)
        assert len(perm) >= pages, "not enough pages for this step"
        tables.append([perm.pop() for _ in range(pages)])
        kv_lens.append(kv)
        qo_lens.append(qo)
        masks.append(mask)
    md = build_metadata(tables, kv_lens, qo_lens, page_size, masks, device)
    t = sum(qo_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return Step(md, randn(t, h, d), randn(t, hkv, d), randn(t, hkv, d), list(kinds))


def _random_tree(gen: torch.Generator, n: int, chain: bool) -> DraftTree:
    tokens = torch.randint(0, 100, (n,), generator=gen)
    if chain:
        return DraftTree.chain(tokens)
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree(tokens, torch.tensor(parents))


def random_cache(gen: torch.Generator, num_pages: int, page_size: int, hkv: int, d: int,
                 device, dtype) -> torch.Tensor:
    return torch.randn(num_pages, 2, page_size, hkv, d, generator=gen).to(device=device,
                                                                          dtype=dtype)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float32."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


class Report:
    """Appends one JSON line per record to $SPECDEC_GPU_REPORT (when set): what the GPU checks
    measured, for the report the run leaves under $OUT."""

    def __init__(self, path: str | None = None) -> None:
        path = path or os.environ.get("SPECDEC_GPU_REPORT")
        self.path = Path(path) if path else None

    def add(self, section: str, **values) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"section": section, "time": time.time(), **values}) + "\n")
