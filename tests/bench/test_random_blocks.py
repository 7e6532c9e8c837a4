"""specdec/bench/random_blocks.py: random GGUF blocks of every type, read back by gguf-py's
``dequantize`` (the oracle: it reads the K-quants it cannot write): finite values of the asked
mean and standard deviation, finite fp16 scales, the K-quants' scale packing as gguf-py unpacks
it, and clear errors for what cannot be written."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K, dequantize

from specdec.bench.random_blocks import pack_k_scales, random_blocks, supported_types

ALL = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def test_every_engine_type_is_written():
    assert set(supported_types()) == set(ALL)


@pytest.mark.parametrize("kind", ALL, ids=lambda k: k.name)
@pytest.mark.parametrize("std", [0.02, 0.5])
def test_blocks_dequantize_to_the_asked_scale(kind, std):
    rows, cols = 64, 1024
    blocks = random_blocks(np.random.default_rng(1), kind, rows, cols, std)
    block, nbytes = GGML_QUANT_SIZES[kind]
    assert blocks.dtype == np.uint8 and blocks.shape == (rows, cols // block * nbytes)
    w = dequantize(blocks, kind)
    assert w.shape == (rows, cols) and np.isfinite(w).all()
    # Q8_0 / Q4_1 keep the first writer's scale (its jitter's own spread not divided out: +6 %)
    assert 0.95 * std < w.std() < (1.1 if kind in (Q.Q8_0, Q.Q4_1) else 1.05) * std
    assert abs(w.mean()) < 0.02 * std
    assert len(np.unique(w)) > 1000  # not a few repeated values


@pytest.mark.parametrize("kind", ALL, ids=lambda k: k.name)
def test_seeded_and_varied(kind):
    a = random_blocks(np.random.default_rng(5), kind, 4, 256, 0.02)
    b = random_blocks(np.random.default_rng(5), kind, 4, 256, 0.02)
    c = random_blocks(np.random.default_rng(6), kind, 4, 256, 0.02)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_k_scales_pack_as_gguf_py_unpacks_them():
    rng = np.random.default_rng(0)
    sc, m = rng.integers(0, 64, (50, 8)), rng.integers(0, 64, (50, 8))
    sc[0], m[0] = 63, 0  # the extremes of 6 bits
    got_sc, got_m = Q4_K.get_scale_min(pack_k_scales(sc, m))
    assert np.array_equal(got_sc.reshape(50, 8), sc)
    assert np.array_equal(got_m.reshape(50, 8), m)


def test_k_quant_sub_blocks_are_centred_and_varied():
    """Each Q4_K sub-block's mean is within a step of 0 (m_j = sc_j +- 1), and the sub-block
    scales differ (not one scale copied)."""
    blocks = random_blocks(np.random.default_rng(2), Q.Q4_K, 16, 2048, 0.02)
    w = dequantize(blocks, Q.Q4_K).reshape(-1, 32)
    d = blocks.reshape(-1, 144)[:, :2].copy().view(np.float16).astype(np.float32)
    step = np.repeat(d[:, 0], 8)  # d of each sub-block's super-block
    assert (np.abs(w.mean(axis=1)) < 62 * 3 * step).all()
    assert w.std(axis=1).std() > 0.1 * w.std(axis=1).mean()


def test_scales_are_finite_fp16():
    d = random_blocks(np.random.default_rng(3), Q.Q6_K, 8, 4096, 0.02)[:, -2:]
    assert np.isfinite(d.copy().view(np.float16)).all()


def test_bad_requests_say_what_is_allowed():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"no random blocks of type IQ2_XS \(allowed: .*Q4_K"):
        random_blocks(rng, Q.IQ2_XS, 1, 256, 0.02)
    with pytest.raises(ValueError, match="Q4_K blocks hold 256 values: a row of 576"):
        random_blocks(rng, Q.Q4_K, 1, 576, 0.02)
    with pytest.raises(ValueError, match="std must be a finite number > 0"):
        random_blocks(rng, Q.Q8_0, 1, 32, float("nan"))
