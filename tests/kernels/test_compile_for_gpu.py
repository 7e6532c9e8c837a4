"""The row-invariant kernels compiled for a Hopper GPU (sm_90) here, without one: Triton's
interpreter runs Python semantics that a GPU compile refuses (a constexpr reassigned in a loop
ran under the interpreter and failed to compile), so the kernels are also compiled, as the H200
compiles them, down to PTX and machine code. The matmul must use the tensor cores' mma (its
invariance argument rests on that instruction), the attention no tensor-core tile; neither
local-memory arrays (PTX ``.local``). In a process of its own: the other kernel tests run the
modules under the interpreter, which decorates them for it at import."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (not imported here: this process runs triton under the interpreter, conftest.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton")

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specdec.kernels.invariant_attention import _attention_kernel, _merge_kernel, block_config
from specdec.kernels.invariant_matmul import ADD_BLOCK, BLOCK_M, _add_ranges, _linear_kernel

HOPPER = GPUTarget("cuda", 90, 32)


def compile_(fn, signature, constexprs):
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ptx = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                         target=HOPPER).asm["ptx"]
    assert ".local" not in ptx
    return ptx


ints = dict.fromkeys(("M", "N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_ym"), "i32")
for dtype, bias in (("bf16", False), ("fp32", True)):
    ptx = compile_(_linear_kernel,
                   {**dict.fromkeys(("x_ptr", "w_ptr", "b_ptr", "y_ptr"), f"*{dtype}"), **ints},
                   dict(HAS_BIAS=bias, PRECISION="ieee" if dtype == "fp32" else "tf32",
                        UPCAST=False, BLOCK_M=BLOCK_M, BLOCK_N=32, BLOCK_K=64))
    # one tensor-core tile shape for every M
    assert dtype != "bf16" or "mma.sync.aligned.m16n8k16" in ptx
    print("matmul", dtype, "ok")
ptx = compile_(_add_ranges, {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
                             "N": "i32"}, dict(SPLITS=4, HAS_BIAS=True, BLOCK=ADD_BLOCK))
print("split-K add", "ok")
for group in (1, 3, 4):
    pad = triton.next_power_of_2(group)
    sig = {"q_ptr": "*bf16", "cache_ptr": "*bf16", **dict.fromkeys(("ws_acc", "ws_m", "ws_l"),
                                                                    "*fp32"),
           **dict.fromkeys(("row_request", "row_limit", "row_tree", "kv_indptr", "kv_indices"),
                           "*i64"), "scale": "fp32", "split_slots": "i32", "num_splits": "i32",
           **dict.fromkeys(("stride_qt", "stride_qh", "stride_page", "stride_kv", "stride_slot",
                            "stride_head"), "i32")}
    ptx = compile_(_attention_kernel, sig, dict(
        PAGE_SIZE=16, GROUP=group, GROUP_PAD=pad, HEAD_DIM=64, BLOCK_D=64,
        BLOCK_N=block_config(pad, 64)[0]))
    assert "mma" not in ptx
    merge = {**dict.fromkeys(("ws_acc", "ws_m", "ws_l"), "*fp32"), "out_ptr": "*bf16",
             "row_limit": "*i64", "row_tree": "*i64", "split_slots": "i32", "num_splits": "i32",
             "stride_ot": "i32", "stride_oh": "i32"}
    compile_(_merge_kernel, merge, dict(GROUP=group, GROUP_PAD=pad, HEAD_DIM=64, BLOCK_D=64))
    print("attention group", group, "ok")
'''


def test_invariant_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # compiled here, not read from a cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said (it warns otherwise)
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok") == 6, run.stdout
