"""``python -m autopipe``: the same command line as the ``autopipe`` script (see :mod:`autopipe.cli.main`)."""

from __future__ import annotations

import sys

from autopipe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
