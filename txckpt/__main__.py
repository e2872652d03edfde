"""``python -m txckpt``: the same command as the ``txckpt`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
