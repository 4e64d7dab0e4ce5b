"""``python -m torchq.demo``: the built-in example (moved to :mod:`torchq.cli.demo`; this module
keeps the README's command and ``torchq.demo.main`` working)."""

import sys

from .cli.demo import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
