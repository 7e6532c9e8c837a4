"""Tiny random GGUF files for the tests (gguf-py's writer): a Llama-family model of a few
layers, its matrices quantized by gguf-py, a byte-level BPE tokenizer of printable ASCII; and
random blocks of every type the kernels take.

    path = write_tiny_gguf(tmp_path / "m.gguf", arch="qwen2", kind="Q8_0")
    blocks = random_blocks("Q4_K", 40, inputs("Q4_K", 3))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.models.gguf import blocks as gb

KINDS = list(gb.BLOCK_BYTES)  # every GGUF type the kernels take
# byte offsets of each type's fp16 scales in its block (gguf-py's layouts), made finite below
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, out: int, inp: int, seed: int = 0) -> gb.Blocks:
    """``out`` rows of random blocks: small finite fp16 scales, any other bytes (quants, and a
    K-quant's packed sub-block scales)."""
    g = np.random.default_rng(seed)
    blk = g.integers(0, 256, (out, inp // gb.BLOCK_WIDTH[kind], gb.BLOCK_BYTES[kind]),
                     dtype=np.uint8)
    for at in FP16_AT[kind]:
        scale = (0.01 * g.standard_normal((out, blk.shape[1], 1))).astype(np.float16)
        blk[..., at:at + 2] = scale.view(np.uint8)
    return gb.Blocks(kind, torch.from_numpy(blk.reshape(out, -1)), inp)


def inputs(kind: str, blocks: int) -> int:
    """in_features of ``blocks`` blocks of 32; for a K-quant (whole blocks of 256) 1 + blocks
    // 3 of those (the tests stay fast)."""
    width = gb.BLOCK_WIDTH[kind]
    return blocks * width if width == gb.BLOCK else (1 + blocks // 3) * width


CHARS = [chr(c) for c in range(33, 127)]  # byte-level BPE's symbols for these bytes


@dataclass(frozen=True)
class TinyShape:
    layers: int = 2
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = len(CHARS) + 2  # printable ASCII + <s> + </s>

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def tensors(shape: TinyShape, arch: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (torch order) of every tensor of the model."""
    s, h, hd = shape, shape.hidden, shape.head_dim
    out = {"token_embd.weight": (s.vocab, h), "output_norm.weight": (h,)}
    if not tied:
        out["output.weight"] = (s.vocab, h)
    q, kv = s.heads * hd, s.kv_heads * hd
    for i in range(s.layers):
        p = f"blk.{i}."
        if arch == "phi3":  # q|k|v and gate|up fused in the file
            out.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
                        p + "attn_qkv.weight": (q + 2 * kv, h), p + "attn_output.weight": (h, q),
                        p + "ffn_up.weight": (2 * s.intermediate, h),
                        p + "ffn_down.weight": (h, s.intermediate)})
            continue
        out.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
                    p + "attn_q.weight": (s.heads * hd, h), p + "attn_k.weight": (s.kv_heads * hd, h),
                    p + "attn_v.weight": (s.kv_heads * hd, h),
                    p + "attn_output.weight": (h, s.heads * hd),
                    p + "ffn_gate.weight": (s.intermediate, h), p + "ffn_up.weight": (s.intermediate, h),
                    p + "ffn_down.weight": (h, s.intermediate)})
        if arch == "qwen2":
            out.update({p + "attn_q.bias": (s.heads * hd,), p + "attn_k.bias": (s.kv_heads * hd,),
                        p + "attn_v.bias": (s.kv_heads * hd,)})
        if arch == "qwen3":
            out.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
    return out


def write_tiny_gguf(path: Path, arch: str = "llama", kind: str = "Q8_0", tied: bool = True,
                    shape: TinyShape = TinyShape(), seed: int = 0, std: float = 0.1,
                    metadata: dict | None = None, kinds: dict[str, str] | None = None,
                    quantize: bool = True, name: str = "tiny",
                    tokenizer: Callable | None = None) -> Path:
    """A random model: matrices of ``kind`` (``kinds`` overrides by tensor name; quantized by
    gguf-py, or, not ``quantize``, random Q8_0 / Q4_1 blocks: 30x faster), vectors F32 (norms
    near 1); ``metadata`` overrides keys (e.g. a wrong ``llama.feed_forward_length``);
    ``tokenizer(writer)`` writes the tokenizer's keys (and any others) in place of the byte-level
    ASCII one (``shape.vocab`` tokens)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    keys = {f"{arch}.block_count": shape.layers, f"{arch}.context_length": 256,
            f"{arch}.embedding_length": shape.hidden,
            f"{arch}.feed_forward_length": shape.intermediate,
            f"{arch}.attention.head_count": shape.heads,
            f"{arch}.attention.head_count_kv": shape.kv_heads,
            f"{arch}.attention.key_length": shape.head_dim,
            f"{arch}.attention.value_length": shape.head_dim,
            f"{arch}.rope.freq_base": 10000.0,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{arch}.vocab_size": shape.vocab, **(metadata or {})}
    for k, v in keys.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    w.add_name(name)
    (tokenizer or ascii_tokenizer)(w)
    if arch == "phi3":  # Phi3Config's default pad token (32000) is past a tiny vocabulary
        w.add_pad_token_id(len(CHARS) + 1)
    for name, shp in tensors(shape, arch, tied).items():
        if len(shp) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shp)).astype(np.float32))
            continue
        k = (kinds or {}).get(name, kind)
        qtype = gguf.GGMLQuantizationType[k]
        if k in ("Q8_0", "Q4_1") and not quantize:  # random blocks: fast for big files
            w.add_tensor(name, _random_blocks(rng, k, shp, std), raw_dtype=qtype)
            continue
        values = (std * rng.standard_normal(shp)).astype(np.float32)
        if k == "F32":
            w.add_tensor(name, values)
        elif k == "F16":
            w.add_tensor(name, values.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ascii_tokenizer(w) -> None:
    """The default tokenizer: byte-level BPE of printable ASCII, <s> and </s>, no merges."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*CHARS, "<s>", "</s>"])
    w.add_token_types([1] * len(CHARS) + [3, 3])
    w.add_token_scores([0.0] * (len(CHARS) + 2))
    w.add_bos_token_id(len(CHARS))
    w.add_eos_token_id(len(CHARS) + 1)


def _random_blocks(rng, kind: str, shape: tuple[int, int], std: float) -> np.ndarray:
    """[rows, bytes per row] uint8 of random blocks whose values have about ``std``."""
    rows, nb = shape[0], shape[1] // 32
    if kind == "Q8_0":
        d = np.full((rows, nb, 1), std / 73, np.float16).view(np.uint8)
        q = rng.integers(-127, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([d, q], axis=-1).reshape(rows, -1)
    d = np.full((rows, nb, 1), std / 4.6, np.float16)
    m = (-7.5 * d).astype(np.float16)
    q = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    return np.concatenate([d.view(np.uint8), m.view(np.uint8), q], axis=-1).reshape(rows, -1)
