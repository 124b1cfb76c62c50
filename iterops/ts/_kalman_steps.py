r"""One Kalman filter step, stage by stage, each stage followed by its reverse (vector-Jacobian product).

The stages of step ``t`` (notation of :mod:`iterops.ts.kalman`; ``a, P`` the prediction entering
the step, ``o`` the observed components, ``k = |o|``, ``j`` the covariance jitter)::

    observe     v = y_t - d_t - Z_t a                    (NaN where missing; o, k)
    update_cov  F = Z sym(P) Z^T + sym(H) + j I, L = chol(F_oo), K = M F_oo^{-1} (M = sym(P) Z_o^T),
                P_f = sym(P) - K M^T - j K K^T + j I
    update_mean a_f = a + K v_o
    loglik      w = F_oo^{-1} v_o, ll = -(k log 2 pi + log|F_oo| + v_o^T w) / 2
    predict     a' = T a_f + c,  P' = T P_f T^T + R sym(Q) R^T

and in reverse (given the cotangents ``a'_bar, P'_bar`` of the next prediction)::

    predict_vjp  -> a_f_bar, P_f_bar, c_bar, T_bar, R_bar, Q_bar
    loglik_vjp   -> v_o_bar, F_oo_bar  (from ll_bar)
    update_vjp   -> P_bar, Z_bar, H_bar, Z_o_bar; v_o_bar += K^T a_f_bar  (from a_f_bar, P_f_bar,
                    v_o_bar, F_oo_bar and the output cotangent of F)
    observe_vjp  -> a_bar, y_bar, d_bar, Z_bar  (from v_o_bar, Z_o_bar)

Structured systems (:class:`Structure`, :func:`find_structure`):

* row-wise indexes of the nonzero entries of T, T^T and Z, found once per call for static matrices,
  every step for time-varying ones;
* where T (Z) is finite and at most half nonzero, the products with it in ``predict`` (``update_cov``)
  and their reverses skip its zeros (:func:`~iterops._linalg_kernels.spmm`): O(m nnz) instead of O(m^3)
  for the shift, companion and identity blocks of structural, SARIMAX and VAR models;
* the skipped terms are exact zeros, so results are the dense products' to rounding;
* non-finite values: a dense product makes ``0 * inf = NaN``, a skipped zero would not.  So a step whose
  other operand (P_f, sym(P), G) or sparse intermediate product has a non-finite entry takes the dense
  product: NaN and -inf propagate exactly as in the dense filter;
* the cotangent of T stays dense (an entry that is 0 at this draw may be a parameter).

One observable (p = 1, the structural and SARIMAX models):

* :func:`update_one` is the update as a rank-one correction, on P_t itself: no Cholesky, no copy (every
  prediction after P0 is exactly symmetric);
* :func:`update_vjp_one` is its reverse with the loops merged (two passes over m x m, three with Z's
  cotangent, instead of ten; where Z skips its zeros its rank terms touch only their rows and columns);
* whether P_t and P_f are finite (for the zero-skipping products) is carried from the pass that wrote
  them; the pass that writes P' (adding R Q R^T, mirroring) also tests it, and the steady-state test after
  it (:func:`steady`, per entry, scale-free) stops at the first entry over the tolerance;
* of the two products with T in a prediction (and in its reverse), only the first is tested for finiteness;
  the forward's second product reads the first's columns in place (:func:`_sparse_congruence`, fused with
  the pass that adds R Q R^T), the reverse's a transposed copy that tests it
  (:func:`~iterops._linalg_kernels.transpose_finite`).

Arrays are grouped by role in NamedTuples:

* :class:`System` (the system matrices), :class:`Options` (jitter and missing-value convention),
  :class:`UpdateWork` (what the update computes and its reverse reuses), :class:`ReverseWork`;
* a stage takes a work NamedTuple when it uses most of it (the update and its reverse), otherwise the
  arrays it uses;
* work arrays are :func:`~iterops._linalg_kernels.borrowed`, so passing them to a per-step function costs
  no reference counting.

Every symmetric matrix is computed on one triangle and mirrored.
Every stage is ``inline="always"``: compiled once, as part of the kernel that calls it
(:mod:`iterops.ts._kalman_filter`).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from iterops._constants import LOG_2PI
from iterops._linalg_kernels import (
    FLOAT_MAX, SMALL, all_finite, borrowed, carve, cho_solve_vec, cholesky, converged, copy_into, flat, matmul, nonzero_index,
    spmm, spmm_rows, sym_finite, sym_inplace, sym_into, transpose_finite,
)

__all__ = [
    "System", "SYSTEM_NAMES", "Options", "Wanted", "UpdateWork", "update_work", "ReverseWork", "reverse_work", "Structure",
    "structure", "find_structure", "ti", "system_at",
    "static_cov", "varies_over_time", "static_rq", "missing", "fully_observed", "observe", "innovation",
    "observe_vjp", "update_cov", "update_one", "gain_one", "update_vjp_one", "MULTIVARIATE", "AUTO", "UNIVARIATE",
    "prefers_univariate", "diagonal",
    "update_univariate", "update_mean", "update_vjp", "loglik", "loglik_vjp", "predict_mean", "rqr",
    "predict_cov", "STEADY_TOL", "steady", "predict_cov_vjp", "rq_vjp", "predict_vjp", "closed_loop",
]

class System(NamedTuple):
    """The system matrices.  In a kernel's arguments each has a leading time axis of length 1
    (static) or n (time-varying); :func:`system_at` gives the matrices of one step.  The
    cotangents of the system are a ``System`` of the same shapes."""

    c: np.ndarray  #: (tc, m) state intercept
    d: np.ndarray  #: (td, p) observation intercept
    T: np.ndarray  #: (tT, m, m) transition
    Z: np.ndarray  #: (tZ, p, m) design
    R: np.ndarray  #: (tR, m, r) selection
    H: np.ndarray  #: (tH, p, p) observation noise covariance
    Q: np.ndarray  #: (tQ, r, r) state noise covariance


#: the system matrices' names, in argument order (``kalman_filter``'s keywords, ``time_varying``'s names)
SYSTEM_NAMES = System._fields


class Options(NamedTuple):
    """Static options of a filter (the Op's props)."""

    jitter: float  #: ``cov_jitter``
    missing_value: float  #: sentinel of a missing observation (besides NaN) ...
    use_missing_value: bool  #: ... when True


class Wanted(NamedTuple):
    """Which of the costly input cotangents a reverse pass computes: T's (a dense m^3 product per step) and
    Z's.  The others cost O(m) per step or are computed once.  A graph that reads neither (PyMC's gradient
    when T and Z hold no parameter) sets both False (:func:`iterops.ts.kalman.kalman_unused_outputs`)."""

    T: bool
    Z: bool


class UpdateWork(NamedTuple):
    """Work arrays of one step's measurement update (m states, p observables); the reverse step
    reads what the forward step left in them."""

    obs: np.ndarray  #: (p,) int64; ``obs[:k]`` = indices of the observed components
    Ps: np.ndarray  #: (m, m) sym(P)
    PZ: np.ndarray  #: (m, p) Ps Z^T
    Zo: np.ndarray  #: (p, m) ``Zo[:k]`` = observed rows of Z
    M: np.ndarray  #: (m, p) ``M[:, :k]`` = Ps Zo^T
    L: np.ndarray  #: (p, p) ``L[:k, :k]`` = chol(F_oo)
    K: np.ndarray  #: (m, p) ``K[:, :k]`` = M F_oo^{-1}, the gain
    w: np.ndarray  #: (p,) ``w[:k]`` = F_oo^{-1} v_o


@numba.njit(cache=True)
def update_work(m, p):
    """An uninitialized :class:`UpdateWork` of arrays carved out of two allocations
    (:func:`~iterops._linalg_kernels.carve`), and those (keep them alive with ``keep_alive`` past the last use)."""
    buf = np.empty(m * m + 3 * m * p + p * m + p * p + p)
    obs = np.empty(p, dtype=np.int64)
    o = m * m
    work = UpdateWork(
        carve(obs, 0, (p,)), carve(buf, 0, (m, m)), carve(buf, o, (m, p)), carve(buf, o + m * p, (p, m)),
        carve(buf, o + 2 * m * p, (m, p)), carve(buf, o + 3 * m * p, (p, p)),
        carve(buf, o + 3 * m * p + p * p, (m, p)), carve(buf, o + 4 * m * p + p * p, (p,)),
    )
    return work, (buf, obs)


class ReverseWork(NamedTuple):
    """Work arrays of one reverse step (m states, p observables)."""

    G: np.ndarray  #: (m, m) sym(P'_bar), the next prediction's covariance cotangent
    W: np.ndarray  #: (m, m) scratch
    S: np.ndarray  #: (m, m) sym(P_f_bar)
    Pf_bar: np.ndarray  #: (m, m) cotangent of P_f
    af_bar: np.ndarray  #: (m,) cotangent of a_f
    K_bar: np.ndarray  #: (m, p) cotangent of the gain
    M_bar: np.ndarray  #: (m, p) cotangent of M = Ps Zo^T
    Finv: np.ndarray  #: (p, p) ``Finv[:k, :k]`` = F_oo^{-1}
    Fo_bar: np.ndarray  #: (p, p) ``Fo_bar[:k, :k]``: cotangent of F_oo from the likelihood
    X_bar: np.ndarray  #: (p, p) cotangent of F (all p rows)
    XZ: np.ndarray  #: (p, m) X_bar Z, then ``XZ[:k]`` = cotangent of Zo
    vo_bar: np.ndarray  #: (p,) ``vo_bar[:k]``: cotangent of v_o
    a_bar_new: np.ndarray  #: (m,) cotangent of the step's a
    P_bar_new: np.ndarray  #: (m, m) cotangent of the step's P (before symmetrization)


@numba.njit(cache=True)
def reverse_work(m, p):
    """An uninitialized :class:`ReverseWork` of arrays carved out of one allocation, and that (as
    :func:`update_work`)."""
    buf = np.empty(5 * m * m + 2 * m * p + 3 * p * p + p * m + p + 2 * m)
    mm, mp, pp = m * m, m * p, p * p
    o1 = 4 * mm + m  # after G, W, S, Pf_bar, af_bar
    o2 = o1 + 2 * mp + 3 * pp  # after K_bar, M_bar, Finv, Fo_bar, X_bar
    work = ReverseWork(
        carve(buf, 0, (m, m)), carve(buf, mm, (m, m)), carve(buf, 2 * mm, (m, m)), carve(buf, 3 * mm, (m, m)),
        carve(buf, 4 * mm, (m,)), carve(buf, o1, (m, p)), carve(buf, o1 + mp, (m, p)),
        carve(buf, o1 + 2 * mp, (p, p)), carve(buf, o1 + 2 * mp + pp, (p, p)), carve(buf, o1 + 2 * mp + 2 * pp, (p, p)),
        carve(buf, o2, (p, m)), carve(buf, o2 + mp, (p,)), carve(buf, o2 + mp + p, (m,)),
        carve(buf, o2 + mp + p + m, (m, m)),
    )
    return work, buf


class Structure(NamedTuple):
    """Nonzero indexes (:func:`~iterops._linalg_kernels.nonzero_index`) of the step's T, T^T and Z,
    and whether the products with T (``use[0]``) and Z (``use[1]``) skip the zeros."""

    T: np.ndarray  #: (m, m + 1) int64, of T
    Tt: np.ndarray  #: (m, m + 1) int64, of T^T
    Z: np.ndarray  #: (p, m + 1) int64, of Z
    use: np.ndarray  #: (2,) bool


@numba.njit(cache=True)
def structure(m, p):
    """An uninitialized :class:`Structure` (``use`` all False) of arrays carved out of two allocations,
    and those."""
    idx = np.empty((2 * m + p) * (m + 1), dtype=np.int64)
    use = np.zeros(2, dtype=np.bool_)
    sx = Structure(
        carve(idx, 0, (m, m + 1)), carve(idx, m * (m + 1), (m, m + 1)), carve(idx, 2 * m * (m + 1), (p, m + 1)),
        borrowed(use),
    )
    return sx, (idx, use)


@numba.njit(cache=True)
def find_structure(Tt, Zt, sx):
    """Fill ``sx`` (:class:`Structure`) from the step's T and Z."""
    sx.use[0] = nonzero_index(Tt, sx.T) and nonzero_index(Tt.T, sx.Tt)
    sx.use[1] = nonzero_index(Zt, sx.Z)


# ---------------------------------------------------------------------------
# Time indexing, missing values
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def ti(X, t):
    """Time index into a system array with a leading time axis of length 1 (static) or n."""
    return t if X.shape[0] > 1 else 0


@numba.njit(cache=True, inline="always")
def system_at(system, t):
    """The matrices of step t (views; for static ones, their only row)."""
    c, d, T, Z, R, H, Q = system
    return System(c[ti(c, t)], d[ti(d, t)], T[ti(T, t)], Z[ti(Z, t)], R[ti(R, t)], H[ti(H, t)], Q[ti(Q, t)])


@numba.njit(cache=True)
def static_cov(system):
    """True when the covariance recursion does not depend on t (no time-varying T, Z, R, H, Q)."""
    return (
        system.T.shape[0] == 1 and system.Z.shape[0] == 1 and system.R.shape[0] == 1
        and system.H.shape[0] == 1 and system.Q.shape[0] == 1
    )


@numba.njit(cache=True, inline="always")
def varies_over_time(system):
    """True when some system matrix varies over time (else :func:`system_at` is the same every step)."""
    return not (static_cov(system) and system.c.shape[0] == 1 and system.d.shape[0] == 1)


@numba.njit(cache=True, inline="always")
def static_rq(system):
    """True when R and Q are static (``R sym(Q) R^T`` is computed once)."""
    return system.R.shape[0] == 1 and system.Q.shape[0] == 1


@numba.njit(cache=True, inline="always")
def missing(yi, options):
    return np.isnan(yi) or (options.use_missing_value and yi == options.missing_value)


@numba.njit(cache=True, inline="always")
def fully_observed(y, t, options):
    for i in range(y.shape[1]):
        if missing(y[t, i], options):
            return False
    return True


# ---------------------------------------------------------------------------
# observe: v = y_t - d_t - Z_t a
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def observe(a, yt, dt, Zt, options, v, obs):
    """v = y_t - d_t - Z_t a (NaN where missing); ``obs[:k]`` = observed indices.  Returns k."""
    m = a.shape[0]
    p = yt.shape[0]
    k = 0
    for i in range(p):
        yi = yt[i]
        s = yi - dt[i]
        for l in range(m):
            s -= Zt[i, l] * a[l]
        if missing(yi, options):
            v[i] = np.nan
        else:
            v[i] = s
            obs[k] = i
            k += 1
    return k


@numba.njit(cache=True, inline="always")
def innovation(y, d, Zt, ap, t, L, v, w):
    """``v = y_t - d_t - Z a_t`` and ``w = F^{-1} v`` for a fully observed step t, ``L = chol(F)``:
    :func:`observe` and the solve of :func:`loglik` for the steady-state loops (no views)."""
    idd = ti(d, t)
    for i in range(y.shape[1]):
        x = y[t, i] - d[idd, i]
        for l in range(Zt.shape[1]):
            x -= Zt[i, l] * ap[t, l]
        v[i] = x
        w[i] = x
    cho_solve_vec(L, y.shape[1], w, w)


@numba.njit(cache=True, inline="always")
def observe_vjp(a, k, obs, Zo, vo_bar, Zo_bar, a_bar, gy, gd, gZ, want_Z=True):
    """Reverse of ``v_o = y_o - d_o - Z_o a``: ``y_bar += v_bar``, ``d_bar -= v_bar``,
    ``Z_bar[o] += Zo_bar - v_bar a^T`` (``Zo_bar``: the cotangent of ``Z_o`` from its other use; only when
    ``want_Z``), ``a_bar -= Z_o^T v_bar``.  ``gy``, ``gd``, ``gZ``: cotangents of step t's y, d, Z."""
    m = a.shape[0]
    for i in range(k):
        oi = obs[i]
        gy[oi] += vo_bar[i]
        gd[oi] -= vo_bar[i]
        for jj in range(m):
            a_bar[jj] -= Zo[i, jj] * vo_bar[i]
        if want_Z:
            for jj in range(m):
                gZ[oi, jj] += Zo_bar[i, jj] - vo_bar[i] * a[jj]


# ---------------------------------------------------------------------------
# update: F, chol(F_oo), gain, P_f; a_f = a + K v_o
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _innovation_cov(Ps, Zt, Ht, jitter, PZ, F, sx):
    """PZ = Ps Z^T; F = Z Ps Z^T + sym(H) + j I (all p rows, one triangle mirrored); Z's zeros
    skipped when ``sx.use[1]`` and Ps, PZ are finite (:class:`Structure`)."""
    m = Ps.shape[0]
    p = Zt.shape[0]
    sparse = sx.use[1] and all_finite(Ps)
    if sparse:  # PZ^T = Z Ps (Ps symmetric)
        sparse = np.isfinite(spmm(Zt, sx.Z, Ps, PZ.T))
    if not sparse:
        matmul(Ps, Zt.T, PZ)
    for i in range(p):
        for jj in range(i, p):
            s = 0.5 * (Ht[i, jj] + Ht[jj, i])
            if sparse:
                for q in range(1, sx.Z[i, 0] + 1):
                    l = sx.Z[i, q]
                    s += Zt[i, l] * PZ[l, jj]
            else:
                for l in range(m):
                    s += Zt[i, l] * PZ[l, jj]
            F[i, jj] = s
            F[jj, i] = s
        F[i, i] += jitter


@numba.njit(cache=True)
def _filtered_cov(Ps, K, M, k, jitter, Pf):
    """Pf = Ps - K M^T - j K K^T + j I (one triangle, mirrored)."""
    m = Ps.shape[0]
    if m > SMALL and k > SMALL:  # BLAS, then symmetrize (a rank-k update with small k: loops)
        matmul(K[:, :k], M[:, :k].T, Pf, -1.0, 0.0)
        if jitter != 0.0:
            matmul(K[:, :k], K[:, :k].T, Pf, -jitter, 1.0)
        for i in range(m):
            for jj in range(i, m):
                s = Ps[i, jj] + 0.5 * (Pf[i, jj] + Pf[jj, i])
                Pf[i, jj] = s
                Pf[jj, i] = s
    else:
        for i in range(m):
            for jj in range(i, m):
                s = Ps[i, jj]
                for l in range(k):
                    s -= K[i, l] * (M[jj, l] + jitter * K[jj, l])
                Pf[i, jj] = s
                Pf[jj, i] = s
    for i in range(m):
        Pf[i, i] += jitter


@numba.njit(cache=True)
def update_cov(P, Zt, Ht, jitter, k, ws, F, Pf, sx):
    """Covariance part of the measurement update.  Returns ``(ok, log|F_oo|)``.  ``sx``: the
    step's :class:`Structure`.

    Writes ``F = Z Ps Z^T + sym(H) + j I`` (all p rows), ``Pf = Ps - K M^T - j K K^T + j I`` and
    every :class:`UpdateWork` array but ``w``.  For this (optimal) gain ``Pf`` equals the Joseph
    form ``(I - K Zo) Ps (I - K Zo)^T + K H_oo K^T + j I`` that pymc-extras evaluates (expand it with
    ``K F_oo = M``); it costs O(m^2 k) instead of O(m^3).  One observable (``p = k = 1``):
    :func:`update_one`.
    """
    m = P.shape[0]
    obs, Ps, PZ, Zo, M, L, K, _ = ws
    finite = sym_finite(P, Ps)
    if Zt.shape[0] == 1 and k == 1:
        ok, logdet, _ = update_one(Ps, finite, Zt, Ht, jitter, ws, F, Pf, sx)
        return ok, logdet
    _innovation_cov(Ps, Zt, Ht, jitter, PZ, F, sx)
    for ii in range(k):
        i = obs[ii]
        for l in range(m):
            Zo[ii, l] = Zt[i, l]
            M[l, ii] = PZ[l, i]
        for jj in range(k):
            L[ii, jj] = F[i, obs[jj]]  # F_oo, factored in place below
    if not cholesky(L, L, k):
        return False, np.nan
    logdet = 0.0
    for i in range(k):
        logdet += 2.0 * np.log(L[i, i])
    for i in range(m):  # K = M F_oo^{-1}, row by row
        for jj in range(k):
            K[i, jj] = M[i, jj]
        cho_solve_vec(L, k, K[i], K[i])
    _filtered_cov(Ps, K, M, k, jitter, Pf)
    return True, logdet


@numba.njit(cache=True, inline="always")
def update_one(Ps, finite, Zt, Ht, jitter, ws, F, Pf, sx):
    """:func:`update_cov` for one observable, observed (``p = k = 1``; ``Ps``: sym(P), exactly
    symmetric, ``finite`` whether it is): the rank-one update, no Cholesky, no copy::

        u = Ps z^T (z = Z's row, its zeros skipped when finite),  f = z u + H + j
        K = u / f,  Pf = Ps - c (u u^T) + j I  with  c = (1 + j / f) / f   (= Ps - K (u + j K)^T + j I)

    ``Pf`` is computed whole, row by row (a loop that vectorises); ``u_l u_q = u_q u_l`` keeps it exactly
    symmetric.

    Writes ``F = f``, ``M[:, 0] = u``, ``K[:, 0]``, ``Zo[0] = z``, ``L[0, 0] = sqrt(f)`` (the
    :class:`UpdateWork` of the general update; ``ws.Ps`` is not touched).  Returns
    ``(ok, log f, Pf finite)``; not ok when f is not positive and finite (as the Cholesky)."""
    m = Ps.shape[0]
    M = ws.M
    ok, logf = gain_one(Ps, finite, Zt, Ht, jitter, ws, F, sx)
    if not ok:
        return False, np.nan, False
    f = F[0, 0]
    u = flat(M, m)  # M[:, 0] (p = 1), as a contiguous vector
    c = (1.0 + jitter / f) / f
    fin = True
    for l in range(m):
        ul = u[l]
        for q in range(m):
            x = Ps[l, q] - c * (ul * u[q])
            Pf[l, q] = x
            fin &= abs(x) <= FLOAT_MAX
        Pf[l, l] += jitter
    return True, logf, fin and np.isfinite(m * jitter)


@numba.njit(cache=True, inline="always")
def gain_one(Ps, finite, Zt, Ht, jitter, ws, F, sx):
    """The gain part of :func:`update_one` (``u = Ps z^T``, ``f``, ``K = u / f``; writes ``F``, ``M[:, 0] = u``,
    ``K[:, 0]``, ``Zo[0] = z``, ``L[0, 0] = sqrt(f)``), without ``P_f``: what a reverse step that needs
    neither ``P_f`` nor ``sym(P)`` recomputes (:func:`iterops.ts._kalman_adjoint.kalman_adjoint_kernel`).
    Returns ``(ok, log f)``."""
    m = Ps.shape[0]
    _, _, _, Zo, M, L, K, _ = ws
    sparse = sx.use[1] and finite
    nz = sx.Z[0, 0] if sparse else m
    f = Ht[0, 0]
    for l in range(m):
        s = 0.0
        for q in range(nz):
            c = sx.Z[0, q + 1] if sparse else q
            s += Ps[l, c] * Zt[0, c]
        M[l, 0] = s
        Zo[0, l] = Zt[0, l]
    for q in range(nz):
        c = sx.Z[0, q + 1] if sparse else q
        f += Zt[0, c] * M[c, 0]
    f += jitter
    F[0, 0] = f
    if not (f > 0.0) or not np.isfinite(f):
        return False, np.nan
    L[0, 0] = np.sqrt(f)
    for l in range(m):
        K[l, 0] = M[l, 0] / f
    return True, np.log(f)


#: ``univariate`` modes of the forward filter (the ``kalman_filter`` option): never, by the rule, always
#: (where H is diagonal)
MULTIVARIATE, AUTO, UNIVARIATE = 0, 1, 2


@numba.njit(cache=True)
def prefers_univariate(m, p, need_F):
    """The automatic rule: the univariate update is faster than the multivariate one for m states and p
    observables, when the output ``F`` is (``need_F``) or is not computed (``benchmarks/bench_kalman.py``'s
    crossover table).  Flops of a step's update: univariate ``1.5 k m^2`` (+ ``m^2 k + m k^2 / 2`` for F),
    multivariate ``1.5 m^2 k + 1.5 m k^2 + k^3 / 6`` (F included); above m = 16 the multivariate update's
    BLAS products win.  One observable: the same work."""
    if need_F:
        return p >= 2 and 6 * p >= 5 * m
    return p >= 2 and m <= 16


@numba.njit(cache=True)
def diagonal(Ht):
    """True when sym(H) is diagonal (NaN off the diagonal counts as not)."""
    for i in range(Ht.shape[0]):
        for jj in range(i + 1, Ht.shape[0]):
            if Ht[i, jj] + Ht[jj, i] != 0.0:
                return False
    return True


@numba.njit(cache=True)
def update_univariate(a, P, v, Zt, Ht, jitter, k, ws, af, Pf, sx):
    """The measurement update one observed component at a time (Durbin & Koopman 2012, sec. 6.4;
    statsmodels' ``filter_univariate``), for a diagonal sym(H).  Returns ``(ok, ll)``.

    From ``a_f = a``, ``P_f = sym(P)``, for each observed ``i`` in order::

        v_i = v[i] - Z_i (a_f - a)       (= y_i - d_i - Z_i a_f)
        F_i = Z_i P_f Z_i^T + H_ii + j;  ok only if F_i > 0 and finite
        u   = P_f Z_i^T / F_i;  a_f += u v_i;  P_f -= u u^T F_i
        ll += -(log 2 pi + log F_i + v_i^2 / F_i) / 2
        G  += u (e_i^T - Z_i G)          (only when j > 0: G = K, the multivariate gain)

    then ``P_f += j I - j G G^T``.  This is :func:`update_cov` + :func:`update_mean` + :func:`loglik`
    with ``F_oo = L D L^T`` (``F_i`` the pivots of D: all positive exactly when F_oo is positive
    definite), so every output is the multivariate one to rounding; with ``j > 0`` the sequential
    recursion gives ``sym(P) - K M^T`` and G supplies the jitter's ``- j K K^T``.  O(k m^2) (O(k m nnz)
    for a sparse Z) plus O(k^2 m) for the jitter, instead of the Cholesky's O(k^3 + k^2 m).
    ``ws.M[:, 0]`` is scratch, ``ws.K[:, :k]`` holds G; ``F`` (all p rows) is not computed here."""
    m = a.shape[0]
    obs, u, G = ws.obs, ws.M[:, 0], ws.K
    sym_into(P, Pf)
    copy_into(a, af)
    sparse = sx.use[1] and all_finite(Pf)
    for i in range(m):
        for jj in range(k):
            G[i, jj] = 0.0
    ll = 0.0
    for ii in range(k):
        i = obs[ii]
        nz = sx.Z[i, 0] if sparse else m
        vi = v[i]
        f = Ht[i, i] + jitter
        for l in range(m):  # u = P_f Z_i^T
            s = 0.0
            if sparse:
                for q in range(nz):
                    c = sx.Z[i, q + 1]
                    s += Pf[l, c] * Zt[i, c]
            else:
                for c in range(m):
                    s += Pf[l, c] * Zt[i, c]
            u[l] = s
        for q in range(nz):
            c = sx.Z[i, q + 1] if sparse else q
            f += Zt[i, c] * u[c]
            vi -= Zt[i, c] * (af[c] - a[c])
        if not (f > 0.0) or not np.isfinite(f):
            return False, np.nan
        ll -= 0.5 * (LOG_2PI + np.log(f) + vi * vi / f)
        for l in range(m):
            u[l] /= f
            af[l] += u[l] * vi
        for l in range(m):
            for q in range(l, m):
                s = Pf[l, q] - u[l] * u[q] * f
                Pf[l, q] = s
                Pf[q, l] = s
        if jitter != 0.0:
            for jj in range(k):  # r_jj = e_ii - Z_i G[:, jj]
                s = 1.0 if jj == ii else 0.0
                for q in range(nz):
                    c = sx.Z[i, q + 1] if sparse else q
                    s -= Zt[i, c] * G[c, jj]
                for l in range(m):
                    G[l, jj] += u[l] * s
    for l in range(m):
        for q in range(l, m):
            s = Pf[l, q]
            if jitter != 0.0:
                for jj in range(k):
                    s -= jitter * G[l, jj] * G[q, jj]
            Pf[l, q] = s
            Pf[q, l] = s
        Pf[l, l] += jitter
    return True, ll


@numba.njit(cache=True, inline="always")
def update_mean(a, v, obs, k, K, af):
    """a_f = a + K v_o."""
    m = a.shape[0]
    for i in range(m):
        s = a[i]
        for jj in range(k):
            s += K[i, jj] * v[obs[jj]]
        af[i] = s


@numba.njit(cache=True, inline="always")
def update_vjp(a, v, Zt, jitter, k, ws, rw, gZ, gH, want_Z=True):
    """Reverse of :func:`update_cov` and :func:`update_mean` (the whole measurement update).

    Reads from ``rw`` (:class:`ReverseWork`) the cotangents ``Pf_bar``, ``af_bar`` of P_f, a_f,
    ``vo_bar[:k]``, ``Fo_bar[:k, :k]`` of v_o, F_oo (from :func:`loglik_vjp`) and ``X_bar`` of F
    (from the output).  Writes ``P_bar_new`` (cotangent of the step's P, before symmetrization),
    ``a_bar_new = a_f_bar``, ``vo_bar += K^T a_f_bar``, ``XZ[:k] = Zo_bar`` and ``X_bar = sym(F_bar)``
    (both for :func:`observe_vjp`); adds to ``gZ`` (when ``want_Z``; ``Zo_bar`` is then not written), ``gH``
    (cotangents of step t's Z, H).
    """
    m = a.shape[0]
    p = Zt.shape[0]
    obs, Ps, _, Zo, M, L, K, _ = ws
    _, _, S, Pf_bar, af_bar, K_bar, M_bar, _, Fo_bar, X_bar, XZ, vo_bar, a_bar_new, P_bar_new = rw
    # Pf = Ps - K M^T - j K K^T + j I, S = sym(Pf_bar): Ps_bar = S; K_bar = -S M - 2 j S K; M_bar = -S K
    # a_f = a + K v_o: K_bar += a_f_bar v_o^T
    sym_into(Pf_bar, S)
    matmul(S, K[:, :k], M_bar[:, :k], -1.0, 0.0)
    matmul(S, M[:, :k], K_bar[:, :k], -1.0, 0.0)
    for i in range(m):
        for jj in range(k):
            K_bar[i, jj] += af_bar[i] * v[obs[jj]] + 2.0 * jitter * M_bar[i, jj]
    for i in range(k):  # v_o_bar += K^T a_f_bar
        s = 0.0
        for l in range(m):
            s += K[l, i] * af_bar[l]
        vo_bar[i] = s + vo_bar[i]
    # K = M F_oo^{-1}: M_bar += K_bar F^{-1}; Fo_bar -= K^T K_bar F^{-1}
    for i in range(m):  # K_bar <- K_bar F^{-1}
        cho_solve_vec(L, k, K_bar[i], K_bar[i])
        for jj in range(k):
            M_bar[i, jj] += K_bar[i, jj]
    for i in range(k):
        for jj in range(k):
            s = 0.0
            for l in range(m):
                s += K[l, i] * K_bar[l, jj]
            X_bar[obs[i], obs[jj]] += Fo_bar[i, jj] - s
    sym_inplace(X_bar)
    # F = Z Ps Z^T + sym(H) + j I: H_bar += X_bar; Z_bar += 2 X_bar Z Ps; Ps_bar += Z^T X_bar Z
    for i in range(p):
        for jj in range(p):
            gH[i, jj] += X_bar[i, jj]
    matmul(X_bar, Zt, XZ)
    if want_Z:
        matmul(XZ, Ps, gZ, 2.0, 1.0)
    matmul(Zt.T, XZ, P_bar_new)
    for i in range(m):
        for jj in range(m):
            P_bar_new[i, jj] += S[i, jj]
    # M = Ps Zo^T: Ps_bar += M_bar Zo; Zo_bar = M_bar^T Ps.   a_f = a + K v_o: a_bar = a_f_bar
    matmul(M_bar[:, :k], Zo[:k], P_bar_new, 1.0, 1.0)
    if want_Z:
        matmul(M_bar[:, :k].T, Ps, XZ[:k])
    for i in range(m):
        a_bar_new[i] = af_bar[i]


@numba.njit(cache=True, inline="always")
def update_vjp_one(v0, Zt, jitter, ws, rw, gH, P_bar, sx, want_Z=True):
    """:func:`update_vjp` for one observable, observed (``p = k = 1``, the update of :func:`update_one`:
    ``u = Ps z^T``, ``f``, ``K = u / f``), its reverse loops merged::

        S = sym(P_f_bar);  M_bar = -S K;  K_bar = (-S u - 2 j S K + a_f_bar v) / f;  M_bar += K_bar
        v_bar += K^T a_f_bar;  x = F_bar + F_oo_bar - K^T K_bar  (H_bar += x)
        Zo_bar = (2 x z + M_bar)^T Ps   (into ``XZ[0]``, for :func:`observe_vjp`)
        P_bar = S + x z^T z + sym(M_bar z)   (one triangle, mirrored: the cotangent of P, symmetrized)

    Writes ``P_bar`` (the :func:`update_vjp` ``P_bar_new``, already symmetric: what :func:`_carry_cov`
    would make of it, without the cotangent of ``predicted_cov``), ``a_bar_new``, ``vo_bar[0]``,
    ``XZ[0]`` (only when ``want_Z``: it is the cotangent of Z's row), ``X_bar[0, 0]``; adds to ``gH``.  The
    same arithmetic as :func:`update_vjp`, to rounding.

    ``S`` is written into ``P_bar`` (which nothing reads after :func:`predict_vjp`), and where z skips its
    zeros (``sx.use[1]``: :class:`Structure`) and ``x``, ``M_bar`` are finite only the rows and columns of z's
    nonzeros get the rank terms, which are exact zeros elsewhere: O(m nnz(z)) instead of a pass over m x m."""
    m = Zt.shape[1]
    _, Ps, _, _, M, L, K, _ = ws
    _, W, _, Pf_bar, af_bar, K_bar, M_bar, _, Fo_bar, X_bar, XZ, vo_bar, a_bar_new, _ = rw
    S = P_bar
    sym_into(Pf_bar, S)
    # S K and S u as sums of scaled rows of the symmetric S (S[l, i] = S[i, l]): the terms of each entry in
    # the order of a row-by-column product, in loops that vectorise; the columns of the (m, 1) arrays as vectors
    sk, su, k0, u0 = flat(M_bar, m), flat(K_bar, m), flat(K, m), flat(M, m)
    for i in range(m):
        sk[i] = 0.0
        su[i] = 0.0
    for l in range(m):
        kl = k0[l]
        ul = u0[l]
        for i in range(m):
            sk[i] += S[l, i] * kl
            su[i] += S[l, i] * ul
    kaf = 0.0
    for i in range(m):
        mb = -sk[i]
        M_bar[i, 0] = mb
        K_bar[i, 0] = -su[i] + af_bar[i] * v0 + 2.0 * jitter * mb
        kaf += K[i, 0] * af_bar[i]
        a_bar_new[i] = af_bar[i]
    vo_bar[0] += kaf
    l00 = L[0, 0]
    kkb = 0.0
    for i in range(m):
        kb = K_bar[i, 0] / l00 / l00
        K_bar[i, 0] = kb
        M_bar[i, 0] += kb
        kkb += K[i, 0] * kb
    x = X_bar[0, 0] + Fo_bar[0, 0] - kkb
    X_bar[0, 0] = x
    gH[0, 0] += x
    if want_Z:
        for j in range(m):
            XZ[0, j] = 0.0
        for l in range(m):
            c = 2.0 * x * Zt[0, l] + M_bar[l, 0]
            for j in range(m):
                XZ[0, j] += c * Ps[l, j]
    mb = flat(M_bar, m)
    z = Zt[0]
    if sx.use[1] and np.isfinite(x) and np.isfinite(np.sum(mb)):
        # rows of z's nonzeros into W (from S, before any is written), then rows and columns of P_bar
        nz = sx.Z[0, 0]
        for q in range(nz):
            i = sx.Z[0, q + 1]
            zi = z[i]
            mi = mb[i]
            for j in range(m):
                W[q, j] = _p_bar_entry(S[i, j], x, zi, z[j], mi, mb[j])
        for q in range(nz):
            i = sx.Z[0, q + 1]
            for j in range(m):
                P_bar[i, j] = W[q, j]
                P_bar[j, i] = W[q, j]
        return
    for i in range(m):  # whole rows (they vectorise); x (z_i z_j) and the sum keep P_bar exactly symmetric
        zi = z[i]
        mi = mb[i]
        for j in range(m):
            P_bar[i, j] = _p_bar_entry(S[i, j], x, zi, z[j], mi, mb[j])


@numba.njit(cache=True, inline="always")
def _p_bar_entry(s, x, zi, zj, mi, mj):
    """Entry (i, j) of :func:`update_vjp_one`'s ``P_bar = S + x z^T z + sym(M_bar z)``.  For a symmetric S it
    is bitwise symmetric in (i, j) (products and sums commute), so both branches write an exactly symmetric P_bar."""
    return s + x * (zi * zj) + 0.5 * (mi * zj + mj * zi)


# ---------------------------------------------------------------------------
# loglik: ll = -(k log 2 pi + log|F_oo| + v_o^T F_oo^{-1} v_o) / 2
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def loglik(v, obs, k, logdet, L, w):
    """The step's log-likelihood, from ``L = chol(F_oo)``; writes ``w[:k] = F_oo^{-1} v_o``."""
    for i in range(k):
        w[i] = v[obs[i]]
    cho_solve_vec(L, k, w, w)
    quad = 0.0
    for i in range(k):
        quad += v[obs[i]] * w[i]
    return -0.5 * (k * LOG_2PI + logdet + quad)


@numba.njit(cache=True, inline="always")
def loglik_vjp(ll_bar, k, w, Finv, vo_bar, Fo_bar):
    """Reverse of :func:`loglik`: ``v_o_bar = -ll_bar w``, ``F_oo_bar = -ll_bar/2 (F_oo^{-1} - w w^T)``."""
    for i in range(k):
        vo_bar[i] = -ll_bar * w[i]
        for jj in range(k):
            Fo_bar[i, jj] = -0.5 * ll_bar * (Finv[i, jj] - w[i] * w[jj])


# ---------------------------------------------------------------------------
# predict: a' = T a_f + c, P' = T P_f T^T + R sym(Q) R^T
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def predict_mean(af, ct, Tt, a_next, sx):
    """a' = T a_f + c; T's zeros skipped when ``sx.use[0]`` and a_f is finite (:class:`Structure`)."""
    m = af.shape[0]
    sparse = sx.use[0] and np.isfinite(np.sum(af))
    for i in range(m):
        s = ct[i]
        if sparse:
            for q in range(1, sx.T[i, 0] + 1):
                l = sx.T[i, q]
                s += Tt[i, l] * af[l]
        else:
            for l in range(m):
                s += Tt[i, l] * af[l]
        a_next[i] = s


@numba.njit(cache=True)
def rqr(Rt, Qt, RQ, out):
    """out = R sym(Q) R^T (exactly symmetric); ``RQ`` (m, r) is scratch."""
    m, r = Rt.shape
    for i in range(m):
        for jj in range(r):
            s = 0.0
            for l in range(r):
                s += Rt[i, l] * (Qt[l, jj] + Qt[jj, l])
            RQ[i, jj] = 0.5 * s
    for i in range(m):
        for jj in range(i, m):
            s = 0.0
            for l in range(r):
                s += RQ[i, l] * Rt[jj, l]
            out[i, jj] = s
            out[jj, i] = s


@numba.njit(cache=True, inline="always")
def predict_cov(Pf, Tt, RQR, P_next, W, sx, pf_finite, P_old, test):
    """P' = T P_f T^T + R sym(Q) R^T for a symmetric ``P_f``; ``W`` scratch.
    T's zeros skipped when ``sx.use[0]`` and P_f, T P_f are finite (:class:`Structure`;
    ``pf_finite``: 1 or 0 when the caller knows whether P_f is finite, -1 to check): then ``W = T P_f`` is
    :func:`~iterops._linalg_kernels.spmm_rows`' sums of scaled rows, and the upper triangle of ``T W^T`` plus
    ``R sym(Q) R^T``, mirrored, is :func:`_sparse_congruence`'s one pass (bitwise the terms, in the order, of
    the product with W's transposed copy it replaces).
    Returns ``(P' finite, converged)``: ``converged`` is the steady-state test :func:`steady` against a
    symmetric ``P_old`` when ``test`` (else False)."""
    m = Pf.shape[0]
    fin = all_finite(Pf) if pf_finite < 0 else pf_finite == 1
    if sx.use[0] and fin:
        spmm_rows(Tt, sx.T, Pf, W)
        if all_finite(W):  # else a zero of T times an infinite entry of W: the dense product's NaN
            return _sparse_congruence(Tt, sx.T, W, RQR, P_next, P_old, test)
    matmul(Tt, Pf, W)
    if m > SMALL:
        matmul(W, Tt.T, P_next)
        for i in range(m):
            for jj in range(i, m):
                s = 0.5 * (P_next[i, jj] + P_next[jj, i]) + RQR[i, jj]
                P_next[i, jj] = s
                P_next[jj, i] = s
        return _triangle_test(P_next, P_old, test)
    for i in range(m):
        for jj in range(i, m):
            s = RQR[i, jj]
            for l in range(m):
                s += W[i, l] * Tt[jj, l]
            P_next[i, jj] = s
            P_next[jj, i] = s
    return _triangle_test(P_next, P_old, test)


@numba.njit(cache=True)
def _sparse_congruence(Tt, idx, W, RQR, P_new, P_old, test):
    """``P_new = T W^T + RQR`` on the upper triangle, mirrored, for ``W = T P_f`` (finite), over T's nonzeros
    (``idx``); then :func:`_triangle_test`'s finiteness and steady-state test, the finiteness in the same pass.

    Each entry sums the terms of :func:`~iterops._linalg_kernels.spmm_rows` in its order (so the result is
    bitwise that of the product of T with W's transpose), reading W's columns in place: a row of T with one
    nonzero (shift and identity rows) makes a row of P' a scaled column of W, no transposed copy."""
    m = W.shape[0]
    finite = True
    for j in range(m):
        c = idx[j, 0]
        if c == 1:
            b = idx[j, 1]
            t = Tt[j, b]
            for i in range(j, m):
                x = t * W[i, b] + RQR[j, i]
                P_new[j, i] = x
                P_new[i, j] = x
                finite &= abs(x) <= FLOAT_MAX
        else:
            for i in range(j, m):
                s = 0.0
                if c > 0:
                    b = idx[j, 1]
                    s = Tt[j, b] * W[i, b]
                    for q in range(2, c + 1):
                        b = idx[j, q]
                        s += Tt[j, b] * W[i, b]
                x = s + RQR[j, i]
                P_new[j, i] = x
                P_new[i, j] = x
                finite &= abs(x) <= FLOAT_MAX
    return finite, test and finite and steady(P_new, P_old, False)


@numba.njit(cache=True)
def _triangle_test(P_new, P_old, test):
    """``(P_new finite, steady(P_new, P_old))`` for the symmetric P_new and P_old (:func:`steady`; False
    unless ``test``, or when P_new is not finite: the next step then fails whatever the test says).
    The finiteness over the upper triangle, by rows (short dependency chains)."""
    m = P_new.shape[0]
    finite = True
    for i in range(m):
        for j in range(i, m):
            finite &= abs(P_new[i, j]) <= FLOAT_MAX
    return finite, test and finite and steady(P_new, P_old, False)


#: tolerance of the steady-state test (:func:`steady`), per entry, relative to the entry's own scale
STEADY_TOL = 1e-14


@numba.njit(cache=True, inline="always")
def steady(P_new, P_old, whole):
    """The filter's steady-state test, the one used on every path: the predicted covariance has converged
    when :func:`~iterops._linalg_kernels.converged` (``tol =`` :data:`STEADY_TOL`) holds for ``P_new = P_{t+1}``
    against ``P_old = P_t``::

        |P_{t+1,ij} - P_{t,ij}| <= 1e-14 sqrt(P_{t+1,ii} P_{t+1,jj})    for every i, j

    (``whole``: every entry of a ``P_old`` that need not be symmetric, P0; else the upper triangles).

    Why freezing the recursion at ``P_{t+1}`` changes no result beyond rounding, whatever the scales of the
    states: rescaling the states (``T -> D T D^-1``, ``Z -> Z D^-1``, ``R -> D R``, ``a0 -> D a0``,
    ``P0 -> D P0 D``, D diagonal) rescales every ``P_t -> D P_t D`` and leaves ``F_t``, ``v_t``, ``K_t Z_t``
    and the log-likelihood unchanged; the test is invariant under the same map, so it freezes at the same
    step for every scaling, and it suffices to look at the scaling where the variances of ``P_{t+1}`` are 1.
    There every entry of ``P_{t+1}`` is at most 1 and moved by at most 1e-14 (about 45 ulps, the rounding
    of one step's sums) in the last step; ``F``, ``K`` and the log-likelihood terms computed from it move
    by as much relative to their own size.  The recursion contracts at the steady state (``dP -> L dP L^T``,
    ``L = T (I - K Z)`` stable), so the drift it would still make is at most that of the last step times
    ``1 / (1 - rho(L)^2)``: rounding-sized unless the closed loop is within a few percent of a unit root
    (a rule relative to the largest entry shares that factor, without the scale-freedom).
    A zero variance freezes only an exactly unchanged row (a state known exactly stays known).  A variance
    that decays geometrically to 0 (lag states of a SARIMAX model without measurement error that no shock
    reaches: ~1e-72 after 300 steps) never converges on its own scale, so such a model runs the full
    recursion until it underflows to 0."""
    return converged(P_new, P_old, STEADY_TOL, whole)


@numba.njit(cache=True, inline="always")
def predict_cov_vjp(G, Tt, Pf, gT, Pf_bar, beta, GT, sx, tmp, g_finite=-1, want_T=True):
    """Reverse of ``P' = T P_f T^T + ...`` for ``G = sym(P'_bar)`` (G and P_f symmetric):
    ``P_f_bar = T^T G T + beta P_f_bar``, ``T_bar += 2 G T P_f`` (dense; only when ``want_T``: an m^3
    product, most of a sparse step's reverse).  ``GT``, ``tmp`` (m, m): scratch.
    T's zeros skipped when ``sx.use[0]`` and G, G T are finite (:class:`Structure`; ``g_finite``: 1 or 0
    when the caller knows whether G is finite, -1 to check)."""
    fin = all_finite(G) if g_finite < 0 else g_finite == 1
    if sx.use[0] and fin:
        spmm_rows(Tt.T, sx.Tt, G, GT)  # GT <- T^T G = (G T)^T
        if transpose_finite(GT, tmp):  # tmp = G T, contiguous: P_f_bar = T^T tmp by sums of scaled rows
            if beta == 0.0:
                spmm_rows(Tt.T, sx.Tt, tmp, Pf_bar)
            else:
                spmm(Tt.T, sx.Tt, tmp, Pf_bar, 1.0, beta)
            if want_T:
                _add_product(GT.T, Pf, gT, 2.0, tmp)
            return
    matmul(G, Tt, GT)
    matmul(Tt.T, GT, Pf_bar, 1.0, beta)
    if want_T:
        _add_product(GT, Pf, gT, 2.0, tmp)


@numba.njit(cache=True)
def _add_product(X, Y, out, alpha, tmp):
    """out += alpha X Y for square, C- or F-contiguous X, Y (the dense cotangent of T): above
    :data:`~iterops._linalg_kernels.SMALL` BLAS into the scratch ``tmp`` (no copy, no allocation)."""
    if X.shape[0] > SMALL:
        np.dot(X, Y, tmp)
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                out[i, j] += alpha * tmp[i, j]
        return
    matmul(X, Y, out, alpha, 1.0)


@numba.njit(cache=True)
def rq_vjp(G, Rt, Qt, gR, gQ):
    """Reverse of ``P' = ... + R sym(Q) R^T`` for ``G = sym(P'_bar)``: ``R_bar += G R (Q + Q^T)``,
    ``Q_bar += R^T G R``.  Linear in G: static R, Q take the sum of G over all steps, once."""
    m, r = Rt.shape
    GR = np.empty((m, r))
    Qs = np.empty((r, r))
    for i in range(r):
        for jj in range(r):
            Qs[i, jj] = Qt[i, jj] + Qt[jj, i]
    matmul(G, Rt, GR)
    matmul(GR, Qs, gR, 1.0, 1.0)
    matmul(Rt.T, GR, gQ, 1.0, 1.0)


@numba.njit(cache=True, inline="always")
def predict_vjp(a_bar, P_bar, p_sym, af, Pf, st, gst, sum_rq, Grq, G, W, Pf_bar, af_bar, sx, tmp, want):
    """Reverse of :func:`predict_mean` and :func:`predict_cov` for the cotangents ``a_bar``,
    ``P_bar`` of ``a'``, ``P'``: ``Pf_bar = T^T G T`` with ``G = sym(P_bar)``, ``af_bar += T^T a_bar``;
    ``c_bar += a_bar``, ``T_bar += a_bar a_f^T + 2 G T P_f`` (when ``want.T``, :class:`Wanted`) and the R, Q
    cotangents, or ``Grq += G`` when ``sum_rq`` (static R, Q: :func:`rq_vjp` once, on the sum).
    ``p_sym``: ``P_bar`` is exactly symmetric (then it is G, not copied).
    ``st``/``gst``: the step's matrices and their cotangents (:func:`system_at`), ``sx`` the
    step's :class:`Structure`; ``W``, ``tmp`` scratch."""
    m = af.shape[0]
    if p_sym:
        G = P_bar
    fin = _sym_sum(P_bar, G, not p_sym, Grq, sum_rq)
    predict_cov_vjp(G, st.T, Pf, gst.T, Pf_bar, 0.0, W, sx, tmp, 1 if fin else 0, want.T)
    if not sum_rq:
        rq_vjp(G, st.R, st.Q, gst.R, gst.Q)
    sparse = sx.use[0] and np.isfinite(np.sum(a_bar))  # T^T's zeros skipped (as in predict_mean)
    for i in range(m):  # c_bar += a'_bar; a_f_bar += T^T a'_bar; T_bar += a'_bar a_f^T
        gst.c[i] += a_bar[i]
        s = af_bar[i]
        if sparse:
            for q in range(1, sx.Tt[i, 0] + 1):
                l = sx.Tt[i, q]
                s += st.T[l, i] * a_bar[l]
        else:
            for l in range(m):
                s += st.T[l, i] * a_bar[l]
        af_bar[i] = s
        if want.T:
            for l in range(m):
                gst.T[i, l] += a_bar[i] * af[l]


@numba.njit(cache=True)
def _sym_sum(X, G, sym, S, add):
    """``G = sym(X)`` when ``sym`` (else G is X), ``S += G`` when ``add``, in one pass; returns True when G is
    finite (``x * 0`` summed by rows, as :func:`~iterops._linalg_kernels.all_finite`)."""
    m = X.shape[0]
    total = 0.0
    for i in range(m):
        row = 0.0
        if sym and add:
            for j in range(m):
                x = 0.5 * (X[i, j] + X[j, i])
                G[i, j] = x
                S[i, j] += x
                row += x * 0.0
        elif sym:
            for j in range(m):
                x = 0.5 * (X[i, j] + X[j, i])
                G[i, j] = x
                row += x * 0.0
        elif add:
            for j in range(m):
                x = X[i, j]
                S[i, j] += x
                row += x * 0.0
        else:
            for j in range(m):
                row += X[i, j] * 0.0
        total += row
    return total == 0.0


@numba.njit(cache=True)
def closed_loop(K, Zo, k, A):
    """A = I - K[:, :k] Zo[:k] (the filtered-state map; the smoother's and the adjoint's L = T A)."""
    m = A.shape[0]
    for i in range(m):
        for jj in range(m):
            s = 1.0 if i == jj else 0.0
            for l in range(k):
                s -= K[i, l] * Zo[l, jj]
            A[i, jj] = s


