"""Malformed arguments to the compiled kernels (specdec/native/__init__.py): a Python exception
naming the kernel, the shape and what is allowed, before any kernel runs, never a read out of
bounds: wrong inner dim, 0-d, 1-d, 3-d, not contiguous, wrong dtype or device, bad panels, key
lists out of range, a fused step's tensors."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import random_blocks
from native_helpers import KERNELS, needs_kernels

from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa
from specdec.native import Panels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def panels() -> dict[str, Panels]:
    w = torch.randn(20, 64)
    b = random_blocks("Q8_0", 20, 64)
    return {"float32": KERNELS.prepare(w), "bfloat16": KERNELS.prepare(w.bfloat16()),
            "Q8_0": gb.prepare(b), "Q8_0+q8": qa.prepare(b)}


BAD_X = [  # (x, exception, the shape the message names)
    (torch.randn(3, 65), ValueError, "(3, 65)"),
    (torch.randn(3, 63), ValueError, "(3, 63)"),
    (torch.tensor(1.0), ValueError, "shape ()"),
    (torch.randn(65), ValueError, "(65,)"),
    (torch.randn(2, 3, 32), ValueError, "(2, 3, 32)"),
    (torch.randn(0, 65), ValueError, "(0, 65)"),
    (torch.randn(64, 3).T, ValueError, "(3, 64) torch.float32 on cpu, not contiguous"),
    (torch.randn(2, 64, 3).transpose(1, 2), ValueError, "(2, 3, 64)"),
    (torch.randn(3, 64, dtype=torch.float64), TypeError, "(3, 64) torch.float64"),
    (torch.randn(3, 64).bfloat16(), TypeError, "(3, 64) torch.bfloat16"),
    (torch.ones(3, 64, dtype=torch.int32), TypeError, "(3, 64) torch.int32"),
    (torch.empty(3, 64, device="meta"), ValueError, "(3, 64) torch.float32 on meta"),
]


@needs_kernels
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "Q8_0", "Q8_0+q8"])
@pytest.mark.parametrize("x, error, shape", BAD_X, ids=[s for _, _, s in BAD_X])
def test_linear_refuses_what_it_cannot_read(panels, fmt, x, error, shape):
    with pytest.raises(error, match="sd_linear: x of ") as e:
        KERNELS.linear(x, panels[fmt])
    assert shape in str(e.value) and "allowed: [..., 64] float32" in str(e.value)


@needs_kernels
def test_linear_refuses_what_is_not_panels(panels):
    with pytest.raises(TypeError, match="sd_linear: w is a Tensor, not Panels"):
        KERNELS.linear(torch.randn(2, 64), torch.randn(20, 64))
    p = panels["Q8_0"]
    assert p.data.numel() == p.panels // 2 * 2 * 544  # pairs x blocks x bytes
    for change, what in [(dict(data=p.data[:-1]), f"must hold {p.data.numel()} elements"),
                         (dict(in_features=96), f"must hold {p.panels // 2 * 3 * 544} "),
                         (dict(in_features=48), "in_features % 32 == 0"),
                         (dict(panels=3), "an even number (>= 2) of panels"),
                         (dict(out_features=17, panels=2), "covering 17 rows"),
                         (dict(out_features=0), "at least one input and one output"),
                         (dict(fmt=19), "format 19 is not one of"),
                         (dict(data=p.data.view(-1)[::2]), "contiguous on the CPU")]:
        fields = dict(data=p.data, out_features=p.out_features, in_features=p.in_features,
                      fmt=p.fmt, panels=p.panels) | change
        with pytest.raises(ValueError, match="Panels of a") as e:
            Panels(**fields)
        assert what in str(e.value), str(e.value)
    for w in (torch.empty(0, 8), torch.empty(8, 0), torch.empty(4, 8, device="meta")):
        with pytest.raises(ValueError, match=r"panels need a .*" + str(tuple(w.shape))[1:-1]):
            KERNELS.prepare(w)


def _attention_args() -> list:
    """3 rows of 4 heads of 16 over 10 K rows (V rows 10 later), keys 0-1, 2-3, 4-5."""
    return [torch.randn(3, 4, 16), torch.randn(20, 2, 16), 10, torch.tensor([0, 2, 4, 6]),
            torch.tensor([0, 1, 2, 3, 4, 5]), 10, 0.25]


BAD_ATTENTION = [  # (argument index, value, exception, text of the message)
    (0, torch.randn(3, 64), ValueError, "q of shape (3, 64)"),
    (0, torch.randn(3, 4, 12), ValueError, "q of shape (3, 4, 12)"),
    (0, torch.randn(3, 4, 16).double(), TypeError, "q of shape (3, 4, 16) torch.float64"),
    (0, torch.randn(4, 3, 16).transpose(0, 1), ValueError, "not contiguous"),
    (1, torch.randn(20, 2, 8), ValueError, "kv_rows of shape (20, 2, 8)"),
    (1, torch.randn(20, 3, 16), ValueError, "kv_rows of shape (20, 3, 16)"),
    (1, torch.randn(20, 0, 16), ValueError, "kv_rows of shape (20, 0, 16)"),
    (1, torch.ones(20, 2, 16, dtype=torch.int8), TypeError, "kv_rows of shape (20, 2, 16)"),
    (2, 21, ValueError, "v_offset 21"),
    (3, torch.tensor([0, 2, 4]), ValueError, "key_indptr of shape (3,)"),
    (3, torch.tensor([0, 2, 4, 3]), ValueError, "row 2's key list"),
    (3, torch.tensor([0, 2, 4, 99]), ValueError, "row 2's key list"),
    (3, torch.tensor([0, 2, 4, 6], dtype=torch.int32), TypeError, "key_indptr of shape (4,)"),
    (4, torch.tensor([0, 1, 2, 3, 4, 10]), ValueError, "row 2's key list"),
    (4, torch.tensor([0, 1, -2, 3, 4, 5]), ValueError, "row 1's key list"),
    (5, 1, ValueError, "at most max_keys = 1 keys"),
]


@needs_kernels
@pytest.mark.parametrize("arg, value, error, text", BAD_ATTENTION,
                         ids=[f"{a}-{t}" for a, _, _, t in BAD_ATTENTION])
def test_attention_refuses_what_it_cannot_read(arg, value, error, text):
    args = _attention_args()
    assert KERNELS.attention(*args).shape == (3, 4, 16)  # the unchanged arguments run
    args[arg] = value
    with pytest.raises(error, match="sd_attention: ") as e:
        KERNELS.attention(*args)
    assert text in str(e.value), str(e.value)


@needs_kernels
def test_key_lists_refuse_missing_pages_and_bad_masks():
    ptr, pages = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    indptr, index = KERNELS.key_lists([2], [5], ptr, pages, 4, [None])
    assert indptr.tolist() == [0, 4, 9] and index.tolist()[:4] == [24, 25, 26, 27]
    assert [t.numel() for t in KERNELS.key_lists([0], [5], ptr, pages, 4, [None])] == [1, 0]
    for args, text in [(([2], [9], ptr, pages, 4, [None]), "3 pages of 4"),
                       (([2], [5], ptr, pages, 0, [None]), "page_size 0"),
                       (([2], [5], ptr[:1], pages, 4, [None]), "kv_indptr of shape (1,)"),
                       (([2], [5], ptr, pages, 4, [torch.ones(2, 4)]), "mask of shape (2, 4)"),
                       (([2], [5, 1], ptr, pages, 4, [None]), "1 qo_lens, 2 kv_lens")]:
        with pytest.raises(ValueError, match="sd_key_lists: ") as e:
            KERNELS.key_lists(*args)
        assert text in str(e.value), str(e.value)


@needs_kernels
def test_a_fused_step_refuses_tensors_that_do_not_fit(tiny_llama):
    from types import SimpleNamespace

    from specdec import LLM

    llm = LLM(model=str(tiny_llama), max_model_len=64)
    model, kv = llm.engine.parts.model, llm.engine.parts.runner.kv.cache
    fused, cfg = model.fused, model.cfg
    t, hd, d = 3, cfg.hidden_size, cfg.head_dim
    rows = kv.layer(0).numel() // (cfg.num_kv_heads * d)
    indptr, index = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2])
    plan = SimpleNamespace(write_index=torch.tensor([0, 1, 2, 4, 5, 6]), indptr=indptr,
                           index=index, max_keys=1, page_size=kv.page_size)
    x, cos = torch.randn(t, hd), torch.randn(t, 1, d)
    y, _ = fused.run(x.clone(), cos, cos, plan, kv)  # fits: runs
    assert y.shape == (t, hd)
    empty = SimpleNamespace(write_index=torch.zeros(0, dtype=torch.int64),
                            indptr=torch.tensor([0]), index=index[:0], max_keys=1,
                            page_size=kv.page_size)
    y, got = fused.run(x[:0], cos[:0], cos[:0], empty, kv, capture_layers=(0,))
    assert y.shape == (0, hd) and got[0].shape == (0, hd)
    def step(**change) -> SimpleNamespace:
        return SimpleNamespace(**(vars(plan) | change))

    bad = [(dict(x=torch.randn(t, hd + 1)), f"x of shape ({t}, {hd + 1})"),
           (dict(x=torch.randn(hd)), f"x of shape ({hd},)"),
           (dict(cos=torch.randn(t, 1, d - 1)), f"cos of shape ({t}, 1, {d - 1})"),
           (dict(qkv_input=torch.randn(t, hd + 1)), f"qkv_input of shape ({t}, {hd + 1})"),
           (dict(plan=step(write_index=torch.tensor([0, 1]))), "write_index of shape (2,)"),
           (dict(plan=step(write_index=torch.tensor([0, 1, 2, 4, 5, rows]))),
            f"0..{rows - 1}"),
           (dict(plan=step(index=torch.tensor([0, 1, rows]))), "row 2's key list"),
           (dict(plan=step(indptr=torch.tensor([0, 3]))), "key_indptr of shape (2,)"),
           # the values are checked in C (sd_layers), the message found by _check_step
           (dict(plan=step(write_index=torch.tensor([0, 1, 2, 4, 5, -1]))), f"0..{rows - 1}"),
           (dict(plan=step(max_keys=0)), "row 0's key list"),
           (dict(plan=step(indptr=torch.tensor([0, 2, 1, 3]), max_keys=2)), "row 1's key list"),
           (dict(plan=step(indptr=torch.tensor([0, 1, 2, 4]))), "row 2's key list"),
           (dict(plan=step(index=torch.tensor([0, 1, rows - kv.page_size]))),  # V row outside
            "row 2's key list")]
    before = kv.tensor.clone()
    for change, text in bad:
        kw = dict(x=x.clone(), cos=cos, sin=cos, plan=plan, kv_cache=kv) | change
        given = kw["x"].clone()
        with pytest.raises(ValueError, match="sd_layer: ") as e:
            fused.run(**kw)
        assert text in str(e.value), str(e.value)
        assert torch.equal(kv.tensor, before), text  # refused before any layer ran
        assert torch.equal(kw["x"], given), text
