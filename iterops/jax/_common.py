"""Helpers shared by the JAX implementations: output dtypes, masks for loops over a traced index."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["out_dtypes", "cast_outputs", "masked_reverse", "constant_int", "mm"]

#: products with at most this many multiplications are written as a broadcast product and a sum
MM_ELEMENTWISE_MAX = 2048


def out_dtypes(node):
    """NumPy dtypes of the node's outputs (the JAX function must return exactly these)."""
    return [np.dtype(o.type.dtype) for o in node.outputs]


def cast_outputs(node, outs):
    """Cast each output to the node's dtype (a single output is returned bare)."""
    dts = out_dtypes(node)
    if not isinstance(outs, tuple | list):
        return jnp.asarray(outs).astype(dts[0])
    return tuple(jnp.asarray(o).astype(d) for o, d in zip(outs, dts))


def masked_reverse(x, k):
    """``x[k - 1 - j]`` for ``j < k``, 0 for ``j >= k`` (``x`` 1-d, ``k`` a traced index)."""
    n = x.shape[0]
    j = jnp.arange(n)
    return jnp.where(j < k, x[jnp.clip(k - 1 - j, 0, max(n - 1, 0))], 0)


def constant_int(var):
    """The integer value of a PyTensor constant (``None`` when it is not one)."""
    from pytensor.graph.basic import Constant

    if isinstance(var, Constant):
        return int(np.asarray(var.data))
    return None


def mm(A, B):
    """``A @ B`` for 1-d or 2-d operands.  A small product (at most :data:`MM_ELEMENTWISE_MAX`
    multiplications) is a broadcast product and a sum, which XLA fuses with the element operations
    around it; a ``dot`` is a separate library call, which in a ``lax.scan`` costs more than a small
    matrix's arithmetic (the bound: ``benchmarks/RESULTS.md``, JAX section)."""
    rows = A.shape[0] if A.ndim == 2 else 1
    cols = B.shape[1] if B.ndim == 2 else 1
    if rows * A.shape[-1] * cols > MM_ELEMENTWISE_MAX:
        return A @ B
    if A.ndim == 2 and B.ndim == 2:
        return jnp.sum(A[:, :, None] * B[None, :, :], axis=1)
    if A.ndim == 2:
        return jnp.sum(A * B[None, :], axis=1)
    if B.ndim == 2:
        return jnp.sum(A[:, None] * B, axis=0)
    return jnp.sum(A * B)
