"""The TP plan of a ModelConfig, checked before any process starts: SmolLM2-135M's numbers
(9 heads over 3 KV heads, head_dim 64, hidden 576, intermediate 1536) and tiny configs (12
heads over 6 KV heads; N beyond the KV heads: replication)."""

from __future__ import annotations

import dataclasses

import pytest

from specdec.distributed.sharding import (
    GGUF_BLOCK_SIZES,
    block_size,
    check_row_parallel_split,
    plan_tensor_parallel,
    row_parallel_sizes,
    tp_sizes_that_work,
)
from specdec.models.decoder.config import ModelConfig

SMOLLM2 = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    max_position_embeddings=8192, sliding_window=None, eos_token_ids=(2,))


def tiny(heads=12, kv=6, head_dim=8, intermediate=96, model_type="llama") -> ModelConfig:
    return dataclasses.replace(SMOLLM2, model_type=model_type, hidden_size=heads * head_dim,
                               num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                               intermediate_size=intermediate, qk_norm=model_type == "qwen3")


def covers(spans, total):
    """The spans tile [0, total) in order, without gaps or overlaps."""
    edge = 0
    for start, stop in spans:
        assert start == edge and stop > start
        edge = stop
    assert edge == total


def check_consistent(cfg: ModelConfig, n: int):
    """Shards tile each split matrix; each rank's query heads read only its KV heads."""
    plan = plan_tensor_parallel(cfg, n)
    hd, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    covers([r.q_rows for r in plan.ranks], cfg.num_heads * hd)
    covers([r.gate_rows for r in plan.ranks], cfg.intermediate_size)
    covers([r.down_cols for r in plan.ranks], cfg.intermediate_size)
    covers([r.o_cols for r in plan.ranks], cfg.num_heads * hd)
    for r in plan.ranks:
        kv0, kv1 = r.kv_heads
        assert kv1 - kv0 == plan.kv_heads_per_rank == max(1, cfg.num_kv_heads // n)
        assert all(kv0 <= h // group < kv1 for h in range(*r.q_heads))
        assert r.k_rows == r.v_rows == (kv0 * hd, kv1 * hd)
        q, k, v = r.qkv_rows
        assert q == r.q_rows and k[0] == cfg.q_size + r.k_rows[0]
        assert v[0] == cfg.q_size + cfg.kv_size + r.v_rows[0]
        gate, up = r.gate_up_rows
        assert gate == r.gate_rows and up == (gate[0] + cfg.intermediate_size,
                                               gate[1] + cfg.intermediate_size)
    if not plan.kv_replicated:
        covers([r.kv_heads for r in plan.ranks], cfg.num_kv_heads)
    return plan


def test_smollm2_at_tp3_gives_each_rank_3_heads_and_its_kv_head():
    plan = check_consistent(SMOLLM2, 3)
    assert (plan.heads_per_rank, plan.kv_heads_per_rank, plan.intermediate_per_rank) == (3, 1, 512)
    assert not plan.kv_replicated
    r1 = plan.ranks[1]
    assert (r1.q_heads, r1.kv_heads) == ((3, 6), (1, 2))
    assert (r1.q_rows, r1.k_rows, r1.v_rows) == ((192, 384), (64, 128), (64, 128))
    assert (r1.gate_rows, r1.up_rows, r1.o_cols, r1.down_cols) == (
        (512, 1024), (512, 1024), (192, 384), (512, 1024))
    assert r1.qkv_rows == ((192, 384), (640, 704), (832, 896))
    assert r1.gate_up_rows == ((512, 1024), (2048, 2560))


def test_smollm2_at_tp2_is_refused_naming_the_heads_and_the_sizes_that_work():
    with pytest.raises(ValueError) as info:
        plan_tensor_parallel(SMOLLM2, 2)
    assert str(info.value).startswith(
        "tensor_parallel_size=2 does not divide num_heads=9 of this model; sizes that work: 1, 3")
    # 9 divides the heads but not intermediate_size=1536
    with pytest.raises(ValueError, match="tensor_parallel_size=9 does not divide "
                                         "intermediate_size=1536 of this model; sizes that "
                                         "work: 1, 3"):
        plan_tensor_parallel(SMOLLM2, 9)
    assert tp_sizes_that_work(SMOLLM2) == [1, 3]


def test_smollm2_quantized_row_parallel_matrices():
    # its own Q4_1 / Q8_0 blocks (32): o's K share 576 / 3 = 192, down's 1536 / 3 = 512
    blocks = {"o_proj": block_size("Q4_1"), "down_proj": block_size("Q8_0")}
    check_consistent(SMOLLM2, 3)
    plan_tensor_parallel(SMOLLM2, 3, blocks)
    # a K-quant o_proj (256): 192 is not a whole number of blocks
    with pytest.raises(ValueError, match="tensor_parallel_size=3 cuts K=576 of o_proj into "
                                         "shares of 192, not a multiple of its block size 256; "
                                         "sizes that work: 1 "):
        plan_tensor_parallel(SMOLLM2, 3, {"o_proj": block_size("Q4_K")})
    plan_tensor_parallel(SMOLLM2, 3, {"down_proj": block_size("Q6_K")})  # 512 = 2 x 256


def test_check_row_parallel_split_names_the_matrix_k_and_the_sizes_that_work():
    check_row_parallel_split("down_proj", 1536, 3, 256)
    check_row_parallel_split("o_proj", 576, 1, 256)  # no cut: any matrix
    check_row_parallel_split("o_proj", 576, 2, 1)  # float: any divisor
    with pytest.raises(ValueError) as info:
        check_row_parallel_split("o_proj", 576, 2, 256)
    assert str(info.value) == (
        "tensor_parallel_size=2 cuts K=576 of o_proj into shares of 288, not a multiple of its "
        "block size 256 (a row-parallel matrix is split at block boundaries); sizes that work "
        "for o_proj: 1")
    with pytest.raises(ValueError, match="does not divide K=4096 of down_proj .*sizes that work "
                                         "for down_proj: 1, 2, 4, 8, 16, 32, 64, 128$"):
        check_row_parallel_split("down_proj", 4096, 3, 32)
    assert row_parallel_sizes(1536, 256) == [1, 2, 3, 6]
    assert row_parallel_sizes(576, 32) == [1, 2, 3, 6, 9, 18]
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        check_row_parallel_split("o_proj", 576, 0, 32)


def test_block_sizes_agree_with_the_gguf_types_specdec_reads():
    from specdec.models.gguf.types import TYPES

    for name, t in TYPES.items():
        assert block_size(name) == GGUF_BLOCK_SIZES[name] == t.width
    assert block_size("q4_k") == 256 and block_size("F16") == 1
    with pytest.raises(ValueError, match="unknown GGUF type 'Q9_9'"):
        block_size("Q9_9")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_12_heads_over_6_kv_heads_split_the_kv_heads(model_type, n):
    plan = check_consistent(tiny(model_type=model_type), n)
    assert not plan.kv_replicated
    assert plan.kv_heads_per_rank == 6 // n
    assert [r.kv_heads for r in plan.ranks] == [(i * 6 // n, (i + 1) * 6 // n) for i in range(n)]


def test_tp_beyond_the_kv_heads_replicates_them():
    plan = check_consistent(tiny(), 12)  # 12 ranks, 6 KV heads: each rank 1, shared by 2
    assert plan.kv_replicated and plan.kv_heads_per_rank == 1
    assert [r.kv_heads[0] for r in plan.ranks] == [r // 2 for r in range(12)]
    assert [plan.kv_head_of_rank(r) for r in range(12)] == [r // 2 for r in range(12)]
    plan = check_consistent(tiny(heads=4, kv=2, head_dim=8, intermediate=64), 4)
    assert plan.kv_replicated and [r.kv_heads for r in plan.ranks] == [
        (0, 1), (0, 1), (1, 2), (1, 2)]


def test_a_size_neither_dividing_nor_multiple_of_the_kv_heads_is_refused():
    cfg = tiny()  # 12 heads, 6 KV heads, intermediate 96
    with pytest.raises(ValueError, match="tensor_parallel_size=4 neither divides num_kv_heads=6 "
                                         "of this model .* nor is a multiple of it .*; sizes "
                                         "that work: 1, 2, 3, 6, 12 "):
        plan_tensor_parallel(cfg, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_size_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        plan_tensor_parallel(SMOLLM2, bad)


def test_an_unknown_row_parallel_matrix_is_refused():
    with pytest.raises(ValueError, match=r"names \['q_proj'\]"):
        plan_tensor_parallel(SMOLLM2, 3, {"q_proj": 32})


def test_tp1_is_the_whole_model():
    plan = check_consistent(SMOLLM2, 1)
    (r0,) = plan.ranks
    assert r0.q_rows == (0, 576) and r0.kv_heads == (0, 3) and r0.down_cols == (0, 1536)
