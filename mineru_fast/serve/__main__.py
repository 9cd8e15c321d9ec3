"""``python -m mineru_fast.serve ...`` is ``mineru-fast serve ...``."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
