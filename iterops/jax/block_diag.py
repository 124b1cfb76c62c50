"""JAX implementation of :class:`~iterops.linalg.block_diag.BlockDiag`: ``(k, n, m) -> (k n, k m)``.

``B[i n + a, j m + b] = delta_ij x[i, a, b]``; off-diagonal blocks are exact zeros (also next to
inf/NaN blocks, as the Numba kernel writes them).  The gradient is PyTensor's reshape graph."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["block_diag"]


def block_diag(x):
    """Block-diagonal matrix of the ``k`` blocks of ``x`` (k, n, m)."""
    k, n, m = x.shape
    eye = jnp.eye(k, dtype=bool)[:, None, :, None]
    return jnp.where(eye, x[:, :, None, :], jnp.zeros((), x.dtype)).reshape(k * n, k * m)


def register(jax_funcify):
    from iterops.linalg.block_diag import BlockDiag

    @jax_funcify.register(BlockDiag)
    def _block_diag(op, node=None, **kwargs):
        out = node.outputs[0].type.dtype

        def block_diag_fn(x):
            return block_diag(x).astype(out)

        return block_diag_fn
