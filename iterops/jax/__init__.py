"""JAX implementations of every iterops Op, for PyTensor's JAX backend (``mode="JAX"``) and PyMC's JAX
samplers (``pm.sample(nuts_sampler="numpyro" | "blackjax")``).

One module per algorithm, each with plain JAX functions (jit-able, vmap-able, on core shapes; PyTensor's
``Blockwise`` vectorizes them over batch dimensions) and a ``register(jax_funcify)`` that registers them
for the iterops Ops, each through :func:`iterops.jax._common.register_op` (every input a JAX array of the
Op's working dtype, whatever the linker passes: a Python scalar for a 0-d constant such as a constant or
disconnected cotangent, integers; every output in the node's dtype):

- :mod:`iterops.jax.lyapunov`: ``DiscreteLyapunov`` (doubling / Schur / auto), ``SmithDoublingLoop``,
  ``LyapunovFixedPointLoop`` and their gradient Ops;
- :mod:`iterops.jax.riccati`: ``DiscreteARE``;
- :mod:`iterops.jax.block_diag`: ``BlockDiag``;
- :mod:`iterops.jax.toeplitz`: ``SolveToeplitz``;
- :mod:`iterops.jax.levinson`: ``LevinsonDurbin``, ``AutoCov``, ``LevinsonRecursion`` and its gradient Op;
- :mod:`iterops.jax.ar`: ``PacfToAR``, ``ARToPacf``, ``ARToAcov``, ``ARDerivative``;
- :mod:`iterops.jax.kalman`: ``KalmanFilter``, ``KalmanFilterGrad``, ``KalmanSmoother``.

Gradients: PyTensor differentiates the graph itself, so a JAX gradient graph holds iterops' gradient Ops
(or, for the equation solvers, the Ops again: implicit function theorem); each has a JAX implementation
here.  The implementations need float64 (``jax.config.update("jax_enable_x64", True)``, which PyMC's JAX
samplers set for float64 models).  Failure values (NaN, ``-inf``) are those of the Numba kernels; nothing
raises inside ``jit`` (an Op with ``on_failure="raise"`` returns its NaN value under JAX).

Importing :mod:`iterops` does not import JAX: :mod:`iterops._jax` calls :func:`register` when PyTensor's
JAX dispatch module is loaded.
"""

from __future__ import annotations

__all__ = ["register"]

_REGISTERED = []


def register(jax_funcify) -> None:
    """Register the JAX implementation of every iterops Op with ``jax_funcify`` (idempotent)."""
    if jax_funcify in _REGISTERED:
        return
    from iterops.jax import ar, block_diag, kalman, levinson, lyapunov, riccati, toeplitz

    for module in (lyapunov, riccati, block_diag, toeplitz, levinson, ar, kalman):
        module.register(jax_funcify)
    _REGISTERED.append(jax_funcify)
