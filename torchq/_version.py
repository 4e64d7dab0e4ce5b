"""The package version (one place: ``torchq.__version__``, the checkpoint headers and the
autotune plan context read it from here)."""

__version__ = "0.1.0"
