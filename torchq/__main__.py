"""``python -m torchq ...`` is the ``torchq`` command (see :mod:`torchq.cli`)."""

import sys

from torchq.cli import main

sys.exit(main())
