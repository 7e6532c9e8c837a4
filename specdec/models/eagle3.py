"""Moved: the eagle3 drafter's model lives in ``specdec.models.heads.eagle3``; what you pass as
``drafter_args`` is also in ``specdec.drafters.eagle3``. This old path still imports (with a
DeprecationWarning) until it is removed, as CHANGELOG.md says."""

import warnings

from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head  # noqa: F401

warnings.warn("specdec.models.eagle3 moved to specdec.models.heads.eagle3 (the classes are also in "
              "specdec.drafters.eagle3); this path will go (CHANGELOG.md)", DeprecationWarning,
              stacklevel=2)
