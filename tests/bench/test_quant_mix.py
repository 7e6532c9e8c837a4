"""specdec/bench/quant_mix.py: llama.cpp's per-tensor type choice. The expected types are
written out by hand from ggml-org/llama.cpp src/llama-quant.cpp (``llama_tensor_get_type_impl``,
``tensor_type_fallback``): in a Q4_K_M file of 24 or 32 layers half the attn_v / ffn_down
tensors are Q6_K, the rest Q4_K, the output (or a tied embedding) Q6_K, an untied token_embd
Q4_K."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType

from specdec.bench.quant_mix import fallback, file_type, tensor_type, use_more_bits

# use_more_bits(i, n): i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2
MORE_BITS_24 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
MORE_BITS_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}


@pytest.mark.parametrize("n, expected", [(24, MORE_BITS_24), (32, MORE_BITS_32),
                                         (8, {0, 3, 6, 7}), (2, {1})])
def test_use_more_bits(n, expected):
    assert {i for i in range(n) if use_more_bits(i, n)} == expected


@pytest.mark.parametrize("n", [24, 32])
def test_q4_k_m_layers(n):
    more = MORE_BITS_24 if n == 24 else MORE_BITS_32
    for i in range(n):
        for role in ("attn_v", "ffn_down"):
            want = Q.Q6_K if i in more else Q.Q4_K
            assert tensor_type("q4_k_m", role, i, n, 4096, tied=False) == want, (role, i)
        for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert tensor_type("q4_k_m", role, i, n, 4096, tied=False) == Q.Q4_K
        for role in ("attn_norm", "ffn_norm"):
            assert tensor_type("q4_k_m", role, i, n, 4096, tied=False) == Q.F32


def test_output_and_embedding():
    assert tensor_type("q4_k_m", "output", None, 32, 4096, tied=False) == Q.Q6_K
    assert tensor_type("q4_k_m", "token_embd", None, 32, 4096, tied=False) == Q.Q4_K
    assert tensor_type("q4_k_m", "token_embd", None, 24, 2048, tied=True) == Q.Q6_K
    assert tensor_type("q5_k_m", "token_embd", None, 32, 4096, tied=False) == Q.Q5_K
    assert tensor_type("q4_k_m", "output_norm", None, 24, 2048, tied=True) == Q.F32
    # a row that 256 does not divide: the output goes Q8_0 (in the mix, before any fallback)
    assert tensor_type("q4_k_m", "token_embd", None, 30, 576, tied=True) == Q.Q8_0
    assert tensor_type("q4_k_m", "token_embd", None, 30, 576, tied=False) == Q.Q5_0


def test_fallbacks_for_rows_256_does_not_divide():
    """SmolLM2-135M's hidden 576: Q4_K -> Q5_0, Q6_K -> Q8_0, Q5_K -> Q5_1; 1536 = 6 * 256 fits."""
    assert tensor_type("q4_k_m", "attn_q", 0, 30, 576, tied=True) == Q.Q5_0
    assert tensor_type("q4_k_m", "attn_v", 0, 30, 576, tied=True) == Q.Q8_0
    assert tensor_type("q4_k_m", "ffn_down", 0, 30, 1536, tied=True) == Q.Q6_K
    assert tensor_type("q5_k_m", "attn_q", 0, 30, 576, tied=True) == Q.Q5_1
    assert fallback(Q.Q4_K, 48) == Q.F16  # not even 32 divides it
    with pytest.raises(ValueError, match="no fallback for Q8_0"):
        fallback(Q.Q8_0, 48)


def test_q8_0_is_q8_0_everywhere():
    for role, layer in (("token_embd", None), ("output", None), ("attn_v", 0), ("ffn_down", 5)):
        assert tensor_type("q8_0", role, layer, 24, 2048, tied=False) == Q.Q8_0


def test_file_types():
    assert file_type("q4_k_m") == LlamaFileType.MOSTLY_Q4_K_M == 15
    assert file_type("q8_0") == LlamaFileType.MOSTLY_Q8_0 == 7
    assert file_type("q5_k_m") == 17


def test_bad_input_names_what_is_allowed():
    with pytest.raises(ValueError, match=r"unknown ftype 'q3_k_s' \(allowed: q4_k_m, q5_k_m, q8_0"):
        tensor_type("q3_k_s", "attn_q", 0, 2, 256, tied=True)
    with pytest.raises(ValueError, match="unknown tensor role 'attn_qkv'"):
        tensor_type("q4_k_m", "attn_qkv", 0, 2, 256, tied=True)
    with pytest.raises(ValueError, match="token_embd and output are global"):
        tensor_type("q4_k_m", "attn_q", None, 2, 256, tied=True)


def test_mixture_of_experts_roles():
    """Routers stay F32; stacked experts take the default type, their down projection the
    ffn_down rule per layer; Mixtral's 8 experts bump attn_v / attn_k to Q8_0 and (q4_k_m)
    attn_output to Q5_K; 64 or 128 experts do not."""
    for i in range(8):
        more = i in {0, 3, 6, 7}
        for e in (8, 64, 128):
            assert tensor_type("q4_k_m", "ffn_gate_inp", i, 8, 2048, False, e) == Q.F32
            assert tensor_type("q4_k_m", "ffn_gate_exps", i, 8, 2048, False, e) == Q.Q4_K
            assert tensor_type("q4_k_m", "ffn_up_shexp", i, 8, 2048, False, e) == Q.Q4_K
            for role in ("ffn_down_exps", "ffn_down_shexp"):
                assert tensor_type("q4_k_m", role, i, 8, 768, False, e) == (
                    Q.Q6_K if more else Q.Q4_K)
            assert tensor_type("q4_k_m", "attn_q_norm", i, 8, 128, False, e) == Q.F32
        assert tensor_type("q4_k_m", "attn_v", i, 8, 4096, False, 8) == Q.Q8_0
        assert tensor_type("q4_k_m", "attn_k", i, 8, 4096, False, 8) == Q.Q8_0
        assert tensor_type("q4_k_m", "attn_output", i, 8, 4096, False, 8) == Q.Q5_K
        assert tensor_type("q5_k_m", "attn_output", i, 8, 4096, False, 8) == Q.Q5_K
        assert tensor_type("q4_k_m", "attn_output", i, 8, 4096, False, 64) == Q.Q4_K
        assert tensor_type("q4_k_m", "attn_k", i, 8, 4096, False, 128) == Q.Q4_K
    # experts 1024 wide take Q4_K; a width 256 does not divide falls back as a dense matrix
    assert tensor_type("q4_k_m", "ffn_down_exps", 2, 8, 1408, False, 60) == Q.Q5_0
