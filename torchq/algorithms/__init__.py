"""Quantization algorithms that choose codes, scales and zero points better than round-to-nearest
(RTN). Their output is an ordinary plain form: the existing layouts and kernels run it.

* :mod:`torchq.algorithms.hqq`: HQQ, zero points by half-quadratic optimisation, no data.
"""

from .hqq import HQQ_DEFAULTS, hqq_zero_points, lp_error

ALGORITHMS = ("rtn", "hqq")

__all__ = ["ALGORITHMS", "HQQ_DEFAULTS", "hqq_zero_points", "lp_error"]
