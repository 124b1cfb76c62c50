"""Fused linear-algebra Ops."""

from iterops.linalg.block_diag import block_diag
from iterops.linalg.lyapunov import solve_discrete_lyapunov
from iterops.linalg.lyapunov_iteration import lyapunov_fixed_point_loop, smith_doubling_loop
from iterops.linalg.riccati import solve_discrete_are

__all__ = ["block_diag", "lyapunov_fixed_point_loop", "smith_doubling_loop", "solve_discrete_are", "solve_discrete_lyapunov"]
