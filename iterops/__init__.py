"""iterops: fused, exactly differentiable iterative algorithms for PyTensor and PyMC.

Importing iterops registers every fused Op with PyTensor's Numba backend and
the Scan rewrites (tag ``"iterops"``; ``mode.excluding("iterops")`` turns them
off).
"""

from iterops import linalg, ts
from iterops import scan_grad  # noqa: F401  (registers the gradient-Scan rewrite)
from iterops.linalg import block_diag, solve_discrete_lyapunov
from iterops.ts import acovf, ar_to_acov, ar_to_pacf, levinson_durbin, pacf_to_ar, solve_toeplitz, yule_walker
from iterops.ts import kalman_filter, kalman_smoother
from iterops.fusion import explain, fuse_loops  # registers the Scan -> fused Op rewrites
from iterops.loop import loop, taps
from iterops import _jax

_jax.install()  # clear error under JAX backends / samplers (no JAX import here)

__version__ = "0.1.0"

__all__ = [
    "acovf",
    "ar_to_acov",
    "ar_to_pacf",
    "levinson_durbin",
    "pacf_to_ar",
    "solve_toeplitz",
    "yule_walker",
    "kalman_filter",
    "kalman_smoother",
    "block_diag", "linalg", "loop", "solve_discrete_lyapunov", "taps", "ts"]
