"""The linear benchmark's table, moved to :mod:`torchq.cli.bench_table` (``torchq bench`` runs it);
this module keeps ``torchq.bench_linear`` and its names importable."""

from .cli.bench_table import (  # noqa: F401
    add_ratios,
    build_input,
    build_linear,
    build_parser,
    format_table,
    header,
    main,
    parse_args,
    run_shape_dtype,
)

__all__ = ["main", "build_parser", "parse_args", "format_table", "add_ratios", "header", "build_linear", "build_input",
           "run_shape_dtype"]
