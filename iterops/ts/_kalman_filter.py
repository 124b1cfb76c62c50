"""The forward Kalman filter loop: the stages of :mod:`iterops.ts._kalman_steps`, step after step, with the
steady-state shortcut (statsmodels'): once the covariance recursion has converged, only the
mean recursion runs.

Compile time: :func:`filter_into` and its stages are ``inline="always"``, compiled once into the C-ABI
kernel; a stage compiled on its own would be re-linked and re-optimized by every caller.  Only small leaf
helpers (:mod:`iterops._linalg_kernels`) are compiled on their own."""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from iterops._constants import LOG_2PI
from iterops._fused import keep_alive
from iterops._linalg_kernels import all_finite, carve, copy_into, sym_finite, sym_into
from iterops.ts._kalman_steps import (
    AUTO, MULTIVARIATE, UNIVARIATE, _innovation_cov, diagonal, find_structure, fully_observed, innovation,
    loglik, observe, predict_cov, predict_mean, prefers_univariate, rqr, static_cov, static_rq, steady as steady_test,
    structure,
    system_at, ti, update_cov, update_mean, update_one, update_univariate, update_work, varies_over_time,
)

__all__ = ["FilterOutputs", "filter_outputs", "kalman_filter_kernel", "filter_into"]


class FilterOutputs(NamedTuple):
    """Per-step outputs of the filter (n steps, m states, p observables), written in place;
    names as in :class:`iterops.ts.kalman.KalmanFilterResult`."""

    loglik_obs: np.ndarray  #: (n,)
    filtered_state: np.ndarray  #: (n, m)
    filtered_cov: np.ndarray  #: (n, m, m)
    predicted_state: np.ndarray  #: (n + 1, m)
    predicted_cov: np.ndarray  #: (n + 1, m, m)
    forecast_error: np.ndarray  #: (n, p)
    forecast_error_cov: np.ndarray  #: (n, p, p)


@numba.njit(cache=True)
def filter_outputs(n, m, p):
    """Uninitialized :class:`FilterOutputs` of an (n, m, p) filter."""
    return FilterOutputs(
        np.empty(n), np.empty((n, m)), np.empty((n, m, m)), np.empty((n + 1, m)), np.empty((n + 1, m, m)),
        np.empty((n, p)), np.empty((n, p, p)),
    )


@numba.njit(cache=True)
def kalman_filter_kernel(y, a0, P0, system, options, univariate=MULTIVARIATE, need_F=True):
    """Forward filter for one series: float64 arrays, ``system`` a :class:`iterops.ts._kalman_steps.System` with
    leading time axes, ``options`` an :class:`iterops.ts._kalman_steps.Options`.

    Shapes: y (n, p); a0 (m,); P0 (m, m); c (tc, m); d (td, p); T (tT, m, m); Z (tZ, p, m);
    R (tR, m, r); H (tH, p, p); Q (tQ, r, r) with each t* in {1, n}.
    Returns ``(loglik, FilterOutputs)``.

    Measurement update: ``univariate`` (``MULTIVARIATE``, ``AUTO``, ``UNIVARIATE`` of
    :mod:`iterops.ts._kalman_steps`) chooses :func:`~iterops.ts._kalman_steps.update_univariate`
    (one observed component at a time) over the multivariate :func:`~iterops.ts._kalman_steps.update_cov`
    on the steps where sym(H_t) is diagonal (checked once for a static H, every step for a
    time-varying one): always (``UNIVARIATE``) or where
    :func:`~iterops.ts._kalman_steps.prefers_univariate` says it is faster for (m, p) (``AUTO``).
    Both give the same outputs to rounding (``F`` is computed in full either way, for the output,
    unless ``need_F`` is False: then univariate steps leave ``forecast_error_cov`` NaN) and fail at
    the same steps.  The step that enters a steady state takes the multivariate update,
    whose Cholesky factor and gain the steady-state loop reuses.

    Steady state (as statsmodels): when T, Z, R, H, Q are static, every component
    is observed and the predicted covariance has converged, entry by entry relative to each entry's own
    scale (:func:`~iterops.ts._kalman_steps.steady`:
    ``|P_{t+1,ij} - P_{t,ij}| <= 1e-14 sqrt(P_{t+1,ii} P_{t+1,jj})``, invariant under a rescaling of the
    states, so a small-scale state still converging is not frozen with a large one), the covariance recursion is
    frozen at ``P_{t+1}``: one more full update computes F, K, P_f from it, and
    later fully observed steps reuse them (only the mean recursion runs, in
    :func:`_steady_run`).  The test does not involve the jitter: the jittered recursion is a
    fixed-point recursion too.  A step with missing components leaves the steady state; the
    full recursion then runs until the covariance has converged again and re-enters it (as
    statsmodels, whose test also needs fully observed steps), so every output equals the
    step-by-step filter's to rounding.
    """
    n, p = y.shape
    out = filter_outputs(n, a0.shape[0], p)
    return filter_into(y, a0, P0, system, options, out, univariate, need_F, True), out


@numba.njit(cache=True, inline="always")
def filter_into(y, a0, P0, system, options, out, univariate, need_F, need_P):
    """:func:`kalman_filter_kernel` writing into preallocated :class:`FilterOutputs`; returns the log-likelihood.
    ``need_P`` False (nothing reads ``filtered_cov`` or ``predicted_cov``): a steady stretch leaves their rows
    unwritten (:func:`_steady_run`); the other steps use them as work arrays."""
    n, p = y.shape
    m = a0.shape[0]
    r = system.Q.shape[1]
    ap, Pp = out.predicted_state, out.predicted_cov
    copy_into(a0, ap[0])
    copy_into(P0, Pp[0])
    ws, ws_own = update_work(m, p)
    obs, L, K, w = ws.obs, ws.L, ws.K, ws.w
    buf = np.empty(2 * m * m + m * r)  # one allocation, carved
    W, RQR = carve(buf, 0, (m, m)), carve(buf, m * m, (m, m))
    RQ = carve(buf, 2 * m * m, (m, r))
    static = static_cov(system)
    sum_rq = static_rq(system)
    sx, sx_own = structure(m, p)  # nonzero indexes of T and Z: once, or every step when one varies
    find_structure(system.T[0], system.Z[0], sx)
    restructure = system.T.shape[0] > 1 or system.Z.shape[0] > 1
    if sum_rq:
        rqr(system.R[0], system.Q[0], RQ, RQR)
    steady = False  # P_{t} passed the convergence test at step t - 1
    p_fin = -1  # P_t finite: 1 / 0, -1 not known
    vary = varies_over_time(system)
    st = system_at(system, 0)  # step t's matrices
    uni = univariate == UNIVARIATE or (univariate == AUTO and prefers_univariate(m, p, need_F))
    uni_h = uni and diagonal(st.H)  # H diagonal at this step (static H: once)
    total = 0.0
    ll = logdet = 0.0
    t = 0
    while t < n:
        if vary:
            st = system_at(system, t)
            if restructure:
                find_structure(st.T, st.Z, sx)
            if uni and system.H.shape[0] > 1:
                uni_h = diagonal(st.H)
        v, F, af, Pf = out.forecast_error[t], out.forecast_error_cov[t], out.filtered_state[t], out.filtered_cov[t]
        pf = -1  # P_f finite: 1 / 0, -1 not known
        k = observe(ap[t], y[t], st.d, st.Z, options, v, obs)
        if uni_h and not steady:  # F for the output only; the update one component at a time
            if need_F:
                sym_into(Pp[t], ws.Ps)
                _innovation_cov(ws.Ps, st.Z, st.H, options.jitter, ws.PZ, F, sx)
            else:
                F[:, :] = np.nan
            ok, ll = update_univariate(ap[t], Pp[t], v, st.Z, st.H, options.jitter, k, ws, af, Pf, sx)
        else:
            if p == 1 and k == 1:  # the rank-one update, on P_t itself (exactly symmetric but for P0)
                if t == 0:
                    fin = sym_finite(Pp[0], ws.Ps)
                    Pt = ws.Ps
                else:
                    fin = all_finite(Pp[t]) if p_fin < 0 else p_fin == 1
                    Pt = Pp[t]
                ok, logdet, pf_fin = update_one(Pt, fin, st.Z, st.H, options.jitter, ws, F, Pf, sx)
                pf = 1 if pf_fin else 0
            else:
                ok, logdet = update_cov(Pp[t], st.Z, st.H, options.jitter, k, ws, F, Pf, sx)
            if ok:
                ll = loglik(v, obs, k, logdet, L, w)
                update_mean(ap[t], v, obs, k, K, af)
        if not ok:  # F_oo not PD: -inf, NaN from here on
            _fail_from(out, t)
            total = -np.inf
            break
        out.loglik_obs[t] = ll
        total += ll
        predict_mean(af, st.c, st.T, ap[t + 1], sx)
        if steady and k == p:  # freeze the covariance recursion at P_t
            copy_into(Pp[t], Pp[t + 1])
            t, part = _steady_run(t + 1, y, system, options, logdet, L, K, w, out, sx, need_P)
            total += part
            steady = False
            p_fin = -1
            continue
        if not sum_rq:
            rqr(st.R, st.Q, RQ, RQR)
        test = static and k == p
        fin, steady = predict_cov(Pf, st.T, RQR, Pp[t + 1], W, sx, pf, Pp[t], test and t > 0)
        if test and t == 0:  # P0 need not be symmetric: the test on whole matrices
            steady = steady_test(Pp[1], Pp[0], True)
        p_fin = 1 if fin else 0
        t += 1
    keep_alive((ws_own, sx_own, buf))
    return total


@numba.njit(cache=True)
def _fail_from(out, t):
    """Outputs of a filter whose step t failed: ``loglik_obs[t] = -inf``, NaN from there on."""
    out.loglik_obs[t] = -np.inf
    out.loglik_obs[t + 1:] = np.nan
    out.filtered_state[t:] = np.nan
    out.filtered_cov[t:] = np.nan
    out.predicted_state[t + 1:] = np.nan
    out.predicted_cov[t + 1:] = np.nan
    out.forecast_error[t + 1:] = np.nan
    out.forecast_error_cov[t + 1:] = np.nan


@numba.njit(cache=True)
def _steady_run(t, y, system, options, logdet, L, K, w, out, sx, need_P):
    """Filter steps t, t+1, ... with the covariance recursion frozen at ``P_{t-1}`` (whose
    update, ``F, L = chol(F), K, P_f``, is that of step t - 1), until a step has a missing component.  Only
    the mean recursion runs, its prediction over T's nonzeros (``sx``) as in a full step; the loop indexes
    the output arrays directly.  The frozen covariances are copied into ``filtered_cov`` and
    ``predicted_cov`` only where those are read (``need_P``), but for the row a full step resumes from.
    Returns (next t, sum of ll)."""
    n, p = y.shape
    c, d, Tt, Zt = system.c, system.d, system.T[0], system.Z[0]
    m = Tt.shape[0]
    ll_obs, af, ap, v = out.loglik_obs, out.filtered_state, out.predicted_state, out.forecast_error
    Fss, Pfss, Pss = out.forecast_error_cov[t - 1], out.filtered_cov[t - 1], out.predicted_cov[t - 1]
    F, Pf, Pp = out.forecast_error_cov, out.filtered_cov, out.predicted_cov
    const = -0.5 * (p * LOG_2PI + logdet)
    total = 0.0
    vt = np.empty(p)
    while t < n:
        if not fully_observed(y, t, options):
            break
        ic = ti(c, t)
        innovation(y, d, Zt, ap, t, L, vt, w)
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
        predict_mean(af[t], c[ic], Tt, ap[t + 1], sx)  # as a full step: T's zeros skipped
        for i in range(p):
            for j in range(p):
                F[t, i, j] = Fss[i, j]
        for i in range(m if need_P else 0):
            for j in range(m):
                Pf[t, i, j] = Pfss[i, j]
                Pp[t + 1, i, j] = Pss[i, j]
        t += 1
    if not need_P and t < n:  # the next full step reads P_t
        for i in range(m):
            for j in range(m):
                Pp[t, i, j] = Pss[i, j]
    return t, total
