"""Fused linear-algebra Ops."""

from iterops.linalg.block_diag import block_diag
from iterops.linalg.lyapunov import solve_discrete_lyapunov

__all__ = ["block_diag", "solve_discrete_lyapunov"]
