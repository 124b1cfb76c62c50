"""Helpers shared by the JAX implementations: output dtypes, masks for loops over a traced index."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["out_dtypes", "cast_outputs", "masked_reverse", "constant_int"]


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
