r"""Toeplitz linear systems by Levinson recursion: one fused Numba kernel, implicit gradients.

Solves :math:`T x = b` where ``T`` is the ``n x n`` Toeplitz matrix with first
column ``c`` and first row ``[c[0], r[1:]]`` (``r[0]`` is ignored), i.e.
``T[i, j] = c[i - j]`` for ``i >= j`` and ``r[j - i]`` for ``i < j`` -- the
convention of :func:`scipy.linalg.solve_toeplitz` and :func:`scipy.linalg.toeplitz`.
``c`` alone means the symmetric system ``r = c`` (real inputs only).

Algorithm (Levinson 1947; the general, non-symmetric form of e.g. Golub & Van
Loan, *Matrix Computations*, 4th ed., Sec. 4.7): forward and backward vectors
``f_m, g_m`` with ``T_m f_m = e_1`` and ``T_m g_m = e_m`` of the leading
``m x m`` block are grown one order at a time,

.. math::
    \epsilon_f = \sum_i T_{m,i} f_i,\quad \epsilon_g = \sum_i T_{0,i+1} g_i,\quad
    f \leftarrow \frac{[f;0] - \epsilon_f [0;g]}{1-\epsilon_f\epsilon_g},\quad
    g \leftarrow \frac{[0;g] - \epsilon_g [f;0]}{1-\epsilon_f\epsilon_g},

and every right-hand side column is updated by ``x <- [x; 0] + (b_m - T_{m,:m} x) g``.
O(n^2 (k + 2)) flops for ``k`` right-hand sides, against O(n^3) for a dense solve.

Failure is a value: the recursion needs every leading principal block of ``T``
to be non-singular.  When a pivot ``c[0]`` or ``1 - eps_f eps_g`` is zero, or an
input or the result is not finite, the whole ``x`` is NaN.  (Like scipy, the
recursion is not backward stable for ill-conditioned indefinite systems; for a
symmetric positive-definite ``T`` it is as accurate as Cholesky in practice.)

Precision: computed in float64; float32 inputs give a float32 result.

Gradients (implicit function theorem on :math:`F(x; c, r, b) = T(c, r) x - b`):
the adjoint is a Toeplitz solve with the transposed matrix -- first column
``[c[0], r[1:]]`` and first row ``c`` -- computed by this Op itself,
:math:`\lambda = T^{-T} \bar x`, :math:`\bar b = \lambda`, and the ``c``/``r``
cotangents are the sums along the diagonals of :math:`\bar T = -\lambda x^T`
(:func:`outer_diagonal_sums`, a 1-d cross-correlation; ``r[0]`` gets none).  Forward mode:
:math:`\dot x = T^{-1}(\dot b - \dot T x)`.  Both are written with this Op and
plain PyTensor reshapes, so batched and higher derivatives compose.

Why the ``c``/``r`` cotangents are written here and not through
:func:`iterops._implicit.implicit_pullback` (which the adjoint solve would fit): that helper
gets them from PyTensor's autodiff of the residual ``T(c, r) x - b``.  With a dense
``toeplitz_matrix(c, r) @ x`` that builds an ``n x n`` matrix and scatters its cotangent onto the
diagonals with advanced indexing, O(n^2) memory per batch member; with ``T x`` as a convolution,
PyTensor 3.3's ``Convolve1d`` pullback does not vectorize under ``Blockwise`` (batched gradients
fail at run time with a broadcasting error).  :func:`outer_diagonal_sums` is the structured
adjoint: one cross-correlation, O(n^2 k) time, O(n k) memory.
"""

from __future__ import annotations

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply
from pytensor.tensor.signal import convolve1d
from pytensor.tensor.variable import TensorVariable

from iterops._fused import FusedOp, apply_batched, entry_point, register_fused_op
from iterops._validate import as_tensor, check_dim_match, check_shape, float_dtype

__all__ = ["solve_toeplitz", "SolveToeplitz", "levinson_kernel", "toeplitz_matrix", "outer_diagonal_sums"]


# ---------------------------------------------------------------------------
# Kernel (the single implementation)
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _finite(v):
    """Every entry of the 1-D or 2-D ``v`` is finite (loops: no array expression to compile)."""
    for idx in np.ndindex(v.shape):
        if not np.isfinite(v[idx]):
            return False
    return True


@numba.njit(cache=True, inline="always")
def levinson_kernel(c, r, b):
    """Solve ``toeplitz(c, r) @ x = b`` for float64 ``c`` (n,), ``r`` (n,), ``b`` (n, k).

    Returns ``x`` (n, k); all-NaN when the recursion breaks down (a singular
    leading block) or an input is not finite.  Never raises.
    """
    n, k = b.shape
    x = np.zeros((n, k))
    if n == 0:
        return x
    if not (_finite(c) and _finite(r) and _finite(b)) or c[0] == 0.0:
        x[:] = np.nan
        return x
    f = np.zeros(n)  # forward vector, T_m f = e_1
    g = np.zeros(n)  # backward vector, T_m g = e_m
    f_new = np.zeros(n)
    f[0] = 1.0 / c[0]
    g[0] = 1.0 / c[0]
    for j in range(k):
        x[0, j] = b[0, j] / c[0]
    for m in range(1, n):
        eps_f = 0.0  # row m of T_{m+1} times [f; 0]
        eps_g = 0.0  # row 0 of T_{m+1} times [0; g]
        for i in range(m):
            eps_f += c[m - i] * f[i]
            eps_g += r[i + 1] * g[i]
        den = 1.0 - eps_f * eps_g
        if den == 0.0 or not np.isfinite(den):
            x[:] = np.nan
            return x
        # f_new = ([f;0] - eps_f [0;g]) / den ;  g_new = ([0;g] - eps_g [f;0]) / den
        f_new[0] = f[0] / den
        for i in range(1, m):
            f_new[i] = (f[i] - eps_f * g[i - 1]) / den
        f_new[m] = -eps_f * g[m - 1] / den
        for i in range(m, 0, -1):
            g[i] = (g[i - 1] - eps_g * (f[i] if i < m else 0.0)) / den
        g[0] = -eps_g * f[0] / den
        f, f_new = f_new, f  # swap buffers
        # x <- [x; 0] + (b_m - T_{m,:m} x) g
        for j in range(k):
            eps_x = 0.0
            for i in range(m):
                eps_x += c[m - i] * x[i, j]
            d = b[m, j] - eps_x
            for i in range(m + 1):
                x[i, j] += d * g[i]
    if not _finite(x):
        x[:] = np.nan
    return x


# ---------------------------------------------------------------------------
# Op
# ---------------------------------------------------------------------------


@entry_point
def _toeplitz_entry(out_dtype: str):
    out = np.dtype(out_dtype).type

    @numba.njit
    def solve(c, r, b):
        n = c.shape[0]
        check_shape("solve_toeplitz", "r", r, "(n,), n = len(c)", (n,))
        check_shape("solve_toeplitz", "b", b, "(n, k), n = len(c)", (n, -1))
        return levinson_kernel(
            np.ascontiguousarray(c).astype(np.float64),
            np.ascontiguousarray(r).astype(np.float64),
            np.ascontiguousarray(b).astype(np.float64),
        ).astype(out)

    return solve


@register_fused_op
class SolveToeplitz(FusedOp):
    """Core Op ``(n),(n),(n,k)->(n,k)``: ``toeplitz(c, r) @ x = b``; use :func:`solve_toeplitz`."""

    __props__ = ()
    gufunc_signature = "(n),(n),(n,k)->(n,k)"

    def make_node(self, c, r, b):
        c, r, b = (pt.as_tensor_variable(v) for v in (c, r, b))
        x = pt.tensor(dtype=float_dtype(c, r, b), shape=b.type.shape)
        return Apply(self, [c, r, b], [x])

    def infer_shape(self, node, input_shapes):
        return [input_shapes[2]]

    def numba_fn(self, node):
        return _toeplitz_entry(node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        c, r, b = inputs
        (x,) = outputs
        (x_bar,) = cotangents
        if isinstance(x_bar.type, DisconnectedType):
            return [disconnected_type()] * 3
        # lam = T^{-T} x_bar: T^T has first column [c0, r1:] and first row c
        lam = apply_batched(self, pt.concatenate([c[:1], r[1:]]), c, x_bar)
        S = -outer_diagonal_sums(lam, x)  # diagonal sums of T_bar = -lam x^T (2n - 1; empty for n = 0)
        n = c.shape[0]
        c_bar = S[n - 1 :]  # diagonals i - j = k >= 0
        # i - j = -k for r[k]; r[0] unused.  ``[:n]``: length n also for n = 0
        r_bar = pt.concatenate([pt.zeros((1,), dtype=S.dtype), S[: n - 1][::-1]])[:n]
        # b_bar is lam itself, an intermediate of c_bar and r_bar too: PyTensor's double-pullback
        # pushforward (batched forward mode) overrides instead of accumulating such shared
        # cotangents, so hand out a distinct variable (as iterops._implicit.implicit_pullback does)
        return [c_bar, r_bar, pt.tensor_copy(lam)]

    def pushforward(self, inputs, outputs, tangents):
        c, r, b = inputs
        (x,) = outputs
        c_dot, r_dot, b_dot = tangents
        rhs = []
        if not isinstance(b_dot.type, DisconnectedType):
            rhs.append(b_dot)
        for name, t in (("c", c_dot), ("r", r_dot)):
            if not isinstance(t.type, DisconnectedType):
                T_dot = toeplitz_matrix(t, pt.zeros_like(r)) if name == "c" else toeplitz_matrix(pt.zeros_like(c), t)
                rhs.append(-(T_dot @ x))
        if not rhs:
            return [disconnected_type()]
        return [apply_batched(self, c, r, sum(rhs[1:], rhs[0]))]  # x_dot = T^{-1} (b_dot - T_dot x)


def outer_diagonal_sums(u, v) -> TensorVariable:
    """Sums along the diagonals of ``u @ v.T`` for ``u``, ``v`` of shape (n, k), without forming it.

    ``S[n - 1 + d] = sum_{i - j = d} sum_l u[i, l] v[j, l]`` (the adjoint of
    building a Toeplitz matrix from its diagonals): a full 1-d
    cross-correlation per column, ``convolve1d(u[:, l], v[::-1, l])``, O(n^2 k).
    Length ``2 n - 1``; empty for ``n = 0``, zeros for ``k = 0``.
    """
    # A zero row and a zero column appended to both, so that no convolution sees an empty series
    # (n = 0) or an empty batch (k = 0): the padded sums have the extra diagonals d = +-n, both
    # zero, at their ends, and the zero column adds nothing.
    u, v = _pad_zero_row_and_column(u), _pad_zero_row_and_column(v)
    return convolve1d(u.T, v.T[:, ::-1], mode="full").sum(axis=0)[1:-1]


def _pad_zero_row_and_column(a):
    return pt.set_subtensor(pt.zeros((a.shape[0] + 1, a.shape[1] + 1), dtype=a.dtype)[:-1, :-1], a)


def toeplitz_matrix(c, r=None) -> TensorVariable:
    """Dense ``(..., n, n)`` Toeplitz matrix, ``T[i, j] = c[i-j]`` (i >= j), ``r[j-i]`` (i < j).

    Like :func:`scipy.linalg.toeplitz` (``r[0]`` ignored; ``r = c`` when omitted),
    batched over the leading dimensions of ``c`` and ``r``.  O(n^2) memory: a
    building block for residuals and reference implementations.
    """
    c = pt.as_tensor_variable(c)
    r = c if r is None else pt.as_tensor_variable(r)
    n = c.shape[-1]
    d = pt.arange(n)[:, None] - pt.arange(n)[None, :]
    return pt.where(d >= 0, c[..., pt.maximum(d, 0)], r[..., pt.maximum(-d, 0)])


# ---------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------


def solve_toeplitz(c_or_cr, b, *, b_ndim: int | None = None) -> TensorVariable:
    r"""Solve the Toeplitz system :math:`T x = b` by Levinson recursion, O(n^2).

    Same call as :func:`scipy.linalg.solve_toeplitz`.

    Parameters
    ----------
    c_or_cr : tensor (..., n) or tuple (c, r) of tensors (..., n)
        First column ``c`` of ``T``; with ``(c, r)`` also its first row
        (``r[0]`` is ignored, the first row is ``[c[0], r[1:]]``).  ``c`` alone
        means the symmetric matrix ``r = c``.  Real (float or int) dtypes.
    b : tensor (..., n) or (..., n, k)
        Right-hand side(s).  Leading dimensions of ``c``, ``r`` and ``b`` broadcast.
    b_ndim : {1, 2}, optional
        Core dimensions of ``b``: 1 for a vector, 2 for a matrix of ``k``
        columns.  Default, as in scipy and :func:`pytensor.tensor.linalg.solve`:
        1 if ``b.ndim == 1`` else 2 -- pass ``b_ndim=1`` for a batch of vectors.

    Returns
    -------
    x : tensor of the shape of ``b`` (with broadcast batch dimensions)
        All-NaN for a system on which the recursion breaks down (a singular
        leading principal block of ``T``) or non-finite input.  Empty when
        ``n = 0`` or ``k = 0``, as :func:`numpy.linalg.solve` (for an empty
        ``(0, k)`` matrix ``b`` scipy returns shape ``(0, 0)``; here it is ``(0, k)``).

    Replaces a dense ``pt.linalg.solve(toeplitz(c, r), b)`` (O(n^3)) or the
    Levinson loop written as a ``pytensor.scan`` over the order ``m``.

    Examples
    --------
    >>> import numpy as np, iterops
    >>> iterops.ts.solve_toeplitz(([1., 3, 6, 10], [1., -1, -2, -3]), [1., 2, 2, 5]).eval().round(4)
    array([ 1.6667, -1.    , -2.6667,  2.3333])
    """
    func = "solve_toeplitz"
    if isinstance(c_or_cr, tuple | list) and len(c_or_cr) == 2 and not _is_number_pair(c_or_cr):
        c, r = c_or_cr
        c = as_tensor(func, "c", c, min_ndim=1)
        r = as_tensor(func, "r", r, min_ndim=1)
    else:
        c = as_tensor(func, "c", c_or_cr, min_ndim=1)
        r = c
    b = as_tensor(func, "b", b, min_ndim=1)
    for name, v in (("c", c), ("r", r), ("b", b)):
        if v.type.numpy_dtype.kind == "c":
            raise TypeError(f"{func}: complex {name} is not supported (got dtype {v.type.dtype}); use real inputs")
    if b_ndim is None:
        b_ndim = 1 if b.type.ndim == 1 else 2
    if b_ndim not in (1, 2):
        raise ValueError(f"{func}: b_ndim must be 1 or 2, got {b_ndim!r}")
    if b.type.ndim < b_ndim:
        raise ValueError(f"{func}: b must have at least b_ndim={b_ndim} dimensions, got b with shape {b.type.shape}")
    n_b = b.type.shape[-1] if b_ndim == 1 else b.type.shape[-2]
    check_dim_match(func, "c", c.type.shape[-1], "r", r.type.shape[-1], "c and r must have the same length n")
    check_dim_match(func, "c", c.type.shape[-1], "b", n_b, "b must have n rows (n = len(c))")
    if b_ndim == 1:
        return apply_batched(SolveToeplitz(), c, r, b[..., None])[..., 0]
    return apply_batched(SolveToeplitz(), c, r, b)


def _is_number_pair(v) -> bool:
    """``(c0, c1)`` of two scalars is a length-2 column, not a ``(c, r)`` pair."""
    return all(np.ndim(e) == 0 and not hasattr(e, "type") for e in v) or all(
        getattr(getattr(e, "type", None), "ndim", 1) == 0 for e in v
    )
