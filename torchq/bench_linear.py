"""The linear benchmark's table, moved to :mod:`torchq.cli.bench_table` (``torchq bench`` runs it);
this module keeps ``torchq.bench_linear.main`` importable."""

from .cli.bench_table import main

__all__ = ["main"]
