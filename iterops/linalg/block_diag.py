r"""Block-diagonal matrix from a stack of equally shaped blocks.

``x`` of shape ``(..., k, n, m)`` gives ``B`` of shape ``(..., k*n, k*m)`` with

.. math::  B[i n + a,\ j m + b] = \delta_{ij}\, x[i, a, b].

``k`` may be symbolic, which ``pytensor.tensor.linalg.block_diag(*matrices)``
cannot express.  The loop it replaces (what PyMC users write with ``pytensor.scan``
when the number of blocks is symbolic)::

    def step(i, out, x):
        return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], x[i])
    outs, _ = pytensor.scan(step, sequences=[pt.arange(k)],
                            outputs_info=[pt.zeros((k * n, k * m))], non_sequences=[x])
    B = outs[-1]

Gradient: the cotangent's diagonal blocks, ``x_bar[i] = B_bar[i n:(i+1) n, i m:(i+1) m]``,
written with PyTensor reshapes so higher derivatives compose.  Forward mode:
``block_diag(x_dot)``.  Nothing can fail at run time.
"""

from __future__ import annotations

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply
from pytensor.tensor.variable import TensorVariable

from iterops._fused import FusedOp, apply_batched, entry_point, register_fused_op
from iterops._validate import as_tensor

__all__ = ["block_diag", "BlockDiag", "block_diag_kernel"]


@numba.njit(cache=True, inline="always")
def block_diag_kernel(x, out):
    """Write the blocks ``x[i]`` (k, n, m) onto the diagonal of zeroed ``out`` (k n, k m)."""
    k, n, m = x.shape
    out[:] = 0
    for i in range(k):
        for a in range(n):
            for b in range(m):
                out[i * n + a, i * m + b] = x[i, a, b]
    return out


@entry_point
def _block_diag_entry(out_dtype: str):
    out_t = np.dtype(out_dtype).type

    @numba.njit
    def assemble(x):
        k, n, m = x.shape
        return block_diag_kernel(x, np.empty((k * n, k * m), dtype=out_t))

    return assemble


@register_fused_op
class BlockDiag(FusedOp):
    """Core Op: ``(k,n,m)->(p,q)`` with ``p = k n``, ``q = k m``; use :func:`block_diag`."""

    __props__ = ()
    gufunc_signature = "(k,n,m)->(p,q)"

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        k, n, m = x.type.shape
        p = k * n if k is not None and n is not None else None
        q = k * m if k is not None and m is not None else None
        return Apply(self, [x], [pt.tensor(dtype=x.type.dtype, shape=(p, q))])

    def infer_shape(self, node, input_shapes):
        k, n, m = input_shapes[0]
        return [(k * n, k * m)]

    def numba_fn(self, node):
        return _block_diag_entry(node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        (x,) = inputs
        (g,) = cotangents
        if isinstance(g.type, DisconnectedType):
            return [disconnected_type()]
        k, n, m = x.shape[0], x.shape[1], x.shape[2]
        # (k n, k m) -> (k, n, k, m); the diagonal over axes (0, 2) is (n, m, k)
        blocks = pt.diagonal(g.reshape((k, n, k, m)), axis1=0, axis2=2)
        return [blocks.transpose(2, 0, 1)]

    def pushforward(self, inputs, outputs, tangents):
        (t,) = tangents
        if isinstance(t.type, DisconnectedType):
            return [disconnected_type()]
        return [apply_batched(self, t)]


def block_diag(*x) -> TensorVariable:
    """Block-diagonal matrix of the blocks stacked along axis ``-3``.

    Parameters
    ----------
    x : tensor (..., k, n, m), or several matrices, or one list/tuple of matrices
        One tensor: its last three dimensions are ``k`` blocks of shape
        ``(n, m)``; leading dimensions are batch dimensions.  Several matrices
        (``block_diag(a, b)`` or ``block_diag([a, b])``): a drop-in for
        ``pytensor.tensor.linalg.block_diag(*matrices)`` and
        ``scipy.linalg.block_diag(*arrs)``, any shapes (leading dimensions of
        ndim > 2 inputs are batch dimensions).  Matrices whose static shapes are
        all known and equal are stacked and assembled by the fused kernel; any
        other case goes to PyTensor's implementation (shapes only known at run
        time may differ, so equality is never assumed).  A single matrix is
        returned as it is.

    Returns
    -------
    B : tensor (..., k*n, k*m); for several matrices (..., sum of rows, sum of columns)

    Examples
    --------
    >>> import numpy as np, iterops
    >>> iterops.block_diag(np.ones((2, 1, 2))).eval()
    array([[1., 1., 0., 0.],
           [0., 0., 1., 1.]])
    """
    func = "block_diag"
    if len(x) == 1 and isinstance(x[0], list | tuple):
        if len(x[0]) == 0:
            raise ValueError(f"{func}: got an empty sequence of matrices; needs at least one")
        return _of_matrices(func, x[0])
    if len(x) == 0:
        raise ValueError(f"{func}: needs a (..., k, n, m) tensor or at least one matrix")
    if len(x) > 1:
        return _of_matrices(func, x)
    (x,) = x
    x = as_tensor(func, "x", x)
    if x.type.ndim < 3:
        raise ValueError(
            f"{func}: x must have shape (..., k, n, m) with ndim >= 3, got x with shape {x.type.shape}; "
            "pass several matrices as separate arguments or as a list"
        )
    return apply_batched(BlockDiag(), x)


def _of_matrices(func, matrices) -> TensorVariable:
    """``block_diag(*matrices)``: the fused kernel when every static shape is known and equal."""
    mats = [as_tensor(func, f"x[{i}]", xi) for i, xi in enumerate(matrices)]
    for i, mi in enumerate(mats):
        if mi.type.ndim < 2:
            raise ValueError(
                f"{func}: with several arguments each must be a matrix (ndim >= 2), "
                f"got x[{i}] with shape {mi.type.shape}; shapes: {[m.type.shape for m in mats]}"
            )
    if len(mats) == 1:
        return mats[0]
    shapes = {mi.type.shape for mi in mats}
    if len(shapes) == 1 and None not in next(iter(shapes)):
        return block_diag(pt.stack(mats, axis=-3))
    return pt.linalg.block_diag(*mats)
