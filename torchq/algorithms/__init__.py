"""Quantization algorithms that choose codes, scales and zero points better than round-to-nearest
(RTN). Their output is an ordinary plain form: the existing layouts and kernels run it.

* :mod:`torchq.algorithms.hqq`: HQQ, zero points by half-quadratic optimisation, no data.
* :mod:`torchq.algorithms.gptq`: GPTQ, codes with error compensation from calibration inputs.
* :mod:`torchq.algorithms.awq`: AWQ, activation-aware input scaling and range clipping.
* :mod:`torchq.algorithms.formats`: what the algorithms need to know of a config's format.
* :mod:`torchq.algorithms.statistics`: calibration statistics and the scope handing them to configs
  (:func:`torchq.calibrate` drives them).
"""

from .awq import AWQ_DEFAULTS, awq_quantize
from .gptq import GPTQ_DEFAULTS, gptq_quantize
from .hqq import HQQ_DEFAULTS, hqq_zero_points, lp_error
from .statistics import CALIBRATED, CalibrationRequired

ALGORITHMS = ("rtn", "hqq", *CALIBRATED)

__all__ = ["ALGORITHMS", "AWQ_DEFAULTS", "awq_quantize", "CALIBRATED", "CalibrationRequired", "GPTQ_DEFAULTS", "HQQ_DEFAULTS", "gptq_quantize",
           "hqq_zero_points", "lp_error"]
