"""``python -m gradguard`` — the same as the ``gradguard`` command."""

import sys

from ._tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
