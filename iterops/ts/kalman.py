r"""Kalman filter: one fused Numba kernel forward, one fused Numba adjoint backward.

Model (Durbin & Koopman 2012 notation, as statsmodels and pymc-extras use it)::

    y_t       = d_t + Z_t alpha_t + eps_t,      eps_t ~ N(0, H_t)
    alpha_t+1 = c_t + T_t alpha_t + R_t eta_t,  eta_t ~ N(0, Q_t)
    alpha_1   ~ N(a0, P0)

with ``m`` states, ``p`` observables, ``r`` state shocks and ``n`` time steps.

One step of the filter (``a, P`` = prediction of alpha_t given y_1..y_{t-1};
``o`` = the observed components of ``y_t``, ``k = |o|``; ``sym(X) = (X + X^T)/2``;
``j`` = ``cov_jitter``)::

    v   = y_t - d_t - Z_t a                         forecast error (NaN where missing)
    F   = sym(Z_t P Z_t^T + H_t) + j I              forecast error covariance (all p rows)
    L   = chol(F[o, o])                             -> loglik = -inf if not PD
    K   = P Z_o^T F_oo^{-1}                         gain (Cholesky solves)
    ll  = -(k log 2 pi + log|F_oo| + v_o^T F_oo^{-1} v_o) / 2
    a_f = a + K v_o
    P_f = sym((I - K Z_o) P (I - K Z_o)^T + K H_oo K^T) + j I    (Joseph form)
    a'  = T_t a_f + c_t
    P'  = sym(T_t P_f T_t^T) + sym(R_t Q_t R_t^T)

A fully missing row gives ``ll = 0``, ``a_f = a``, ``P_f = sym(P) + j I``.  With
``cov_jitter=0`` (the default) this is statsmodels' conventional filter with
known initialization (``initialize_known(a0, P0)``): every output agrees with
``statsmodels.tsa.statespace.kalman_filter.KalmanFilter`` to rounding, including
missing data (NaN ``forecast_error`` on missing components, full-size
``forecast_error_cov``).

Reproducing pymc-extras' ``StandardFilter`` (pymc_extras/statespace/filters/kalman_filter.py)
-----------------------------------------------------------------------------------------------
``kalman_filter(..., cov_jitter=1e-8, missing_value=-9999.0)`` performs the
arithmetic of ``StandardFilter(cov_jitter=1e-8, missing_fill_value=-9999.0)``
(their defaults: ``JITTER_DEFAULT``, ``MISSING_FILL``):

* ``cov_jitter`` -> their ``stabilize(H, jitter)`` inside ``F`` and
  ``stabilize(P_filtered, jitter)`` after the update; their Joseph update uses
  the un-jittered ``H`` in ``K H K^T``, and so does ours; no jitter on the
  predicted covariance, as theirs.
* ``missing_value`` -> their ``missing_fill_value``: entries of ``y`` equal to it
  are missing, as are NaN entries.  Their masking (zeroed rows of ``Z``, ``d``,
  ``H``, ``y``; ones on the masked diagonal of ``F`` before the Cholesky) is
  exactly "drop the missing components", which is what we compute.
* their log-likelihood constant: ``-(k/2) log(2 pi)`` with ``k`` the number of
  observed components, as here.
* their output ``predicted_states``/``predicted_covariances`` (n rows, starting
  with ``a0``/``P0``) is our ``predicted_state[..., :-1, :]``/``predicted_cov[..., :-1, :, :]``;
  ``filtered_*`` and ``loglike_obs`` are ours.
* their ``observed_states`` (``y_hat``, zeroed where missing) is
  ``where(missing, 0, d_t + Z_t @ predicted_state[t])``; their
  ``observed_covariances`` equals our ``forecast_error_cov`` on observed
  rows/columns, and is ``0`` off the diagonal and ``cov_jitter`` on the diagonal
  of missing rows/columns.
* rounding: we symmetrize ``F`` before the Cholesky (they factor the lower
  triangle of the unsymmetrized product), so outputs agree to ~1e-12 relative,
  not bitwise.

Time-varying matrices are declared explicitly: ``time_varying=("T", "Z")``
means ``T`` has shape (..., n, m, m) and ``Z`` (..., n, p, m) with row ``t``
used at step ``t`` (``c_t, T_t, R_t, Q_t`` move alpha_t to alpha_{t+1}).
No dimension guessing is done.

Failure is a value: if ``F[o, o]`` is not positive definite (or not finite) at
step ``t``, ``loglik = -inf``, ``loglik_obs[t] = -inf``, the later
``loglik_obs`` and every filtered/predicted quantity from step ``t`` on are
NaN; the gradient is NaN.  Nothing raises at run time except a shape mismatch
that could not be checked at graph-build time (``ValueError``).

Gradient: a hand-written reverse-mode adjoint of the recursion above, in a
second fused Numba Op (:class:`KalmanFilterGrad`).  The backward pass re-runs
each step's update from the stored predictions (``predicted_state``,
``predicted_cov``) and reverses it primitive by primitive (the comments in
:func:`kalman_adjoint_kernel` give each step's vector-Jacobian product).  It
supports cotangents of every output, with respect to every input (``y`` where
observed; 0 where missing).  The gradient Op itself is not differentiable
(second derivatives raise).

Reference loop this replaces (what pymc-extras writes with ``pytensor.scan``)::

    def step(y, a, P, c, d, T, Z, R, H, Q):
        v = y - d - Z @ a; F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F); A = pt.eye(m) - K @ Z
        ll = pm.logp(pm.MvNormal.dist(0, F), v)
        a_f = a + K @ v; P_f = A @ P @ A.T + K @ H @ K.T
        return a_f, P_f, T @ a_f + c, T @ P_f @ T.T + R @ Q @ R.T, ll
    outs, _ = pytensor.scan(step, sequences=[y], outputs_info=[None, None, a0, P0, None], ...)
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, grad_not_implemented
from pytensor.graph.basic import Apply
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.variable import TensorVariable

from iterops._fused import FusedOp, entry_point, register_fused_op
from iterops._validate import as_tensor, float_dtype

__all__ = [
    "kalman_filter",
    "stationary_cov",
    "KalmanFilterResult",
    "KalmanFilter",
    "KalmanFilterGrad",
    "kalman_filter_kernel",
    "kalman_adjoint_kernel",
]

#: System matrices, in argument order, and their core ndim when static.
SYSTEM_NAMES = ("c", "d", "T", "Z", "R", "H", "Q")
_CORE_NDIM = {"c": 1, "d": 1, "T": 2, "Z": 2, "R": 2, "H": 2, "Q": 2}
# core signature of each input (time axis "t<name>" of length 1 when static, n when time-varying)
_IN_SIG = (
    "(n,p)", "(m)", "(m,m)",
    "(tc,m)", "(td,p)", "(tT,m,m)", "(tZ,p,m)", "(tR,m,r)", "(tH,p,p)", "(tQ,r,r)",
)
_OUT_SIG = ("()", "(n)", "(n,m)", "(n,m,m)", "(n1,m)", "(n1,m,m)", "(n,p)", "(n,p,p)")
OUTPUT_NAMES = (
    "loglik", "loglik_obs", "filtered_state", "filtered_cov",
    "predicted_state", "predicted_cov", "forecast_error", "forecast_error_cov",
)
INPUT_NAMES = ("y", "a0", "P0", *SYSTEM_NAMES)
_LOG_2PI = float(np.log(2.0 * np.pi))
_SMALL = 10  # above this size, matrix products go to BLAS (as iterops.linalg.lyapunov._mm)


class KalmanFilterResult(NamedTuple):
    """Outputs of :func:`kalman_filter` (``...`` = batch dimensions)."""

    loglik: TensorVariable  #: (...,) total log-likelihood
    loglik_obs: TensorVariable  #: (..., n) per-step log-likelihood
    filtered_state: TensorVariable  #: (..., n, m) E[alpha_t | y_1..y_t]
    filtered_cov: TensorVariable  #: (..., n, m, m)
    predicted_state: TensorVariable  #: (..., n+1, m) E[alpha_t | y_1..y_{t-1}]; row 0 = a0
    predicted_cov: TensorVariable  #: (..., n+1, m, m); row 0 = P0
    forecast_error: TensorVariable  #: (..., n, p) y_t - d_t - Z_t a_t; NaN where missing
    forecast_error_cov: TensorVariable  #: (..., n, p, p) Z_t P_t Z_t^T + H_t (+ jitter I)


# ---------------------------------------------------------------------------
# Kernels (the single implementation)
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _matmul(X, Y, out):
    """out = X @ Y (hand-written loops for small matrices, BLAS above ``_SMALL``)."""
    n_, k_ = X.shape
    m_ = Y.shape[1]
    if (n_ > _SMALL or m_ > _SMALL or k_ > _SMALL) and k_ > 0:
        out[:, :] = np.dot(np.ascontiguousarray(X), np.ascontiguousarray(Y))
        return
    for i in range(n_):
        for j in range(m_):
            s = 0.0
            for l in range(k_):
                s += X[i, l] * Y[l, j]
            out[i, j] = s


@numba.njit(cache=True)
def _sym_inplace(X):
    """X <- (X + X^T) / 2 for a square X."""
    for i in range(X.shape[0]):
        for j in range(i + 1, X.shape[0]):
            s = 0.5 * (X[i, j] + X[j, i])
            X[i, j] = s
            X[j, i] = s


@numba.njit(cache=True)
def _cholesky(F, L, k):
    """Lower Cholesky of ``F[:k, :k]`` into ``L[:k, :k]``; False if not PD / not finite."""
    for j in range(k):
        s = F[j, j]
        for l in range(j):
            s -= L[j, l] * L[j, l]
        if not (s > 0.0) or not np.isfinite(s):
            return False
        ljj = np.sqrt(s)
        L[j, j] = ljj
        for i in range(j + 1, k):
            s = F[i, j]
            for l in range(j):
                s -= L[i, l] * L[j, l]
            L[i, j] = s / ljj
    return True


@numba.njit(cache=True)
def _cho_solve_vec(L, k, b, x):
    """x[:k] = (L L^T)^{-1} b[:k]; ``x`` may alias ``b``."""
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
def _cho_inverse(L, k, Finv):
    """Finv[:k, :k] = (L L^T)^{-1} from the Cholesky factor in L[:k, :k]."""
    for jj in range(k):
        for i in range(k):
            Finv[i, jj] = 1.0 if i == jj else 0.0
        _cho_solve_vec(L, k, Finv[:, jj], Finv[:, jj])


@numba.njit(cache=True)
def _observe(a, yt, dt, Zt, mv, use_mv, v, obs):
    """v = y_t - d_t - Z_t a (NaN where missing); ``obs[:k]`` = observed indices.  Returns k."""
    m = a.shape[0]
    p = yt.shape[0]
    k = 0
    for i in range(p):
        yi = yt[i]
        s = yi - dt[i]
        for l in range(m):
            s -= Zt[i, l] * a[l]
        if np.isnan(yi) or (use_mv and yi == mv):
            v[i] = np.nan
        else:
            v[i] = s
            obs[k] = i
            k += 1
    return k


@numba.njit(cache=True)
def _cov_update(P, Zt, Ht, jitter, obs, k, F, Zo, Ho, M, L, K, A, Pf, tmp):
    """Covariance part of the measurement update.  Returns ``(ok, log|F_oo|)``.

    Writes ``F`` (p, p) in full, ``Zo[:k]``, ``Ho[:k, :k]``, ``M[:, :k] = P Zo^T``,
    ``L[:k, :k] = chol(F_oo)``, ``K[:, :k] = M F_oo^{-1}``, ``A = I - K Zo`` and
    ``Pf = sym(A P A^T + K Ho K^T) + j I``.
    """
    m = P.shape[0]
    p = Zt.shape[0]
    # F = sym(Z P Z^T + H) + j I over all p rows; tmp[:, :p] = P Z^T
    for i in range(m):
        for jj in range(p):
            s = 0.0
            for l in range(m):
                s += P[i, l] * Zt[jj, l]
            tmp[i, jj] = s
    for i in range(p):
        for jj in range(p):
            s = Ht[i, jj]
            for l in range(m):
                s += Zt[i, l] * tmp[l, jj]
            F[i, jj] = s
    for i in range(p):
        for jj in range(i + 1, p):
            s = 0.5 * (F[i, jj] + F[jj, i])
            F[i, jj] = s
            F[jj, i] = s
        F[i, i] += jitter
    # observed blocks
    for ii in range(k):
        i = obs[ii]
        for l in range(m):
            Zo[ii, l] = Zt[i, l]
            M[l, ii] = tmp[l, i]
        for jj in range(k):
            Ho[ii, jj] = Ht[i, obs[jj]]
            L[ii, jj] = F[i, obs[jj]]  # F_oo, factored in place below
    if not _cholesky(L, L, k):
        return False, np.nan
    logdet = 0.0
    for i in range(k):
        logdet += 2.0 * np.log(L[i, i])
    # K = M F_oo^{-1}, row by row
    for i in range(m):
        for jj in range(k):
            K[i, jj] = M[i, jj]
        _cho_solve_vec(L, k, K[i], K[i])
    # A = I - K Zo
    for i in range(m):
        for jj in range(m):
            s = 1.0 if i == jj else 0.0
            for l in range(k):
                s -= K[i, l] * Zo[l, jj]
            A[i, jj] = s
    # Pf = sym(A P A^T + K Ho K^T) + j I ; tmp <- A P
    _matmul(A, P, tmp[:m, :m])
    _matmul(tmp[:m, :m], A.T, Pf)
    if k > 0:
        # tmp[:, :k] <- K Ho
        for i in range(m):
            for jj in range(k):
                s = 0.0
                for l in range(k):
                    s += K[i, l] * Ho[l, jj]
                tmp[i, jj] = s
        for i in range(m):
            for jj in range(m):
                s = 0.0
                for l in range(k):
                    s += tmp[i, l] * K[jj, l]
                Pf[i, jj] += s
    _sym_inplace(Pf)
    for i in range(m):
        Pf[i, i] += jitter
    return True, logdet


@numba.njit(cache=True)
def _mean_update(a, v, obs, k, logdet, L, K, w, af):
    """w = F_oo^{-1} v_o; a_f = a + K v_o.  Returns the step's log-likelihood."""
    m = a.shape[0]
    for i in range(k):
        w[i] = v[obs[i]]
    _cho_solve_vec(L, k, w, w)
    quad = 0.0
    for i in range(k):
        quad += v[obs[i]] * w[i]
    for i in range(m):
        s = a[i]
        for jj in range(k):
            s += K[i, jj] * v[obs[jj]]
        af[i] = s
    return -0.5 * (k * _LOG_2PI + logdet + quad)


@numba.njit(cache=True)
def _predict_mean(af, ct, Tt, a_next):
    """a' = T a_f + c."""
    m = af.shape[0]
    for i in range(m):
        s = ct[i]
        for l in range(m):
            s += Tt[i, l] * af[l]
        a_next[i] = s


@numba.njit(cache=True)
def _predict_cov(Pf, Tt, Rt, Qt, P_next, tmp, tmp2):
    """P' = sym(T P_f T^T) + sym(R Q R^T)."""
    m = Pf.shape[0]
    r = Qt.shape[0]
    if m > _SMALL or r > _SMALL:
        _matmul(Tt, Pf, tmp[:m, :m])
        _matmul(tmp[:m, :m], Tt.T, P_next)
        _matmul(Rt, Qt, tmp2[:m, :r])
        _matmul(tmp2[:m, :r], Rt.T, tmp[:m, :m])
        for i in range(m):
            for jj in range(m):
                P_next[i, jj] += tmp[i, jj]
    else:
        for i in range(m):
            for jj in range(m):
                s = 0.0
                for l in range(m):
                    s += Tt[i, l] * Pf[l, jj]
                tmp[i, jj] = s
        for i in range(m):
            for jj in range(r):
                s = 0.0
                for l in range(r):
                    s += Rt[i, l] * Qt[l, jj]
                tmp2[i, jj] = s
        for i in range(m):
            for jj in range(m):
                s = 0.0
                for l in range(m):
                    s += tmp[i, l] * Tt[jj, l]
                for l in range(r):
                    s += tmp2[i, l] * Rt[jj, l]
                P_next[i, jj] = s
    _sym_inplace(P_next)


@numba.njit(cache=True)
def _workspace(m, p, r):
    q = max(m, p, r, 1)
    return (
        np.empty(p, dtype=np.int64),  # obs
        np.empty((p, m)),  # Zo
        np.empty((p, p)),  # Ho
        np.empty((m, p)),  # M
        np.empty((p, p)),  # L
        np.empty((m, p)),  # K
        np.empty(p),  # w
        np.empty((m, m)),  # A
        np.empty((q, q)),  # tmp
        np.empty((q, q)),  # tmp2
    )


@numba.njit(cache=True)
def _ti(X, t):
    """Time index into a system array with a leading time axis of length 1 (static) or n."""
    return t if X.shape[0] > 1 else 0


@numba.njit(cache=True)
def _static_cov(T, Z, R, H, Q):
    """True when the covariance recursion does not depend on t (no time-varying T, Z, R, H, Q)."""
    return T.shape[0] == 1 and Z.shape[0] == 1 and R.shape[0] == 1 and H.shape[0] == 1 and Q.shape[0] == 1


@numba.njit(cache=True)
def _same(X, Y):
    """Bitwise equality of two (m, m) arrays."""
    for i in range(X.shape[0]):
        for j in range(X.shape[1]):
            if X[i, j] != Y[i, j]:
                return False
    return True


@numba.njit(cache=True)
def kalman_filter_kernel(y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv):
    """Forward filter for one series; float64 arrays, system matrices with a leading time axis.

    Shapes: y (n, p); a0 (m,); P0 (m, m); c (tc, m); d (td, p); T (tT, m, m);
    Z (tZ, p, m); R (tR, m, r); H (tH, p, p); Q (tQ, r, r) with each t* in {1, n}.
    Returns ``(loglik, loglik_obs, filtered_state, filtered_cov, predicted_state,
    predicted_cov, forecast_error, forecast_error_cov)``.

    Steady state (as statsmodels): when T, Z, R, H, Q are static, every component
    is observed and the predicted covariance has converged
    (``max|P_{t+1} - P_t| <= 1e-14 max|P_{t+1}|``), the covariance recursion is
    frozen at ``P_{t+1}``: one more full update computes F, K, P_f from it, and
    later fully observed steps reuse them (only the mean recursion runs).  A step
    with missing components leaves the steady state.
    """
    n, p = y.shape
    m = a0.shape[0]
    r = Q.shape[1]
    ll_obs = np.full(n, np.nan)
    af = np.full((n, m), np.nan)
    Pf = np.full((n, m, m), np.nan)
    ap = np.full((n + 1, m), np.nan)
    Pp = np.full((n + 1, m, m), np.nan)
    v = np.full((n, p), np.nan)
    F = np.full((n, p, p), np.nan)
    ap[0] = a0
    Pp[0] = P0
    obs, Zo, Ho, M, L, K, w, A, tmp, tmp2 = _workspace(m, p, r)
    static = _static_cov(T, Z, R, H, Q)
    steady = False  # covariance recursion frozen
    cached = False  # F, L, K, Pf of the frozen covariance are in the work arrays
    logdet = 0.0
    total = 0.0
    for t in range(n):
        Zt = Z[_ti(Z, t)]
        k = _observe(ap[t], y[t], d[_ti(d, t)], Zt, mv, use_mv, v[t], obs)
        if k < p:
            steady = False
            cached = False
        if not cached:
            ok, logdet = _cov_update(Pp[t], Zt, H[_ti(H, t)], jitter, obs, k, F[t], Zo, Ho, M, L, K, A, Pf[t], tmp)
            if not ok:
                ll_obs[t] = -np.inf
                return -np.inf, ll_obs, af, Pf, ap, Pp, v, F
            cached = steady
        else:
            F[t] = F[t - 1]
            Pf[t] = Pf[t - 1]
        ll = _mean_update(ap[t], v[t], obs, k, logdet, L, K, w, af[t])
        ll_obs[t] = ll
        total += ll
        _predict_mean(af[t], c[_ti(c, t)], T[_ti(T, t)], ap[t + 1])
        if steady:
            Pp[t + 1] = Pp[t]
        else:
            _predict_cov(Pf[t], T[_ti(T, t)], R[_ti(R, t)], Q[_ti(Q, t)], Pp[t + 1], tmp, tmp2)
            if static and k == p:
                diff = 0.0
                scale = 0.0
                for i in range(m):
                    for j in range(m):
                        diff = max(diff, abs(Pp[t + 1, i, j] - Pp[t, i, j]))
                        scale = max(scale, abs(Pp[t + 1, i, j]))
                steady = diff <= 1e-14 * scale
    return total, ll_obs, af, Pf, ap, Pp, v, F


@numba.njit(cache=True)
def _steady_adjoint_step(
    t, a, v, w, af, Tt, Zt, A, K, Zo, Finv, Lss, k, abar, Pbar,
    g_ll, g_llobs, g_af, g_Pf, g_v, g_F, has_ll, has_llobs, has_af, has_Pf, has_v, has_F,
    gy, gc, gd, gT, gZ, Gs, Ss, Xs, Ms,
    G, af_bar, vo_bar, Fo_bar, X_bar, Mo_bar, W1, S, a_bar_new, P_bar_new,
):
    """One backward step inside a steady stretch (static system, every component observed,
    ``cov_jitter = 0``, covariance update bitwise the one of step t+1).

    With ``S = T^T G T + sym(Pf_bar_out)`` (G = sym(P'_bar)) the gain terms of the generic step
    cancel: ``K_bar = 2 S (K H - A P Z^T) + a_f_bar v^T = a_f_bar v^T`` because ``K F = P Z^T``
    (optimal gain).  So ``Mo_bar = a_f_bar w^T`` (w = F^{-1} v), ``Fo_bar = -ll_bar/2 (F^{-1} - w w^T)
    - (K^T a_f_bar) w^T`` and the covariance cotangent recursion is

        P_bar = L^T G L + A^T sym(Pf_bar_out) A + Z^T sym(F_bar) Z + Mo_bar Z,   L = T A.

    The parameter cotangents of the covariance path are linear in (G, S, F_bar, Mo_bar) with
    coefficients constant over the stretch: their sums ``Gs, Ss, Xs, Ms`` are accumulated here
    and turned into T/R/Q/H/Z cotangents once by :func:`_steady_flush`.  The mean path
    (a, v, y, d, c, and the a_f-dependent T and Z terms) is done per step, as in the generic step.
    """
    m = a.shape[0]
    p = v.shape[0]
    for i in range(m):
        for j in range(m):
            G[i, j] = 0.5 * (Pbar[i, j] + Pbar[j, i])
            Gs[i, j] += G[i, j]
    # mean path: a' = T a_f + c
    for i in range(m):
        gc[i] += abar[i]
        s = g_af[t, i] if has_af else 0.0
        for l in range(m):
            s += Tt[l, i] * abar[l]
        af_bar[i] = s
        for j in range(m):
            gT[i, j] += abar[i] * af[j]
    ll_bar = 0.0
    if has_ll:
        ll_bar += g_ll[()]
    if has_llobs:
        ll_bar += g_llobs[t]
    # u = K^T a_f_bar (stored in vo_bar first)
    for i in range(k):
        s = 0.0
        for l in range(m):
            s += K[l, i] * af_bar[l]
        vo_bar[i] = s
    # F_bar (p == k here: obs = 0..p-1); X_bar = sym(F_bar_out + Fo_bar)
    for i in range(p):
        for j in range(p):
            Fo_bar[i, j] = -0.5 * ll_bar * (Finv[i, j] - w[i] * w[j]) - vo_bar[i] * w[j]
            X_bar[i, j] = g_F[t, i, j] if has_F else 0.0
    for i in range(p):
        for j in range(p):
            s = 0.5 * (Fo_bar[i, j] + Fo_bar[j, i] + X_bar[i, j] + X_bar[j, i])
            W1[i, j] = s
    for i in range(p):
        for j in range(p):
            X_bar[i, j] = W1[i, j]
            Xs[i, j] += W1[i, j]
    for i in range(m):
        for j in range(p):
            Mo_bar[i, j] = af_bar[i] * w[j]
            Ms[i, j] += Mo_bar[i, j]
    # P_bar = L^T G L (+ A^T sym(g_Pf) A) + Z^T X_bar Z + Mo_bar Z
    _matmul(G, Lss, S)  # S <- G L
    _matmul(Lss.T, S, P_bar_new)
    if has_Pf:
        for i in range(m):
            for j in range(m):
                W1[i, j] = 0.5 * (g_Pf[t, i, j] + g_Pf[t, j, i])
                Ss[i, j] += W1[i, j]
        _matmul(W1[:m, :m], A, S)
        _matmul(A.T, S, G)  # (G no longer needed)
        for i in range(m):
            for j in range(m):
                P_bar_new[i, j] += G[i, j]
    for i in range(p):  # W1[:p, :m] = X_bar Z
        for j in range(m):
            s = 0.0
            for l in range(p):
                s += X_bar[i, l] * Zt[l, j]
            W1[i, j] = s
    for i in range(m):
        for j in range(m):
            s = 0.0
            for l in range(p):
                s += Zt[l, i] * W1[l, j] + Mo_bar[i, l] * Zt[l, j]
            P_bar_new[i, j] += s
    # v = y - d - Z a: vo_bar = u - ll_bar w (+ g_v)
    for i in range(p):
        vb = vo_bar[i] - ll_bar * w[i]
        if has_v:
            vb += g_v[t, i]
        vo_bar[i] = vb
        gy[t, i] += vb
        gd[i] -= vb
        for j in range(m):
            gZ[i, j] -= vb * a[j]
    for j in range(m):
        s = af_bar[j]
        for i in range(p):
            s -= Zt[i, j] * vo_bar[i]
        a_bar_new[j] = s


@numba.njit(cache=True)
def _steady_flush(Tt, Zt, Rt, Qt, P, Pf, A, K, k, Gs, Ss, Xs, Ms, gT, gZ, gR, gH, gQ, W1, W2):
    """Add the covariance-path parameter cotangents of a steady stretch (sums from
    :func:`_steady_adjoint_step`) and reset the sums.  Same formulas as the generic step:
    T_bar += 2 G T Pf; R_bar += G R (Q + Q^T); Q_bar += R^T G R; with S = T^T G T + sym(Pf_bar_out):
    A_bar = S A (P + P^T), Z_bar -= K^T A_bar, H_bar += K^T S K; and H_bar += F_bar,
    Z_bar += F_bar Z (P + P^T) + Mo_bar^T P."""
    m = Tt.shape[0]
    p = Zt.shape[0]
    r = Qt.shape[0]
    _matmul(Gs, Tt, W1[:m, :m])  # W1 = G T
    for i in range(m):  # Ss += T^T (G T)
        for j in range(m):
            s = 0.0
            for l in range(m):
                s += Tt[l, i] * W1[l, j]
            Ss[i, j] += s
    _matmul(W1[:m, :m], Pf, W2[:m, :m])
    for i in range(m):
        for j in range(m):
            gT[i, j] += 2.0 * W2[i, j]
    for i in range(m):  # W1[:, :r] = G R
        for j in range(r):
            s = 0.0
            for l in range(m):
                s += Gs[i, l] * Rt[l, j]
            W1[i, j] = s
    for i in range(m):
        for j in range(r):
            s = 0.0
            for l in range(r):
                s += W1[i, l] * (Qt[l, j] + Qt[j, l])
            gR[i, j] += s
    for i in range(r):
        for j in range(r):
            s = 0.0
            for l in range(m):
                s += Rt[l, i] * W1[l, j]
            gQ[i, j] += s
    _matmul(Ss, A, W1[:m, :m])  # W1 = S A
    for i in range(m):  # W2 = A_bar = (S A)(P + P^T)
        for j in range(m):
            s = 0.0
            for l in range(m):
                s += W1[i, l] * (P[l, j] + P[j, l])
            W2[i, j] = s
    for i in range(k):  # Z_bar -= K^T A_bar
        for j in range(m):
            s = 0.0
            for l in range(m):
                s += K[l, i] * W2[l, j]
            gZ[i, j] -= s
    _matmul(Ss, K[:, :k], W1[:m, :k])  # W1 = S K
    for i in range(k):
        for j in range(k):
            s = 0.0
            for l in range(m):
                s += K[l, i] * W1[l, j]
            gH[i, j] += s
    for i in range(p):
        for j in range(p):
            gH[i, j] += Xs[i, j]
    _matmul(Xs, Zt, W1[:p, :m])
    for i in range(p):
        for j in range(m):
            s = 0.0
            for l in range(m):
                s += W1[i, l] * (P[l, j] + P[j, l]) + Ms[l, i] * P[l, j]
            gZ[i, j] += s
    Gs[:, :] = 0.0
    Ss[:, :] = 0.0
    Xs[:, :] = 0.0
    Ms[:, :] = 0.0


@numba.njit(cache=True)
def kalman_adjoint_kernel(
    y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv, ap, Pp,
    g_ll, g_llobs, g_af, g_Pf, g_ap, g_Pp, g_v, g_F,
    has_ll, has_llobs, has_af, has_Pf, has_ap, has_Pp, has_v, has_F,
):
    """Reverse-mode adjoint of :func:`kalman_filter_kernel`.

    ``ap``/``Pp`` are the forward ``predicted_state``/``predicted_cov``; each
    step's update is recomputed from them.  ``g_*`` are the output cotangents
    (``has_*`` False: disconnected, array ignored).  Returns the cotangents of
    ``(y, a0, P0, c, d, T, Z, R, H, Q)`` in their shapes (time-summed for static
    matrices); all NaN if the forward pass failed.
    """
    n, p = y.shape
    m = a0.shape[0]
    r = Q.shape[1]
    gy = np.zeros_like(y)
    gc = np.zeros_like(c)
    gd = np.zeros_like(d)
    gT = np.zeros_like(T)
    gZ = np.zeros_like(Z)
    gR = np.zeros_like(R)
    gH = np.zeros_like(H)
    gQ = np.zeros_like(Q)
    obs, Zo, Ho, M, L, K, w, A, tmp, tmp2 = _workspace(m, p, r)
    q = max(m, p, r, 1)
    v = np.empty(p)
    F = np.empty((p, p))
    af = np.empty(m)
    Pf = np.empty((m, m))
    abar = np.zeros(m)  # cotangent of the prediction entering the current step
    Pbar = np.zeros((m, m))
    if has_ap:
        abar[:] = g_ap[n]
    if has_Pp:
        Pbar[:] = g_Pp[n]
    G = np.empty((m, m))
    S = np.empty((m, m))
    Pf_bar = np.empty((m, m))
    af_bar = np.empty(m)
    A_bar = np.empty((m, m))
    K_bar = np.empty((m, p))
    Finv = np.empty((p, p))
    Fo_bar = np.empty((p, p))
    X_bar = np.empty((p, p))
    vo_bar = np.empty(p)
    Mo_bar = np.empty((m, p))
    a_bar_new = np.empty(m)
    P_bar_new = np.empty((m, m))
    W1 = np.empty((q, q))
    static = _static_cov(T, Z, R, H, Q)
    cached_full = False
    P_cached = np.empty((m, m))
    Psym = np.empty((m, m))
    logdet = 0.0
    # steady-state fast path (see _steady_adjoint_step): L = T A and the sums of the stretch
    fast = jitter == 0.0 and static
    Lss = np.empty((m, m))
    Gs = np.zeros((m, m))
    Ss = np.zeros((m, m))
    Xs = np.zeros((p, p))
    Ms = np.zeros((m, p))
    n_acc = 0
    for t in range(n - 1, -1, -1):
        it_c, it_d, it_T, it_Z = _ti(c, t), _ti(d, t), _ti(T, t), _ti(Z, t)
        it_R, it_H, it_Q = _ti(R, t), _ti(H, t), _ti(Q, t)
        Tt, Zt, Rt, Ht, Qt = T[it_T], Z[it_Z], R[it_R], H[it_H], Q[it_Q]
        a = ap[t]
        P = Pp[t]
        k = _observe(a, y[t], d[it_d], Zt, mv, use_mv, v, obs)
        # recompute the covariance update unless it is bitwise the one of step t+1
        reuse = static and k == p and cached_full and _same(P, P_cached)
        if not reuse:
            if n_acc > 0:  # leave a steady stretch: its parameter cotangents, once
                _steady_flush(T[0], Z[0], R[0], Q[0], P_cached, Pf, A, K, p, Gs, Ss, Xs, Ms,
                              gT[0], gZ[0], gR[0], gH[0], gQ[0], W1, tmp2)
                n_acc = 0
            ok, logdet = _cov_update(P, Zt, Ht, jitter, obs, k, F, Zo, Ho, M, L, K, A, Pf, tmp)
            cached_full = k == p
            P_cached[:] = P
            if ok:
                _cho_inverse(L, k, Finv)
                if fast and cached_full:
                    _matmul(Tt, A, Lss)
        else:
            ok = True
        if ok:
            _mean_update(a, v, obs, k, logdet, L, K, w, af)
        if not ok:
            return (np.full_like(y, np.nan), np.full_like(a0, np.nan), np.full_like(P0, np.nan),
                    np.full_like(c, np.nan), np.full_like(d, np.nan), np.full_like(T, np.nan),
                    np.full_like(Z, np.nan), np.full_like(R, np.nan), np.full_like(H, np.nan),
                    np.full_like(Q, np.nan))
        if reuse and fast:
            _steady_adjoint_step(
                t, a, v, w, af, Tt, Zt, A, K, Zo, Finv, Lss, k, abar, Pbar,
                g_ll, g_llobs, g_af, g_Pf, g_v, g_F, has_ll, has_llobs, has_af, has_Pf, has_v, has_F,
                gy, gc[0], gd[0], gT[0], gZ[0], Gs, Ss, Xs, Ms,
                G, af_bar, vo_bar, Fo_bar, X_bar, Mo_bar, W1, S, a_bar_new, P_bar_new,
            )
            n_acc += 1
            for i in range(m):
                abar[i] = a_bar_new[i]
                if has_ap:
                    abar[i] += g_ap[t, i]
                for jj in range(m):
                    Pbar[i, jj] = P_bar_new[i, jj]
                    if has_Pp:
                        Pbar[i, jj] += g_Pp[t, i, jj]
            continue
        # --- predict: a' = T a_f + c ; P' = sym(T Pf T^T) + sym(R Q R^T) ---
        # G = sym(P'_bar); Pf_bar = T^T G T; T_bar += 2 G T Pf (G, Pf symmetric);
        # R_bar += G R (Q + Q^T); Q_bar += R^T G R; c_bar += a'_bar; T_bar += a'_bar a_f^T;
        # a_f_bar = T^T a'_bar
        for i in range(m):
            for jj in range(m):
                G[i, jj] = 0.5 * (Pbar[i, jj] + Pbar[jj, i])
        _matmul(G, Tt, W1[:m, :m])  # W1 = G T
        _matmul(Tt.T, W1[:m, :m], Pf_bar)  # Pf_bar = T^T (G T)
        _matmul(W1[:m, :m], Pf, S)  # T_bar += 2 (G T) Pf + a'_bar a_f^T  (S: scratch here)
        for i in range(m):
            for jj in range(m):
                gT[it_T, i, jj] += 2.0 * S[i, jj] + abar[i] * af[jj]
        for i in range(m):  # W1[:, :r] = G R
            for jj in range(r):
                s = 0.0
                for l in range(m):
                    s += G[i, l] * Rt[l, jj]
                W1[i, jj] = s
        for i in range(m):  # R_bar += (G R)(Q + Q^T)
            for jj in range(r):
                s = 0.0
                for l in range(r):
                    s += W1[i, l] * (Qt[l, jj] + Qt[jj, l])
                gR[it_R, i, jj] += s
        for i in range(r):  # Q_bar += R^T (G R)
            for jj in range(r):
                s = 0.0
                for l in range(m):
                    s += Rt[l, i] * W1[l, jj]
                gQ[it_Q, i, jj] += s
        for i in range(m):
            gc[it_c, i] += abar[i]
            s = 0.0
            for l in range(m):
                s += Tt[l, i] * abar[l]
            af_bar[i] = s
        if has_af:
            for i in range(m):
                af_bar[i] += g_af[t, i]
        if has_Pf:
            for i in range(m):
                for jj in range(m):
                    Pf_bar[i, jj] += g_Pf[t, i, jj]
        # --- Pf = sym(A P A^T + K Ho K^T) + j I ; S = sym(Pf_bar) ---
        # A_bar = S A (P + P^T); P_bar = A^T S A; K_bar = S K (Ho + Ho^T); Ho_bar = K^T S K
        for i in range(m):
            for jj in range(m):
                S[i, jj] = 0.5 * (Pf_bar[i, jj] + Pf_bar[jj, i])
        _matmul(S, A, W1[:m, :m])  # W1 = S A
        for i in range(m):
            for jj in range(m):
                Psym[i, jj] = P[i, jj] + P[jj, i]
        _matmul(W1[:m, :m], Psym, A_bar)  # A_bar = (S A)(P + P^T)
        _matmul(A.T, W1[:m, :m], P_bar_new)  # P_bar_new = A^T (S A)
        for i in range(m):  # W1[:, :k] = S K
            for jj in range(k):
                s = 0.0
                for l in range(m):
                    s += S[i, l] * K[l, jj]
                W1[i, jj] = s
        for i in range(m):  # K_bar = (S K)(Ho + Ho^T) - A_bar Zo^T + af_bar v_o^T
            for jj in range(k):
                s = 0.0
                for l in range(k):
                    s += W1[i, l] * (Ho[l, jj] + Ho[jj, l])
                for l in range(m):
                    s -= A_bar[i, l] * Zo[jj, l]
                K_bar[i, jj] = s + af_bar[i] * v[obs[jj]]
        for i in range(k):  # Ho_bar = K^T (S K) -> H[obs, obs]
            for jj in range(k):
                s = 0.0
                for l in range(m):
                    s += K[l, i] * W1[l, jj]
                gH[it_H, obs[i], obs[jj]] += s
        for i in range(k):  # A = I - K Zo: Zo_bar -= K^T A_bar
            for jj in range(m):
                s = 0.0
                for l in range(m):
                    s += K[l, i] * A_bar[l, jj]
                gZ[it_Z, obs[i], jj] -= s
        # --- a_f = a + K v_o: a_bar = af_bar; v_o_bar = K^T af_bar ---
        for i in range(m):
            a_bar_new[i] = af_bar[i]
        ll_bar = 0.0
        if has_ll:
            ll_bar += g_ll[()]
        if has_llobs:
            ll_bar += g_llobs[t]
        for i in range(k):
            s = 0.0
            for l in range(m):
                s += K[l, i] * af_bar[l]
            # ll = -(log|F| + v^T F^{-1} v)/2: v_bar -= ll_bar F^{-1} v
            vo_bar[i] = s - ll_bar * w[i]
            if has_v:
                vo_bar[i] += g_v[t, obs[i]]
        # Fo_bar = -ll_bar/2 (F^{-1} - w w^T) - K^T K_bar F^{-1};  Mo_bar = K_bar F^{-1}
        for i in range(m):
            for jj in range(k):
                s = 0.0
                for l in range(k):
                    s += K_bar[i, l] * Finv[l, jj]
                Mo_bar[i, jj] = s
        for i in range(k):
            for jj in range(k):
                s = 0.0
                for l in range(m):
                    s += K[l, i] * Mo_bar[l, jj]
                Fo_bar[i, jj] = -0.5 * ll_bar * (Finv[i, jj] - w[i] * w[jj]) - s
        # full F_bar (p, p): output cotangent + observed block; X_bar = sym(F_bar)
        for i in range(p):
            for jj in range(p):
                X_bar[i, jj] = 0.0
        if has_F:
            for i in range(p):
                for jj in range(p):
                    X_bar[i, jj] = g_F[t, i, jj]
        for i in range(k):
            for jj in range(k):
                X_bar[obs[i], obs[jj]] += Fo_bar[i, jj]
        for i in range(p):
            for jj in range(i + 1, p):
                s = 0.5 * (X_bar[i, jj] + X_bar[jj, i])
                X_bar[i, jj] = s
                X_bar[jj, i] = s
        # X = Z P Z^T + H: Z_bar += X_bar Z (P + P^T); P_bar += Z^T X_bar Z; H_bar += X_bar
        for i in range(p):
            for jj in range(p):
                gH[it_H, i, jj] += X_bar[i, jj]
        for i in range(p):  # W1[:p, :m] = X_bar Z
            for jj in range(m):
                s = 0.0
                for l in range(p):
                    s += X_bar[i, l] * Zt[l, jj]
                W1[i, jj] = s
        for i in range(p):
            for jj in range(m):
                s = 0.0
                for l in range(m):
                    s += W1[i, l] * (P[l, jj] + P[jj, l])
                gZ[it_Z, i, jj] += s
        for i in range(m):
            for jj in range(m):
                s = 0.0
                for l in range(p):
                    s += Zt[l, i] * W1[l, jj]
                P_bar_new[i, jj] += s
        # Mo = P Zo^T: P_bar += Mo_bar Zo; Zo_bar += Mo_bar^T P
        for i in range(m):
            for jj in range(m):
                s = 0.0
                for l in range(k):
                    s += Mo_bar[i, l] * Zo[l, jj]
                P_bar_new[i, jj] += s
        for i in range(k):
            for jj in range(m):
                s = 0.0
                for l in range(m):
                    s += Mo_bar[l, i] * P[l, jj]
                gZ[it_Z, obs[i], jj] += s
        # v_o = y_o - d_o - Zo a: y_bar += v_bar; d_bar -= v_bar; Zo_bar -= v_bar a^T; a_bar -= Zo^T v_bar
        for i in range(k):
            oi = obs[i]
            gy[t, oi] += vo_bar[i]
            gd[it_d, oi] -= vo_bar[i]
            for jj in range(m):
                gZ[it_Z, oi, jj] -= vo_bar[i] * a[jj]
                a_bar_new[jj] -= Zo[i, jj] * vo_bar[i]
        # carry to the previous step, adding the cotangent of predicted_state[t]
        for i in range(m):
            abar[i] = a_bar_new[i]
            if has_ap:
                abar[i] += g_ap[t, i]
            for jj in range(m):
                Pbar[i, jj] = P_bar_new[i, jj]
                if has_Pp:
                    Pbar[i, jj] += g_Pp[t, i, jj]
    if n_acc > 0:
        _steady_flush(T[0], Z[0], R[0], Q[0], P_cached, Pf, A, K, p, Gs, Ss, Xs, Ms,
                      gT[0], gZ[0], gR[0], gH[0], gQ[0], W1, tmp2)
    return gy, abar, Pbar, gc, gd, gT, gZ, gR, gH, gQ


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


def _check_shapes(y, a0, P0, c, d, T, Z, R, H, Q, tv):
    """Run-time shape check (raises: a shape mismatch is a programming error, not a sampler point)."""
    n, p = y.shape
    m = a0.shape[0]
    r = Q.shape[1]
    bad = P0.shape[0] != m or P0.shape[1] != m
    bad |= c.shape[1] != m or d.shape[1] != p
    bad |= T.shape[1] != m or T.shape[2] != m
    bad |= Z.shape[1] != p or Z.shape[2] != m
    bad |= R.shape[1] != m or R.shape[2] != r
    bad |= H.shape[1] != p or H.shape[2] != p
    bad |= Q.shape[2] != r
    lens = (c.shape[0], d.shape[0], T.shape[0], Z.shape[0], R.shape[0], H.shape[0], Q.shape[0])
    for i in range(7):
        bad |= lens[i] != (n if tv[i] else 1)
    return bad


_check_shapes_jit = numba.njit(cache=True)(_check_shapes)


@numba.njit(cache=True)
def _c(x):
    """C-contiguous float64 view or copy: the kernels are compiled (and cached) for C layouts only,
    and run several times faster on them than on strided views."""
    return np.ascontiguousarray(x)


@numba.njit(cache=True)
def _c0(x):
    """Fresh C-contiguous 0-d float64 copy of a 0-d array."""
    out = np.empty((), dtype=np.float64)
    out[()] = x[()]
    return out


@entry_point
def _filter_entry(tv: tuple, jitter: float, mv: float, use_mv: bool):
    @numba.njit
    def kalman_filter_fn(y, a0, P0, c, d, T, Z, R, H, Q):
        if _check_shapes_jit(y, a0, P0, c, d, T, Z, R, H, Q, tv):
            raise ValueError("kalman_filter: inconsistent input shapes at run time")
        ll, llo, af, Pf, ap, Pp, v, F = kalman_filter_kernel(
            _c(y), _c(a0), _c(P0), _c(c), _c(d), _c(T), _c(Z), _c(R), _c(H), _c(Q), jitter, mv, use_mv
        )
        out = np.empty((), dtype=np.float64)
        out[()] = ll
        return out, llo, af, Pf, ap, Pp, v, F

    return kalman_filter_fn


@entry_point
def _adjoint_entry(tv: tuple, jitter: float, mv: float, use_mv: bool, connected: tuple):
    has = connected
    n_ct = sum(connected)
    # position of each connected cotangent among the Op's trailing inputs
    pos = []
    j = 0
    for h in connected:
        pos.append(j if h else -1)
        j += h
    pos = tuple(pos)

    # Unpack the variable-length tail with literal indices known at build time.
    src = ["def _impl(y, a0, P0, c, d, T, Z, R, H, Q, ap, Pp" + "".join(f", g{i}" for i in range(n_ct)) + "):"]
    src.append("    if _check(y, a0, P0, c, d, T, Z, R, H, Q, tv):")
    src.append("        raise ValueError('kalman_filter gradient: inconsistent input shapes at run time')")
    n = "y.shape[0]"
    m = "a0.shape[0]"
    p = "y.shape[1]"
    dummies = {
        0: "np.zeros(())", 1: f"np.zeros(0)", 2: "np.zeros((0, 0))", 3: "np.zeros((0, 0, 0))",
        4: "np.zeros((0, 0))", 5: "np.zeros((0, 0, 0))", 6: "np.zeros((0, 0))", 7: "np.zeros((0, 0, 0))",
    }
    # np.ascontiguousarray would turn the 0-d loglik cotangent into 1-d: _c0 copies it into a fresh
    # 0-d C array instead, so that every graph calls the (large, slow to compile) adjoint kernel with
    # one type signature, whatever layout the graph gives that cotangent
    args = [(f"_c(g{pos[i]})" if i else f"_c0(g{pos[i]})") if has[i] else dummies[i] for i in range(8)]
    src.append(
        "    return _kernel(_c(y), _c(a0), _c(P0), _c(c), _c(d), _c(T), _c(Z), _c(R), _c(H), _c(Q), "
        "jitter, mv, use_mv, _c(ap), _c(Pp), "
        + ", ".join(args) + ", " + ", ".join(str(bool(h)) for h in has) + ")"
    )
    del n, m, p
    ns = {
        "np": np, "_check": _check_shapes_jit, "_kernel": kalman_adjoint_kernel, "_c": _c, "_c0": _c0,
        "tv": tv, "jitter": jitter, "mv": mv, "use_mv": use_mv,
    }
    exec("\n".join(src), ns)
    return numba.njit(ns["_impl"])


def _props_common(tv, cov_jitter, missing_value):
    return (
        tuple(bool(x) for x in tv),
        float(cov_jitter),
        float("nan") if missing_value is None else float(missing_value),
        missing_value is not None,
    )


class KalmanOpBase(FusedOp):
    """Options shared by the filter and smoother core Ops (float64 inputs; system matrices carry
    a time axis).  ``time_varying``: tuple of 7 bools for (c, d, T, Z, R, H, Q); a static matrix
    has a time axis of length 1."""

    __props__ = ("time_varying", "cov_jitter", "missing_value")

    def __init__(self, time_varying=(False,) * 7, cov_jitter=0.0, missing_value=None):
        self.time_varying = tuple(bool(x) for x in time_varying)
        self.cov_jitter = float(cov_jitter)
        self.missing_value = None if missing_value is None else float(missing_value)

    def _entry_args(self):
        return _props_common(self.time_varying, self.cov_jitter, self.missing_value)


@register_fused_op
class KalmanFilter(KalmanOpBase):
    """Core Op of :func:`kalman_filter` (see :class:`KalmanOpBase` for the options)."""

    gufunc_signature = ",".join(_IN_SIG) + "->" + ",".join(_OUT_SIG)

    def make_node(self, *inputs):
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        y, a0 = inputs[0], inputs[1]
        n, p = y.type.shape
        m = a0.type.shape[0]
        n1 = None if n is None else n + 1
        f = "float64"
        outs = [
            pt.tensor(dtype=f, shape=()), pt.tensor(dtype=f, shape=(n,)),
            pt.tensor(dtype=f, shape=(n, m)), pt.tensor(dtype=f, shape=(n, m, m)),
            pt.tensor(dtype=f, shape=(n1, m)), pt.tensor(dtype=f, shape=(n1, m, m)),
            pt.tensor(dtype=f, shape=(n, p)), pt.tensor(dtype=f, shape=(n, p, p)),
        ]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        (n, p), (m,) = input_shapes[0], input_shapes[1]
        return [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]

    def numba_fn(self, node):
        return _filter_entry(*self._entry_args())

    def pullback(self, inputs, outputs, cotangents):
        connected = tuple(not isinstance(g.type, DisconnectedType) for g in cotangents)
        if not any(connected):
            return [pt.zeros_like(x) for x in inputs]
        grad_op = KalmanFilterGrad(self.time_varying, self.cov_jitter, self.missing_value, connected)
        cts = [g for g, h in zip(cotangents, connected) if h]
        return list(grad_op(*inputs, outputs[4], outputs[5], *cts))


@register_fused_op
class KalmanFilterGrad(FusedOp):
    """Adjoint Op of :class:`KalmanFilter`: (inputs, predicted_state, predicted_cov, connected cotangents)
    -> cotangents of the 10 inputs.  Not differentiable itself."""

    __props__ = ("time_varying", "cov_jitter", "missing_value", "connected")

    def __init__(self, time_varying, cov_jitter, missing_value, connected):
        self.time_varying = tuple(bool(x) for x in time_varying)
        self.cov_jitter = float(cov_jitter)
        self.missing_value = None if missing_value is None else float(missing_value)
        self.connected = tuple(bool(x) for x in connected)
        ins = [*_IN_SIG, "(n1,m)", "(n1,m,m)"] + [s for s, h in zip(_OUT_SIG, self.connected) if h]
        self.gufunc_signature = ",".join(ins) + "->" + ",".join(_IN_SIG)

    def make_node(self, *inputs):
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        outs = [pt.tensor(dtype="float64", shape=x.type.shape) for x in inputs[:10]]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        return list(input_shapes[:10])

    def numba_fn(self, node):
        return _adjoint_entry(*_props_common(self.time_varying, self.cov_jitter, self.missing_value), self.connected)

    def pullback(self, inputs, outputs, cotangents):
        return [
            grad_not_implemented(self, i, x, "second derivatives of kalman_filter are not implemented")
            for i, x in enumerate(inputs)
        ]


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _normalize_time_varying(func, time_varying):
    if isinstance(time_varying, str):
        time_varying = (time_varying,)
    tv = tuple(time_varying)
    unknown = [x for x in tv if x not in SYSTEM_NAMES]
    if unknown:
        raise ValueError(
            f"{func}: time_varying may only name {SYSTEM_NAMES}, got unknown name(s) {unknown}"
        )
    return tuple(name in tv for name in SYSTEM_NAMES)


def _prepare_inputs(func, y, a0, P0, c, d, T, Z, R, H, Q, time_varying):
    """Validate at graph-build time; return float64 core-ready inputs, tv flags and the output dtype."""
    tv = _normalize_time_varying(func, time_varying)
    y = as_tensor(func, "y", y, min_ndim=2)
    a0 = as_tensor(func, "a0", a0, min_ndim=1)
    P0 = as_tensor(func, "P0", P0, min_ndim=2)
    mats = {}
    for name, x, is_tv in zip(SYSTEM_NAMES, (c, d, T, Z, R, H, Q), tv):
        nd = _CORE_NDIM[name] + is_tv
        x = as_tensor(func, name, x, min_ndim=nd)
        mats[name] = x
    out_dtype = float_dtype(y, a0, P0, *mats.values())
    n, p = y.type.shape[-2:]
    m = a0.type.shape[-1]

    def core(name, x, is_tv=False):
        nd = _CORE_NDIM.get(name, 0) + is_tv
        return x.type.shape[x.type.ndim - nd:] if nd else ()

    def require(cond, msg):
        if cond:
            raise ValueError(f"{func}: {msg}")

    def eq(a, b):
        return a is None or b is None or a == b

    shapes = ", ".join(
        [f"y {y.type.shape}", f"a0 {a0.type.shape}", f"P0 {P0.type.shape}"]
        + [f"{k} {v.type.shape}" for k, v in mats.items()]
    )
    suffix = f" (static shapes, None = unknown; time_varying={tuple(n_ for n_, f_ in zip(SYSTEM_NAMES, tv) if f_)}; got {shapes})"
    # dimensions: m from a0 (else T), p from y, r from Q
    if m is None:
        m = mats["T"].type.shape[-1]
    r = mats["Q"].type.shape[-1]
    require(not (eq(P0.type.shape[-1], m) and eq(P0.type.shape[-2], m)), f"P0 must be (m, m) with m = len(a0) = {m}" + suffix)
    expected = {"c": (m,), "d": (p,), "T": (m, m), "Z": (p, m), "R": (m, r), "H": (p, p), "Q": (r, r)}
    what = {
        "c": "c must have m entries (state dimension)",
        "d": "d must have p entries (y's last dimension)",
        "T": "T must be square (m, m)",
        "Z": "Z must be (p, m): p rows = y columns, m columns = states",
        "R": "R must be (m, r): m rows = states, r columns = Q's size",
        "H": "H must be square (p, p) with p = y columns",
        "Q": "Q must be square (r, r)",
    }
    for name in ("T", "H", "Q"):
        cs = mats[name].type.shape[-2:]
        require(not eq(cs[0], cs[1]), what[name] + suffix)
    for name, is_tv in zip(SYSTEM_NAMES, tv):
        x = mats[name]
        cs = x.type.shape[x.type.ndim - _CORE_NDIM[name]:]
        require(not all(eq(a_, b_) for a_, b_ in zip(cs, expected[name])), what[name] + suffix)
        if is_tv:
            tlen = x.type.shape[x.type.ndim - _CORE_NDIM[name] - 1]
            require(not eq(tlen, n), f"time-varying {name} must have length n_time = {n} along axis "
                    f"{-_CORE_NDIM[name] - 1}, got {tlen}" + suffix)
    f64 = lambda x: pt.cast(x, "float64") if x.type.dtype != "float64" else x  # noqa: E731
    system = [
        f64(mats[name]) if is_tv else pt.expand_dims(f64(mats[name]), -_CORE_NDIM[name] - 1)
        for name, is_tv in zip(SYSTEM_NAMES, tv)
    ]
    return [f64(y), f64(a0), f64(P0), *system], tv, out_dtype


def kalman_filter(
    y, a0, P0, c, d, T, Z, R, H, Q, *,
    time_varying=(),
    cov_jitter: float = 0.0,
    missing_value: float | None = None,
) -> KalmanFilterResult:
    r"""Kalman filter log-likelihood, filtered and predicted moments; one fused Numba loop.

    See the module docstring for the equations, the pymc-extras correspondence and
    the failure behaviour.

    Parameters
    ----------
    y : (..., n, p)
        Observations; NaN entries (and entries equal to ``missing_value``) are missing.
    a0 : (..., m), P0 : (..., m, m)
        Mean and covariance of alpha_1 (known initialization; see :func:`stationary_cov`).
    c : (..., m), d : (..., p), T : (..., m, m), Z : (..., p, m), R : (..., m, r),
    H : (..., p, p), Q : (..., r, r)
        System matrices.  A name listed in ``time_varying`` carries an extra time
        axis of length ``n`` right before its core dimensions, e.g. ``T`` (..., n, m, m).
    time_varying : iterable of {"c", "d", "T", "Z", "R", "H", "Q"}
        Which system matrices vary over time (explicit; shapes are not guessed).
    cov_jitter : float
        Added to the diagonal of ``F`` and of the filtered covariance at each step
        (pymc-extras' ``cov_jitter``).  0 reproduces statsmodels.
    missing_value : float, optional
        Extra sentinel marking missing observations (pymc-extras' ``missing_fill_value``, -9999.0).

    Leading (batch) dimensions of all arguments broadcast.

    Returns
    -------
    KalmanFilterResult
        ``loglik`` (...), ``loglik_obs`` (..., n), ``filtered_state`` (..., n, m),
        ``filtered_cov`` (..., n, m, m), ``predicted_state`` (..., n+1, m),
        ``predicted_cov`` (..., n+1, m, m), ``forecast_error`` (..., n, p),
        ``forecast_error_cov`` (..., n, p, p).  dtype: float64, or float32 if all inputs are float32.

    Examples
    --------
    >>> import numpy as np, iterops
    >>> y = np.array([[1.0], [np.nan], [0.5]])
    >>> res = iterops.ts.kalman_filter(y, [0.0], [[1.0]], [0.0], [0.0], [[1.0]], [[1.0]],
    ...                                [[1.0]], [[1.0]], [[0.5]])
    >>> round(float(res.loglik.eval()), 6)  # statsmodels' KalmanFilter llf: -2.892596
    -2.892596
    """
    outs = _apply_kalman_op(
        "kalman_filter", KalmanFilter, (y, a0, P0, c, d, T, Z, R, H, Q), time_varying, cov_jitter, missing_value
    )
    return KalmanFilterResult(*outs)


def _apply_kalman_op(func, op_type, args, time_varying, cov_jitter, missing_value):
    """Validate (graph-build time), apply ``op_type`` through ``Blockwise``, cast back to the input precision."""
    inputs, tv, out_dtype = _prepare_inputs(func, *args, time_varying)
    if not np.isfinite(cov_jitter) or cov_jitter < 0:
        raise ValueError(f"{func}: cov_jitter must be finite and >= 0, got {cov_jitter}")
    outs = Blockwise(op_type(tv, cov_jitter, missing_value))(*inputs)
    if out_dtype != "float64":
        outs = [pt.cast(o, out_dtype) for o in outs]
    return outs


def stationary_cov(T, R, Q) -> TensorVariable:
    r"""Stationary initialization ``P0`` solving ``P0 = T P0 T^T + R Q R^T``.

    ``T`` (..., m, m) must have spectral radius below one; ``R`` (..., m, r),
    ``Q`` (..., r, r).  Calls :func:`iterops.solve_discrete_lyapunov`, so it is
    fused, batched and differentiable.
    """
    from iterops.linalg.lyapunov import solve_discrete_lyapunov

    func = "stationary_cov"
    T = as_tensor(func, "T", T, min_ndim=2)
    R = as_tensor(func, "R", R, min_ndim=2)
    Q = as_tensor(func, "Q", Q, min_ndim=2)
    if T.type.shape[-1] is not None and R.type.shape[-2] is not None and T.type.shape[-1] != R.type.shape[-2]:
        raise ValueError(f"{func}: R must have m = {T.type.shape[-1]} rows, got R with shape {R.type.shape}")
    if Q.type.shape[-1] is not None and R.type.shape[-1] is not None and Q.type.shape[-1] != R.type.shape[-1]:
        raise ValueError(f"{func}: Q must be (r, r) with r = R's columns, got Q {Q.type.shape}, R {R.type.shape}")
    return solve_discrete_lyapunov(T, R @ Q @ R.mT)
