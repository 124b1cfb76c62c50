r"""Second derivatives of :func:`iterops.ts.kalman_filter`: one Numba kernel for the pullback of its adjoint Op.

:class:`~iterops.ts.kalman.KalmanFilterGrad` computes ``u = J(x)^T g`` (``x`` the ten inputs
``y, a0, P0, c, d, T, Z, R, H, Q``, ``g`` the cotangents of the eight outputs, ``J`` the filter's Jacobian).
Its pullback, with cotangent ``w`` of ``u`` (``w`` has the shapes of ``x``), is

.. math::
    \bar x = \nabla_x \langle w, J(x)^T g\rangle = \tfrac{d}{d\varepsilon} J(x + \varepsilon w)^T g \big|_0,
    \qquad \bar g = J(x)\, w ,

the Hessian-vector products that ``pytensor.hessian``, PyMC's ``compile_d2logp``, pymc-extras'
``find_MAP(compute_hessian=True)`` and ``fit_laplace`` ask for (the first equality is the symmetry of second
derivatives).  :func:`hessian_vector_kernel` computes both in one forward and one reverse pass: forward mode
over the hand-written reverse mode, its tangents carried by complex arithmetic.  The pass runs on
``x + i h w`` with the step ``h = 2^-100 / max|w|``; every operation of the recursion is analytic (products,
sums, divisions, a Cholesky factor without conjugation, ``sqrt`` and ``log`` near the positive reals), so

.. math::
    f(x + i h w) = f(x) + i h\, Df(x)[w] + O(h^2) ,

and ``Im(.)/h`` of the forward outputs is ``J w`` and of the reverse pass's input cotangents is ``x_bar``.
There is no subtraction of nearby values (the complex-step method: Squire & Trapp 1998; Martins, Sturdza &
Alonso 2003), so the result is exact to rounding: the truncation term is ``(h max|w|)^2 = 2^-200`` relative.
Branches (the positive-definiteness test, missing components) read real parts.

The recursion is the filter's (module docstring of :mod:`iterops.ts.kalman`), one step::

    S = sym(P);  v = y - d - Z a;  F = Z S Z^T + sym(H) + j I;  F_oo = F on observed rows and columns, 1 on the
    missing diagonal;  M = S Z_o^T;  u = F_oo^{-1} v_o;  K = M F_oo^{-1}
    ll = -(k log 2 pi + log|F_oo| + v_o^T u) / 2;  a_f = a + M u;  P_f = S - K M^T - j K K^T + j I
    a' = T a_f + c;  P' = T P_f T^T + R sym(Q) R^T

and its reverse, stage by stage, for the cotangents of all eight outputs (:func:`_update_vjp`,
:func:`_predict_vjp`), from what the forward pass taped of each step (:class:`_Tape`).  Paths: missing components
(NaN or ``missing_value``), time-varying matrices, ``cov_jitter``.  Products with ``T`` and ``Z`` skip their zeros
when at most half are nonzero (:class:`_Sparse`, :class:`_Update`); static ``R``, ``Q`` are reversed once, on the
sum of the steps' cotangents.  The univariate update and the steady-state shortcut of the first-order kernels are
ways of computing this recursion, to rounding: the second derivatives are those of the recursion itself, every step
run in full.  The diffuse filter's adjoint is not covered (its pullback raises ``NotImplementedError``).

Shapes: as the filter's (``y`` (n, p), system matrices with a time axis of 1 or n); ``cot`` as
:class:`~iterops.ts._kalman_adjoint.Cotangents` (a zero-row per-step cotangent is disconnected); ``grad`` (written)
the input cotangents ``x_bar``; ``tangent`` (written) ``J w`` of each output whose cotangent is connected (a
zero-row array is left alone), the log-likelihood's as a (1,) array.

The real parts of the same pass are the filter's outputs and the first-order gradient ``J(x)^T g`` (the
truncation term is again ``2^-200`` relative): written to ``value`` when asked (:class:`SecondWanted`), so that a
graph holding both the adjoint Op and this pullback runs one kernel
(:func:`iterops.ts._kalman_second.gradient_from_hvp`).

Failure value: where some step's ``F_oo`` is not positive definite or not finite (the filter's
``loglik = -inf``), every entry of ``grad``, ``tangent`` and ``value`` is NaN; where some entry of ``w`` exceeds
``2^900`` in magnitude or is not finite, every entry of ``grad`` and ``tangent`` is NaN and ``value`` is the
unperturbed pass's gradient.

It replaces PyTensor's reverse mode twice through a ``pytensor.scan`` of the recursion: the filter's Scan, its
gradient Scan and their reverse (nested Scans that took minutes to compile under Numba).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from iterops._constants import LOG_2PI
from iterops._linalg_kernels import cho_inverse, cholesky, copy_into, matmul, nonzero_index, spmm_rows, sym_into
from iterops.ts._kalman_adjoint import Cotangents, InputCotangents
from iterops.ts._kalman_steps import System, missing, predict_mean, ti

__all__ = ["hessian_vector_kernel", "Tangents", "SecondWanted"]

#: the complex step is ``STEP / max|w|``: ``(h max|w|)^2 = 2^-200``, far below rounding, and no square of an
#: imaginary part underflows
STEP = 2.0**-100
#: the smallest step taken (a direction of magnitude up to ``2^900``); a larger direction gives NaN
MIN_STEP = 2.0**-1000


class SecondWanted(NamedTuple):
    """What :func:`hessian_vector_kernel` computes beyond ``grad`` and ``tangent``: the cotangents of ``T``, ``Z``
    (as :class:`~iterops.ts._kalman_steps.Wanted`), and ``value``, the first-order gradient ``J(x)^T g``."""

    T: bool
    Z: bool
    value: bool


#: ``J w``, the forward tangent of each filter output (written): a :class:`Cotangents` of output-shaped arrays, the
#: log-likelihood's a (1,) array; a zero-row array is not wanted
Tangents = Cotangents


class _Update(NamedTuple):
    """One step's measurement update (complex), written by :func:`_update`."""

    S: np.ndarray  #: (m, m) sym(P)
    v: np.ndarray  #: (p,) y - d - Z a
    vo: np.ndarray  #: (p,) v on observed components, 0 on missing ones
    ZS: np.ndarray  #: (p, m) Z S
    F: np.ndarray  #: (p, p)
    L: np.ndarray  #: (p, p) Cholesky factor of F_oo (lower triangle)
    Finv: np.ndarray  #: (p, p) F_oo^{-1}
    M: np.ndarray  #: (m, p) S Z_o^T
    u: np.ndarray  #: (p,) F_oo^{-1} v_o
    K: np.ndarray  #: (m, p) M F_oo^{-1}
    af: np.ndarray  #: (m,)
    Pf: np.ndarray  #: (m, m)
    Zi: np.ndarray  #: (p, m + 1) int64: the nonzeros of this step's Z (:func:`nonzero_index`)
    Zs: np.ndarray  #: (1,) bool: products over them pay off (else dense)


class _Tape(NamedTuple):
    """What the reverse pass reads of each forward step's update (complex, one row per step): the rest is recomputed
    from the stored predictions (``S = sym(P)``, ``M = S Z_o^T = (Z_o S)^T``) at O(m^2 + m p) per step."""

    ZS: np.ndarray  #: (n, p, m)
    Finv: np.ndarray  #: (n, p, p)
    u: np.ndarray  #: (n, p)
    vo: np.ndarray  #: (n, p)
    af: np.ndarray  #: (n, m)
    Pf: np.ndarray  #: (n, m, m), or (0, m, m) when T's cotangent is not wanted (only its reverse reads P_f)


@numba.njit(cache=True)
def _tape(n, m, p, want_T):
    c = _complex
    return _Tape(c((n, p, m)), c((n, p, p)), c((n, p)), c((n, p)), c((n, m)), c((n if want_T else 0, m, m)))


@numba.njit(cache=True)
def _record(u, tape, t):
    """Row ``t`` of the :class:`_Tape` from the step's :class:`_Update` ``u``."""
    copy_into(u.ZS, tape.ZS[t])
    copy_into(u.Finv, tape.Finv[t])
    copy_into(u.u, tape.u[t])
    copy_into(u.vo, tape.vo[t])
    copy_into(u.af, tape.af[t])
    if tape.Pf.shape[0] > 0:
        copy_into(u.Pf, tape.Pf[t])


@numba.njit(cache=True)
def _replay(P, o, u, tape, t):
    """The :class:`_Update` of step ``t`` for the reverse pass: the taped rows, ``S = sym(P)`` and ``M`` into ``u``."""
    sym_into(P, u.S)
    m, p = u.M.shape
    ZS = tape.ZS[t]
    for i in range(m):
        for j in range(p):
            u.M[i, j] = ZS[j, i] * o[j]
    Pf = tape.Pf[t] if tape.Pf.shape[0] > 0 else u.Pf
    return _Update(u.S, u.v, tape.vo[t], ZS, u.F, u.L, tape.Finv[t], u.M, tape.u[t], u.K, tape.af[t], Pf, u.Zi, u.Zs)


class _Rows(NamedTuple):
    """The rows of one step's input cotangents that its measurement update adds to (complex)."""

    y: np.ndarray  #: (p,)
    d: np.ndarray  #: (p,)
    Z: np.ndarray  #: (p, m)
    H: np.ndarray  #: (p, p)


class _Reverse(NamedTuple):
    """Work arrays of one reverse step (complex)."""

    af: np.ndarray  #: (m,) cotangent of a_f
    Pf: np.ndarray  #: (m, m) cotangent of P_f
    S: np.ndarray  #: (m, m) cotangent of S = sym(P) (:func:`_update_vjp`); scratch of :func:`_predict_vjp` before
    G2: np.ndarray  #: (m, m) G + G^T, G the cotangent of the next prediction's covariance
    W: np.ndarray  #: (m, m) scratch
    X: np.ndarray  #: (p, p) F_oo^{-1} + j F_oo^{-1} F_oo^{-1}
    Y: np.ndarray  #: (p, p) cotangent of X, then of F_oo^{-1}
    Fb: np.ndarray  #: (p, p) cotangent of F
    Wp: np.ndarray  #: (p, p) scratch
    Mb: np.ndarray  #: (m, p) cotangent of M
    Wmp: np.ndarray  #: (m, p) scratch
    Wpm: np.ndarray  #: (p, m) scratch
    ub: np.ndarray  #: (p,)
    vb: np.ndarray  #: (p,)
    RQ: np.ndarray  #: (m, r) R sym(Q)
    Qs: np.ndarray  #: (r, r) sym(Q)
    Wr: np.ndarray  #: (m, r) scratch


@numba.njit(cache=True, inline="always")
def _complex(shape):
    """An uninitialized complex128 array."""
    return np.empty(shape, dtype=np.complex128)


@numba.njit(cache=True)
def _update_work(m, p):
    c = _complex
    return _Update(c((m, m)), c(p), c(p), c((p, m)), c((p, p)), c((p, p)), c((p, p)), c((m, p)), c(p), c((m, p)),
                   c(m), c((m, m)), np.empty((p, m + 1), dtype=np.int64), np.zeros(1, np.bool_))


@numba.njit(cache=True)
def _reverse_work(m, p, r):
    c = _complex
    return _Reverse(c(m), c((m, m)), c((m, m)), c((m, m)), c((m, m)), c((p, p)), c((p, p)), c((p, p)), c((p, p)),
                    c((m, p)), c((m, p)), c((p, m)), c(p), c(p), c((m, r)), c((r, r)), c((m, r)))


@numba.njit(cache=True)
def _perturbed(X, W, h):
    """``X + i h W`` (complex128, C-contiguous, X's shape); ``X`` when ``h`` is 0 (whatever ``W`` holds)."""
    out = np.empty(X.shape, dtype=np.complex128)
    xf, wf, of = X.reshape(-1), W.reshape(-1), out.reshape(-1)
    for i in range(xf.size):
        of[i] = complex(xf[i], h * wf[i] if h > 0.0 else 0.0)
    return out


@numba.njit(cache=True)
def _imag_into(Z, h, out):
    """``out = Im(Z) / h`` (same shapes, C-contiguous)."""
    zf, of = Z.reshape(-1), out.reshape(-1)
    for i in range(zf.size):
        of[i] = zf[i].imag / h


@numba.njit(cache=True)
def _step_size(w):
    """``STEP / max|w|`` over every entry of the direction ``w`` (an :class:`InputCotangents`); ``STEP`` when it
    is zero or not finite (a NaN direction gives NaN results anyway)."""
    s = w.system
    big = max(_absmax(w.y), _absmax(w.a0), _absmax(w.P0), _absmax(s.c), _absmax(s.d), _absmax(s.T), _absmax(s.Z),
              _absmax(s.R), _absmax(s.H), _absmax(s.Q))
    return STEP / big if 0.0 < big < np.inf else STEP


@numba.njit(cache=True)
def _absmax(X):
    """``max |X|`` (0 for an empty X; NaN propagates as not finite: ``max`` keeps the first NaN)."""
    big = 0.0
    for x in X.reshape(-1):
        if not abs(x) <= big:
            big = abs(x)
    return big


@numba.njit(cache=True)
def _all_finite(w):
    """Whether every entry of the direction ``w`` (an :class:`InputCotangents`) is finite."""
    s = w.system
    for X in (w.y, w.P0, s.c, s.d):
        if not np.all(np.isfinite(X)):
            return False
    for X in (s.T, s.Z, s.R, s.H, s.Q):
        if not np.all(np.isfinite(X)):
            return False
    return bool(np.all(np.isfinite(w.a0)))


@numba.njit(cache=True)
def _observations(y, wy, h, options):
    """``(y + i h w_y`` (``y`` when ``h`` is 0) with 0 on missing entries, the observed mask: 1.0 observed,
    0.0 missing)."""
    n, p = y.shape
    yc = np.zeros((n, p), dtype=np.complex128)
    o = np.zeros((n, p))
    for t in range(n):
        for i in range(p):
            if not missing(y[t, i], options):
                yc[t, i] = complex(y[t, i], h * wy[t, i] if h > 0.0 else 0.0)
                o[t, i] = 1.0
    return yc, o


@numba.njit(cache=True)
def _sym_add(X, out, alpha):
    """``out += alpha sym(X)`` for a square X."""
    for i in range(X.shape[0]):
        for j in range(X.shape[0]):
            out[i, j] += alpha * 0.5 * (X[i, j] + X[j, i])


@numba.njit(cache=True)
def _update(a, P, y, o, d, Z, H, jitter, w):
    """The measurement update of one step into ``w`` (:class:`_Update`); returns ``(ll, ok)``, ``ok`` False where
    ``F_oo`` is not positive definite (the real parts' Cholesky fails) or not finite."""
    m, p = a.shape[0], y.shape[0]
    sym_into(P, w.S)
    k = 0.0
    for i in range(p):
        s = y[i] - d[i]
        for j in range(m):
            s -= Z[i, j] * a[j]
        w.v[i] = s
        w.vo[i] = s * o[i]
        k += o[i]
    if w.Zs[0]:
        spmm_rows(Z, w.Zi, w.S, w.ZS)
    else:
        matmul(Z, w.S, w.ZS)
    matmul(w.ZS, Z.T, w.F)
    for i in range(p):
        for j in range(p):
            w.F[i, j] += 0.5 * (H[i, j] + H[j, i])
        w.F[i, i] += jitter
    for i in range(p):  # F_oo: observed rows and columns, ones on the missing diagonal
        for j in range(p):
            w.L[i, j] = w.F[i, j] * (o[i] * o[j]) + (1.0 - o[i] if i == j else 0.0)
    if not cholesky(w.L, w.L, p):
        return complex(-np.inf, 0.0), False
    cho_inverse(w.L, p, w.Finv)
    logdet = 0j
    for i in range(p):
        logdet += 2.0 * np.log(w.L[i, i])
    for i in range(m):
        for j in range(p):
            w.M[i, j] = w.ZS[j, i] * o[j]  # M = S Z_o^T = (Z_o S)^T
    quad = 0j
    for i in range(p):
        s = 0j
        for j in range(p):
            s += w.Finv[i, j] * w.vo[j]
        w.u[i] = s
        quad += w.vo[i] * s
    matmul(w.M, w.Finv, w.K)
    for i in range(m):
        s = a[i]
        for j in range(p):
            s += w.M[i, j] * w.u[j]
        w.af[i] = s
    matmul(w.K, w.M.T, w.Pf, -1.0, 0.0)
    if jitter != 0.0:
        matmul(w.K, w.K.T, w.Pf, -jitter, 1.0)
    for i in range(m):
        for j in range(m):
            w.Pf[i, j] += w.S[i, j]
        w.Pf[i, i] += jitter
    return -0.5 * (k * LOG_2PI + logdet + quad), True


@numba.njit(cache=True)
def _rqr(R, Q, rw, out):
    """``out = R sym(Q) R^T``; leaves ``rw.Qs = sym(Q)``, ``rw.RQ = R sym(Q)``."""
    sym_into(Q, rw.Qs)
    matmul(R, rw.Qs, rw.RQ)
    matmul(rw.RQ, R.T, out)


class _Sparse(NamedTuple):
    """The nonzeros of ``T`` and ``T^T`` (:func:`iterops._linalg_kernels.nonzero_index`) and whether products over
    them pay off (finite, at most half nonzero; state-space models' shift, companion and identity blocks)."""

    T: np.ndarray  #: (m, m + 1) int64
    Tt: np.ndarray  #: (m, m + 1) int64
    use: np.ndarray  #: (1,) bool


@numba.njit(cache=True)
def _sparse(m):
    return _Sparse(np.empty((m, m + 1), dtype=np.int64), np.empty((m, m + 1), dtype=np.int64), np.zeros(1, np.bool_))


@numba.njit(cache=True)
def _find_sparse(T, sx):
    """Index the nonzeros of ``T`` (complex: an entry with a nonzero direction counts) into ``sx``."""
    sx.use[0] = nonzero_index(T, sx.T) and nonzero_index(T.T, sx.Tt)


@numba.njit(cache=True)
def _t_product(T, idx, X, out, sx):
    """``out = T X`` over T's nonzeros (``idx``: those of ``T`` or ``T^T``, for ``T`` a transposed view) when
    :class:`_Sparse` says so, else dense."""
    if sx.use[0]:
        spmm_rows(T, idx, X, out)
    else:
        matmul(T, X, out)


@numba.njit(cache=True)
def _add_sparse_t_times(Z, zi, Y, out):
    """``out += Z^T Y`` over the nonzeros of ``Z`` (p, m) (``zi``: :func:`nonzero_index` of Z); ``Y`` (p, k)."""
    for r in range(Z.shape[0]):
        for q in range(1, zi[r, 0] + 1):
            i = zi[r, q]
            z = Z[r, i]
            for j in range(out.shape[1]):
                out[i, j] += z * Y[r, j]


@numba.njit(cache=True)
def _predict(T, c, af, Pf, RQR, a_next, P_next, TP, sx):
    """``a' = T a_f + c``, ``P' = T P_f T^T + R sym(Q) R^T`` (``T (T P_f)^T``: P_f is symmetric)."""
    m = af.shape[0]
    predict_mean(af, c, T, a_next, sx)
    _t_product(T, sx.T, Pf, TP, sx)
    _t_product(T, sx.T, TP.T, P_next, sx)
    for i in range(m):
        for j in range(m):
            P_next[i, j] += RQR[i, j]


@numba.njit(cache=True)
def _predict_vjp(T, a_bar, G, u, rw, gc, gT, want_T, sx):
    """Reverse of :func:`_predict` but its ``R sym(Q) R^T`` (:func:`_rq_vjp`) for the cotangents ``a_bar``, ``G`` of
    ``a'``, ``P'``: sets ``rw.af = T^T a_bar``, ``rw.Pf = T^T G T`` (``rw.S`` scratch); adds to the cotangents ``gc``
    and (when ``want_T``) ``gT`` of this step's rows."""
    m = a_bar.shape[0]
    for i in range(m):
        gc[i] += a_bar[i]
        s = 0j
        for j in range(m):
            s += T[j, i] * a_bar[j]
        rw.af[i] = s
    _t_product(T.T, sx.Tt, G, rw.W, sx)  # T^T G
    _t_product(T.T, sx.Tt, rw.W.T, rw.S, sx)  # T^T G^T T = (T^T G T)^T
    for i in range(m):
        for j in range(m):
            rw.Pf[i, j] = rw.S[j, i]
    if want_T:  # T_bar += a_bar a_f^T + (G + G^T) T P_f  (P_f symmetric)
        for i in range(m):
            for j in range(m):
                rw.G2[i, j] = G[i, j] + G[j, i]
        _t_product(T, sx.T, u.Pf, rw.W, sx)
        matmul(rw.G2, rw.W, gT, 1.0, 1.0)
        for i in range(m):
            for j in range(m):
                gT[i, j] += a_bar[i] * u.af[j]


@numba.njit(cache=True)
def _rq_vjp(R, Q, G, rw, gR, gQ):
    """Reverse of ``R sym(Q) R^T`` for the cotangent ``G``: ``R_bar += (G + G^T) R sym(Q)``, ``Q_bar += sym(R^T G R)``
    (``rw.G2``, ``rw.Qs``, ``rw.RQ``, ``rw.Wr`` scratch).  Linear in ``G``: static ``R, Q`` take the sum over steps once."""
    m, r = R.shape
    for i in range(m):
        for j in range(m):
            rw.G2[i, j] = G[i, j] + G[j, i]
    sym_into(Q, rw.Qs)
    matmul(R, rw.Qs, rw.RQ)
    matmul(rw.G2, rw.RQ, gR, 1.0, 1.0)
    matmul(G, R, rw.Wr)
    for i in range(r):
        for j in range(r):
            s = 0j
            for l in range(m):
                s += R[l, i] * rw.Wr[l, j]
            rw.Qs[i, j] = s  # R^T G R
    _sym_add(rw.Qs, gQ, 1.0)


@numba.njit(cache=True)
def _update_vjp(a, o, Z, jitter, ll_bar, gF, u, rw, rows, a_bar, want_Z):
    """Reverse of :func:`_update` (``u`` its :class:`_Update`) for the cotangents ``rw.af``, ``rw.Pf`` of ``a_f``,
    ``P_f``, ``ll_bar`` of ``ll``, ``rw.vb`` (on entry) of ``v`` and ``gF`` of ``F``: writes the cotangents ``a_bar`` of
    ``a`` and ``rw.S`` of ``S = sym(P)``; adds to this step's :class:`_Rows` ``rows`` (``Z``'s when ``want_Z``)."""
    m, p = a.shape[0], o.shape[0]
    b, B, S_bar = rw.af, rw.Pf, rw.S
    gy, gd, gZ, gH = rows
    # X = F^-1 + j F^-1 F^-1 (P_f = S - M X M^T + j I): M_bar = b u^T - (B + B^T) M X, X_bar = -M^T B M
    matmul(u.Finv, u.Finv, rw.X, jitter, 0.0)
    for i in range(p):
        for j in range(p):
            rw.X[i, j] += u.Finv[i, j]
    for i in range(m):
        for j in range(m):
            rw.G2[i, j] = B[i, j] + B[j, i]
            S_bar[i, j] = B[i, j]
    matmul(u.M, rw.X, rw.Wmp)
    matmul(rw.G2, rw.Wmp, rw.Mb, -1.0, 0.0)
    for i in range(m):
        for j in range(p):
            rw.Mb[i, j] += b[i] * u.u[j]
    matmul(B, u.M, rw.Wmp)
    matmul(u.M.T, rw.Wmp, rw.Y, -1.0, 0.0)  # X_bar
    # F^-1_bar = X_bar + j (X_bar F^-1 + F^-1 X_bar) + ub v_o^T, ub = M^T b - ll_bar v_o / 2 (u = F^-1 v_o and
    # ll's quadratic form)
    if jitter != 0.0:
        matmul(rw.Y, u.Finv, rw.Wp)
        matmul(u.Finv, rw.Y, rw.Wp, 1.0, 1.0)
        for i in range(p):
            for j in range(p):
                rw.Y[i, j] += jitter * rw.Wp[i, j]
    for i in range(p):
        s = -0.5 * ll_bar * u.vo[i]
        for l in range(m):
            s += u.M[l, i] * b[l]
        rw.ub[i] = s
    for i in range(p):
        for j in range(p):
            rw.Y[i, j] += rw.ub[i] * u.vo[j]
    # v_bar = o (F^-1 ub - ll_bar u + the forecast_error cotangent)
    for i in range(p):
        s = -0.5 * ll_bar * u.u[i]  # ll's direct term; the one through u is in ub
        for j in range(p):
            s += u.Finv[i, j] * rw.ub[j]
        rw.vb[i] = o[i] * (rw.vb[i] + s)
    # F_oo_bar = -F^-1 F^-1_bar F^-1 - ll_bar F^-1 / 2, on observed rows and columns; F_bar = gF + that
    matmul(rw.Y, u.Finv, rw.Wp)
    matmul(u.Finv, rw.Wp, rw.Fb, -1.0, 0.0)
    for i in range(p):
        for j in range(p):
            rw.Fb[i, j] = (rw.Fb[i, j] - 0.5 * ll_bar * u.Finv[i, j]) * (o[i] * o[j]) + gF[i, j]
    # M = S Z_o^T: S_bar += M_bar Z_o, Z_bar += diag(o) M_bar^T S
    for i in range(m):
        for j in range(p):
            rw.Wmp[i, j] = rw.Mb[i, j] * o[j]
    if u.Zs[0]:
        _add_sparse_t_times(Z, u.Zi, rw.Wmp.T, S_bar.T)  # S_bar += Wmp Z
    else:
        matmul(rw.Wmp, Z, S_bar, 1.0, 1.0)
    # F = Z S Z^T + sym(H) + j I: S_bar += Z^T F_bar Z, Z_bar += (F_bar + F_bar^T) Z S, H_bar += sym(F_bar)
    for i in range(p):
        for j in range(p):
            rw.Wp[i, j] = rw.Fb[i, j] + rw.Fb[j, i]
    matmul(rw.Fb, Z, rw.Wpm)
    if u.Zs[0]:
        _add_sparse_t_times(Z, u.Zi, rw.Wpm, S_bar)
    else:
        matmul(Z.T, rw.Wpm, S_bar, 1.0, 1.0)
    _sym_add(rw.Fb, gH, 1.0)
    if want_Z:
        matmul(rw.Wmp.T, u.S, gZ, 1.0, 1.0)
        matmul(rw.Wp, u.ZS, gZ, 1.0, 1.0)
        for i in range(p):
            for j in range(m):
                gZ[i, j] -= rw.vb[i] * a[j]
    # v = y - d - Z a
    for i in range(p):
        gy[i] += rw.vb[i]
        gd[i] -= rw.vb[i]
    for j in range(m):
        s = b[j]
        for i in range(p):
            s -= Z[i, j] * rw.vb[i]
        a_bar[j] = s


@numba.njit(cache=True)
def _fail(grad, tangent):
    """NaN in every entry of ``grad`` and ``tangent`` (the filter failed, or the direction is unusable)."""
    _nan_cotangents(grad)
    for X in (tangent.filtered_state, tangent.predicted_state, tangent.forecast_error):
        X[...] = np.nan  # 2-d
    for X in (tangent.filtered_cov, tangent.predicted_cov, tangent.forecast_error_cov):
        X[...] = np.nan  # 3-d
    tangent.loglik[...] = np.nan
    tangent.loglik_obs[...] = np.nan


@numba.njit(cache=True)
def _nan_cotangents(grad):
    """NaN in every entry of the :class:`InputCotangents` ``grad``."""
    s = grad.system
    for X in (grad.y, grad.P0, s.c, s.d):
        X[...] = np.nan  # 2-d
    for X in (s.T, s.Z, s.R, s.H, s.Q):
        X[...] = np.nan  # 3-d
    grad.a0[...] = np.nan


@numba.njit(cache=True)
def _real_into(Z, out):
    """``out = Re(Z)`` (same shapes, C-contiguous)."""
    zf, of = Z.reshape(-1), out.reshape(-1)
    for i in range(zf.size):
        of[i] = zf[i].real


@numba.njit(cache=True)
def _row_add(g, t, out):
    """``out += g[t]`` where the per-step cotangent ``g`` is connected (has rows)."""
    if g.shape[0] > 0:
        gf, of = g[t].reshape(-1), out.reshape(-1)
        for i in range(of.size):
            of[i] += gf[i]


@numba.njit(cache=True)
def hessian_vector_kernel(x, options, cot, w, grad, tangent, value, want):
    """Module docstring: ``grad = Im(J(x + i h w)^T g) / h`` and ``tangent = Im(f(x + i h w)) / h`` for the filter's
    :class:`~iterops.ts.kalman.Inputs` ``x``, the outputs' :class:`Cotangents` ``cot``, the direction ``w`` and the
    written :class:`InputCotangents` ``grad`` and :class:`Tangents` ``tangent``.  ``value`` (written when
    ``want.value``): ``Re(J(x + i h w)^T g) = J(x)^T g``, the first-order gradient, to rounding (the real part of
    the same pass).  ``want`` (:class:`SecondWanted`): the cotangents of ``T``/``Z`` where
    False are not computed (left 0, in ``grad`` and ``value``; each costs O(m^3) / O(m^2 p) per step).  Returns
    0.0, or 1.0 when the filter failed (NaN in ``grad``, ``tangent`` and ``value``)."""
    (n, p), m, r = x.y.shape, x.a0.shape[0], x.system.Q.shape[-1]
    h = _step_size(w)
    # a direction beyond 2^900 in magnitude (the step would lose precision: subnormal) or not finite: NaN second
    # derivatives; ``value`` (when wanted) from the unperturbed pass (hp = 0), as the first-order kernel gives it
    usable = h >= MIN_STEP and _all_finite(w)
    if not usable and not want.value:
        _fail(grad, tangent)
        return 1.0
    hp = h if usable else 0.0
    h = h if usable else STEP  # divides imaginary parts that ``_fail`` overwrites
    y, o = _observations(x.y, w.y, hp, options)
    s, ws = x.system, w.system
    sc = System(_perturbed(s.c, ws.c, hp), _perturbed(s.d, ws.d, hp), _perturbed(s.T, ws.T, hp),
                _perturbed(s.Z, ws.Z, hp), _perturbed(s.R, ws.R, hp), _perturbed(s.H, ws.H, hp),
                _perturbed(s.Q, ws.Q, hp))
    jitter = options.jitter
    ap, Pp = np.empty((n + 1, m), dtype=np.complex128), np.empty((n + 1, m, m), dtype=np.complex128)
    ap[0], Pp[0] = _perturbed(x.a0, w.a0, hp), _perturbed(x.P0, w.P0, hp)
    u, rw = _update_work(m, p), _reverse_work(m, p, r)
    RQR, TP, sx, tape = _complex((m, m)), _complex((m, m)), _sparse(m), _tape(n, m, p, want.T)
    static_rq = sc.R.shape[0] == 1 and sc.Q.shape[0] == 1
    total = 0j
    for t in range(n):
        c, d, T, Z = sc.c[ti(sc.c, t)], sc.d[ti(sc.d, t)], sc.T[ti(sc.T, t)], sc.Z[ti(sc.Z, t)]
        R, H, Q = sc.R[ti(sc.R, t)], sc.H[ti(sc.H, t)], sc.Q[ti(sc.Q, t)]
        if t == 0 or sc.Z.shape[0] > 1:
            u.Zs[0] = nonzero_index(Z, u.Zi)
        ll, ok = _update(ap[t], Pp[t], y[t], o[t], d, Z, H, jitter, u)
        if not ok:
            _fail(grad, tangent)
            if want.value:
                _nan_cotangents(value)
            return 1.0
        _record(u, tape, t)
        total += ll
        if tangent.loglik_obs.shape[0] > 0:
            tangent.loglik_obs[t] = ll.imag / h
        if tangent.filtered_state.shape[0] > 0:
            _imag_into(u.af, h, tangent.filtered_state[t])
        if tangent.filtered_cov.shape[0] > 0:
            _imag_into(u.Pf, h, tangent.filtered_cov[t])
        if tangent.forecast_error.shape[0] > 0:
            for i in range(p):
                tangent.forecast_error[t, i] = u.v[i].imag / h * o[t, i]
        if tangent.forecast_error_cov.shape[0] > 0:
            _imag_into(u.F, h, tangent.forecast_error_cov[t])
        if t == 0 or not static_rq:
            _rqr(R, Q, rw, RQR)
        if t == 0 or sc.T.shape[0] > 1:
            _find_sparse(T, sx)
        _predict(T, c, u.af, u.Pf, RQR, ap[t + 1], Pp[t + 1], TP, sx)
    tangent.loglik[0] = total.imag / h
    if tangent.predicted_state.shape[0] > 0:
        _imag_into(ap, h, tangent.predicted_state)
    if tangent.predicted_cov.shape[0] > 0:
        _imag_into(Pp, h, tangent.predicted_cov)

    # reverse pass on the perturbed recursion: J(x + i h w)^T g
    g = InputCotangents(np.zeros((n, p), dtype=np.complex128), np.zeros(m, dtype=np.complex128),
                        np.zeros((m, m), dtype=np.complex128), System(
                            np.zeros(sc.c.shape, dtype=np.complex128), np.zeros(sc.d.shape, dtype=np.complex128),
                            np.zeros(sc.T.shape, dtype=np.complex128), np.zeros(sc.Z.shape, dtype=np.complex128),
                            np.zeros(sc.R.shape, dtype=np.complex128), np.zeros(sc.H.shape, dtype=np.complex128),
                            np.zeros(sc.Q.shape, dtype=np.complex128)))
    gs = g.system
    a_bar, G = np.zeros(m, dtype=np.complex128), np.zeros((m, m), dtype=np.complex128)
    gF0 = np.zeros((p, p))
    G_sum = np.zeros((m, m), dtype=np.complex128)
    _row_add(cot.predicted_state, n, a_bar)
    _row_add(cot.predicted_cov, n, G)
    for t in range(n - 1, -1, -1):
        c, d, T, Z = sc.c[ti(sc.c, t)], sc.d[ti(sc.d, t)], sc.T[ti(sc.T, t)], sc.Z[ti(sc.Z, t)]
        R, H, Q = sc.R[ti(sc.R, t)], sc.H[ti(sc.H, t)], sc.Q[ti(sc.Q, t)]
        ut = _replay(Pp[t], o[t], u, tape, t)
        if sc.T.shape[0] > 1:
            _find_sparse(T, sx)
        if sc.Z.shape[0] > 1:
            u.Zs[0] = nonzero_index(Z, u.Zi)
        _predict_vjp(T, a_bar, G, ut, rw, gs.c[ti(gs.c, t)], gs.T[ti(gs.T, t)], want.T, sx)
        if static_rq:
            for i in range(m):
                for j in range(m):
                    G_sum[i, j] += G[i, j]
        else:
            _rq_vjp(R, Q, G, rw, gs.R[ti(gs.R, t)], gs.Q[ti(gs.Q, t)])
        _row_add(cot.filtered_state, t, rw.af)
        _row_add(cot.filtered_cov, t, rw.Pf)
        for i in range(p):
            rw.vb[i] = 0.0
        _row_add(cot.forecast_error, t, rw.vb)
        ll_bar = cot.loglik + (cot.loglik_obs[t] if cot.loglik_obs.shape[0] > 0 else 0.0)
        gF = cot.forecast_error_cov[t] if cot.forecast_error_cov.shape[0] > 0 else gF0
        rows = _Rows(g.y[t], gs.d[ti(gs.d, t)], gs.Z[ti(gs.Z, t)], gs.H[ti(gs.H, t)])
        _update_vjp(ap[t], o[t], Z, jitter, ll_bar, gF, ut, rw, rows, a_bar, want.Z)
        _row_add(cot.predicted_state, t, a_bar)
        for i in range(m):
            for j in range(m):
                G[i, j] = 0.5 * (rw.S[i, j] + rw.S[j, i])
        _row_add(cot.predicted_cov, t, G)
    if static_rq:
        _rq_vjp(sc.R[0], sc.Q[0], G_sum, rw, gs.R[0], gs.Q[0])
    if want.value:
        out = value.system
        for X, Y in ((g.y, value.y), (gs.c, out.c), (gs.d, out.d)):
            _real_into(X, Y)
        for X, Y in ((gs.T, out.T), (gs.Z, out.Z), (gs.R, out.R), (gs.H, out.H), (gs.Q, out.Q)):
            _real_into(X, Y)
        _real_into(a_bar, value.a0)
        _real_into(G, value.P0)
    if not usable:
        _fail(grad, tangent)
        return 0.0
    _imag_into(g.y, h, grad.y)
    _imag_into(a_bar, h, grad.a0)
    _imag_into(G, h, grad.P0)
    out = grad.system
    for X, Y in ((gs.c, out.c), (gs.d, out.d)):
        _imag_into(X, h, Y)
    for X, Y in ((gs.T, out.T), (gs.Z, out.Z), (gs.R, out.R), (gs.H, out.H), (gs.Q, out.Q)):
        _imag_into(X, h, Y)
    return 0.0
