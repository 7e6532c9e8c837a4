"""A sharded LlamaDecoder (specdec.distributed.shard_model) at 2 and 3 ranks on gloo, against the
unsharded model; and the GGUF-block slices the kernels run.

What they show:
- tiny random Llama (12 heads over 6 KV heads, q|k|v bias, untied head), Qwen3 (12 over 6,
  q/k norms, tied embedding) and an MQA Llama (12 over 1: the KV head replicated on every
  rank), float64 and float32: each rank's dense and paged forwards (the paged one with a KV
  cache of the rank's KV heads) give rank 0 the unsharded model's hidden states and logits
  (float64 to 1e-12, float32 to 1e-5 of the values' scale), the embedding exactly, every
  rank the same bits; with the compiled row-invariant CPU kernels (float32, installed after
  sharding: the shard refuses their layer call and runs its layers through their matmuls) a
  row's bits do not depend on the other rows of the step, as the unsharded model's do not.
  Plain F.linear is not row-invariant on this CPU (its BLAS picks a kernel by the row count:
  a row's bits change between 1, 6 and 18 rows, in float64 and float32): those cases check
  it on the unsharded model and skip;
- a row slice / column slice of a ``BlockWeight`` (Q8_0, Q4_K, bf16 rows; fused parts of
  different types, a part with a row order) dequantizes bitwise to the float matrix's slice,
  and the compiled kernels run the sliced blocks as they run the same values in float32;
- what is refused: a plan of another model, a second shard, kernels installed first, a
  block-unaligned cut of o / down (naming weights="dequantized").
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.nn.functional as F
import tp_model_workers
from conftest import make_tiny_model

from specdec.distributed import launch, plan_tensor_parallel
from specdec.distributed.shard_model import rank_config, shard_decoder, take_columns, take_rows
from specdec.models.checkpoints.quantize import quantize_matrix
from specdec.models.gguf.block_weight import BlockWeight, Part
from specdec.models.gguf.blocks import Blocks
from specdec.models.loader import load_model

# every test here that spawns ranks runs on one xdist worker, one after the other
pytestmark = pytest.mark.xdist_group("distributed_spawn")

TIMEOUT_S = 60.0
# (dtype, linear kernels): plain F.linear in float64 / float32, the compiled ones in float32
MODES = (("float64", "plain"), ("float32", "plain"), ("float32", "invariant"))
SHAPE = dict(hidden_size=48, intermediate_size=96, num_attention_heads=12, head_dim=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {
        "llama": str(make_tiny_model(root / "llama", "llama", seed=1, num_key_value_heads=6,
                                     attention_bias=True, **SHAPE)),
        "qwen3": str(make_tiny_model(root / "qwen3", "qwen3", seed=2, num_key_value_heads=6,
                                     tie_word_embeddings=True, **SHAPE)),
        "mqa": str(make_tiny_model(root / "mqa", "llama", seed=3, num_key_value_heads=1,
                                   **SHAPE)),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def report(request, folders):
    """rank 0's report of tp_model_workers.model_checks at 2 and 3 ranks (every rank's own
    assertions passed, or a WorkerError names the rank that failed)."""
    world_size = request.param
    cases = [(folders[name], dtype, kernels) for name in ("llama", "qwen3", "mqa")
             for dtype, kernels in MODES]
    with launch(tp_model_workers.run_model_checks, world_size, args=(TIMEOUT_S, cases),
                timeout_s=TIMEOUT_S, threads_per_rank=1) as workers:
        with workers.group(backend="gloo") as group:
            found = tp_model_workers.model_checks(group, cases)
        workers.join()
    assert not multiprocessing.active_children()
    names = {folders[n]: n for n in folders}
    return world_size, {(names[f], d, k): v for (f, d, k), v in found.items()}


def test_each_rank_holds_its_share(report):
    n, found = report
    for (name, _, _), e in found.items():
        kv = 1 if name == "mqa" else 6
        assert e["tp_size"] == n and e["full_heads"] == 12
        assert e["num_heads"] == 12 // n and e["intermediate_size"] == 96 // n
        assert e["num_kv_heads"] == max(1, kv // n) and e["kv_replicated"] == (n > kv)
        q, kvs = 12 // n * 8, max(1, kv // n) * 8
        assert e["qkv_shape"] == (q + 2 * kvs, 48)
        assert e["o_shape"] == (48, q) and e["o_contiguous"]
        assert e["down_shape"] == (48, 96 // n)
        assert "tensor-parallel" in e["refusal"] and not e["fused"]


@pytest.mark.parametrize("dtype,kernels,tol", [("float64", "plain", 1e-12),
                                               ("float32", "plain", 1e-5),
                                               ("float32", "invariant", 1e-5)])
def test_rank_0_gets_the_unsharded_models_outputs(report, dtype, kernels, tol):
    n, found = report
    for name in ("llama", "qwen3", "mqa"):
        e = found[(name, dtype, kernels)]
        assert e["embedded_equal"], (name, dtype)
        for out, diff in e["diff"].items():
            assert diff <= tol * max(1.0, e["scale"][out]), (name, dtype, out, diff)


def test_with_the_compiled_kernels_a_rows_bits_do_not_depend_on_the_other_rows(report):
    """The unsharded model is row-invariant with them, and so is every shard (prefill and
    decode rows of A alone == among B and C), through the exact all-reduce."""
    n, found = report
    for name in ("llama", "qwen3", "mqa"):
        e = found[(name, "float32", "invariant")]
        assert all(e["full_invariant"].values()), (name, e["full_invariant"])
        assert all(e["invariant"].values()), (name, e["invariant"])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_with_plain_f_linear_row_invariance_survives_where_f_linear_has_it(report, dtype):
    """Where plain F.linear is row-invariant (checked on the unsharded model first: if it is
    not, sharding cannot make it so; on this CPU it is not), so is the sharded model."""
    n, found = report
    for name in ("llama", "qwen3", "mqa"):
        e = found[(name, dtype, "plain")]
        if not all(e["full_invariant"].values()):
            pytest.skip(f"plain F.linear is not row-invariant in {dtype} on this CPU "
                        f"({name}: {e['full_invariant']})")
        assert all(e["invariant"].values()), (name, dtype, e["invariant"])


# ---------------------------------------------------------------- GGUF blocks (no ranks)

def random_blocks(out: int, k: int, kind: str, seed: int) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    return quantize_matrix(torch.randn(out, k, generator=g), kind)


def half_blocks(out: int, k: int, seed: int) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    return Blocks("BF16", torch.randn(out, k, generator=g).bfloat16().view(torch.uint8), k)


def fused_weight(k: int) -> BlockWeight:
    """A q|k|v-like matrix of three parts: Q4_K, Q8_0 with a row order, bf16 rows."""
    q = Part(random_blocks(24, k, "Q4_K", 1), None, "q")
    order = torch.randperm(16, generator=torch.Generator().manual_seed(4))
    kpart = Part(random_blocks(16, k, "Q8_0", 2), order, "k")
    v = Part(half_blocks(16, k, 3), None, "v")
    return BlockWeight([q, kpart, v], "qkv")


def test_block_rows_and_columns_dequantize_to_the_float_slices():
    w = fused_weight(512)
    full = w.dequantize()
    spans = ((4, 20), (26, 34), (40, 52))  # across parts, parts of parts
    rows = take_rows(w, spans)
    assert isinstance(rows, BlockWeight) and rows.shape == (16 + 8 + 12, 512)
    want = torch.cat([full[a:b] for a, b in spans])
    assert torch.equal(rows.dequantize(), want)
    assert all(p.order is None for p in rows.parts)
    assert rows.stored_bytes < w.stored_bytes  # only the rank's rows are kept
    cols = take_columns(w, (256, 512))  # whole Q4_K blocks (256), Q8_0 (32), bf16 (1)
    assert isinstance(cols, BlockWeight) and cols.shape == (56, 256)
    assert torch.equal(cols.dequantize(), full[:, 256:512])
    assert all(p.blocks.rows.is_contiguous() for p in cols.parts)
    with pytest.raises(ValueError, match="whole Q4_K blocks"):
        take_columns(w, (32, 64))  # fine for Q8_0, not for Q4_K
    q8 = BlockWeight([Part(random_blocks(8, 96, "Q8_0", 5))], "o")
    assert torch.equal(take_columns(q8, (32, 64)).dequantize(), q8.dequantize()[:, 32:64])


def test_the_compiled_kernels_run_the_sliced_blocks():
    from specdec import native
    from specdec.models.gguf.weights import native_runs, prepare_runs
    from specdec.models.matmul.prepared import PreparedLinears

    kernels = native.load()
    if kernels is None:
        pytest.skip("the compiled CPU kernels are not built here")
    w = BlockWeight([Part(random_blocks(32, 512, "Q4_K", 6), None, "gate"),
                     Part(random_blocks(32, 512, "Q4_K", 7), None, "up")], "gate_up")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8))
    for sliced in (take_columns(w, (256, 512)), take_rows(take_columns(w, (0, 256)),
                                                          ((16, 32), (48, 64)))):
        mm = PreparedLinears(kernels)
        mm.adopt(sliced, prepare_runs(native_runs(sliced)))
        got = mm(x, sliced, None)
        want = PreparedLinears(kernels)(x, sliced.dequantize(), None)  # float32 panels
        assert torch.equal(got, want)
        torch.testing.assert_close(got, F.linear(x, sliced.dequantize()), rtol=1e-5, atol=1e-5)


def block_model(folder):
    """The tiny model with its layer matrices as Q8_0 blocks (K multiples of 32)."""
    model, cfg, _ = load_model(folder, torch.float32, "cpu", 64)
    with torch.no_grad():
        for layer in model.layers:
            for attr in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
                blocks = quantize_matrix(getattr(layer, attr), "Q8_0")
                setattr(layer, attr, torch.nn.Parameter(BlockWeight([Part(blocks)], attr),
                                                        requires_grad=False))
    return model, cfg


@pytest.fixture(scope="module")
def q8_folder(tmp_path_factory) -> str:
    # hidden 96, q_size 96 (12 x 8), MLP 192: every K a multiple of 32
    return str(make_tiny_model(tmp_path_factory.mktemp("q8") / "m", "llama", seed=9,
                               hidden_size=96, intermediate_size=192, num_attention_heads=12,
                               head_dim=8, num_key_value_heads=6))


def test_a_block_model_shards_into_blocks_bitwise_the_float_slices(q8_folder):
    model, cfg = block_model(q8_folder)
    floats = {a: getattr(model.layers[0], a).dequantize()
              for a in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")}
    plan = plan_tensor_parallel(cfg, 3)
    shard_decoder(model, plan, 1, lambda t: t)
    r = plan.ranks[1]
    layer = model.layers[0]
    assert all(isinstance(getattr(layer, a), BlockWeight) for a in floats)
    assert torch.equal(layer.qkv_weight.dequantize(),
                       torch.cat([floats["qkv_weight"][a:b] for a, b in r.qkv_rows]))
    assert torch.equal(layer.gate_up_weight.dequantize(),
                       torch.cat([floats["gate_up_weight"][a:b] for a, b in r.gate_up_rows]))
    assert torch.equal(layer.o_weight.dequantize(), floats["o_weight"][:, slice(*r.o_cols)])
    assert torch.equal(layer.down_weight.dequantize(),
                       floats["down_weight"][:, slice(*r.down_cols)])
    assert model.cfg == rank_config(cfg, plan) and layer.cfg == model.cfg


def test_a_block_unaligned_cut_is_refused_naming_dequantized_weights(q8_folder):
    model, cfg = block_model(q8_folder)
    plan = plan_tensor_parallel(cfg, 2)  # o's K 96 in shares of 48: not whole Q8_0 blocks
    with pytest.raises(ValueError, match=r'o_proj.*block size 32.*weights="dequantized"'):
        shard_decoder(model, plan, 0, lambda t: t)
    assert model.tp_size == 1 and model.layers[0].o_weight.shape == (96, 96)  # untouched


def test_refusals(folders):
    model, cfg, _ = load_model(folders["llama"], torch.float64, "cpu", 64)
    other, other_cfg, _ = load_model(folders["mqa"], torch.float64, "cpu", 64)
    with pytest.raises(ValueError, match="not this model's"):
        shard_decoder(model, plan_tensor_parallel(other_cfg, 2), 0, lambda t: t)
    with pytest.raises(ValueError, match="rank=2 is outside"):
        shard_decoder(model, plan_tensor_parallel(cfg, 2), 2, lambda t: t)
    other.matmul = lambda x, w, b: F.linear(x, w, b)
    with pytest.raises(ValueError, match="before installing kernels"):
        shard_decoder(other, plan_tensor_parallel(other_cfg, 2), 0, lambda t: t)
    shard_decoder(model, plan_tensor_parallel(cfg, 2), 0, lambda t: t)
    with pytest.raises(ValueError, match="sharded already"):
        shard_decoder(model, plan_tensor_parallel(cfg, 2), 0, lambda t: t)


def test_tp_1_is_the_plain_model_bitwise(folders):
    model, cfg, _ = load_model(folders["qwen3"], torch.float32, "cpu", 64)
    ids = torch.tensor([tp_model_workers.DENSE_IDS[0]])
    with torch.inference_mode():
        before = model.forward_dense(ids).hidden
    shard_decoder(model, plan_tensor_parallel(cfg, 1), 0, lambda t: t + 1)
    assert all(layer.reduce is None for layer in model.layers)
    assert model.compiled_refusal() is None
    with torch.inference_mode():
        assert torch.equal(model.forward_dense(ids).hidden, before)
