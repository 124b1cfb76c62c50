"""Pattern entries: importing this package registers them.

One module per family of loops; each entry is a reference step written the
way a user would plus a builder of the fused replacement (see
:mod:`iterops.fusion.registry`).  Patterns whose fused Op is not available
are skipped.
"""

from iterops.fusion.patterns import block_diag, kalman, levinson, lyapunov  # noqa: F401
