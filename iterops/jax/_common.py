"""Helpers shared by the JAX implementations: :func:`register_op` (how every iterops Op is registered with
PyTensor's JAX dispatch: inputs converted, outputs cast), masks for loops over a traced index, small products."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["REGISTERED", "register_op", "out_dtypes", "cast_outputs", "masked_reverse", "constant_int", "mm"]

#: products with at most this many multiplications are written as a broadcast product and a sum
MM_ELEMENTWISE_MAX = 2048


#: every iterops Op class with a JAX implementation (each registered by :func:`register_op`)
REGISTERED: list[type] = []


def register_op(jax_funcify, op_class, work=None, integer=()):
    """Decorator registering ``build(op, node) -> fn`` as the JAX implementation of ``op_class``, where ``fn``
    gets every input as a JAX array of its working dtype and its outputs are cast to the node's dtypes.

    What PyTensor's JAX linker passes is not always an array of the input's type: a 0-d constant arrives as
    a Python scalar (``jax_typify``), e.g. the constant cotangent ``1`` of ``s2`` in ``phi.sum() + s2``, a
    ``tol``, a disconnected cotangent's ``zeros(())`` placeholder; and public functions accept integer data.
    So every input becomes ``jnp.asarray(x, dtype)``, the ``dtype``:

    - of an integer input at a position in ``integer`` (a count: ``n_steps``): its own;
    - of any other input: ``work`` when given (the dtype the Op computes in, e.g. float64); else its own
      for a float or complex input, and the node's first output dtype for an integer one.
    """

    def decorate(build):
        def funcify(op, node=None, **kwargs):
            fn = build(op, node)
            dtypes = [_working_dtype(node, i, work, i in integer) for i in range(len(node.inputs))]

            def op_fn(*args):
                return cast_outputs(node, fn(*(jnp.asarray(x, d) for x, d in zip(args, dtypes, strict=True))))

            op_fn.__name__ = op_class.__name__  # PyTensor names the generated code's functions after it
            return op_fn

        jax_funcify.register(op_class)(funcify)
        if op_class not in REGISTERED:
            REGISTERED.append(op_class)
        return build

    return decorate


def _working_dtype(node, i, work, integer):
    """The dtype :func:`register_op` gives input ``i`` of ``node``."""
    own = np.dtype(node.inputs[i].type.dtype)
    if own.kind in "biu" and integer:
        return own
    if work is not None:
        return np.dtype(work)
    return np.dtype(node.outputs[0].type.dtype) if own.kind in "biu" else own


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
