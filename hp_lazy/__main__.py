"""``python -m hp_lazy``: see :mod:`hp_lazy.cli`."""

from __future__ import annotations

import sys

from hp_lazy.cli import main

if __name__ == "__main__":
    sys.exit(main())
