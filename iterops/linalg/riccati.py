r"""Discrete algebraic Riccati equation: one fused Numba kernel, implicit gradients.

Solves, for the stabilising solution ``X``,

.. math::  X = A^T X A - A^T X B (R + B^T X B)^{-1} B^T X A + Q

(the convention of :func:`scipy.linalg.solve_discrete_are`).  ``X`` is the
steady-state predicted covariance of a Kalman filter for ``x_{t+1} = F x_t + w_t``,
``y_t = H x_t + v_t`` with ``A = F^T``, ``B = H^T``, ``Q = Cov(w)``, ``R = Cov(v)``
(and the cost-to-go of the infinite-horizon LQR problem with ``A``, ``B``, ``Q``, ``R``).
``Q`` and ``R`` enter through their symmetric parts ``(Q + Q^T) / 2``, ``(R + R^T) / 2``.
*Stabilising* means that the closed-loop matrix ``A - B K``,
``K = (R + B^T X B)^{-1} B^T X A``, has spectral radius below one.  Shapes: ``A`` (..., n, n),
``B`` (..., n, m), ``Q`` (..., n, n), ``R`` (..., m, m) -> ``X`` (..., n, n).

Code map, in reading order: the kernel (:func:`_sda_step`, :func:`_sda`, :func:`_gain_and_residual`,
:func:`dare_kernel`); its C-ABI function :func:`_dare_abi` (arguments declared once in :data:`DARE_ABI`, on the
one signature :data:`iterops._abi.SIGNATURE`) and the entry point; the Op :class:`DiscreteARE` with its
residual and closed loop (the implicit gradient); :func:`solve_discrete_are`.

Algorithm: the structure-preserving doubling algorithm (SDA; Chu, Fan & Lin 2005,
"A structure-preserving doubling algorithm for continuous-time algebraic Riccati
equations", and Lin & Xu 2006 for the discrete case), with ``A_0 = A``,
``G_0 = B R^{-1} B^T``, ``H_0 = Q``::

    W_k     = I + G_k H_k
    A_{k+1} = A_k W_k^{-1} A_k
    G_{k+1} = G_k + A_k W_k^{-1} G_k A_k^T
    H_{k+1} = H_k + A_k^T H_k W_k^{-1} A_k

``H_k`` converges quadratically to ``X`` (the error falls like
``rho(A - B K)^(2^(k+1))``), ``A_k`` to zero.  It stops when every entry has converged relative to
its own scale, ``|H_{k+1} - H_k|_ij <= tol sqrt(|H_{k+1,ii} H_{k+1,jj}|)``
(:func:`iterops._linalg_kernels.converged`: scale-free, so in a solution like ``diag(1e8, 1e-8)`` the small
entries are converged too, not only the largest; a zero variance needs an exactly unchanged row, which
``A_k -> 0`` reaches).  The iteration is the Riccati analogue of
Smith's doubling for the Lyapunov equation (:mod:`iterops.linalg.lyapunov`), which is
the case ``B = 0`` (then ``X = A^T X A + Q``).

Failure is a value: an all-NaN ``X`` when an input is not finite, ``R`` or a
``W_k`` is singular, the iteration does not converge within ``max_iter`` steps,
the relative residual of the result exceeds ``1e-8``, or the result is not stabilising
(``rho(A - B K) >= 1``: no stabilising solution, e.g. an unstable mode of ``A`` that
``B`` cannot reach).  The kernel never raises.

Precision: computed in float64; float32 (and integer) inputs give a result in
``floatX`` / float32 as :func:`iterops._validate.float_dtype` says.  Complex inputs are
rejected when the graph is built.

Gradients (implicit function theorem on the residual
``F(X; A, B, Q, R) = A^T X A - A^T X B (R + B^T X B)^{-1} B^T X A + Q - X``): its
derivative in ``X`` at the solution is ``dX -> A_c^T dX A_c - dX`` with
``A_c = A - B K`` (e.g. Kao & Hennequin 2020 for the Lyapunov family; the same
calculation as PyTensor's ``SolveDiscreteARE`` gradient), so the adjoint ``S`` solves
the discrete *Lyapunov* equation

.. math::  A_c S A_c^T - S + \bar X = 0 ,

computed with :func:`iterops.solve_discrete_lyapunov`; the cotangents of ``A``, ``B``,
``Q``, ``R`` are the vector-Jacobian product of ``F`` with ``S``
(:func:`iterops._implicit.implicit_pullback`).  Forward mode likewise
(:func:`iterops._implicit.implicit_pushforward`, ``A_c^T dX A_c - dX = -dF``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.tensor.variable import TensorVariable

from iterops._abi import SIGNATURE, Abi, Struct
from iterops._fused import (
    FusedOp, apply_batched, data_ptr, entry_point, keep_alive, opaque_kernel, register_fused_op,
)
from iterops._implicit import implicit_pullback, implicit_pushforward
from iterops._linalg_kernels import converged, copy_into, mm, sym_inplace, sym_into
from iterops._validate import as_tensor, check_dim_match, check_shape, check_square, float_dtype
from iterops.linalg.lyapunov import SOLUTION, Solution, _all_finite, _ct, solve_discrete_lyapunov

__all__ = ["solve_discrete_are", "DiscreteARE", "dare_kernel"]

#: failure thresholds of the a-posteriori checks
_MAX_RELATIVE_RESIDUAL = 1e-8

# ---------------------------------------------------------------------------
# Kernel (the single implementation)
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _lu_solve(M, B):
    """``(M^{-1} B, ok)`` by LU with partial pivoting; ``ok`` False for a zero or non-finite pivot.

    A failure-as-a-value solve (``np.linalg.solve`` raises on a singular matrix).  ``M`` (n, n),
    ``B`` (n, k), both float64; neither is modified.
    """
    n, k = B.shape
    LU = M.copy()
    X = B.copy()
    for c in range(n):
        p, big = c, np.abs(LU[c, c])
        for i in range(c + 1, n):
            if np.abs(LU[i, c]) > big:
                p, big = i, np.abs(LU[i, c])
        if not (big > 0.0) or not np.isfinite(big):
            return X, False
        if p != c:
            for j in range(n):
                LU[c, j], LU[p, j] = LU[p, j], LU[c, j]
            for j in range(k):
                X[c, j], X[p, j] = X[p, j], X[c, j]
        for i in range(c + 1, n):
            f = LU[i, c] / LU[c, c]
            for j in range(c + 1, n):
                LU[i, j] -= f * LU[c, j]
            for j in range(k):
                X[i, j] -= f * X[c, j]
    for i in range(n - 1, -1, -1):
        for j in range(k):
            s = X[i, j]
            for l in range(i + 1, n):
                s -= LU[i, l] * X[l, j]
            X[i, j] = s / LU[i, i]
    return X, True


@numba.njit(cache=True)
def _max_abs(M):
    """``np.max(np.abs(M))`` for a non-empty 2-D ``M`` (NaN if any entry is), by loops."""
    big = 0.0
    for i in range(M.shape[0]):
        for j in range(M.shape[1]):
            a = np.abs(M[i, j])
            if a != a:
                return a
            big = max(big, a)
    return big


@numba.njit(cache=True, inline="always")
def _sda_step(Ak, Gk, Hk):
    """One doubling step ``(A_k, G_k, H_k) -> (A_{k+1}, G_{k+1}, H_{k+1}, ok)`` (module docstring)."""
    n = Ak.shape[0]
    W = mm(Gk, Hk)
    for i in range(n):
        W[i, i] += 1.0
    rhs = np.empty((n, 2 * n))
    for i in range(n):
        for j in range(n):
            rhs[i, j] = Ak[i, j]
            rhs[i, n + j] = Gk[i, j]
    S, ok = _lu_solve(W, rhs)  # [W^{-1} A_k, W^{-1} G_k]
    WA = np.empty((n, n))
    WG = np.empty((n, n))
    for i in range(n):
        for j in range(n):
            WA[i, j] = S[i, j]
            WG[i, j] = S[i, n + j]
    AkT = _ct(Ak)
    A_new = mm(Ak, WA)
    G_new = mm(mm(Ak, WG), AkT)  # G_k + A_k W^{-1} G_k A_k^T
    H_new = mm(AkT, mm(Hk, WA))  # H_k + A_k^T H_k W^{-1} A_k
    for i in range(n):
        for j in range(n):
            G_new[i, j] += Gk[i, j]
            H_new[i, j] += Hk[i, j]
    sym_inplace(G_new)
    sym_inplace(H_new)
    return A_new, G_new, H_new, ok


@numba.njit(cache=True, inline="always")
def _sda(A, G, H, tol, max_iter):
    """Run the doubling from ``(A, G, H)``: ``(X, converged)``."""
    n = A.shape[0]
    Ak, Gk, Hk = A.copy(), G.copy(), H.copy()
    for _ in range(max_iter):
        Ak, Gk, H_new, ok = _sda_step(Ak, Gk, Hk)
        if not ok or not _all_finite(H_new):
            return H_new, False
        done = converged(H_new, Hk, tol, False)  # both symmetric and finite
        Hk = H_new
        if done:
            return Hk, True
    return Hk, False


@numba.njit(cache=True, inline="always")
def _gain_and_residual(A, B, Q, R, X):
    """``(A - B K, relative residual, ok)`` for a candidate ``X``, ``K = (R + B^T X B)^{-1} B^T X A``."""
    n, m = B.shape
    XA = mm(X, A)
    XB = mm(X, B)
    Bt = _ct(B)
    M = mm(Bt, XB)
    for i in range(m):
        for j in range(m):
            M[i, j] += R[i, j]  # R + B^T X B
    K, ok = _lu_solve(M, mm(Bt, XA))
    At = _ct(A)
    Res = mm(At, XA)
    AtXBK = mm(mm(At, XB), K)
    Acl = mm(B, K)
    for i in range(n):
        for j in range(n):
            Res[i, j] = Res[i, j] - AtXBK[i, j] + Q[i, j] - X[i, j]  # A^T X A - A^T X B K + Q - X
            Acl[i, j] = A[i, j] - Acl[i, j]
    scale = _max_abs(X) + _max_abs(Q) + 1e-300
    return Acl, _max_abs(Res) / scale, ok


@numba.njit(cache=True, inline="always")
def dare_kernel(A, B, Q, R, tol, max_iter):
    """Stabilising solution of the DARE for one system; ``(X, ok)``, ``X`` all-NaN when not ok.

    ``A`` (n, n), ``B`` (n, m), ``Q`` (n, n), ``R`` (m, m), float64, C-contiguous; ``Q`` and ``R``
    are used through their symmetric parts.  ``tol <= 0`` means ``1e2 * eps``.  Loops instead of
    array expressions and slice assignments (compile time: ``benchmarks/bench_compile.py``).
    """
    n, m = B.shape
    X = np.full((n, n), np.nan)
    if n == 0:
        return X, True
    if not (_all_finite(A) and _all_finite(B) and _all_finite(Q) and _all_finite(R)):
        return X, False
    if tol <= 0.0:
        tol = 1e2 * np.finfo(np.float64).eps
    Qs = np.empty((n, n))
    Rs = np.empty((m, m))
    sym_into(Q, Qs)
    sym_into(R, Rs)
    RinvBt, ok = _lu_solve(Rs, _ct(B))  # G_0 = B R^{-1} B^T
    if not ok:
        return X, False
    G = mm(B, RinvBt)
    sym_inplace(G)
    Xs, conv = _sda(A, G, Qs, tol, max_iter)
    if not conv:
        return X, False
    Acl, rel_res, ok = _gain_and_residual(A, B, Qs, Rs, Xs)
    if not ok or not (rel_res <= _MAX_RELATIVE_RESIDUAL):
        return X, False
    lam = np.linalg.eigvals(Acl.astype(np.complex128))
    for i in range(n):
        if np.abs(lam[i]) >= 1.0:
            return X, False  # converged to a solution that is not the stabilising one
    return Xs, True


# ---------------------------------------------------------------------------
# Op
# ---------------------------------------------------------------------------


class DareInputs(NamedTuple):
    """The equation of one system (float64, C-contiguous)."""

    A: np.ndarray  #: (n, n)
    B: np.ndarray  #: (n, m)
    Q: np.ndarray  #: (n, n)
    R: np.ndarray  #: (m, m)


class DareOptions(NamedTuple):
    """The solver's static options, as :func:`dare_kernel` takes them."""

    tol: float  #: relative stopping tolerance of the doubling; ``<= 0``: ``1e2 * eps``
    max_iter: int  #: doubling steps at most


#: the arguments of :func:`_dare_abi`
DARE_ABI = Abi(inputs=Struct(DareInputs, A=2, B=2, Q=2, R=2), options=Struct(DareOptions, tol="f", max_iter="i"),
               out=SOLUTION)
_dare_args = DARE_ABI.unpack


@opaque_kernel(SIGNATURE)
def _dare_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`dare_kernel` (see :class:`iterops._fused.OpaqueKernel`; arguments:
    :data:`DARE_ABI`): writes ``out.X``, returns 1.0 if solved, else 0.0.  Called directly, the kernel (LU
    solves, an eigenvalue check) would be compiled into every new graph again.  The kernel is
    ``inline="always"``, so it is compiled once, here, not a second time on its own."""
    x, options, out = _dare_args(ptrs, dims, vals)
    Xs, ok = dare_kernel(x.A, x.B, x.Q, x.R, options.tol, options.max_iter)
    copy_into(Xs, out.X)
    return 1.0 if ok else 0.0


@entry_point
def _dare_entry(out_dtype: str, tol: float, max_iter: int):
    """Entry point of :class:`DiscreteARE`: ``(A (n, n), B (n, m), Q (n, n), R (m, m)) -> X (n, n)``; checks the
    shapes (``ValueError``), solves in float64 through :func:`_dare_abi` and returns ``out_dtype``; all-NaN ``X``
    when not solved."""
    out_type = np.dtype(out_dtype).type
    abi, pack = _dare_abi.external, DARE_ABI.pack

    @numba.njit
    def solve(A, B, Q, R):
        n, m = A.shape[0], R.shape[0]
        check_shape("solve_discrete_are", "A", A, "(n, n), n = A.shape[0]", (n, n))
        check_shape("solve_discrete_are", "B", B, "(n, m), n = A.shape[0], m = R.shape[0]", (n, m))
        check_shape("solve_discrete_are", "Q", Q, "(n, n), n = A.shape[0]", (n, n))
        check_shape("solve_discrete_are", "R", R, "(m, m), m = R.shape[0]", (m, m))
        x = DareInputs(np.ascontiguousarray(A.astype(np.float64)), np.ascontiguousarray(B.astype(np.float64)),
                       np.ascontiguousarray(Q.astype(np.float64)), np.ascontiguousarray(R.astype(np.float64)))
        out = Solution(np.empty((n, n)))
        ptrs, dims, vals = pack(x, DareOptions(tol, max_iter), out)
        abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
        keep_alive((x, out, ptrs, dims, vals))
        return out.X.astype(out_type)

    return solve


@register_fused_op
class DiscreteARE(FusedOp):
    """Core Op ``(n,n),(n,m),(n,n),(m,m)->(n,n)``: (A, B, Q, R) -> X; use :func:`solve_discrete_are`."""

    __props__ = ("tol", "max_iter")
    gufunc_signature = "(n,n),(n,m),(n,n),(m,m)->(n,n)"

    def __init__(self, tol=0.0, max_iter=100):
        self.tol = float(tol)
        self.max_iter = int(max_iter)

    def make_node(self, A, B, Q, R):
        A, B, Q, R = (pt.as_tensor_variable(v) for v in (A, B, Q, R))
        n = next((s for s in (A.type.shape[-1], B.type.shape[-2], Q.type.shape[-1]) if s is not None), None)
        X = pt.tensor(dtype=float_dtype(A, B, Q, R), shape=(n, n))
        return Apply(self, [A, B, Q, R], [X])

    def infer_shape(self, node, input_shapes):
        return [input_shapes[0]]

    def numba_fn(self, node):
        return _dare_entry(node.outputs[0].type.dtype, self.tol, self.max_iter)

    def pullback(self, inputs, outputs, cotangents):
        A, B, Q, R = inputs
        (X,) = outputs
        (X_bar,) = cotangents
        Acl = _closed_loop(X, A, B, R)
        # (dF/dX)^T S = rhs  <=>  A_c S A_c^T - S = rhs  <=>  S = lyap(A_c, -rhs)
        return implicit_pullback(
            _residual, X, [A, B, Q, R], X_bar, solve_adjoint=lambda rhs: solve_discrete_lyapunov(Acl, -rhs)
        )

    def pushforward(self, inputs, outputs, tangents):
        A, B, Q, R = inputs
        (X,) = outputs
        Acl = _closed_loop(X, A, B, R)
        # (dF/dX) y = rhs  <=>  A_c^T y A_c - y = rhs  <=>  y = lyap(A_c^T, -rhs)
        return [
            implicit_pushforward(
                _residual, X, [A, B, Q, R], tangents, solve_tangent=lambda rhs: solve_discrete_lyapunov(Acl.mT, -rhs)
            )
        ]


def _sym(M):
    return 0.5 * (M + M.mT)


def _residual(X, A, B, Q, R):
    """F(X; A, B, Q, R) = A^T X A - A^T X B (R + B^T X B)^{-1} B^T X A + Q - X (symmetric parts of Q, R)."""
    XA = X @ A
    gain = pt.linalg.solve(_sym(R) + B.mT @ X @ B, B.mT @ XA)
    return A.mT @ XA - A.mT @ X @ B @ gain + _sym(Q) - X


def _closed_loop(X, A, B, R):
    """A_c = A - B K, K = (R + B^T X B)^{-1} B^T X A."""
    return A - B @ pt.linalg.solve(_sym(R) + B.mT @ X @ B, B.mT @ X @ A)


# ---------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------


def solve_discrete_are(A, B, Q, R, *, tol: float | None = None, max_iter: int = 100) -> TensorVariable:
    r"""Stabilising solution of :math:`X = A^T X A - A^T X B (R + B^T X B)^{-1} B^T X A + Q`.

    One fused Numba kernel (structure-preserving doubling); gradients by the
    implicit function theorem (an adjoint discrete Lyapunov solve).

    Parameters
    ----------
    A : tensor, shape (..., n, n)
    B : tensor, shape (..., n, m)
    Q : tensor, shape (..., n, n)
        Symmetric (its symmetric part is used), typically positive semi-definite.
    R : tensor, shape (..., m, m)
        Symmetric (its symmetric part is used), non-singular, typically positive definite.
        Leading dimensions of all four broadcast.  Real float or integer dtypes.
    tol : float, optional
        Relative stopping tolerance of the doubling, per entry on its own scale
        (``|H_{k+1} - H_k|_ij <= tol sqrt(|H_{k+1,ii} H_{k+1,jj}|)``);
        ``1e2 * eps`` by default.
    max_iter : int
        Maximum doubling steps (each doubles the horizon summed).

    Returns
    -------
    X : tensor, shape (broadcast(...), n, n)
        Symmetric.  All-NaN where there is no stabilising solution, ``R`` is
        singular, the doubling did not converge or an input is not finite.

    Replaces the Scan users write to iterate the Riccati recursion of a Kalman
    filter's predicted covariance to its steady state::

        def step(P, A, B, Q, R):
            K = pt.linalg.solve(R + B.T @ P @ B, B.T @ P @ A)
            P_new = A.T @ P @ A - A.T @ P @ B @ K + Q
            return P_new, until(pt.max(pt.abs(P_new - P)) < tol)
        Ps, _ = pytensor.scan(step, outputs_info=[Q], non_sequences=[A, B, Q, R], n_steps=10_000)
        X = Ps[-1]

    Examples
    --------
    >>> import numpy as np, iterops
    >>> A = np.array([[1.0, 1.0], [0.0, 1.0]]); B = np.array([[0.0], [1.0]])
    >>> iterops.linalg.solve_discrete_are(A, B, np.eye(2), np.eye(1)).eval().round(4)  # = scipy's
    array([[2.9471, 2.3692],
           [2.3692, 4.6131]])
    """
    func = "solve_discrete_are"
    if int(max_iter) < 1:
        raise ValueError(f"{func}: max_iter must be >= 1, got {max_iter}")
    if tol is not None and not (float(tol) >= 0.0):
        raise ValueError(f"{func}: tol must be >= 0, got {tol}")
    A, B, Q, R = (as_tensor(func, name, v, min_ndim=2) for name, v in (("A", A), ("B", B), ("Q", Q), ("R", R)))
    for name, v in (("A", A), ("B", B), ("Q", Q), ("R", R)):
        if v.type.numpy_dtype.kind == "c":
            raise TypeError(f"{func}: complex {name} is not supported, got {name} with dtype {v.type.dtype}")
    for name, v in (("A", A), ("Q", Q), ("R", R)):
        check_square(func, name, v)
    n_msg = "A, B and Q must have the same n (A, Q: (n, n); B: (n, m))"
    check_dim_match(func, "A", A.type.shape[-1], "B", B.type.shape[-2], n_msg)
    check_dim_match(func, "A", A.type.shape[-1], "Q", Q.type.shape[-1], n_msg)
    check_dim_match(func, "B", B.type.shape[-1], "R", R.type.shape[-1], "R must be (m, m) for B of shape (n, m)")
    return apply_batched(DiscreteARE(tol=tol or 0.0, max_iter=max_iter), A, B, Q, R)
