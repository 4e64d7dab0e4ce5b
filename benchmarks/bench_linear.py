"""The linear benchmark lives in the package (``torchq bench`` runs it): see :mod:`torchq.cli.bench_table`.

    python benchmarks/bench_linear.py --quick
"""

import sys

from torchq.cli.bench_table import main

if __name__ == "__main__":
    sys.exit(main())
