"""Help text for the command line: docstrings without reStructuredText markup."""

from __future__ import annotations

import re

__all__ = ["plain_text"]

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain_text(text: str) -> str:
    """Docstring text without reStructuredText markup, for ``--help``: ``:func:`x``` and
    double-backquoted literals become plain ``x``."""
    return _ROLE.sub(r"\1", text).replace("``", "")
