"""The linear benchmark lives in the package (``torchq bench`` runs it): see :mod:`torchq.bench_linear`.

    python benchmarks/bench_linear.py --quick
"""

import sys

from torchq.bench_linear import main

if __name__ == "__main__":
    sys.exit(main())
