r"""Discrete Lyapunov equation: one fused Numba kernel with exact implicit gradients.

Solves

.. math::  A X A^H - X + Q = 0

(the convention of :func:`scipy.linalg.solve_discrete_lyapunov` and
:func:`pytensor.tensor.linalg.solve_discrete_lyapunov`).  For a stable ``A``
(spectral radius below one) the solution is the infinite sum
:math:`X = \sum_k A^k Q (A^H)^k`: the stationary covariance of
``x_{t+1} = A x_t + e_t`` with ``Cov(e) = Q``.  Shapes: ``A``, ``Q`` (..., n, n) -> ``X`` (..., n, n).

Code map, in reading order: the C-ABI declarations (:data:`LYAPUNOV_ABI`, :data:`SCHUR_ABI`: one
:class:`iterops._abi.Abi` per working dtype, float64 and complex128); the kernel (:func:`_doubling`,
:func:`_schur`, :func:`lyapunov_kernel`) with its Schur fallback behind :data:`_SCHUR_ABI`; the C-ABI kernels
(:data:`_ABI`: :func:`_lyapunov_abi`, :func:`_lyapunov_abi_complex`) and the entry point; the Op
:class:`DiscreteLyapunov` and its implicit gradient; :func:`solve_discrete_lyapunov`; the rewrite
:func:`builtin_lyapunov_to_fused`.

Methods
-------
``"doubling"``
    Smith's doubling iteration (the loop PyMC users write with ``pytensor.scan``;
    quantecon's ``solve_discrete_lyapunov`` runs the same iteration)::

        alpha, gamma = A, Q
        repeat: term = alpha gamma alpha^H ; gamma <- gamma + term ; alpha <- alpha alpha
        until |term_ij| <= tol * |gamma_ij| for every entry (i, j)

    Quadratic convergence when the spectral radius is below one: the k-th
    iterate holds the first 2^k terms of the sum.  The stop rule is elementwise,
    so every entry -- also one many orders of magnitude below the largest --
    is summed to its own relative precision.
``"schur"``
    Direct (Kitagawa / Bartels-Stewart): complex Schur form ``A = U T U^H``,
    then the triangular equation ``T Y T^H - Y + U^H Q U = 0`` is solved
    column by column in O(n^3), ``X = U Y U^H``.  Backward stable, accurate
    next to the unit circle and valid for unstable ``A`` as long as no
    eigenvalue pair has ``lambda_i conj(lambda_j) = 1``.
``"auto"`` (default)
    Doubling, accepted if it converged within ``max_iter`` iterations and its
    relative residual is below ``100 * eps``; otherwise the Schur method.

Compile time: the Schur method (LAPACK's complex Schur wrapper, complex
products) is half of the solver's machine code and most inputs never need it,
so it sits in a C-ABI function of its own that is compiled the first time an
input needs it (:class:`iterops._fused.LazyKernel`): same machine code, same
results, paid only by a model that reaches the fallback.  Both C-ABI functions
have the one signature :data:`iterops._abi.SIGNATURE`; their arguments are
declared once as NamedTuples (:class:`LyapunovInputs`, :class:`LyapunovOptions`,
:class:`Solution`), and the complex128 twins are compiled only when first used
(``python -m iterops.warmup --all-dtypes`` compiles them ahead of time).

Failure is a value: non-finite input, an (almost) singular equation
(``|lambda_i conj(lambda_j) - 1| < 1e3 * eps``), or non-convergence give an
all-NaN ``X`` (``on_failure="nan"``, the default, so that a sampler rejects
the point) or raise ``FloatingPointError`` (``on_failure="raise"``).

Precision: float64 and complex128 compute natively; float32 (and integer)
inputs are solved in float64 and the result is cast to the output dtype
(float32 in, float32 out).

Gradients (implicit function theorem; Kao & Hennequin 2020, eq. 10-11 for the
Sylvester family): with output cotangent ``X_bar`` the adjoint ``S`` solves the
same equation with ``A^H`` and ``X_bar``,

.. math::  A^H S A - S + \bar X = 0,\qquad \bar Q = S,\qquad
           \bar A = S A X^H + S^H A X ,

computed by :func:`iterops._implicit.implicit_pullback` from the residual, with
``S`` obtained from this Op itself, so second derivatives work.  Forward mode
solves ``A dX A^H - dX + (dA X A^H + A X dA^H + dQ) = 0`` with the same Op.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numba
from numba import types
from numba.extending import overload
import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import copy_stack_trace, node_rewriter
from pytensor.link.numba.dispatch.linalg.decomposition.schur import schur_complex
from pytensor.tensor.linalg.solvers.linear_control import SolveBilinearDiscreteLyapunov
from pytensor.tensor.variable import TensorVariable

from iterops._abi import SIGNATURE, Abi, Struct
from iterops._fused import (
    FusedOp, LazyKernel, apply_batched, data_ptr, entry_point, keep_alive, opaque_kernel, register_fused_op,
)
from iterops._implicit import implicit_pullback, implicit_pushforward
from iterops._linalg_kernels import copy_into, mm
from iterops._validate import as_tensor, check_dim_match, check_shape, check_square, float_dtype

__all__ = ["solve_discrete_lyapunov", "DiscreteLyapunov", "lyapunov_kernel", "builtin_lyapunov_to_fused"]

_METHODS = {"auto": 0, "doubling": 1, "schur": 2}
_ON_FAILURE = ("nan", "raise")


class LyapunovInputs(NamedTuple):
    """The equation ``A X A^H - X + Q = 0`` of one system (float64 or complex128, C-contiguous)."""

    A: np.ndarray  #: (n, n)
    Q: np.ndarray  #: (n, n)


class LyapunovOptions(NamedTuple):
    """The solver's static options, as :func:`lyapunov_kernel` takes them."""

    method: int  #: 0 auto, 1 doubling, 2 schur (:data:`_METHODS`)
    tol: float  #: relative stopping tolerance of the doubling; ``<= 0``: machine precision
    max_iter: int  #: doubling steps at most


class Solution(NamedTuple):
    """An equation solver's result, written by its C-ABI kernel (all-NaN when not solved)."""

    X: np.ndarray  #: (n, n)


LYAPUNOV_INPUTS = Struct(LyapunovInputs, A=2, Q=2)
SOLUTION = Struct(Solution, X=2)
#: the working dtypes of the C-ABI kernels (float32 and integer inputs are solved in float64)
_WORK_DTYPES = ("float64", "complex128")
#: the arguments of :func:`_lyapunov_abi` per working dtype (the dtype of its arrays; scalars cross as float64)
LYAPUNOV_ABI = {
    d: Abi(dtype=d, inputs=LYAPUNOV_INPUTS, options=Struct(LyapunovOptions, method="i", tol="f", max_iter="i"),
           out=SOLUTION)
    for d in _WORK_DTYPES
}
#: the arguments of the Schur fallback :func:`_schur_abi` per working dtype
SCHUR_ABI = {d: Abi(dtype=d, inputs=LYAPUNOV_INPUTS, out=SOLUTION) for d in _WORK_DTYPES}
# the unpackers, as globals that jitted code can call
_lyapunov_args, _lyapunov_args_complex = (LYAPUNOV_ABI[d].unpack for d in _WORK_DTYPES)
_schur_args, _schur_args_complex = (SCHUR_ABI[d].unpack for d in _WORK_DTYPES)

# ---------------------------------------------------------------------------
# Kernel (the single implementation)
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _ct(M):
    """Conjugate transpose, contiguous."""
    n, m = M.shape
    out = np.empty((m, n), dtype=M.dtype)
    for i in range(n):
        for j in range(m):
            out[j, i] = np.conj(M[i, j])
    return out


@numba.njit(cache=True)
def _all_finite(M):
    for i in range(M.shape[0]):
        for j in range(M.shape[1]):
            if not np.isfinite(M[i, j]):
                return False
    return True


@numba.njit(cache=True)
def _doubling(A, Q, tol, max_iter):
    """Smith's doubling; returns (X, converged).

    ``gamma_k = sum_{j < 2^k} A^j Q (A^H)^j`` and ``alpha_k = A^(2^k)``:
    ``gamma_{k+1} = gamma_k + alpha_k gamma_k alpha_k^H``, ``alpha_{k+1} = alpha_k^2``.
    Converged when the term just added is below ``tol`` relative to *each* entry's own value,
    ``|alpha gamma alpha^H|_ij <= tol |gamma_new|_ij`` for every ``i, j`` (an entry that is
    exactly zero needs an exactly zero term), so an entry orders of magnitude below the largest
    one is summed to its own precision too.  For a stable ``A`` the terms go to zero, underflow
    included, so this always stops; a non-finite term (unstable ``A``) stops with
    ``converged=False``, as does reaching ``max_iter``.
    """
    n = A.shape[0]
    alpha = np.ascontiguousarray(A)
    gamma = np.ascontiguousarray(Q).copy()
    for _ in range(max_iter):
        term = mm(mm(alpha, gamma), _ct(alpha))
        done = True
        for i in range(n):
            for j in range(n):
                t = term[i, j]
                g = gamma[i, j] + t
                gamma[i, j] = g
                if not np.isfinite(g):  # diverging (unstable A): |inf| <= tol |inf| must not pass
                    return gamma, False
                if not (np.abs(t) <= tol * np.abs(g)):
                    done = False
        if done:
            return gamma, True
        alpha = mm(alpha, alpha)
    return gamma, False


@numba.njit(cache=True)
def _schur(A, Q):
    """Kitagawa's direct method on the complex Schur form; returns (X, ok)."""
    n = A.shape[0]
    T, Z = schur_complex(A.astype(np.complex128), None, False)
    T = np.ascontiguousarray(T)
    U = np.ascontiguousarray(Z)
    Uh = _ct(U)
    C = mm(Uh, mm(np.ascontiguousarray(Q).astype(np.complex128), U))
    Y = np.zeros((n, n), dtype=np.complex128)
    w = np.empty(n, dtype=np.complex128)
    rhs = np.empty(n, dtype=np.complex128)
    sing = 1e3 * np.finfo(np.float64).eps
    for j in range(n - 1, -1, -1):
        # column j: (conj(T_jj) T - I) y_j = -c_j - T w_j,  w_j = sum_{l>j} conj(T_jl) y_l
        for i in range(n):
            acc = 0j
            for l in range(j + 1, n):
                acc += np.conj(T[j, l]) * Y[i, l]
            w[i] = acc
        for i in range(n):
            acc = 0j
            for k in range(i, n):
                acc += T[i, k] * w[k]
            rhs[i] = -C[i, j] - acc
        tjj = np.conj(T[j, j])
        for i in range(n - 1, -1, -1):  # back substitution, upper triangular
            acc = rhs[i]
            for k in range(i + 1, n):
                acc -= tjj * T[i, k] * Y[k, j]
            d = tjj * T[i, i] - 1.0
            if np.abs(d) < sing:
                return np.full((n, n), np.nan + 0j), False
            Y[i, j] = acc / d
    X = mm(U, mm(Y, Uh))
    return X, True


def _as_dtype_of(Z, like):
    """``Z`` (complex) in the dtype of ``like``: its real part for a real ``like``."""
    return Z.real if np.isrealobj(like) else Z


@overload(_as_dtype_of)
def _as_dtype_of_impl(Z, like):
    if isinstance(like.dtype, types.Complex):
        return lambda Z, like: Z
    return lambda Z, like: Z.real


@numba.njit(cache=True, inline="always")
def _schur_into(x, out):
    """:func:`_schur` of the :class:`LyapunovInputs` ``x`` into ``out.X`` (the real part for a real ``A``;
    all-NaN on failure); 1.0 if solved and finite, else 0.0."""
    Xo = out.X
    Xs, ok = _schur(x.A, x.Q)
    if ok:
        copy_into(_as_dtype_of(Xs, Xo), Xo)
        ok = _all_finite(Xo)
    if not ok:
        for i in range(Xo.shape[0]):
            for j in range(Xo.shape[1]):
                Xo[i, j] = np.nan
    return 1.0 if ok else 0.0


def _schur_abi(ptrs, dims, vals):
    """C-ABI Schur solve (:func:`_schur_into`) for :class:`iterops._fused.LazyKernel`, float64 (arguments:
    :data:`SCHUR_ABI`): writes ``out.X``, returns 1.0 if solved and finite, else 0.0 (also when compiling fails)."""
    x, out = _schur_args(ptrs, dims, vals)
    return _schur_into(x, out)


def _schur_abi_complex(ptrs, dims, vals):
    """:func:`_schur_abi` for complex128 arrays."""
    x, out = _schur_args_complex(ptrs, dims, vals)
    return _schur_into(x, out)


#: The Schur fallback, compiled when an input first needs it (most models never do: the doubling
#: iteration solves every stable ``A`` not too close to the unit circle), one per working dtype.
_SCHUR_ABI = {
    "float64": LazyKernel(SIGNATURE, _schur_abi),
    "complex128": LazyKernel(SIGNATURE, _schur_abi_complex, dtype="complex128"),
}


def _schur_solve(A, Q):
    """``(X, ok)`` of the Schur method for C-contiguous (n, n) ``A``, ``Q`` (jitted code only),
    through :data:`_SCHUR_ABI`."""
    raise NotImplementedError


@overload(_schur_solve)
def _schur_solve_impl(A, Q):
    abi, pack = _SCHUR_ABI[str(A.dtype)].external, SCHUR_ABI[str(A.dtype)].pack

    def impl(A, Q):
        n = A.shape[0]
        x, out = LyapunovInputs(A, Q), Solution(np.empty((n, n), dtype=A.dtype))
        ptrs, dims, vals = pack(x, out)
        ok = abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals)) == 1.0
        keep_alive((x, out, ptrs, dims, vals))
        return out.X, ok

    return impl


@numba.njit(cache=True)
def _relative_residual(A, Q, X):
    """``max|A X A^H - X + Q| / (max|A|^2 max|X| + max|X| + max|Q|)`` (loops: no array expression)."""
    n = A.shape[0]
    R = mm(mm(A, X), _ct(A))
    nA = nX = nQ = nR = 0.0
    for i in range(n):
        for j in range(n):
            nA = max(nA, np.abs(A[i, j]))
            nX = max(nX, np.abs(X[i, j]))
            nQ = max(nQ, np.abs(Q[i, j]))
            nR = max(nR, np.abs(R[i, j] - X[i, j] + Q[i, j]))
    return nR / max(nA * nA * nX + nX + nQ, 1e-300)


@numba.njit(cache=True, inline="always")
def lyapunov_kernel(A, Q, method, tol, max_iter):
    """Solve ``A X A^H - X + Q = 0`` for one (n, n) system.

    ``A``, ``Q``: float64 or complex128 (same dtype), shape (n, n), C-contiguous.
    ``method``: 0 auto, 1 doubling, 2 schur.  ``tol <= 0`` means machine
    precision.  Returns ``(X, ok)``; ``X`` is all-NaN when ``ok`` is False.
    """
    n = A.shape[0]
    X = np.full((n, n), np.nan, dtype=A.dtype)
    if n == 0:
        return X, True
    if not (_all_finite(A) and _all_finite(Q)):
        return X, False
    eps = np.finfo(np.float64).eps
    if tol <= 0.0:
        tol = eps
    if method != 2:
        Xd, conv = _doubling(A, Q, tol, max_iter)
        if conv and (method == 1 or _relative_residual(A, Q, Xd) <= 100.0 * eps):
            return Xd, True
        if method == 1:
            return X, False
    return _schur_solve(A, Q)


# ---------------------------------------------------------------------------
# Op
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def _solve_into(x, options, out):
    """:func:`lyapunov_kernel` of the :class:`LyapunovInputs` ``x`` into ``out.X``; 1.0 if solved, else 0.0."""
    Xs, ok = lyapunov_kernel(x.A, x.Q, options.method, options.tol, options.max_iter)
    copy_into(Xs, out.X)
    return 1.0 if ok else 0.0


@opaque_kernel(SIGNATURE)
def _lyapunov_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`lyapunov_kernel` (see :class:`iterops._fused.OpaqueKernel`), float64
    (arguments: :data:`LYAPUNOV_ABI`): writes ``out.X``, returns 1.0 if solved.  The kernel is
    ``inline="always"``: compiled once, here (a kernel compiled on its own would be optimized and compiled to
    machine code twice, once more in this function that links it).  Its Schur fallback is a call into
    :data:`_SCHUR_ABI`, compiled on first use."""
    x, options, out = _lyapunov_args(ptrs, dims, vals)
    return _solve_into(x, options, out)


@opaque_kernel(SIGNATURE, dtype="complex128")
def _lyapunov_abi_complex(ptrs, dims, vals):
    """:func:`_lyapunov_abi` for complex128 arrays."""
    x, options, out = _lyapunov_args_complex(ptrs, dims, vals)
    return _solve_into(x, options, out)


#: the solver's C-ABI kernel per working dtype
_ABI = {"float64": _lyapunov_abi, "complex128": _lyapunov_abi_complex}


@entry_point
def _lyapunov_entry(work_dtype: str, out_dtype: str, method: int, tol: float, max_iter: int, raise_: bool):
    """Entry point of :class:`DiscreteLyapunov`: ``(A, Q) -> X``, all (n, n); checks the shapes (``ValueError``),
    solves in ``work_dtype`` through :data:`_ABI` and returns ``out_dtype``.  Not solved: all-NaN ``X``, or
    ``FloatingPointError`` with ``raise_``."""
    work = np.dtype(work_dtype).type
    out_type = np.dtype(out_dtype).type
    abi, pack = _ABI[work_dtype].external, LYAPUNOV_ABI[work_dtype].pack

    @numba.njit
    def solve(A, Q):
        n = A.shape[0]
        check_shape("solve_discrete_lyapunov", "A", A, "(n, n), n = A.shape[0]", (n, n))
        check_shape("solve_discrete_lyapunov", "Q", Q, "(n, n), n = A.shape[0]", (n, n))
        x = LyapunovInputs(np.ascontiguousarray(A.astype(work)), np.ascontiguousarray(Q.astype(work)))
        out = Solution(np.empty((n, n), dtype=work))
        ptrs, dims, vals = pack(x, LyapunovOptions(method, tol, max_iter), out)
        ok = abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals)) == 1.0
        keep_alive((x, out, ptrs, dims, vals))
        if raise_ and not ok:
            raise FloatingPointError("solve_discrete_lyapunov: no (unique, finite) solution found")
        return out.X.astype(out_type)

    return solve


@register_fused_op
class DiscreteLyapunov(FusedOp):
    """Core Op: ``(n,n),(n,n)->(n,n)``; use :func:`solve_discrete_lyapunov`."""

    __props__ = ("method", "tol", "max_iter", "on_failure")
    gufunc_signature = "(n,n),(n,n)->(n,n)"

    def __init__(self, method="auto", tol=0.0, max_iter=100, on_failure="nan"):
        self.method = method
        self.tol = float(tol)
        self.max_iter = int(max_iter)
        self.on_failure = on_failure

    def make_node(self, A, Q):
        A, Q = pt.as_tensor_variable(A), pt.as_tensor_variable(Q)
        n = A.type.shape[-1] if A.type.shape[-1] is not None else Q.type.shape[-1]
        X = pt.tensor(dtype=float_dtype(A, Q), shape=(n, n))
        return Apply(self, [A, Q], [X])

    def infer_shape(self, node, input_shapes):
        return [input_shapes[0]]

    def numba_fn(self, node):
        out = node.outputs[0].type.dtype
        work = "complex128" if out.startswith("complex") else "float64"
        return _lyapunov_entry(work, out, _METHODS[self.method], self.tol, self.max_iter, self.on_failure == "raise")

    def _same_equation(self, A, Q):
        return apply_batched(self, A, Q)

    def pullback(self, inputs, outputs, cotangents):
        A, Q = inputs
        (X,) = outputs
        (X_bar,) = cotangents
        # (dF/dX)^H lam = rhs  <=>  A^H lam A - lam = rhs  <=>  lam = lyap(A^H, -rhs)
        return implicit_pullback(
            _residual, X, [A, Q], X_bar,
            solve_adjoint=lambda rhs: self._same_equation(A.conj().mT, -rhs),
        )

    def pushforward(self, inputs, outputs, tangents):
        A, Q = inputs
        (X,) = outputs
        # (dF/dX) y = rhs  <=>  A y A^H - y = rhs  <=>  y = lyap(A, -rhs)
        return [
            implicit_pushforward(
                _residual, X, [A, Q], tangents,
                solve_tangent=lambda rhs: self._same_equation(A, -rhs),
            )
        ]


def _residual(X, A, Q):
    """F(X; A, Q) = A X A^H - X + Q."""
    return A @ X @ A.conj().mT - X + Q


# ---------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------


def solve_discrete_lyapunov(
    A,
    Q,
    method: Literal["auto", "doubling", "schur"] = "auto",
    *,
    tol: float | None = None,
    max_iter: int = 100,
    on_failure: Literal["nan", "raise"] = "nan",
) -> TensorVariable:
    r"""Solve the discrete Lyapunov equation :math:`A X A^H - X + Q = 0` for ``X``.

    One fused Numba kernel; gradients by the implicit function theorem.

    Parameters
    ----------
    A : tensor, shape (..., n, n)
        Transition matrix.  float32, float64 or complex128.
    Q : tensor, shape (..., n, n)
        Right-hand side (a covariance for the stationary-covariance use).
        Leading dimensions of ``A`` and ``Q`` broadcast.
    method : {"auto", "doubling", "schur"}
        See the module docstring.  ``"doubling"`` requires spectral radius < 1.
    tol : float, optional
        Relative stopping tolerance of the doubling iteration, per entry
        (``|gamma_new - gamma|_ij <= tol * |gamma_new|_ij`` for every ``i, j``);
        machine epsilon by default.
    max_iter : int
        Maximum doubling iterations (each doubles the number of summed terms).
    on_failure : {"nan", "raise"}
        ``"nan"``: an all-NaN ``X`` when there is no unique finite solution, the
        iteration did not converge or the input is not finite (samplers reject
        the point).  ``"raise"``: raise ``FloatingPointError`` at run time.

    Returns
    -------
    X : tensor, shape (broadcast(...), n, n)

    Replaces the Scan users write for the doubling loop::

        def step(alpha, gamma, tol):
            new_gamma = gamma + alpha @ gamma @ alpha.T
            return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)
        (_, gammas), _ = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[tol], n_steps=100)
        X = gammas[-1]

    Examples
    --------
    >>> import numpy as np, pytensor.tensor as pt, iterops
    >>> A = pt.matrix("A"); Q = pt.matrix("Q")
    >>> X = iterops.solve_discrete_lyapunov(A, Q)
    >>> X.eval({A: [[0.5, 0.1], [0.0, 0.3]], Q: np.eye(2)}).round(4)  # = scipy's solution
    array([[1.3532, 0.0388],
           [0.0388, 1.0989]])
    """
    func = "solve_discrete_lyapunov"
    if method not in _METHODS:
        raise ValueError(f"{func}: method must be one of {sorted(_METHODS)}, got {method!r}")
    if on_failure not in _ON_FAILURE:
        raise ValueError(f"{func}: on_failure must be one of {_ON_FAILURE}, got {on_failure!r}")
    if int(max_iter) < 1:
        raise ValueError(f"{func}: max_iter must be >= 1, got {max_iter}")
    if tol is not None and not (float(tol) >= 0.0):
        raise ValueError(f"{func}: tol must be >= 0, got {tol}")
    A = as_tensor(func, "A", A, min_ndim=2)
    Q = as_tensor(func, "Q", Q, min_ndim=2)
    check_square(func, "A", A)
    check_square(func, "Q", Q)
    check_dim_match(func, "A", A.type.shape[-1], "Q", Q.type.shape[-1], "A and Q must have the same n (last dimension)")
    op = DiscreteLyapunov(method=method, tol=tol or 0.0, max_iter=max_iter, on_failure=on_failure)
    return apply_batched(op, A, Q)


@node_rewriter([SolveBilinearDiscreteLyapunov])
def builtin_lyapunov_to_fused(fgraph, node):
    """PyTensor's ``pt.linalg.solve_discrete_lyapunov(A, Q)`` (``method="bilinear"``, its default; pymc-extras'
    stationary initialisation of SARIMAX and VARMAX) -> :func:`solve_discrete_lyapunov`.

    Both return the unique solution of ``A X A^T - X + Q = 0``, to rounding; the built-in gets there by three LU
    solves, two real Schur forms and a Sylvester solve, and its gradient by autodiff through them, the fused Op in
    one kernel with an implicit gradient (n = 14: forward about 4x, forward + gradient about 6x cheaper).

    Real float outputs only (complex ones keep the built-in).  ``A`` and ``Q`` are cast to the output's dtype
    first, as the built-in's solves upcast them (float32 inputs give a float64 ``X``).  Where the equation has no
    unique solution (``lambda_i lambda_j = 1``, within ``1e3`` eps: an exact unit root) the built-in returns
    rounding noise, and the fused Op its documented failure value, an all-NaN ``X``.

    Registered by :mod:`iterops.rewrites` in ``canonicalize``, so PyMC's pre-gradient pass differentiates the
    fused Op; off with ``mode.excluding("iterops")`` or :func:`iterops.fusion.disabled`."""
    (X,) = node.outputs
    A, Q = node.inputs
    if X.type.dtype not in ("float32", "float64"):  # a complex A or Q gives a complex X
        return None
    new = solve_discrete_lyapunov(pt.cast(A, X.type.dtype), pt.cast(Q, X.type.dtype))
    if new.type.dtype != X.type.dtype or new.type.ndim != X.type.ndim:
        return None
    copy_stack_trace(X, new)
    return [new]
