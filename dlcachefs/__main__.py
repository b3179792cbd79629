"""``python -m dlcachefs``: the ``dlcachefs`` command (the console script's entry point)."""

import sys

from dlcachefs.cli import main

if __name__ == "__main__":
    sys.exit(main())
