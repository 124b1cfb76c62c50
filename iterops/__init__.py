"""iterops: fused, exactly differentiable iterative algorithms for PyTensor and PyMC.

Importing iterops registers every fused Op with PyTensor's Numba backend and
the Scan rewrites (tag ``"iterops"``; ``mode.excluding("iterops")`` turns them
off).
"""

from iterops import linalg, ts
from iterops.linalg import block_diag, solve_discrete_lyapunov

__version__ = "0.1.0"

__all__ = ["block_diag", "linalg", "solve_discrete_lyapunov", "ts"]
