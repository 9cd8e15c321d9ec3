"""``python -m mineru_fast ...`` is ``mineru-fast ...``."""

import sys

from mineru_fast.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
