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
    S   = sym(P)                                    (P enters only through S)
    F   = Z_t S Z_t^T + sym(H_t) + j I              forecast error covariance (all p rows)
    L   = chol(F[o, o])                             -> loglik = -inf if not PD
    M   = S Z_o^T;  K = M F_oo^{-1}                 gain (Cholesky solves)
    ll  = -(k log 2 pi + log|F_oo| + v_o^T F_oo^{-1} v_o) / 2
    a_f = a + K v_o
    P_f = S - K M^T - j K K^T + j I
    a'  = T_t a_f + c_t
    P'  = T_t P_f T_t^T + R_t sym(Q_t) R_t^T

Every symmetric matrix is computed on one triangle and mirrored, so the
covariances are exactly symmetric.  For this (optimal) gain ``P_f`` is the Joseph
form ``(I - K Z_o) S (I - K Z_o)^T + K H_oo K^T + j I`` (expand it with
``K F_oo = M``), which is what pymc-extras evaluates; the expanded form costs
O(m^2 k) instead of O(m^3) and is what statsmodels' conventional filter uses.
Because ``P0`` enters through ``sym(P0)``, the gradient with respect to ``P0``
is symmetric (plus the cotangent of ``predicted_cov[0]``, which is ``P0``
itself).

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
observed; 0 where missing).  Over a steady-state stretch the gain terms cancel
and the covariance cotangents of the whole stretch follow from one Lyapunov
equation, so far from its start only the O(m p + m^2) mean path runs per step
(:func:`_steady_adjoint_run`).  The gradient Op itself is not differentiable
(second derivatives raise).

The kernels sit behind a C-ABI barrier (:class:`iterops._fused.OpaqueKernel`):
they compile once per machine (about a minute, cached on disk) and a new graph
that uses them compiles in about a second.

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

from iterops._fused import F64P, FusedOp, data_ptr, entry_point, keep_alive, opaque_kernel, register_fused_op
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
def _matmul(X, Y, out, alpha=1.0, beta=0.0):
    """out = alpha X @ Y + beta out (loops for small matrices, BLAS above ``_SMALL``).

    ``X``/``Y`` may be transposed or sliced views; with ``beta = 0`` what ``out`` held is ignored."""
    n_, k_ = X.shape
    m_ = Y.shape[1]
    if (n_ > _SMALL or m_ > _SMALL or k_ > _SMALL) and n_ > 0 and m_ > 0 and k_ > 0:
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
def _sym_inplace(X):
    """X <- (X + X^T) / 2 for a square X."""
    for i in range(X.shape[0]):
        for j in range(i + 1, X.shape[0]):
            s = 0.5 * (X[i, j] + X[j, i])
            X[i, j] = s
            X[j, i] = s


@numba.njit(cache=True)
def _sym_into(X, out, scale=1.0):
    """out = scale (X + X^T) / 2 for a square X."""
    for i in range(X.shape[0]):
        for j in range(i, X.shape[0]):
            s = 0.5 * scale * (X[i, j] + X[j, i])
            out[i, j] = s
            out[j, i] = s


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


@numba.njit(cache=True, inline="always")
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


@numba.njit(cache=True, inline="always")
def _missing(yi, mv, use_mv):
    return np.isnan(yi) or (use_mv and yi == mv)


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
        if _missing(yi, mv, use_mv):
            v[i] = np.nan
        else:
            v[i] = s
            obs[k] = i
            k += 1
    return k


@numba.njit(cache=True)
def _cov_update(P, Zt, Ht, jitter, obs, k, Ps, PZ, F, Zo, M, L, K, Pf):
    """Covariance part of the measurement update.  Returns ``(ok, log|F_oo|)``.

    Writes ``Ps = sym(P)``, ``PZ = Ps Z^T``, ``F = Z Ps Z^T + sym(H) + j I`` (all p rows),
    ``Zo[:k]``, ``M[:, :k] = Ps Zo^T``, ``L[:k, :k] = chol(F_oo)``, ``K[:, :k] = M F_oo^{-1}`` and
    ``Pf = Ps - K M^T - j K K^T + j I``.  Every symmetric result is computed on one triangle and
    mirrored, so it is exactly symmetric.  For this (optimal) gain ``Pf`` equals the Joseph form
    ``(I - K Zo) Ps (I - K Zo)^T + K H_oo K^T + j I`` that pymc-extras evaluates (expand it with
    ``K F_oo = M``); it costs O(m^2 k) instead of O(m^3).
    """
    m = P.shape[0]
    p = Zt.shape[0]
    _sym_into(P, Ps)
    _matmul(Ps, Zt.T, PZ)
    for i in range(p):
        for jj in range(i, p):
            s = 0.5 * (Ht[i, jj] + Ht[jj, i])
            for l in range(m):
                s += Zt[i, l] * PZ[l, jj]
            F[i, jj] = s
            F[jj, i] = s
        F[i, i] += jitter
    for ii in range(k):
        i = obs[ii]
        for l in range(m):
            Zo[ii, l] = Zt[i, l]
            M[l, ii] = PZ[l, i]
        for jj in range(k):
            L[ii, jj] = F[i, obs[jj]]  # F_oo, factored in place below
    if not _cholesky(L, L, k):
        return False, np.nan
    logdet = 0.0
    for i in range(k):
        logdet += 2.0 * np.log(L[i, i])
    for i in range(m):  # K = M F_oo^{-1}, row by row
        for jj in range(k):
            K[i, jj] = M[i, jj]
        _cho_solve_vec(L, k, K[i], K[i])
    if m > _SMALL:  # BLAS, then symmetrize
        _matmul(K[:, :k], M[:, :k].T, Pf, -1.0, 0.0)
        if jitter != 0.0:
            _matmul(K[:, :k], K[:, :k].T, Pf, -jitter, 1.0)
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
    return True, logdet


@numba.njit(cache=True)
def _closed_loop(K, Zo, k, A):
    """A = I - K[:, :k] Zo[:k] (the filtered-state map; the smoother's and the adjoint's L = T A)."""
    m = A.shape[0]
    for i in range(m):
        for jj in range(m):
            s = 1.0 if i == jj else 0.0
            for l in range(k):
                s -= K[i, l] * Zo[l, jj]
            A[i, jj] = s


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
def _rqr(Rt, Qt, RQ, out):
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


@numba.njit(cache=True)
def _predict_cov(Pf, Tt, RQR, P_next, W):
    """P' = T P_f T^T + R sym(Q) R^T for a symmetric ``P_f`` (one triangle, mirrored); ``W`` scratch."""
    m = Pf.shape[0]
    _matmul(Tt, Pf, W)
    if m > _SMALL:
        _matmul(W, Tt.T, P_next)
        for i in range(m):
            for jj in range(i, m):
                s = 0.5 * (P_next[i, jj] + P_next[jj, i]) + RQR[i, jj]
                P_next[i, jj] = s
                P_next[jj, i] = s
        return
    for i in range(m):
        for jj in range(i, m):
            s = RQR[i, jj]
            for l in range(m):
                s += W[i, l] * Tt[jj, l]
            P_next[i, jj] = s
            P_next[jj, i] = s


@numba.njit(cache=True)
def _workspace(m, p, r):
    """Work arrays of the measurement update: obs, Ps, PZ, Zo, M, L, K, w."""
    return (
        np.empty(p, dtype=np.int64),  # obs
        np.empty((m, m)),  # Ps
        np.empty((m, p)),  # PZ
        np.empty((p, m)),  # Zo
        np.empty((m, p)),  # M
        np.empty((p, p)),  # L
        np.empty((m, p)),  # K
        np.empty(p),  # w
    )


@numba.njit(cache=True, inline="always")
def _ti(X, t):
    """Time index into a system array with a leading time axis of length 1 (static) or n."""
    return t if X.shape[0] > 1 else 0


@numba.njit(cache=True)
def _static_cov(T, Z, R, H, Q):
    """True when the covariance recursion does not depend on t (no time-varying T, Z, R, H, Q)."""
    return T.shape[0] == 1 and Z.shape[0] == 1 and R.shape[0] == 1 and H.shape[0] == 1 and Q.shape[0] == 1


@numba.njit(cache=True)
def _converged(P_new, P_old):
    """Steady-state test: ``max|P_new - P_old| <= 1e-14 max|P_new|``."""
    diff = 0.0
    scale = 0.0
    for i in range(P_new.shape[0]):
        for j in range(P_new.shape[1]):
            diff = max(diff, abs(P_new[i, j] - P_old[i, j]))
            scale = max(scale, abs(P_new[i, j]))
    return diff <= 1e-14 * scale


@numba.njit(cache=True, inline="always")
def _fully_observed(y, t, mv, use_mv):
    for i in range(y.shape[1]):
        if _missing(y[t, i], mv, use_mv):
            return False
    return True


@numba.njit(cache=True, inline="always")
def _innovation(y, d, Zt, ap, t, L, v, w):
    """``v = y_t - d_t - Z a_t`` and ``w = F^{-1} v`` for a fully observed step, ``L = chol(F)``."""
    idd = _ti(d, t)
    for i in range(y.shape[1]):
        x = y[t, i] - d[idd, i]
        for l in range(Zt.shape[1]):
            x -= Zt[i, l] * ap[t, l]
        v[i] = x
        w[i] = x
    _cho_solve_vec(L, y.shape[1], w, w)


@numba.njit(cache=True)
def _steady_run(t, y, c, d, Tt, Zt, mv, use_mv, logdet, L, K, Fss, Pfss, Pss, ll_obs, af, Pf, ap, Pp, v, F, w):
    """Filter steps t, t+1, ... with the covariance recursion frozen at ``Pss`` (``F, L, K, P_f``
    computed from it), until a step has a missing component.  Only the mean recursion runs;
    the loop indexes the output arrays directly (no per-step views).  Returns (next t, sum of ll)."""
    n, p = y.shape
    m = Tt.shape[0]
    const = -0.5 * (p * _LOG_2PI + logdet)
    total = 0.0
    vt = np.empty(p)
    while t < n:
        if not _fully_observed(y, t, mv, use_mv):
            break
        ic = _ti(c, t)
        _innovation(y, d, Zt, ap, t, L, vt, w)
        quad = 0.0
        for i in range(p):
            v[t, i] = vt[i]
            quad += v[t, i] * w[i]
        ll = const - 0.5 * quad
        ll_obs[t] = ll
        total += ll
        for i in range(m):
            s = ap[t, i]
            for j in range(p):
                s += K[i, j] * v[t, j]
            af[t, i] = s
        for i in range(m):
            s = c[ic, i]
            for l in range(m):
                s += Tt[i, l] * af[t, l]
            ap[t + 1, i] = s
        for i in range(p):
            for j in range(p):
                F[t, i, j] = Fss[i, j]
        for i in range(m):
            for j in range(m):
                Pf[t, i, j] = Pfss[i, j]
                Pp[t + 1, i, j] = Pss[i, j]
        t += 1
    return t, total


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
    later fully observed steps reuse them (only the mean recursion runs, in
    :func:`_steady_run`).  A step with missing components leaves the steady state.
    """
    n, p = y.shape
    ll_obs, af, Pf, ap, Pp, v, F = _filter_outputs(n, a0.shape[0], p)
    total = _filter_into(y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv, ll_obs, af, Pf, ap, Pp, v, F)
    return total, ll_obs, af, Pf, ap, Pp, v, F


@numba.njit(cache=True)
def _filter_outputs(n, m, p):
    """Uninitialized ``loglik_obs, filtered_state, filtered_cov, predicted_state, predicted_cov,
    forecast_error, forecast_error_cov`` of an (n, m, p) filter."""
    return (
        np.empty(n), np.empty((n, m)), np.empty((n, m, m)), np.empty((n + 1, m)), np.empty((n + 1, m, m)),
        np.empty((n, p)), np.empty((n, p, p)),
    )


@numba.njit(cache=True)
def _filter_into(y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv, ll_obs, af, Pf, ap, Pp, v, F):
    """:func:`kalman_filter_kernel` writing into preallocated outputs; returns the log-likelihood."""
    n, p = y.shape
    m = a0.shape[0]
    r = Q.shape[1]
    ap[0] = a0
    Pp[0] = P0
    obs, Ps, PZ, Zo, M, L, K, w = _workspace(m, p, r)
    W = np.empty((m, m))
    RQ = np.empty((m, r))
    RQR = np.empty((m, m))
    static = _static_cov(T, Z, R, H, Q)
    static_rq = R.shape[0] == 1 and Q.shape[0] == 1
    if static_rq:
        _rqr(R[0], Q[0], RQ, RQR)
    steady = False  # P_{t} passed the convergence test at step t - 1
    total = 0.0
    t = 0
    while t < n:
        Zt = Z[_ti(Z, t)]
        k = _observe(ap[t], y[t], d[_ti(d, t)], Zt, mv, use_mv, v[t], obs)
        ok, logdet = _cov_update(Pp[t], Zt, H[_ti(H, t)], jitter, obs, k, Ps, PZ, F[t], Zo, M, L, K, Pf[t])
        if not ok:  # F_oo not PD: -inf, NaN from here on
            ll_obs[t] = -np.inf
            ll_obs[t + 1:] = np.nan
            af[t:] = np.nan
            Pf[t:] = np.nan
            ap[t + 1:] = np.nan
            Pp[t + 1:] = np.nan
            v[t + 1:] = np.nan
            F[t + 1:] = np.nan
            return -np.inf
        ll = _mean_update(ap[t], v[t], obs, k, logdet, L, K, w, af[t])
        ll_obs[t] = ll
        total += ll
        _predict_mean(af[t], c[_ti(c, t)], T[_ti(T, t)], ap[t + 1])
        if steady and k == p:  # freeze the covariance recursion at P_t
            Pp[t + 1] = Pp[t]
            t, part = _steady_run(t + 1, y, c, d, T[0], Zt, mv, use_mv, logdet, L, K, F[t], Pf[t], Pp[t],
                                  ll_obs, af, Pf, ap, Pp, v, F, w)
            total += part
            steady = False
            continue
        if not static_rq:
            _rqr(R[_ti(R, t)], Q[_ti(Q, t)], RQ, RQR)
        _predict_cov(Pf[t], T[_ti(T, t)], RQR, Pp[t + 1], W)
        steady = static and k == p and _converged(Pp[t + 1], Pp[t])
        t += 1
    return total


@numba.njit(cache=True, inline="always")
def _row_same(X, t, Y):
    """Bitwise equality of ``X[t]`` and ``Y`` (no view)."""
    for i in range(Y.shape[0]):
        for j in range(Y.shape[1]):
            if X[t, i, j] != Y[i, j]:
                return False
    return True


@numba.njit(cache=True)
def _congruence(X, G, W, out, beta):
    """out = X^T G X + beta out for square X, G (``W`` scratch)."""
    _matmul(G, X, W)
    _matmul(X.T, W, out, 1.0, beta)


@numba.njit(cache=True)
def _predict_cov_vjp(G, Tt, Pf, gT, Pf_bar, beta, GT):
    """Reverse of ``P' = T P_f T^T + ...`` for ``G = sym(P'_bar)`` (G and P_f symmetric):
    ``P_f_bar = T^T G T + beta P_f_bar``, ``T_bar += 2 G T P_f``.  ``GT`` (m, m): scratch."""
    _matmul(G, Tt, GT)
    _matmul(Tt.T, GT, Pf_bar, 1.0, beta)
    _matmul(GT, Pf, gT, 2.0, 1.0)


@numba.njit(cache=True)
def _rq_vjp(G, Rt, Qt, gR, gQ):
    """Reverse of ``P' = ... + R sym(Q) R^T`` for ``G = sym(P'_bar)``: ``R_bar += G R (Q + Q^T)``,
    ``Q_bar += R^T G R``.  Linear in G: static R, Q take the sum of G over all steps, once."""
    m, r = Rt.shape
    GR = np.empty((m, r))
    _matmul(G, Rt, GR)
    _matmul(GR, Qt + Qt.T, gR, 1.0, 1.0)
    _matmul(Rt.T, GR, gQ, 1.0, 1.0)


@numba.njit(cache=True)
def _steady_flush(Tt, Zt, P, Pf, A, K, Gs, Ss, Xs, Ms, gT, gZ, gH, Grq):
    """Add the covariance-path parameter cotangents of a steady stretch (sums from
    :func:`_steady_adjoint_run`): the predict reverse with ``G = Gs`` (its R/Q part through
    ``Grq += Gs``, applied once by the caller); with
    ``S = T^T Gs T + Ss``: ``A_bar = S A (P + P^T)``, ``Z_bar -= K^T A_bar``, ``H_bar += K^T S K``;
    and ``H_bar += Xs``, ``Z_bar += Xs Z (P + P^T) + Ms^T P``.  (The generic step's terms, summed
    with the gain terms cancelled as in :func:`_steady_adjoint_run`.)"""
    m = Tt.shape[0]
    p = Zt.shape[0]
    _predict_cov_vjp(Gs, Tt, Pf, gT, Ss, 1.0, np.empty((m, m)))
    Grq += Gs
    Psum = P + P.T
    SA = np.empty((m, m))
    _matmul(Ss, A, SA)
    A_bar = np.empty((m, m))
    _matmul(SA, Psum, A_bar)
    _matmul(K.T, A_bar, gZ, -1.0, 1.0)
    SK = np.empty((m, p))
    _matmul(Ss, K, SK)
    _matmul(K.T, SK, gH, 1.0, 1.0)
    for i in range(p):
        for j in range(p):
            gH[i, j] += Xs[i, j]
    XZ = np.empty((p, m))
    _matmul(Xs, Zt, XZ)
    _matmul(XZ, Psum, gZ, 1.0, 1.0)
    _matmul(Ms.T, P, gZ, 1.0, 1.0)


@numba.njit(cache=True, inline="always")
def _carry_cov(P_bar_new, t, g_Pp, has_Pp, Pbar):
    """Covariance cotangent entering step t-1: ``sym(P_bar)`` plus that of ``predicted_cov[t]``."""
    m = Pbar.shape[0]
    for i in range(m):
        for j in range(m):
            Pbar[i, j] = 0.5 * (P_bar_new[i, j] + P_bar_new[j, i]) + (g_Pp[t, i, j] if has_Pp else 0.0)


_WINDOW_TOL = 1e-18  # ||L^K||_F^2 below which a steady stretch's far steps skip the covariance recursion
_MAX_DOUBLINGS = 20


@numba.njit(cache=True)
def _doubling_window(Lss, n_steps):
    """Powers ``L^T, (L^T)^2, (L^T)^4, ...`` of the steady closed-loop map until
    ``||L^K||_F^2 <= _WINDOW_TOL``.  Returns ``(powers, K)``; ``K = 0`` if that needs ``K >= n_steps``
    (short stretch, or ``L`` not stable enough): then the stretch runs the full recursion."""
    m = Lss.shape[0]
    powers = np.empty((_MAX_DOUBLINGS + 1, m, m))
    powers[0] = Lss.T
    for k in range(_MAX_DOUBLINGS + 1):
        if (1 << k) >= n_steps:
            return powers, 0
        nrm = 0.0
        for i in range(m):
            for j in range(m):
                nrm += powers[k, i, j] * powers[k, i, j]
        if not np.isfinite(nrm):
            return powers, 0
        if nrm <= _WINDOW_TOL:
            return powers[:k], 1 << k
        if k < _MAX_DOUBLINGS:
            _matmul(powers[k], powers[k], powers[k + 1])
    return powers, 0


@numba.njit(cache=True)
def _lyapunov_sum(powers, X):
    """``sum_{j < K} (L^T)^j X L^j`` by doubling with the stored powers (``K = 2^len(powers)``);
    equals the Lyapunov solution ``G = L^T G L + X`` to ``||L^K||^2`` relative."""
    m = X.shape[0]
    G = X.copy()
    W = np.empty((m, m))
    Gn = np.empty((m, m))
    for k in range(powers.shape[0]):
        # G <- G + P G P^T with P = (L^T)^(2^k)
        _matmul(powers[k], G, W)
        _matmul(W, powers[k].T, Gn)
        for i in range(m):
            for j in range(m):
                G[i, j] += Gn[i, j]
    return G


@numba.njit(cache=True)
def _steady_adjoint_run(
    t, y, c, d, Tt, Zt, mv, use_mv, ap, Pp, P_cached, L, K, Finv, A, Lss, Pf,
    g_ll, g_llobs, g_af, g_Pf, g_ap, g_Pp, g_v, g_F,
    has_llobs, has_af, has_Pf, has_ap, has_Pp, has_v, has_F,
    gy, gc, gd, gT, gZ, gH, Grq, abar, Pbar,
):
    """Backward steps t, t-1, ..., s0 of a steady stretch: static system, ``cov_jitter = 0``, every
    component observed and ``P_s`` bitwise ``P_cached``, whose update (``L, K, F^{-1}, A = I - K Z,
    Lss = T A, P_f``) is in the work arrays.  Returns ``s0 - 1``, the next step to process.

    With ``S = T^T G T + sym(Pf_bar_out)`` (G = sym(P'_bar)) the gain terms of the generic step
    cancel: ``K_bar = -S M + a_f_bar v^T`` and ``M_bar = -S K + K_bar F^{-1}`` leave, after
    symmetrization, ``A^T S A`` because ``K F = M`` (optimal gain).  So ``Mo_bar = a_f_bar w^T``
    (w = F^{-1} v), ``X = sym(F_bar)``, ``F_bar = -ll_bar/2 (F^{-1} - w w^T) - (K^T a_f_bar) w^T (+ F_bar_out)``
    and the covariance cotangent obeys ``P_bar_s = Lss^T sym(P_bar_{s+1}) Lss + C_s`` with

        C_s = A^T sym(Pf_bar_out) A + Z^T X Z + sym(Mo_bar Z) + sym(P_bar_out[s]).

    The covariance-path parameter cotangents are linear in ``Gs = sum_s sym(P_bar_{s+1})`` and in
    the sums of ``X``, ``Mo_bar`` and ``sym(Pf_bar_out)``; :func:`_steady_flush` applies them once.
    Telescoping the recursion gives ``Gs = Lss^T Gs Lss + (sum C + E - P_bar_s0)`` (E = entering
    cotangent), one Lyapunov equation, so on a long stretch only the ``K`` steps nearest ``s0``
    (where ``||Lss^K||_F^2 <= 1e-18``) run the O(m^3) recursion, for ``P_bar_s0``; the others do only
    the O(m p + m^2) mean path (a, v, y, d, c and the a_f-dependent T and Z terms) and the sums.
    Short stretches, or a closed loop without that decay, run the recursion on every step.
    """
    p = y.shape[1]
    m = Tt.shape[0]
    s0 = t
    while s0 >= 0 and _fully_observed(y, s0, mv, use_mv) and _row_same(Pp, s0, P_cached):
        s0 -= 1
    s0 += 1
    powers, window = _doubling_window(Lss, t - s0 + 1)
    exact = window == 0  # full recursion on every step, Gs summed directly
    v = np.empty(p)
    w = np.empty(p)
    u = np.empty(p)
    af = np.empty(m)
    af_bar = np.empty(m)
    a_bar_new = np.empty(m)
    G = np.empty((m, m))
    S = np.empty((m, m))
    W1 = np.empty((m, m))
    P_bar_new = np.empty((m, m))
    E = np.empty((m, m))
    X_bar = np.empty((p, p))
    W2 = np.empty((p, m))
    Gs = np.zeros((m, m))
    Ss = np.zeros((m, m))
    Xs = np.zeros((p, p))
    Ms = np.zeros((m, p))
    Cs = np.zeros((m, m))  # sum of sym(P_bar_out[s])
    _sym_into(Pbar, E)
    for s in range(t, s0 - 1, -1):
        recursion = exact or s < s0 + window
        if recursion and not exact and s == s0 + window - 1:
            Pbar[:, :] = 0.0  # far steps' contribution to P_bar_s0 is below ||Lss^K||^2: dropped
        ic = _ti(c, s)
        idd = _ti(d, s)
        _innovation(y, d, Zt, ap, s, L, v, w)  # recompute v, w = F^{-1} v and a_f = a + K v
        for i in range(m):
            x = ap[s, i]
            for j in range(p):
                x += K[i, j] * v[j]
            af[i] = x
        # mean path: a' = T a_f + c
        for i in range(m):
            gc[ic, i] += abar[i]
            x = g_af[s, i] if has_af else 0.0
            for l in range(m):
                x += Tt[l, i] * abar[l]
            af_bar[i] = x
            for j in range(m):
                gT[i, j] += abar[i] * af[j]
        ll_bar = g_ll + (g_llobs[s] if has_llobs else 0.0)
        for i in range(p):  # u = K^T a_f_bar
            x = 0.0
            for l in range(m):
                x += K[l, i] * af_bar[l]
            u[i] = x
        for i in range(p):  # X = sym(F_bar)
            for j in range(i, p):
                x = -0.5 * ll_bar * (Finv[i, j] - w[i] * w[j]) - 0.5 * (u[i] * w[j] + u[j] * w[i])
                if has_F:
                    x += 0.5 * (g_F[s, i, j] + g_F[s, j, i])
                X_bar[i, j] = x
                X_bar[j, i] = x
                Xs[i, j] += x
                if j != i:
                    Xs[j, i] += x
        for i in range(m):  # Mo_bar = a_f_bar w^T
            for j in range(p):
                Ms[i, j] += af_bar[i] * w[j]
        if has_Pf:
            for i in range(m):
                for j in range(m):
                    W1[i, j] = 0.5 * (g_Pf[s, i, j] + g_Pf[s, j, i])
                    Ss[i, j] += W1[i, j]
        if has_Pp:
            for i in range(m):
                for j in range(m):
                    Cs[i, j] += 0.5 * (g_Pp[s, i, j] + g_Pp[s, j, i])
        # v = y - d - Z a: v_bar = u - ll_bar w (+ g_v); a_bar = a_f_bar - Z^T v_bar
        for i in range(p):
            vb = u[i] - ll_bar * w[i]
            if has_v:
                vb += g_v[s, i]
            u[i] = vb
            gy[s, i] += vb
            gd[idd, i] -= vb
            for j in range(m):
                gZ[i, j] -= vb * ap[s, j]
        for j in range(m):
            x = af_bar[j]
            for i in range(p):
                x -= Zt[i, j] * u[i]
            abar[j] = x + (g_ap[s, j] if has_ap else 0.0)
        if not recursion:
            continue
        # P_bar = Lss^T G Lss + A^T sym(Pf_bar_out) A + Z^T X Z + Mo_bar Z  (symmetrized by _carry)
        _sym_into(Pbar, G)
        if exact:
            for i in range(m):
                for j in range(m):
                    Gs[i, j] += G[i, j]
        _congruence(Lss, G, S, P_bar_new, 0.0)
        if has_Pf:
            _congruence(A, W1, S, P_bar_new, 1.0)
        _matmul(X_bar, Zt, W2)
        for i in range(m):
            for j in range(m):
                x = 0.0
                for l in range(p):
                    x += Zt[l, i] * W2[l, j] + af_bar[i] * w[l] * Zt[l, j]
                P_bar_new[i, j] += x
        _carry_cov(P_bar_new, s, g_Pp, has_Pp, Pbar)
    if not exact:
        # Gs = L^T Gs L + (sum C + E - P_bar_s0), sum C = Z^T Xs Z + sym(Ms Z) + A^T Ss A + Cs
        _matmul(Xs, Zt, W2)
        _matmul(Zt.T, W2, G)
        for i in range(m):
            for j in range(m):
                x = 0.0
                for l in range(p):
                    x += Ms[i, l] * Zt[l, j] + Ms[j, l] * Zt[l, i]
                G[i, j] += 0.5 * x + Cs[i, j] + E[i, j] - 0.5 * (Pbar[i, j] + Pbar[j, i])
        if has_Pf:
            _congruence(A, Ss, S, G, 1.0)
        Gs = _lyapunov_sum(powers, G)
    _steady_flush(Tt, Zt, P_cached, Pf, A, K, Gs, Ss, Xs, Ms, gT, gZ, gH, Grq)
    return s0 - 1


@numba.njit(cache=True)
def kalman_adjoint_kernel(
    y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv, ap, Pp,
    g_ll, g_llobs, g_af, g_Pf, g_ap, g_Pp, g_v, g_F,
    has_llobs, has_af, has_Pf, has_ap, has_Pp, has_v, has_F,
    gy, ga0, gP0, gc, gd, gT, gZ, gR, gH, gQ,
):
    """Reverse-mode adjoint of :func:`kalman_filter_kernel`.

    ``ap``/``Pp`` are the forward ``predicted_state``/``predicted_cov``; each
    step's update is recomputed from them.  ``g_ll`` is the (float) cotangent of
    ``loglik``, the other ``g_*`` are output cotangent arrays (``has_*`` False:
    disconnected, array ignored).  Writes the cotangents of
    ``(y, a0, P0, c, d, T, Z, R, H, Q)`` into ``gy ... gQ`` (their shapes;
    time-summed for static matrices); all NaN if the forward pass failed.

    Steady stretches (see :func:`_steady_adjoint_run`) take a cheaper path when
    ``cov_jitter = 0``; every other step runs the generic reverse below.
    """
    n, p = y.shape
    m = a0.shape[0]
    r = Q.shape[1]
    for out in (gy, gc, gd, gP0):
        out[:] = 0.0
    for out in (gT, gZ, gR, gH, gQ):
        out[:] = 0.0
    obs, Ps, PZ, Zo, M, L, K, w = _workspace(m, p, r)
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
    K_bar = np.empty((m, p))
    M_bar = np.empty((m, p))
    Finv = np.empty((p, p))
    X_bar = np.empty((p, p))
    XZ = np.empty((p, m))
    vo_bar = np.empty(p)
    a_bar_new = np.empty(m)
    P_bar_new = np.empty((m, m))
    A = np.empty((m, m))
    Lss = np.empty((m, m))
    P_cached = np.empty((m, m))
    static_rq = R.shape[0] == 1 and Q.shape[0] == 1
    Grq = np.zeros((m, m))  # sum of G over the steps, for static R and Q
    fast = jitter == 0.0 and _static_cov(T, Z, R, H, Q)
    cached = False  # the work arrays hold the update of P_cached, fully observed (fast only)
    t = n - 1
    while t >= 0:
        if cached and _fully_observed(y, t, mv, use_mv) and _row_same(Pp, t, P_cached):
            t = _steady_adjoint_run(
                t, y, c, d, T[0], Z[0], mv, use_mv, ap, Pp, P_cached, L, K, Finv, A, Lss, Pf,
                g_ll, g_llobs, g_af, g_Pf, g_ap, g_Pp, g_v, g_F,
                has_llobs, has_af, has_Pf, has_ap, has_Pp, has_v, has_F,
                gy, gc, gd, gT[0], gZ[0], gH[0], Grq, abar, Pbar,
            )
            continue
        it_c, it_d, it_T, it_Z = _ti(c, t), _ti(d, t), _ti(T, t), _ti(Z, t)
        it_R, it_H, it_Q = _ti(R, t), _ti(H, t), _ti(Q, t)
        Tt, Zt = T[it_T], Z[it_Z]
        a = ap[t]
        k = _observe(a, y[t], d[it_d], Zt, mv, use_mv, v, obs)
        ok, logdet = _cov_update(Pp[t], Zt, H[it_H], jitter, obs, k, Ps, PZ, F, Zo, M, L, K, Pf)
        if not ok:
            for out in (gy, gc, gd, gP0):
                out[:] = np.nan
            for out in (gT, gZ, gR, gH, gQ):
                out[:] = np.nan
            ga0[:] = np.nan
            return
        _cho_inverse(L, k, Finv)
        _mean_update(a, v, obs, k, logdet, L, K, w, af)
        # --- predict: a' = T a_f + c ; P' = T Pf T^T + R sym(Q) R^T ---
        _sym_into(Pbar, G)
        _predict_cov_vjp(G, Tt, Pf, gT[it_T], Pf_bar, 0.0, S)
        if static_rq:
            Grq += G
        else:
            _rq_vjp(G, R[it_R], Q[it_Q], gR[it_R], gQ[it_Q])
        for i in range(m):  # c_bar += a'_bar; T_bar += a'_bar a_f^T; a_f_bar = T^T a'_bar
            gc[it_c, i] += abar[i]
            s = g_af[t, i] if has_af else 0.0
            for l in range(m):
                s += Tt[l, i] * abar[l]
                gT[it_T, i, l] += abar[i] * af[l]
            af_bar[i] = s
        if has_Pf:
            for i in range(m):
                for jj in range(m):
                    Pf_bar[i, jj] += g_Pf[t, i, jj]
        # --- Pf = Ps - K M^T - j K K^T + j I; S = sym(Pf_bar) ---
        # Ps_bar = S; K_bar = -S M - 2 j S K + a_f_bar v_o^T; M_bar = -S K
        _sym_into(Pf_bar, S)
        _matmul(S, K[:, :k], M_bar[:, :k], -1.0, 0.0)
        _matmul(S, M[:, :k], K_bar[:, :k], -1.0, 0.0)
        for i in range(m):
            for jj in range(k):
                K_bar[i, jj] += af_bar[i] * v[obs[jj]] + 2.0 * jitter * M_bar[i, jj]
        # --- a_f = a + K v_o; ll = -(log|F_oo| + v_o^T F_oo^{-1} v_o)/2 (+ const) ---
        ll_bar = g_ll + (g_llobs[t] if has_llobs else 0.0)
        for i in range(k):  # v_o_bar = K^T a_f_bar - ll_bar w (+ g_v)
            s = 0.0
            for l in range(m):
                s += K[l, i] * af_bar[l]
            vo_bar[i] = s - ll_bar * w[i] + (g_v[t, obs[i]] if has_v else 0.0)
        # --- K = M F_oo^{-1}: M_bar += K_bar F^{-1}; Fo_bar = -K^T K_bar F^{-1} - ll_bar/2 (F^{-1} - w w^T) ---
        for i in range(m):  # K_bar <- K_bar F^{-1}
            _cho_solve_vec(L, k, K_bar[i], K_bar[i])
            for jj in range(k):
                M_bar[i, jj] += K_bar[i, jj]
        for i in range(p):
            for jj in range(p):
                X_bar[i, jj] = g_F[t, i, jj] if has_F else 0.0
        for i in range(k):
            for jj in range(k):
                s = 0.0
                for l in range(m):
                    s += K[l, i] * K_bar[l, jj]
                X_bar[obs[i], obs[jj]] += -0.5 * ll_bar * (Finv[i, jj] - w[i] * w[jj]) - s
        _sym_inplace(X_bar)
        # --- F = Z Ps Z^T + sym(H) + j I: H_bar += X_bar; Z_bar += 2 X_bar Z Ps; Ps_bar += Z^T X_bar Z ---
        for i in range(p):
            for jj in range(p):
                gH[it_H, i, jj] += X_bar[i, jj]
        _matmul(X_bar, Zt, XZ)
        _matmul(XZ, Ps, gZ[it_Z], 2.0, 1.0)
        _matmul(Zt.T, XZ, P_bar_new)
        for i in range(m):
            for jj in range(m):
                P_bar_new[i, jj] += S[i, jj]
        # --- M = Ps Zo^T: Ps_bar += M_bar Zo; Zo_bar += M_bar^T Ps ---
        # --- v_o = y_o - d_o - Zo a: y_bar += v_bar; d_bar -= v_bar; Zo_bar -= v_bar a^T; a_bar -= Zo^T v_bar ---
        _matmul(M_bar[:, :k], Zo[:k], P_bar_new, 1.0, 1.0)
        _matmul(M_bar[:, :k].T, Ps, XZ[:k])  # Zo_bar (M = Ps Zo^T)
        for i in range(m):
            a_bar_new[i] = af_bar[i]
        for i in range(k):
            oi = obs[i]
            gy[t, oi] += vo_bar[i]
            gd[it_d, oi] -= vo_bar[i]
            for jj in range(m):
                gZ[it_Z, oi, jj] += XZ[i, jj] - vo_bar[i] * a[jj]
                a_bar_new[jj] -= Zo[i, jj] * vo_bar[i]
        for i in range(m):
            abar[i] = a_bar_new[i] + (g_ap[t, i] if has_ap else 0.0)
        _carry_cov(P_bar_new, t, g_Pp, has_Pp, Pbar)
        cached = fast and k == p
        if cached:
            P_cached[:] = Pp[t]
            _closed_loop(K, Zo, k, A)
            _matmul(T[0], A, Lss)
        t -= 1
    if static_rq:
        _rq_vjp(Grq, R[0], Q[0], gR[0], gQ[0])
    ga0[:] = abar
    gP0[:, :] = Pbar


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


_I64 = numba.types.int64
_F64 = numba.types.float64


@opaque_kernel(_F64(*([F64P] * 17), *([_I64] * 11), _F64, _F64, _I64))
def _filter_abi(y, a0, P0, c, d, T, Z, R, H, Q, llo, af, Pf, ap, Pp, v, F,
                n, p, m, r, tc, td, tT, tZ, tR, tH, tQ, jitter, mv, use_mv):
    """C-ABI barrier around :func:`_filter_into` (C-contiguous float64 buffers, their sizes;
    see :class:`iterops._fused.OpaqueKernel` for why).  Returns the log-likelihood."""
    return _filter_into(
        numba.carray(y, (n, p)), numba.carray(a0, (m,)), numba.carray(P0, (m, m)),
        numba.carray(c, (tc, m)), numba.carray(d, (td, p)), numba.carray(T, (tT, m, m)),
        numba.carray(Z, (tZ, p, m)), numba.carray(R, (tR, m, r)), numba.carray(H, (tH, p, p)),
        numba.carray(Q, (tQ, r, r)), jitter, mv, use_mv != 0,
        numba.carray(llo, (n,)), numba.carray(af, (n, m)), numba.carray(Pf, (n, m, m)),
        numba.carray(ap, (n + 1, m)), numba.carray(Pp, (n + 1, m, m)), numba.carray(v, (n, p)),
        numba.carray(F, (n, p, p)),
    )


@opaque_kernel(numba.types.void(*([F64P] * 29), *([_I64] * 12), _F64, _F64, _F64))
def _adjoint_abi(y, a0, P0, c, d, T, Z, R, H, Q, ap, Pp, gllobs, gaf, gPf, gap, gPp, gv, gF,
                 oy, oa0, oP0, oc, od, oT, oZ, oR, oH, oQ,
                 n, p, m, r, tc, td, tT, tZ, tR, tH, tQ, flags, jitter, mv, gll):
    """C-ABI barrier around :func:`kalman_adjoint_kernel`.  ``flags`` bits: 0 ``use_mv``, 1-7 which
    of (loglik_obs, filtered_state, filtered_cov, predicted_state, predicted_cov, forecast_error,
    forecast_error_cov) have a cotangent; a missing one is a buffer of any size, read as empty."""
    h1 = ((flags >> 1) & 1) == 1
    h2 = ((flags >> 2) & 1) == 1
    h3 = ((flags >> 3) & 1) == 1
    h4 = ((flags >> 4) & 1) == 1
    h5 = ((flags >> 5) & 1) == 1
    h6 = ((flags >> 6) & 1) == 1
    h7 = ((flags >> 7) & 1) == 1
    n1, n2, n3, n6, n7 = n * h1, n * h2, n * h3, n * h6, n * h7  # empty where disconnected
    n4, n5 = (n + 1) * h4, (n + 1) * h5
    kalman_adjoint_kernel(
        numba.carray(y, (n, p)), numba.carray(a0, (m,)), numba.carray(P0, (m, m)),
        numba.carray(c, (tc, m)), numba.carray(d, (td, p)), numba.carray(T, (tT, m, m)),
        numba.carray(Z, (tZ, p, m)), numba.carray(R, (tR, m, r)), numba.carray(H, (tH, p, p)),
        numba.carray(Q, (tQ, r, r)), jitter, mv, (flags & 1) == 1,
        numba.carray(ap, (n + 1, m)), numba.carray(Pp, (n + 1, m, m)),
        gll, numba.carray(gllobs, (n1,)), numba.carray(gaf, (n2, m)), numba.carray(gPf, (n3, m, m)),
        numba.carray(gap, (n4, m)), numba.carray(gPp, (n5, m, m)), numba.carray(gv, (n6, p)),
        numba.carray(gF, (n7, p, p)),
        h1, h2, h3, h4, h5, h6, h7,
        numba.carray(oy, (n, p)), numba.carray(oa0, (m,)), numba.carray(oP0, (m, m)),
        numba.carray(oc, (tc, m)), numba.carray(od, (td, p)), numba.carray(oT, (tT, m, m)),
        numba.carray(oZ, (tZ, p, m)), numba.carray(oR, (tR, m, r)), numba.carray(oH, (tH, p, p)),
        numba.carray(oQ, (tQ, r, r)),
    )


@entry_point
def _filter_entry(tv: tuple, jitter: float, mv: float, use_mv: bool):
    flag = int(use_mv)
    abi = _filter_abi.external  # opaque call: a new graph does not recompile the kernel

    @numba.njit
    def kalman_filter_fn(y, a0, P0, c, d, T, Z, R, H, Q):
        if _check_shapes_jit(y, a0, P0, c, d, T, Z, R, H, Q, tv):
            raise ValueError("kalman_filter: inconsistent input shapes at run time")
        y_, a0_, P0_, c_, d_ = _c(y), _c(a0), _c(P0), _c(c), _c(d)
        T_, Z_, R_, H_, Q_ = _c(T), _c(Z), _c(R), _c(H), _c(Q)
        n, p = y_.shape
        m = a0_.shape[0]
        r = Q_.shape[1]
        llo, af, Pf, ap, Pp, v, F = _filter_outputs(n, m, p)
        ll = abi(
            data_ptr(y_), data_ptr(a0_), data_ptr(P0_), data_ptr(c_), data_ptr(d_), data_ptr(T_),
            data_ptr(Z_), data_ptr(R_), data_ptr(H_), data_ptr(Q_), data_ptr(llo), data_ptr(af),
            data_ptr(Pf), data_ptr(ap), data_ptr(Pp), data_ptr(v), data_ptr(F),
            n, p, m, r, c_.shape[0], d_.shape[0], T_.shape[0], Z_.shape[0], R_.shape[0], H_.shape[0],
            Q_.shape[0], jitter, mv, flag,
        )
        keep_alive((y_, a0_, P0_, c_, d_, T_, Z_, R_, H_, Q_))
        out = np.empty((), dtype=np.float64)
        out[()] = ll
        return out, llo, af, Pf, ap, Pp, v, F

    return kalman_filter_fn


@entry_point
def _adjoint_entry(tv: tuple, jitter: float, mv: float, use_mv: bool, connected: tuple):
    # position of each connected cotangent among the Op's trailing inputs
    pos = []
    j = 0
    for h in connected:
        pos.append(j if h else -1)
        j += h
    flags = int(use_mv) | sum(1 << i for i in range(1, 8) if connected[i])
    names = ("y", "a0", "P0", "c", "d", "T", "Z", "R", "H", "Q", "ap", "Pp")
    # Unpack the variable-length tail with indices known at build time.
    src = ["def _impl(" + ", ".join(names) + "".join(f", g{i}" for i in range(sum(connected))) + "):"]
    src.append("    if _check(y, a0, P0, c, d, T, Z, R, H, Q, tv):")
    src.append("        raise ValueError('kalman_filter gradient: inconsistent input shapes at run time')")
    src += [f"    {x}_ = _c({x})" for x in names]
    src.append(f"    gll = g{pos[0]}[()]" if connected[0] else "    gll = 0.0")
    src += [f"    g{i}_ = _c(g{pos[i]})" if connected[i] else f"    g{i}_ = np.zeros(1)" for i in range(1, 8)]
    src += [f"    o{x} = np.empty_like({x}_)" for x in names[:10]]
    ptrs = [f"_ptr({x}_)" for x in names] + [f"_ptr(g{i}_)" for i in range(1, 8)] + [f"_ptr(o{x})" for x in names[:10]]
    dims = ["y_.shape[0]", "y_.shape[1]", "a0_.shape[0]", "Q_.shape[1]"] + [f"{x}_.shape[0]" for x in "cdTZRHQ"]
    src.append(f"    _abi({', '.join(ptrs)}, {', '.join(dims)}, {flags}, jitter, mv, gll)")
    src.append("    _keep((" + ", ".join([f"{x}_" for x in names] + [f"g{i}_" for i in range(1, 8)]) + "))")
    src.append("    return " + ", ".join(f"o{x}" for x in names[:10]))
    ns = {
        "np": np, "_check": _check_shapes_jit, "_abi": _adjoint_abi.external, "_c": _c, "_ptr": data_ptr, "_keep": keep_alive,
        "tv": tv, "jitter": jitter, "mv": mv,
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
