"""``python -m specdec``: the ``specdec`` command (also what torchrun starts on every rank:
docs/distributed.md)."""

import sys

from specdec.cli import main

sys.exit(main())
