"""Numerical constants shared by the kernels, the JAX rules, the reference loops and the fusion patterns.

Each is defined here once and imported where it is used.  This module is one of the kernel sources
(:data:`iterops._fused.KERNEL_SOURCES`): Numba freezes a global's value into the compiled kernel, so
editing a constant recompiles every kernel that reads it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LOG_2PI", "FLOAT64_EPS"]

#: ``log(2 pi)``: the constant of a Gaussian log-density, ``-(k log 2 pi + log|F| + v^T F^{-1} v) / 2``
LOG_2PI = float(np.log(2.0 * np.pi))
#: machine epsilon of float64 (``2^-52``), the unit of the solvers' default tolerances
FLOAT64_EPS = float(np.finfo(np.float64).eps)
