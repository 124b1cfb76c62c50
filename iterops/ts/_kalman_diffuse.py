r"""The exact initial (diffuse) Kalman filter of Durbin & Koopman (2012, sec. 5.2-5.3), forward and reverse.

Initial state ``alpha_1 ~ a0 + A delta + R0 eta0`` with ``delta`` diffuse: ``P_1 = P_star + kappa P_inf``,
``kappa -> infinity``.  While ``P_inf,t`` is not zero (``sum(P_inf,t ** 2) > 1e-10``, statsmodels'
``tolerance_diffuse``) step ``t`` is a *diffuse step*, processed one observed component ``i`` after the
other (the univariate treatment, D&K sec. 5.3 / 6.4, which statsmodels always uses in the diffuse period);
with ``z = Z_t[i]``, ``h = H_t[i, i]`` and ``(a, P, P_inf)`` the state before component ``i``::

    v = y_t[i] - d_t[i] - z a;   M = P z;   M_inf = P_inf z;   F = z M + h;   F_inf = z M_inf

    F_inf > 1e-10 (D&K 5.12-5.14 for one component; K0 = M_inf / F_inf, K1 = M / F_inf - K0 F / F_inf):
        a     <- a + K0 v
        P     <- P - K0 M^T - K1 M_inf^T  = P - (M M_inf^T + M_inf M^T) / F_inf + M_inf M_inf^T F / F_inf^2
        P_inf <- P_inf - K0 M_inf^T
        ll   += -(log 2 pi + log F_inf) / 2
    else, F > 1e-10 (the ordinary univariate update):
        a <- a + M v / F;  P <- P - M M^T / F;  ll += -(log 2 pi + log F + v^2 / F) / 2
    else: failure (see below).

then ``a' = T a + c``, ``P' = T P T^T + R sym(Q) R^T``, ``P_inf' = T P_inf T^T``.  Missing components are
skipped.  The first step with ``P_inf`` zero is ``d``; from it on the ordinary filter runs from
``(a_d, P_d)`` (:mod:`iterops.ts.kalman`).  This is statsmodels' exact diffuse filter
(``_filters/_univariate_diffuse.pyx.in``) including its log-likelihood convention: no ``kappa`` terms, the
diffuse components contribute ``-(log 2 pi + log F_inf) / 2``, ``loglikelihood_burn = 0``.

Outputs of a diffuse step (statsmodels' conventions): ``predicted_cov``/``filtered_cov`` hold ``P_star``;
in a fully observed step ``forecast_error[t, i]`` is the sequential ``v`` of component ``i`` (after
components ``< i`` updated the state) and ``forecast_error_cov[t]`` is diagonal (``F`` of each component);
in a step with missing components they are, as statsmodels' ``FilterResults`` recomputes them,
``y_t - d_t - Z_t a_t`` (NaN where missing) and ``Z_t P_t Z_t^T + H_t``.

Failure is a value: a component with ``F_inf <= 1e-10`` and ``F <= 1e-10`` (``F_star`` not positive), a
non-finite ``F``, or ``P_inf`` still nonzero after the last step (the diffuse period does not end within
``n`` steps) gives ``loglik = -inf``; in the first two cases ``loglik_obs[t] = -inf`` and the outputs from
step ``t`` on are NaN.  Only a diagonal ``H_t`` is supported during the diffuse period (the univariate
treatment); an ``H_t`` with a nonzero off-diagonal entry in a diffuse step is a failure too.

Reverse: :func:`diffuse_adjoint` re-runs the forward steps (they are few) keeping the predictions of each
step, then reverses each step component by component (:func:`_component_vjp` is the reverse of
:func:`_component`), given the cotangents of ``(a_d, P_d)`` from the ordinary filter's adjoint.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from iterops._constants import LOG_2PI
from iterops.ts._kalman_filter import _fail_from
from iterops.ts._kalman_steps import fully_observed, missing, system_at

__all__ = ["DIFFUSE_TOL", "DiffuseOutputs", "diffuse_outputs", "diffuse_filter", "diffuse_adjoint"]

DIFFUSE_TOL = 1e-10  #: statsmodels' ``tolerance_diffuse``: of ``sum(P_inf ** 2)``, of ``F_inf``, of ``F``

_FAIL, _DIFFUSE, _ORDINARY = 0, 1, 2


class DiffuseOutputs(NamedTuple):
    """Per-step outputs (n steps) of the diffuse period, rows ``t < d`` written (names as
    :class:`iterops.ts.kalman.KalmanFilterResult`), and the hand-off to the ordinary filter."""

    loglik_obs: np.ndarray  #: (n,)
    filtered_state: np.ndarray  #: (n, m)
    filtered_cov: np.ndarray  #: (n, m, m)
    predicted_state: np.ndarray  #: (n + 1, m); row d = a_d
    predicted_cov: np.ndarray  #: (n + 1, m, m); row d = P_d
    forecast_error: np.ndarray  #: (n, p)
    forecast_error_cov: np.ndarray  #: (n, p, p)
    predicted_inf: np.ndarray  #: (n + 1, m, m) P_inf,t (the reverse pass's tape); row 0 = sym(P_inf)


class _ComponentTape(NamedTuple):
    """What the reverse of one component's update (:func:`_component_vjp`) reads of it: the outcome of
    :func:`_component` and the state before it, with its products."""

    case: int  #: _DIFFUSE or _ORDINARY
    v: float  #: forecast error
    F: float  #: z P z^T + h
    Fi: float  #: F_inf = z P_inf z^T
    a: np.ndarray  #: (m,) state before
    P: np.ndarray  #: (m, m)
    Pi: np.ndarray  #: (m, m) P_inf
    M: np.ndarray  #: (m,) P z
    Mi: np.ndarray  #: (m,) P_inf z


class _StateCotangents(NamedTuple):
    """Cotangents of a diffuse step's running state ``(a, P, P_inf)``, updated in place from the state
    after an operation to the state before it."""

    a: np.ndarray  #: (m,)
    P: np.ndarray  #: (m, m)
    Pi: np.ndarray  #: (m, m)


@numba.njit(cache=True)
def diffuse_outputs(n, m, p):
    """Zeroed :class:`DiffuseOutputs` of an (n, m, p) filter."""
    return DiffuseOutputs(
        np.zeros(n), np.zeros((n, m)), np.zeros((n, m, m)), np.zeros((n + 1, m)), np.zeros((n + 1, m, m)),
        np.zeros((n, p)), np.zeros((n, p, p)), np.zeros((n + 1, m, m)),
    )


@numba.njit(cache=True)
def _frob2(X):
    s = 0.0
    for i in range(X.shape[0]):
        for j in range(X.shape[1]):
            s += X[i, j] * X[i, j]
    return s


@numba.njit(cache=True)
def _diag_ok(Ht):
    for i in range(Ht.shape[0]):
        for j in range(Ht.shape[1]):
            if i != j and Ht[i, j] != 0.0:
                return False
    return True


@numba.njit(cache=True)
def _component(yi, di, z, h, a, P, Pi, M, Mi):
    """One component's update of a diffuse step, in place on ``a, P, Pi`` (``M, Mi``: work, left
    holding ``P z, P_inf z`` of the state before).  Returns ``(case, ll, v, F, F_inf)``."""
    m = a.shape[0]
    v = yi - di
    for k in range(m):
        v -= z[k] * a[k]
    F = h
    Fi = 0.0
    for k in range(m):
        s = 0.0
        si = 0.0
        for l in range(m):
            s += P[k, l] * z[l]
            si += Pi[k, l] * z[l]
        M[k] = s
        Mi[k] = si
    for k in range(m):
        F += z[k] * M[k]
        Fi += z[k] * Mi[k]
    if not (np.isfinite(F) and np.isfinite(Fi) and np.isfinite(v)):
        return _FAIL, -np.inf, v, F, Fi
    if Fi > DIFFUSE_TOL:
        g = v / Fi
        s2 = F / (Fi * Fi)
        for k in range(m):
            a[k] += Mi[k] * g
        for k in range(m):
            for l in range(m):
                P[k, l] += -(M[k] * Mi[l] + Mi[k] * M[l]) / Fi + Mi[k] * Mi[l] * s2
                Pi[k, l] -= Mi[k] * Mi[l] / Fi
        return _DIFFUSE, -0.5 * (LOG_2PI + np.log(Fi)), v, F, Fi
    if F > DIFFUSE_TOL:
        g = v / F
        for k in range(m):
            a[k] += M[k] * g
        for k in range(m):
            for l in range(m):
                P[k, l] -= M[k] * M[l] / F
        return _ORDINARY, -0.5 * (LOG_2PI + np.log(F) + v * v / F), v, F, Fi
    return _FAIL, -np.inf, v, F, Fi


@numba.njit(cache=True)
def _component_vjp(fwd, z, ll_bar, v_bar, F_bar, bar, gz):
    """Reverse of :func:`_component` (``fwd``: :class:`_ComponentTape`, its outcome and the state before).
    ``bar`` (:class:`_StateCotangents`): cotangents of the state after, turned in place into those of the
    state before; ``ll_bar``, ``v_bar``, ``F_bar``: the output cotangents of ``ll``, ``v`` and ``F``;
    ``gz`` += cotangent of ``z``.  Returns ``(v_bar, h_bar)`` (the ``y`` cotangent is ``v_bar``, the ``d``
    one ``-v_bar``)."""
    case, v, F, Fi, a, P, Pi, M, Mi = fwd
    a_bar, P_bar, Pi_bar = bar
    m = a.shape[0]
    M_bar = np.zeros(m)
    Mi_bar = np.zeros(m)
    Fi_bar = 0.0
    if case == _DIFFUSE:
        g = v / Fi
        s2 = F / (Fi * Fi)
        g_bar = 0.0
        q = 0.0  # <P_bar, M Mi^T + Mi M^T>
        s_bar = 0.0  # <P_bar, Mi Mi^T>
        qi = 0.0  # <Pi_bar, Mi Mi^T>
        for k in range(m):
            g_bar += a_bar[k] * Mi[k]
            Mi_bar[k] += a_bar[k] * g
            for l in range(m):
                Gs = P_bar[k, l] + P_bar[l, k]
                Gi = Pi_bar[k, l] + Pi_bar[l, k]
                M_bar[k] -= Gs * Mi[l] / Fi
                Mi_bar[k] += -Gs * M[l] / Fi + s2 * Gs * Mi[l] - Gi * Mi[l] / Fi
                q += P_bar[k, l] * (M[k] * Mi[l] + Mi[k] * M[l])
                s_bar += P_bar[k, l] * Mi[k] * Mi[l]
                qi += Pi_bar[k, l] * Mi[k] * Mi[l]
        F_bar += s_bar / (Fi * Fi)
        Fi_bar += q / (Fi * Fi) - 2.0 * s_bar * F / (Fi * Fi * Fi) + qi / (Fi * Fi)
        v_bar += g_bar / Fi
        Fi_bar += -g_bar * v / (Fi * Fi) - 0.5 * ll_bar / Fi
    else:
        g = v / F
        g_bar = 0.0
        s_bar = 0.0  # <P_bar, M M^T>
        for k in range(m):
            g_bar += a_bar[k] * M[k]
            M_bar[k] += a_bar[k] * g
            for l in range(m):
                M_bar[k] -= (P_bar[k, l] + P_bar[l, k]) * M[l] / F
                s_bar += P_bar[k, l] * M[k] * M[l]
        F_bar += s_bar / (F * F)
        v_bar += g_bar / F
        F_bar += -g_bar * v / (F * F) + ll_bar * (-0.5 / F + 0.5 * v * v / (F * F))
        v_bar += -ll_bar * v / F
    # F = z M + h, F_inf = z M_inf, M = P z, M_inf = P_inf z, v = y - d - z a
    for k in range(m):
        M_bar[k] += F_bar * z[k]
        Mi_bar[k] += Fi_bar * z[k]
    for k in range(m):
        s = F_bar * M[k] + Fi_bar * Mi[k] - v_bar * a[k]
        for l in range(m):
            s += P[l, k] * M_bar[l] + Pi[l, k] * Mi_bar[l]
        gz[k] += s
    for k in range(m):
        a_bar[k] -= v_bar * z[k]
        for l in range(m):
            P_bar[k, l] += M_bar[k] * z[l]
            Pi_bar[k, l] += Mi_bar[k] * z[l]
    return v_bar, F_bar


@numba.njit(cache=True)
def _sym_copy(X, out):
    for i in range(X.shape[0]):
        for j in range(X.shape[1]):
            out[i, j] = 0.5 * (X[i, j] + X[j, i])


@numba.njit(cache=True)
def _predict(af, Pf, Pif, st, a_next, P_next, Pi_next):
    """a' = T a + c, P' = T P T^T + R sym(Q) R^T, P_inf' = T P_inf T^T (full products, as the reverse)."""
    Tt, Rt, Qt = st.T, st.R, st.Q
    m = af.shape[0]
    r = Qt.shape[0]
    W = Tt @ Pf
    Wi = Tt @ Pif
    Qs = 0.5 * (Qt + Qt.T)
    RQR = Rt @ Qs @ Rt.T
    for i in range(m):
        s = st.c[i]
        for l in range(m):
            s += Tt[i, l] * af[l]
        a_next[i] = s
        for j in range(m):
            s = RQR[i, j]
            si = 0.0
            for l in range(m):
                s += W[i, l] * Tt[j, l]
                si += Wi[i, l] * Tt[j, l]
            P_next[i, j] = s
            Pi_next[i, j] = si
    return r


@numba.njit(cache=True)
def _predict_vjp(af, Pf, Pif, st, gst, bar):
    """Reverse of :func:`_predict`: in place, ``bar`` (:class:`_StateCotangents`) of the next prediction
    becomes that of ``a_f, P_f, P_inf,f``; system cotangents accumulate into ``gst``."""
    a_bar, P_bar, Pi_bar = bar
    Tt, Rt, Qt = st.T, st.R, st.Q
    Qs = 0.5 * (Qt + Qt.T)
    # T_bar += a_bar af^T + P_bar T Pf^T + P_bar^T T Pf + (same for P_inf)
    gst.T[:, :] += np.outer(a_bar, af) + P_bar @ Tt @ Pf.T + P_bar.T @ Tt @ Pf + Pi_bar @ Tt @ Pif.T
    gst.T[:, :] += Pi_bar.T @ Tt @ Pif
    gst.c[:] += a_bar
    G = P_bar + P_bar.T
    gst.R[:, :] += G @ Rt @ Qs
    Qs_bar = Rt.T @ P_bar @ Rt
    gst.Q[:, :] += 0.5 * (Qs_bar + Qs_bar.T)
    a_new = Tt.T @ a_bar
    P_new = Tt.T @ P_bar @ Tt
    Pi_new = Tt.T @ Pi_bar @ Tt
    a_bar[:] = a_new
    P_bar[:, :] = P_new
    Pi_bar[:, :] = Pi_new


@numba.njit(cache=True)
def diffuse_filter(y, a0, P0, Pinf0, system, options, out):
    """The diffuse steps of one series, into ``out`` (:class:`DiffuseOutputs`, zeroed).

    ``y`` (n, p), ``a0`` (m,), ``P0`` = P_star (m, m), ``Pinf0`` (m, m), ``system`` a
    :class:`iterops.ts._kalman_steps.System` with time axes.  Returns ``(loglik, d, ok)``: the summed
    log-likelihood of steps ``t < d``, the first non-diffuse step ``d`` (``n`` if none) and False on
    failure (then ``loglik = -inf`` and the rows from the failing step on are NaN, ``d`` = that step).
    """
    n, p = y.shape
    m = a0.shape[0]
    a = a0.copy()
    P = np.empty((m, m))
    Pi = np.empty((m, m))
    _sym_copy(P0, P)
    _sym_copy(Pinf0, Pi)
    M = np.empty(m)
    Mi = np.empty(m)
    out.predicted_state[0] = a0
    out.predicted_cov[0] = P0
    out.predicted_inf[0] = Pi
    total = 0.0
    t = 0
    while t < n and _frob2(Pi) > DIFFUSE_TOL:
        st = system_at(system, t)
        ok = _diag_ok(st.H)
        ll_t = 0.0
        for i in range(p):
            yi = y[t, i]
            if missing(yi, options):
                out.forecast_error[t, i] = np.nan
                continue
            case, ll, v, F, _ = _component(yi, st.d[i], st.Z[i], st.H[i, i], a, P, Pi, M, Mi)
            out.forecast_error[t, i] = v
            out.forecast_error_cov[t, i, i] = F
            ll_t += ll
            if case == _FAIL:
                ok = False
        if not ok:
            _fail_from(out, t)
            return -np.inf, t, False
        if not fully_observed(y, t, options):
            _multivariate_forecast(y[t], out.predicted_state[t], out.predicted_cov[t], st, options,
                                   out.forecast_error[t], out.forecast_error_cov[t])
        out.loglik_obs[t] = ll_t
        total += ll_t
        out.filtered_state[t] = a
        out.filtered_cov[t] = P
        _predict(a, P, Pi, st, out.predicted_state[t + 1], out.predicted_cov[t + 1], out.predicted_inf[t + 1])
        a[:] = out.predicted_state[t + 1]
        P[:, :] = out.predicted_cov[t + 1]
        Pi[:, :] = out.predicted_inf[t + 1]
        t += 1
    if _frob2(Pi) > DIFFUSE_TOL:  # the diffuse period did not end within n steps
        return -np.inf, n, False
    return total, t, True


@numba.njit(cache=True)
def _multivariate_forecast(yt, a, P, st, options, v, F):
    """statsmodels' report of a step with missing components (its ``FilterResults`` recomputes them):
    ``v = y_t - d_t - Z_t a_t`` (NaN where missing), ``F = Z_t P_t Z_t^T + H_t`` (all p rows)."""
    Zt = st.Z
    F[:, :] = Zt @ P @ Zt.T + st.H
    for i in range(yt.shape[0]):
        if missing(yt[i], options):
            v[i] = np.nan
        else:
            s = yt[i] - st.d[i]
            for k in range(a.shape[0]):
                s -= Zt[i, k] * a[k]
            v[i] = s


@numba.njit(cache=True)
def _multivariate_forecast_vjp(yt, a, P, st, gst, options, gv, gF, gy, a_bar, P_bar):
    """Reverse of :func:`_multivariate_forecast` for the cotangents ``gv`` (p,), ``gF`` (p, p) (either may
    have no rows: disconnected); accumulates into ``gy``, ``gst``, ``a_bar`` and ``P_bar``."""
    Zt = st.Z
    p, m = Zt.shape
    if gv.shape[0] > 0:
        for i in range(p):
            if missing(yt[i], options):
                continue
            g = gv[i]
            gy[i] += g
            gst.d[i] -= g
            for k in range(m):
                gst.Z[i, k] -= g * a[k]
                a_bar[k] -= g * Zt[i, k]
    if gF.shape[0] > 0:  # F = Z P Z^T + H: Z_bar += G Z P^T + G^T Z P, P_bar += Z^T G Z, H_bar += G
        ZP = Zt @ P
        ZPt = Zt @ P.T
        for i in range(p):
            for j in range(p):
                gst.H[i, j] += gF[i, j]
            for k in range(m):
                s = 0.0
                for j in range(p):
                    s += gF[i, j] * ZPt[j, k] + gF[j, i] * ZP[j, k]
                gst.Z[i, k] += s
        for k in range(m):
            for l in range(m):
                s = 0.0
                for i in range(p):
                    for j in range(p):
                        s += Zt[i, k] * gF[i, j] * Zt[j, l]
                P_bar[k, l] += s


@numba.njit(cache=True)
def diffuse_adjoint(y, system, options, tape, d, cot, a_bar, P_bar, grad):
    """Reverse of :func:`diffuse_filter`'s steps ``d-1, ..., 0``.

    ``tape``: the :class:`DiffuseOutputs` of the forward pass (predictions, ``predicted_inf``); ``cot``:
    :class:`iterops.ts._kalman_adjoint.Cotangents` of the outputs (full length; rows ``t < d`` are the
    diffuse ones); ``a_bar, P_bar``: the cotangents of ``(a_d, P_d)`` (of the ordinary filter's ``a0, P0``,
    which include those of ``predicted_state[d]``, ``predicted_cov[d]``).  Accumulates into ``grad``
    (:class:`iterops.ts._kalman_adjoint.InputCotangents`; the system cotangents already hold the ordinary
    filter's) and returns the cotangent of ``P_inf`` (``grad.a0``, ``grad.P0`` are set)."""
    n, p = y.shape
    m = a_bar.shape[0]
    Pi_bar = np.zeros((m, m))
    bar = _StateCotangents(a_bar, P_bar, Pi_bar)
    a = np.empty(m)
    P = np.empty((m, m))
    Pi = np.empty((m, m))
    Ma = np.empty((p, m))
    Mia = np.empty((p, m))
    A = np.empty((p + 1, m))
    PP = np.empty((p + 1, m, m))
    PPi = np.empty((p + 1, m, m))
    cases = np.empty(p, dtype=np.int64)
    vs = np.empty(p)
    Fs = np.empty(p)
    Fis = np.empty(p)
    ll_tot = cot.loglik
    P0_raw_bar = np.zeros((m, m))  # cotangent of P0 itself (not through sym(P0))
    for t in range(d - 1, -1, -1):
        st = system_at(system, t)
        gst = system_at(grad.system, t)
        # recompute the step's components from its prediction
        a[:] = tape.predicted_state[t]
        if t == 0:
            _sym_copy(tape.predicted_cov[0], P)
        else:
            P[:, :] = tape.predicted_cov[t]
        Pi[:, :] = tape.predicted_inf[t]
        for i in range(p):
            A[i] = a
            PP[i] = P
            PPi[i] = Pi
            cases[i] = -1
            if missing(y[t, i], options):
                continue
            case, _, v, F, Fi = _component(y[t, i], st.d[i], st.Z[i], st.H[i, i], a, P, Pi, Ma[i], Mia[i])
            cases[i] = case
            vs[i] = v
            Fs[i] = F
            Fis[i] = Fi
        # filtered outputs' cotangents, then the prediction's reverse
        if cot.filtered_state.shape[0] > 0:
            a_bar_f = cot.filtered_state[t].copy()
        else:
            a_bar_f = np.zeros(m)
        Pi_f = Pi.copy()
        _predict_vjp(a, P, Pi_f, st, gst, bar)
        a_bar += a_bar_f
        if cot.filtered_cov.shape[0] > 0:
            P_bar += cot.filtered_cov[t]
        ll_bar = ll_tot + (cot.loglik_obs[t] if cot.loglik_obs.shape[0] > 0 else 0.0)
        sequential = fully_observed(y, t, options)  # else forecast_error[t], _cov[t] are multivariate
        for i in range(p - 1, -1, -1):
            if cases[i] < 0:
                continue
            v_out = cot.forecast_error[t, i] if sequential and cot.forecast_error.shape[0] > 0 else 0.0
            F_out = cot.forecast_error_cov[t, i, i] if sequential and cot.forecast_error_cov.shape[0] > 0 else 0.0
            fwd = _ComponentTape(cases[i], vs[i], Fs[i], Fis[i], A[i], PP[i], PPi[i], Ma[i], Mia[i])
            v_bar, h_bar = _component_vjp(fwd, st.Z[i], ll_bar, v_out, F_out, bar, gst.Z[i])
            grad.y[t, i] += v_bar
            gst.d[i] -= v_bar
            gst.H[i, i] += h_bar
        if not sequential:
            gv = cot.forecast_error[t] if cot.forecast_error.shape[0] > 0 else cot.forecast_error[0:0, 0]
            gF = cot.forecast_error_cov[t] if cot.forecast_error_cov.shape[0] > 0 else cot.forecast_error_cov[0:0, 0]
            # P_t enters raw (at t = 0: P0 itself, not sym(P0))
            _multivariate_forecast_vjp(y[t], tape.predicted_state[t], tape.predicted_cov[t], st, gst, options, gv, gF,
                                       grad.y[t], a_bar, P0_raw_bar if t == 0 else P_bar)
        # this step's prediction outputs
        if cot.predicted_state.shape[0] > 0:
            a_bar += cot.predicted_state[t]
        if t > 0 and cot.predicted_cov.shape[0] > 0:
            P_bar += cot.predicted_cov[t]
    grad.a0[:] = a_bar
    if d == 0:  # P_bar is already the ordinary filter's cotangent of its P0 (= P0)
        grad.P0[:, :] = P_bar
    else:  # step 0 used sym(P0); predicted_cov[0] is P0 itself
        for i in range(m):
            for j in range(m):
                grad.P0[i, j] = 0.5 * (P_bar[i, j] + P_bar[j, i])
        if cot.predicted_cov.shape[0] > 0:
            grad.P0[:, :] += cot.predicted_cov[0]
        grad.P0[:, :] += P0_raw_bar
    out = np.empty((m, m))
    for i in range(m):
        for j in range(m):
            out[i, j] = 0.5 * (Pi_bar[i, j] + Pi_bar[j, i])
    return out
