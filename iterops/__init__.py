"""iterops: fused, exactly differentiable iterative algorithms for PyTensor and PyMC.

Importing iterops registers every fused Op with PyTensor's Numba backend and
every graph rewrite (:mod:`iterops.rewrites`, tag ``"iterops"``;
``mode.excluding("iterops")`` turns them off): the Scan -> fused Op
replacement (:mod:`iterops.fusion`), the gradient-Scan mit-mot -> sit-sot
rewrite (:mod:`iterops.scan_grad`), and rewrites between fused Ops.
"""

from iterops import _jax, linalg, rewrites, ts  # noqa: F401  (rewrites registers every graph rewrite)
from iterops.fusion import disabled, explain, fuse_loops
from iterops.linalg import block_diag, solve_discrete_lyapunov
from iterops.loop import loop, taps
from iterops.ts import (
    acovf,
    ar_to_acov,
    ar_to_pacf,
    kalman_filter,
    kalman_smoother,
    levinson_durbin,
    pacf_to_ar,
    solve_toeplitz,
    stationary_cov,
    yule_walker,
)

_jax.install()  # JAX implementations, registered when PyTensor loads its JAX backend (imports no JAX)

__version__ = "0.1.0"

__all__ = [
    "acovf",
    "ar_to_acov",
    "ar_to_pacf",
    "block_diag",
    "disabled",
    "explain",
    "fuse_loops",
    "kalman_filter",
    "kalman_smoother",
    "levinson_durbin",
    "linalg",
    "loop",
    "pacf_to_ar",
    "solve_discrete_lyapunov",
    "solve_toeplitz",
    "stationary_cov",
    "taps",
    "ts",
    "yule_walker",
]
