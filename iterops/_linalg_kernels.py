"""Small dense-matrix helpers shared by iterops' Numba kernels.

State-space matrices are small (a handful of states), so hand-written loops beat a BLAS call
(no call overhead, no allocation) for products of at most :data:`SMALL` ``**3`` multiply-adds (every
dimension at most :data:`SMALL`, or a thin one: a rank-one update, a matrix-vector product); larger
products go to BLAS.  Every
helper writes into a preallocated ``out`` so that a kernel's loop allocates nothing.

* :func:`matmul` -- ``out = alpha X Y + beta out``; pass ``X.T`` / ``Y.T`` for products with a
  transposed operand (a transposed view costs nothing), ``beta = 1`` to accumulate;
  :func:`mm` is its allocating form, :func:`congruence` is ``X^T G X``;
* :func:`sym_inplace`, :func:`sym_into`, :func:`sym_finite` -- the symmetric part ``(X + X^T) / 2``
  (the last also says whether it is finite);
* :func:`cholesky`, :func:`cho_solve_vec`, :func:`cho_inverse` -- a lower Cholesky factor that
  reports failure as a value, and solves with it;
* :func:`copy_into` -- ``out[...] = src`` by loops;
* :func:`converged` -- the scale-free stop test of the covariance-like iterations (Kalman steady state, DARE
  doubling): every entry's change relative to its own scale;
* :func:`borrowed`, :func:`carve` -- work arrays that cost nothing to pass to a function (the latter
  carved out of one allocation).

Compile time: a kernel calls these helpers, and Numba links and re-optimizes each callee's code
into every caller that is compiled on its own, so the helpers here are small leaves.  Kernels
copy arrays with :func:`copy_into` rather than a slice assignment (``out[:] = src``), which
compiles Numba's shape-mismatch error message (string formatting, about ten functions) into
every kernel that uses it.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from iterops._fused import data_ptr

__all__ = [
    "SMALL", "FLOAT_MAX", "matmul", "mm", "congruence", "sym_inplace", "sym_into", "sym_finite", "cholesky",
    "cho_solve_vec", "cho_inverse", "copy_into", "converged", "transpose_into", "transpose_finite", "borrowed", "flat", "carve",
]

SMALL = 10  #: matrix products of more than SMALL**3 multiply-adds go to BLAS
FLOAT_MAX = float(np.finfo(np.float64).max)  #: |x| <= FLOAT_MAX: x is finite (one comparison, which vectorises)


def _dot_into(X, Y, out):
    """``out = X @ Y`` by BLAS with no copy, when that is safe: returns False (nothing written) unless X and Y
    are typed C- or F-contiguous (a plain array or its transpose), ``out`` C-contiguous, all float64, and
    ``out`` shares no memory with X or Y (gemm's output must not alias its operands).  Numba only."""
    raise NotImplementedError("_dot_into is only called from Numba kernels")


@overload(_dot_into)
def _dot_into_overload(X, Y, out):
    f64 = numba.types.float64
    if not (X.layout in "CF" and Y.layout in "CF" and out.layout == "C" and X.dtype == Y.dtype == out.dtype == f64):
        return lambda X, Y, out: False  # 'A' views (slices): np.dot would warn, and copy anyway

    def impl(X, Y, out):
        o, x, y = out.ctypes.data, X.ctypes.data, Y.ctypes.data
        if (x < o + out.nbytes and o < x + X.nbytes) or (y < o + out.nbytes and o < y + Y.nbytes):
            return False
        np.dot(X, Y, out)
        return True

    return impl


@numba.njit(cache=True)
def matmul(X, Y, out, alpha=1.0, beta=0.0):
    """out = alpha X @ Y + beta out (loops up to :data:`SMALL` ``**3`` multiply-adds, BLAS above).

    ``X``/``Y`` may be transposed or sliced views; with ``beta = 0`` what ``out`` held is ignored.
    (A thin product such as the rank-one ``(m, 1) @ (1, m)`` of a univariate filter's adjoint takes
    the loops: BLAS would cost two contiguous copies and an allocation for ``m^2`` multiply-adds.)
    BLAS writes ``out`` directly (no operand copies, no product allocated) when ``alpha = 1``, ``beta = 0``
    and the operands are whole matrices or their transposes (:func:`_dot_into`)."""
    n_, k_ = X.shape
    m_ = Y.shape[1]
    if n_ * m_ * k_ > SMALL * SMALL * SMALL:
        if alpha == 1.0 and beta == 0.0 and _dot_into(X, Y, out):
            return
        prod = np.dot(np.ascontiguousarray(X), np.ascontiguousarray(Y))
        for i in range(n_):
            for j in range(m_):
                out[i, j] = alpha * prod[i, j] + (beta * out[i, j] if beta != 0.0 else 0.0)
        return
    for i in range(n_):
        for j in range(m_):
            s = 0.0
            for l in range(k_):
                s += X[i, l] * Y[l, j]
            out[i, j] = alpha * s + (beta * out[i, j] if beta != 0.0 else 0.0)


@numba.njit(cache=True)
def mm(X, Y):
    """X @ Y, a new (C-contiguous) array: :func:`matmul` into a fresh output."""
    out = np.empty((X.shape[0], Y.shape[1]), dtype=X.dtype)
    matmul(X, Y, out)
    return out


@numba.njit(cache=True)
def congruence(X, G, W, out, beta):
    """out = X^T G X + beta out for square X, G (``W`` scratch)."""
    matmul(G, X, W)
    matmul(X.T, W, out, 1.0, beta)


@numba.njit(cache=True)
def sym_inplace(X):
    """X <- (X + X^T) / 2 for a square X."""
    for i in range(X.shape[0]):
        for j in range(i + 1, X.shape[0]):
            s = 0.5 * (X[i, j] + X[j, i])
            X[i, j] = s
            X[j, i] = s


@numba.njit(cache=True)
def sym_into(X, out):
    """out = (X + X^T) / 2 for a square X (``out`` not ``X``), whole rows: exactly symmetric (the sum
    commutes), and twice as fast as one triangle mirrored at the sizes of a filter step."""
    for i in range(X.shape[0]):
        for j in range(X.shape[0]):
            out[i, j] = 0.5 * (X[i, j] + X[j, i])


@numba.njit(cache=True)
def sym_finite(X, out):
    """out = (X + X^T) / 2 for a square X (as :func:`sym_into`); returns True when every entry is
    finite."""
    sym_into(X, out)
    return all_finite(out)


@numba.njit(cache=True)
def cholesky(F, L, k):
    """Lower Cholesky of ``F[:k, :k]`` into ``L[:k, :k]`` (``L`` may be ``F``); False if not PD / not finite.
    For a complex ``F``: the factor of ``L L^T`` (no conjugation, an analytic function of ``F``), tested on real parts."""
    for j in range(k):
        s = F[j, j]
        for l in range(j):
            s -= L[j, l] * L[j, l]
        if not (s.real > 0.0) or not np.isfinite(s):  # .real: a complex F (complex-step tangents) takes the same test
            return False
        ljj = np.sqrt(s)
        L[j, j] = ljj
        for i in range(j + 1, k):
            s = F[i, j]
            for l in range(j):
                s -= L[i, l] * L[j, l]
            L[i, j] = s / ljj
    return True


@numba.njit(cache=True, inline="always")
def cho_solve_vec(L, k, b, x):
    """x[:k] = (L L^T)^{-1} b[:k] with the factor in ``L[:k, :k]``; ``x`` may alias ``b``."""
    for i in range(k):
        s = b[i]
        for l in range(i):
            s -= L[i, l] * x[l]
        x[i] = s / L[i, i]
    for i in range(k - 1, -1, -1):
        s = x[i]
        for l in range(i + 1, k):
            s -= L[l, i] * x[l]
        x[i] = s / L[i, i]


@numba.njit(cache=True)
def cho_inverse(L, k, Finv):
    """Finv[:k, :k] = (L L^T)^{-1} from the Cholesky factor in L[:k, :k]."""
    for jj in range(k):
        for i in range(k):
            Finv[i, jj] = 1.0 if i == jj else 0.0
        cho_solve_vec(L, k, Finv[:, jj], Finv[:, jj])


@numba.njit(cache=True, inline="always")
def copy_into(src, out):
    """out[...] = src for two arrays of the same shape (no shape check: the caller's shapes agree)."""
    for idx in np.ndindex(src.shape):
        out[idx] = src[idx]


@numba.njit(cache=True, inline="always")
def transpose_into(X, out):
    """out = X^T for a square X (no shape check)."""
    for i in range(X.shape[0]):
        for j in range(X.shape[1]):
            out[j, i] = X[i, j]


@numba.njit(cache=True)
def transpose_finite(X, out):
    """out = X^T for a square X (as :func:`transpose_into`); returns True when every entry is finite.  The test
    rides on the copy (``x * 0`` summed by rows, as :func:`all_finite`) and costs nothing measurable."""
    total = 0.0
    for i in range(X.shape[0]):
        row = 0.0
        for j in range(X.shape[1]):
            x = X[i, j]
            out[j, i] = x
            row += x * 0.0
        total += row
    return total == 0.0


@numba.njit(cache=True, inline="always")
def borrowed(a):
    """A view of the C-contiguous ``a`` that Numba does not reference-count.

    Numba increments and decrements the reference count of every array argument of every call,
    each array of a NamedTuple argument included, with atomic operations: passing the work
    NamedTuples to the stages of a filter step costs about a microsecond per step.  A borrowed
    array (over ``a``'s data, without ``a``'s reference count) costs nothing to pass.  The caller
    keeps ``a`` alive until the borrowed array's last use (:func:`iterops._fused.keep_alive`)."""
    return numba.carray(data_ptr(a), a.shape)


@numba.njit(cache=True, inline="always")
def flat(X, size):
    """A :func:`borrowed` 1-d view of the first ``size`` entries of the C-contiguous ``X`` (the column of an
    (m, 1) work array as a vector; no run-time reshape call)."""
    return numba.carray(data_ptr(X), size)


@numba.njit(cache=True, inline="always")
def carve(buf, start, shape):
    """A :func:`borrowed` array of ``shape`` over ``buf[start:]`` (``buf`` 1-d, C-contiguous): work arrays
    carved out of one allocation (one ``malloc`` per kernel call instead of one per array; the caller keeps
    ``buf`` alive past the last use)."""
    return numba.carray(data_ptr(buf[start:]), shape)


# ---------------------------------------------------------------------------
# Structured (sparse) products: skip the zero entries of a factor (shift, companion and identity
# blocks of a state-space model); the caller decides the exact fallback to the dense product.
# ---------------------------------------------------------------------------

__all__ += ["nonzero_index", "spmm", "spmm_rows", "all_finite"]


@numba.njit(cache=True)
def nonzero_index(X, idx):
    """Row-wise index of the nonzero entries of ``X`` (n, m) into ``idx`` (n, m + 1) int64:
    ``idx[i, 0]`` = their number in row i, ``idx[i, 1:1 + idx[i, 0]]`` = their columns, ascending.

    Returns True when a product that skips the zeros pays off and is exact: every entry of X is
    finite and at most half of them are nonzero (a NaN counts as nonzero)."""
    n, m = X.shape
    nnz = 0
    finite = True
    for i in range(n):
        c = 0
        for j in range(m):
            x = X[i, j]
            if x != 0.0:
                c += 1
                idx[i, c] = j
                finite = finite and np.isfinite(x)
        idx[i, 0] = c
        nnz += c
    return finite and 2 * nnz <= n * m


@numba.njit(cache=True)
def spmm(X, idx, Y, out, alpha=1.0, beta=0.0):
    """out = alpha X Y + beta out over the nonzero entries of X only (``idx``: :func:`nonzero_index` of X;
    X, Y, out may be transposed views).  Each entry sums its terms in the order of :func:`matmul`'s loops,
    so for finite Y the result is the dense product's to rounding (bitwise for ``alpha = 1, beta = 0``
    below :data:`SMALL`).  Returns a float that is not finite when an entry of ``alpha X Y`` is not (the
    caller then takes the dense product, in which ``0 * inf = NaN``), 0 otherwise.

    With ``beta = 0``: :func:`spmm_rows`, then the test.  A caller that reads the product anyway (a
    transposed copy, :func:`transpose_finite`) or does not need the test calls :func:`spmm_rows` itself: the
    test is a third of the product's time at m = 13."""
    if beta != 0.0:
        return _spmm_accumulate(X, idx, Y, out, alpha, beta)
    spmm_rows(X, idx, Y, out, alpha)
    return 0.0 if all_finite(out) else np.inf


@numba.njit(cache=True)
def spmm_rows(X, idx, Y, out, alpha=1.0):
    """out = alpha X Y over the nonzero entries of X (as :func:`spmm` with ``beta = 0``), without its test.

    Each row of ``out`` is built as a sum of scaled rows of Y (``out[i] += alpha X[i, l] Y[l]``, the same terms
    in the same order per entry; ``alpha`` scales X's entry, exact for ``alpha = +-1``): no reduction in the
    inner loop, which runs along a row of Y (contiguous for a C-ordered Y) and vectorises."""
    n = Y.shape[1]
    for i in range(X.shape[0]):
        c = idx[i, 0]
        if c == 0:
            for j in range(n):
                out[i, j] = 0.0
            continue
        l = idx[i, 1]
        x = alpha * X[i, l]
        for j in range(n):  # the first term assigns: no zeroing pass
            out[i, j] = x * Y[l, j]
        for q in range(2, c + 1):
            l = idx[i, q]
            x = alpha * X[i, l]
            for j in range(n):
                out[i, j] += x * Y[l, j]


@numba.njit(cache=True)
def _spmm_accumulate(X, idx, Y, out, alpha, beta):
    """:func:`spmm` with ``beta != 0``: entry by entry."""
    total = 0.0
    for i in range(X.shape[0]):
        c = idx[i, 0]
        row = 0.0  # the sum by rows: short dependency chains
        for j in range(Y.shape[1]):
            s = 0.0
            for q in range(1, c + 1):
                l = idx[i, q]
                s += X[i, l] * Y[l, j]
            s *= alpha
            row += s
            out[i, j] = s + beta * out[i, j]
        total += row
    return total


@numba.njit(cache=True)
def all_finite(X):
    """True when every entry of the 2-d X is finite: ``x * 0`` is 0 for a finite x, NaN otherwise, summed by
    rows (short dependency chains, no reduction over the whole matrix)."""
    total = 0.0
    for i in range(X.shape[0]):
        s = 0.0
        for j in range(X.shape[1]):
            s += X[i, j] * 0.0
        total += s
    return total == 0.0


@numba.njit(cache=True, inline="always")
def converged(new, old, tol, whole):
    """Stop test of an iteration on symmetric positive semi-definite matrices (a Kalman filter's predicted
    covariance, the DARE's doubling iterate): True when every entry moved by at most ``tol`` relative to
    its own scale, the geometric mean of its two variances::

        |new_ii - old_ii| <= tol |new_ii|,   |new_ij - old_ij| <= tol sqrt|new_ii| sqrt|new_jj|

    over the upper triangle of ``old`` (every entry when ``whole``: an ``old`` that need not be symmetric).
    The diagonal is tested first (no square root): far from convergence the first variance fails and the
    test costs one comparison.  A zero variance demands an unchanged row; NaN fails.  (The magnitudes of
    the diagonal: an indefinite iterate, such as the DARE's for an indefinite Q, gets the same test.)

    Scale-free: rescaling the states by a diagonal ``D`` (``new -> D new D``, ``old -> D old D``) multiplies
    both sides of every inequality by ``|d_i d_j|``, so the test decides the same for every scaling of
    the states.  In the scaling where every nonzero variance of ``new`` is 1, ``new`` is a correlation
    matrix (entries at most 1 in magnitude, Cauchy-Schwarz) and the test is ``max |new - old| <= tol``:
    an absolute bound on every entry in units where the matrix is of order one, which is what
    ``tol`` = a few dozen ulps means.  A test relative to the largest entry (``max|new - old| <= tol
    max|new|``) is not scale-free: a state whose variance is ``1e-16`` of another's passes it whatever its
    own change.  It is at least as strict as that test (``sqrt(new_ii new_jj) <= max|new|``)."""
    m = new.shape[0]
    for i in range(m):
        if not abs(new[i, i] - old[i, i]) <= tol * abs(new[i, i]):
            return False
    for i in range(m):
        si = tol * np.sqrt(abs(new[i, i]))
        for j in range(i + 1, m):
            b = si * np.sqrt(abs(new[j, j]))
            if not abs(new[i, j] - old[i, j]) <= b:
                return False
            if whole and not abs(new[i, j] - old[j, i]) <= b:
                return False
    return True
