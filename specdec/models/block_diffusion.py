"""Moved: the block_diffusion drafter's model lives in ``specdec.models.heads.block_diffusion``; what you pass as
``drafter_args`` is also in ``specdec.drafters.block_diffusion``. This old path still imports (with a
DeprecationWarning) until it is removed, as CHANGELOG.md says."""

import warnings

from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel  # noqa: F401

warnings.warn("specdec.models.block_diffusion moved to specdec.models.heads.block_diffusion (the classes are also in "
              "specdec.drafters.block_diffusion); this path will go (CHANGELOG.md)", DeprecationWarning,
              stacklevel=2)
