"""Moved: the mtp drafter's model lives in ``specdec.models.heads.mtp``; what you pass as
``drafter_args`` is also in ``specdec.drafters.mtp``. This old path still imports (with a
DeprecationWarning) until it is removed, as CHANGELOG.md says."""

import warnings

from specdec.models.heads.mtp import MTPConfig, MTPHeads  # noqa: F401

warnings.warn("specdec.models.mtp moved to specdec.models.heads.mtp (the classes are also in "
              "specdec.drafters.mtp); this path will go (CHANGELOG.md)", DeprecationWarning,
              stacklevel=2)
