"""``python -m plinth ...``: the ``plinth`` command."""

import sys

from plinth.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
