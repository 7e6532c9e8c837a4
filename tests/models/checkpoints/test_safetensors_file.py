"""A checkpoint's safetensors files memory-mapped (specdec.models.checkpoints.safetensors_file): the same
tensors safetensors reads, views of the file, and errors that name the file and tensor."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.models.checkpoints.safetensors_file import open_checkpoint, open_safetensors


def test_tensors_are_the_files_values(tmp_path):
    want = {"a": torch.randn(5, 7).bfloat16(), "b": torch.randn(3).half(),
            "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.randn(2, 2),
            "e": torch.empty(0, 4)}
    save_file(want, tmp_path / "m.safetensors")
    files = open_checkpoint([tmp_path / "m.safetensors"])
    assert set(files) == set(want) and len(files) == len(want)
    for name, t in load_file(tmp_path / "m.safetensors").items():
        assert files[name].dtype == t.dtype and torch.equal(files[name], t), name
    assert files.kind("a") == "BF16" and files.kind("b") == "F16"
    files["a"].add_(1)  # copy-on-write: the file keeps its bytes
    files.release_pages()
    assert torch.equal(load_file(tmp_path / "m.safetensors")["a"], want["a"])


def test_a_name_in_two_files_is_named(tmp_path):
    save_file({"x": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"x": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'x' is in both .*a\.safetensors and "
                                         r".*b\.safetensors"):
        open_checkpoint([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])


def _raw(path, header: dict, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("header,data,message", [
    ({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0",
     r"tensor w is F8_E4M3; readable: F64, F32"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,
     r"corrupt or truncated weights file .*: tensor w \(F32 \[4\], 16 bytes\)"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8,
     r"corrupt or truncated weights file .*: tensor w \(F32 \[2\], 8 bytes\) at bytes 0\.\.4"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4,
     r"corrupt weights file .*: tensor 'w' has a malformed entry"),
    ({"w": "F32"}, b"", r"corrupt weights file .*: tensor 'w' has a malformed entry"),
], ids=["dtype", "past-the-end", "size", "shape", "entry"])
def test_a_bad_entry_is_named(tmp_path, header, data, message):
    path = tmp_path / "m.safetensors"
    _raw(path, header, data)
    with pytest.raises(ValueError, match=message):
        open_safetensors(path)


def test_a_bad_header_is_named(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 3) + b"[1]")
    with pytest.raises(ValueError, match=r"corrupt weights file .*m\.safetensors: its header "
                                         "is not a JSON object"):
        open_safetensors(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match=r"a header of 1099511627776 bytes in a file of 10"):
        open_safetensors(path)
