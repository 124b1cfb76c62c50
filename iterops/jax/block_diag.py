"""JAX implementation of :class:`~iterops.linalg.block_diag.BlockDiag`: ``(k, n, m) -> (k n, k m)``.

``B[i n + a, j m + b] = delta_ij x[i, a, b]``; off-diagonal blocks are exact zeros (also next to
inf/NaN blocks, as the Numba kernel writes them).  The gradient is PyTensor's reshape graph."""

from __future__ import annotations

import jax.numpy as jnp

from iterops.jax._common import register_op

__all__ = ["block_diag"]


def block_diag(x):
    """Block-diagonal matrix of the ``k`` blocks of ``x`` (k, n, m)."""
    k, n, m = x.shape
    eye = jnp.eye(k, dtype=bool)[:, None, :, None]
    return jnp.where(eye, x[:, :, None, :], jnp.zeros((), x.dtype)).reshape(k * n, k * m)


def register(jax_funcify):
    from iterops.linalg.block_diag import BlockDiag

    register_op(jax_funcify, BlockDiag)(lambda op, node: block_diag)
