"""A written drafter folder's files have the mode any file the user writes gets (#52: the
weights came out 0600 beside a 0644 config.json: safetensors makes its files private)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from specdec.models.heads.checkpoint import write_folder


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_weights_get_the_same_mode_as_config_json(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_folder(tmp_path / "drafter", {"a": 1}, {"w": torch.zeros(2, 2)})
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE((tmp_path / "drafter" / name).stat().st_mode)
             for name in ("config.json", "model.safetensors")}
    assert modes == {"config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}
