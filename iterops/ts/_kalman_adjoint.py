r"""The reverse-mode adjoint of the Kalman filter: the reverses of :mod:`iterops.ts._kalman_steps`' stages, step
after step from the last one, and the cheaper reverse of a steady-state stretch.

Each step's forward quantities are recomputed from the stored predictions (``predicted_state``,
``predicted_cov``), then reversed in the opposite order of the forward stages::

    predict_vjp -> loglik_vjp -> update_vjp -> observe_vjp

(one observable: the rank-one update and its merged reverse, :func:`~iterops.ts._kalman_steps.update_vjp_one`,
recomputed in O(m nnz(Z) + m^2) per step)

with the output cotangents of a step joining where their output is made.  Over a steady-state
stretch the gain terms cancel (up to the covariance jitter's, which stay linear in the covariance
cotangent) and the covariance cotangents of the whole stretch follow from one Lyapunov equation
(:func:`_steady_adjoint_run`), solved by :mod:`iterops.linalg.lyapunov`'s Smith doubling.

Compile time: the kernel and its stages are ``inline="always"``, compiled once as part of the C-ABI
kernel (see :mod:`iterops.ts._kalman_filter`); only small leaf helpers are compiled on their own.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from iterops._fused import keep_alive
from iterops._linalg_kernels import (
    all_finite, borrowed, carve, cho_inverse, congruence, copy_into, matmul, sym_finite, sym_into,
)
from iterops.linalg.lyapunov import _doubling
from iterops.ts._kalman_steps import (
    System, closed_loop, find_structure, fully_observed, innovation, loglik, loglik_vjp, observe, observe_vjp,
    gain_one, predict_cov_vjp, predict_vjp, reverse_work, rq_vjp, static_cov, static_rq, structure, system_at, ti,
    update_cov, update_mean, update_one, update_vjp, update_vjp_one, update_work, varies_over_time,
)

__all__ = ["Cotangents", "InputCotangents", "kalman_adjoint_kernel"]


class Cotangents(NamedTuple):
    """Cotangents of the filter's outputs (names as :class:`iterops.ts.kalman.KalmanFilterResult`).
    A per-step cotangent with no rows is disconnected (zero)."""

    loglik: float
    loglik_obs: np.ndarray  #: (n,) or (0,)
    filtered_state: np.ndarray  #: (n, m) or (0, *)
    filtered_cov: np.ndarray  #: (n, m, m) or (0, *, *)
    predicted_state: np.ndarray  #: (n + 1, m) or (0, *)
    predicted_cov: np.ndarray  #: (n + 1, m, m) or (0, *, *)
    forecast_error: np.ndarray  #: (n, p) or (0, *)
    forecast_error_cov: np.ndarray  #: (n, p, p) or (0, *, *)


class InputCotangents(NamedTuple):
    """Cotangents of the filter's inputs, of their shapes (time-summed for static matrices)."""

    y: np.ndarray  #: (n, p)
    a0: np.ndarray  #: (m,)
    P0: np.ndarray  #: (m, m)
    system: System  #: as the system


class _Tape(NamedTuple):
    """What a steady stretch's reverse reads of the forward pass."""

    y: np.ndarray  #: (n, p) the observations
    a: np.ndarray  #: (n + 1, m) predicted_state
    P: np.ndarray  #: (n + 1, m, m) predicted_cov


class _ReverseState(NamedTuple):
    """The reverse pass's running state, updated in place step after step."""

    abar: np.ndarray  #: (m,) cotangent of the prediction a_{t+1} entering the step processed next
    Pbar: np.ndarray  #: (m, m) cotangent of P_{t+1}
    Grq: np.ndarray  #: (m, m) sum of G = sym(P'_bar) over the steps done, for static R and Q


class _SteadyCache(NamedTuple):
    """The update of a steady stretch's predicted covariance, left by the generic reverse of the
    step just after the stretch (``L, K, Finv, Pf`` are that step's work arrays).  ``j`` is the
    covariance jitter; with ``j = 0``, ``Aj = A`` and ``N`` is not used."""

    P: np.ndarray  #: (m, m) the predicted covariance (bitwise equal over the stretch)
    A: np.ndarray  #: (m, m) I - K Z
    Lss: np.ndarray  #: (m, m) T Aj, the closed-loop map of the covariance cotangent
    L: np.ndarray  #: (p, p) chol(F)
    K: np.ndarray  #: (m, p) the gain
    Finv: np.ndarray  #: (p, p) F^{-1}
    Pf: np.ndarray  #: (m, m) the filtered covariance
    B: np.ndarray  #: (m, p) K F^{-1}
    N: np.ndarray  #: (m, m) B Z
    Aj: np.ndarray  #: (m, m) A - j N = I - K (I + j F^{-1}) Z
    TN: np.ndarray  #: (m, m) T N
    j: float  #: cov_jitter


@numba.njit(cache=True, inline="always")
def _has(x):
    """A per-step cotangent is connected when it has rows."""
    return x.shape[0] > 0


@numba.njit(cache=True, inline="always")
def kalman_adjoint_kernel(y, system, options, ap, Pp, cot, grad, want):
    """Reverse-mode adjoint of :func:`iterops.ts._kalman_filter.kalman_filter_kernel`.

    ``ap``/``Pp`` are the forward ``predicted_state``/``predicted_cov``; each step's update is
    recomputed from them.  ``cot``: :class:`Cotangents` of the outputs.  Writes the cotangents
    of the inputs into ``grad`` (:class:`InputCotangents`); all NaN if the forward pass failed.  ``want``
    (:class:`iterops.ts._kalman_steps.Wanted`): the per-step terms of T's and Z's cotangents are computed
    only where True (else those cotangents are not meaningful; the entry point fills them with NaN); with
    neither, a one-observable step recomputes only its gain (:func:`~iterops.ts._kalman_steps.gain_one`).

    Steady stretches (see :func:`_steady_adjoint_run`) take a cheaper path (static
    ``T, Z, R, H, Q``, any ``cov_jitter``); every other step recomputes its update and reverses its stages, the
    output cotangents of the step joining where their output is made.  (That step is written
    out in the loop, where the reverse stages are inlined, rather than in a function of its
    own: a call would pass every array of the NamedTuples on every step.)
    """
    n, p = y.shape
    m = ap.shape[1]
    _fill(grad, 0.0)
    ws, ws_own = update_work(m, p)
    rw, rw_own = reverse_work(m, p)
    obs, _, _, Zo, _, L, K, w = ws
    G, W, _, Pf_bar, af_bar, _, _, Finv, Fo_bar, X_bar, XZ, vo_bar, a_bar_new, P_bar_new = rw
    mm, o = m * m, p + p * p + m
    buf = np.empty(p + p * p + 2 * m + 9 * mm + m * p)  # one allocation, carved
    v, F, af, Pf = carve(buf, 0, (p,)), carve(buf, p, (p, p)), carve(buf, p + p * p, (m,)), carve(buf, o, (m, m))
    abar, Pbar = carve(buf, o + mm, (m,)), carve(buf, o + mm + m, (m, m))  # of the prediction entering the step
    _entering_cotangents(cot, n, abar, Pbar)
    jitter, sum_rq = options.jitter, static_rq(system)
    o += 2 * mm + m
    cache = _SteadyCache(
        carve(buf, o, (m, m)), carve(buf, o + mm, (m, m)), carve(buf, o + 2 * mm, (m, m)), L, K, Finv, Pf,
        carve(buf, o + 3 * mm, (m, p)), carve(buf, o + 3 * mm + m * p, (m, m)),
        carve(buf, o + 4 * mm + m * p, (m, m)), carve(buf, o + 5 * mm + m * p, (m, m)), jitter,
    )
    Grq = carve(buf, o + 6 * mm + m * p, (m, m))  # sum of G over the steps, for static R and Q
    Grq[:, :] = 0.0
    tape, state = _Tape(y, ap, Pp), _ReverseState(abar, Pbar, Grq)  # for the steady stretches
    fast = static_cov(system)
    cached = False  # the work arrays hold the update of cache.P, fully observed (fast only)
    vary = varies_over_time(system)
    st, gst = system_at(system, 0), system_at(grad.system, 0)  # step t's matrices, cotangents
    sx, sx_own = structure(m, p)  # as in the forward filter
    find_structure(system.T[0], system.Z[0], sx)
    restructure = system.T.shape[0] > 1 or system.Z.shape[0] > 1
    gain_only = p == 1 and not want.T and not want.Z  # a one-observable step recomputes its gain only
    # Pbar exactly symmetric (a step's reverse leaves it so, but for the cotangent of predicted_cov it may add)
    p_sym = not _has(cot.predicted_cov)
    t = n - 1
    while t >= 0:
        if cached and fully_observed(y, t, options) and _row_same(Pp, t, Pp[t + 1]):
            copy_into(Pp[t + 1], cache.P)
            _steady_cache(system.T[0], Zo, cache)  # the work arrays still hold cache.P's update
            t = _steady_adjoint_run(t, tape, system, options, cot, grad, state, cache, sx, want)
            p_sym = False
            continue
        if vary:
            st, gst = system_at(system, t), system_at(grad.system, t)
            if restructure:
                find_structure(st.T, st.Z, sx)
        a = ap[t]
        k = observe(a, y[t], st.d, st.Z, options, v, obs)
        if gain_only and k == 1 and t > 0:  # P_t exactly symmetric; P_f and sym(P_t) feed only T's, Z's cotangents
            ok, logdet = gain_one(Pp[t], all_finite(Pp[t]), st.Z, st.H, jitter, ws, F, sx)
        elif p == 1 and k == 1:  # update_cov's one-observable branch, inlined (a call would pass ws and sx whole)
            ok, logdet, _ = update_one(ws.Ps, sym_finite(Pp[t], ws.Ps), st.Z, st.H, jitter, ws, F, Pf, sx)
        else:
            ok, logdet = update_cov(Pp[t], st.Z, st.H, jitter, k, ws, F, Pf, sx)
        if not ok:
            _fill(grad, np.nan)
            grad.a0[:] = np.nan
            return
        cho_inverse(L, k, Finv)
        loglik(v, obs, k, logdet, L, w)  # w = F_oo^{-1} v_o
        update_mean(a, v, obs, k, K, af)
        # predict (a_f_bar starts from the cotangent of filtered_state[t], P_f_bar gets filtered_cov[t]'s)
        _row_or_zero(cot.filtered_state, t, af_bar)
        predict_vjp(abar, Pbar, p_sym, af, Pf, st, gst, sum_rq, Grq, G, W, Pf_bar, af_bar, sx, rw.S, want)
        if _has(cot.filtered_cov):
            Pf_bar += cot.filtered_cov[t]
        # loglik (ll_bar: loglik's and loglik_obs[t]'s), update (X_bar starts from forecast_error_cov[t]'s)
        loglik_vjp(cot.loglik + (cot.loglik_obs[t] if _has(cot.loglik_obs) else 0.0), k, w, Finv, vo_bar, Fo_bar)
        _row_or_zero(cot.forecast_error_cov, t, X_bar)
        one = p == 1 and k == 1
        if one:  # writes the symmetrized cotangent of P_t into Pbar directly
            update_vjp_one(v[0], st.Z, jitter, ws, rw, gst.H, Pbar, sx, want.Z)
        else:
            update_vjp(a, v, st.Z, jitter, k, ws, rw, gst.Z, gst.H, want.Z)
        # observe (v_bar gets forecast_error[t]'s); a_t, P_t get predicted_state[t]'s, predicted_cov[t]'s
        if _has(cot.forecast_error):
            for i in range(k):
                vo_bar[i] += cot.forecast_error[t, obs[i]]
        observe_vjp(a, k, obs, Zo, vo_bar, XZ, a_bar_new, grad.y[t], gst.d, gst.Z, want.Z)
        for i in range(m):
            abar[i] = a_bar_new[i] + (cot.predicted_state[t, i] if _has(cot.predicted_state) else 0.0)
        if not one:
            _carry_cov(P_bar_new, t, cot.predicted_cov, Pbar)
        elif _has(cot.predicted_cov):
            for i in range(m):
                for j in range(m):
                    Pbar[i, j] += cot.predicted_cov[t, i, j]
        p_sym = not _has(cot.predicted_cov)
        # the cache (P = Pp[t], copied when a steady stretch follows) only then: it costs two m^3 products
        cached = fast and k == p
        t -= 1
    if sum_rq:
        rq_vjp(Grq, system.R[0], system.Q[0], grad.system.R[0], grad.system.Q[0])
    copy_into(abar, grad.a0)
    copy_into(Pbar, grad.P0)
    keep_alive((ws_own, rw_own, sx_own, buf))


@numba.njit(cache=True, inline="always")
def _steady_cache(Tt, Zt, cache):
    """Fill ``cache`` (:class:`_SteadyCache`, whose ``P`` is set) for the fully observed step last reversed,
    whose ``K``, ``Finv`` are in ``cache``: ``A = I - K Z``, ``B = K F^{-1}``, ``N = B Z``,
    ``Aj = A - j N``, ``TN = T N``, ``Lss = T Aj``."""
    m = Tt.shape[0]
    closed_loop(cache.K, Zt, Zt.shape[0], cache.A)
    matmul(cache.K, cache.Finv, cache.B)
    matmul(cache.B, Zt, cache.N)
    for i in range(m):
        for j in range(m):
            cache.Aj[i, j] = cache.A[i, j] - cache.j * cache.N[i, j]
    matmul(Tt, cache.N, cache.TN)
    matmul(Tt, cache.Aj, cache.Lss)


@numba.njit(cache=True, inline="always")
def _fill(grad, value):
    """Every input cotangent but ``a0`` (set last) = value."""
    for out in (grad.y, grad.system.c, grad.system.d, grad.P0):
        out[:] = value
    for out in (grad.system.T, grad.system.Z, grad.system.R, grad.system.H, grad.system.Q):
        out[:] = value


@numba.njit(cache=True, inline="always")
def _entering_cotangents(cot, n, abar, Pbar):
    """``abar, Pbar`` = the cotangents of ``a_n, P_n`` (the last prediction): those of ``predicted_state[n]``,
    ``predicted_cov[n]``, or 0."""
    if _has(cot.predicted_state):
        copy_into(cot.predicted_state[n], abar)
    else:
        abar[:] = 0.0
    if _has(cot.predicted_cov):
        copy_into(cot.predicted_cov[n], Pbar)
    else:
        Pbar[:, :] = 0.0


@numba.njit(cache=True, inline="always")
def _row_or_zero(g, t, out):
    """out = g[t], or 0 if the cotangent g is disconnected."""
    if _has(g):
        copy_into(g[t], out)
    else:
        out[:] = 0.0


@numba.njit(cache=True, inline="always")
def _carry_cov(P_bar_new, t, g_Pp, Pbar):
    """Covariance cotangent entering step t-1: ``sym(P_bar)`` plus that of ``predicted_cov[t]``."""
    m = Pbar.shape[0]
    has_Pp = _has(g_Pp)
    for i in range(m):
        for j in range(m):
            Pbar[i, j] = 0.5 * (P_bar_new[i, j] + P_bar_new[j, i]) + (g_Pp[t, i, j] if has_Pp else 0.0)


@numba.njit(cache=True, inline="always")
def _row_same(X, t, Y):
    """Bitwise equality of ``X[t]`` and ``Y`` (no view)."""
    for i in range(Y.shape[0]):
        for j in range(Y.shape[1]):
            if X[t, i, j] != Y[i, j]:
                return False
    return True


# ---------------------------------------------------------------------------
# Steady stretches
# ---------------------------------------------------------------------------


class _SteadyWork(NamedTuple):
    """Work arrays of a steady stretch's reverse steps."""

    v: np.ndarray  #: (p,) forecast error
    w: np.ndarray  #: (p,) F^{-1} v
    u: np.ndarray  #: (p,) K^T a_f_bar, then v_bar
    af: np.ndarray  #: (m,) filtered state
    af_bar: np.ndarray  #: (m,)
    G: np.ndarray  #: (m, m) sym(P'_bar)
    S: np.ndarray  #: (m, m) scratch
    W1: np.ndarray  #: (m, m) sym(cotangent of filtered_cov[s])
    P_bar_new: np.ndarray  #: (m, m)
    X_bar: np.ndarray  #: (p, p) sym(F_bar)
    W2: np.ndarray  #: (p, m) scratch


class _Stretch(NamedTuple):
    """A steady stretch's steps ``t, t-1, ..., s0``; the ``window`` steps nearest ``s0`` run the covariance
    recursion (all when ``window = 0``, :func:`_steady_window`)."""

    t: int
    s0: int
    window: int


class _SteadySums(NamedTuple):
    """Sums over a steady stretch, from which the covariance-path cotangents follow."""

    Gs: np.ndarray  #: (m, m) sum of sym(P_bar_{s+1})
    Ss: np.ndarray  #: (m, m) sum of sym(cotangent of filtered_cov[s])
    Xs: np.ndarray  #: (p, p) sum of X = sym(F_bar)
    Ms: np.ndarray  #: (m, p) sum of Mo_bar = a_f_bar w^T


_WINDOW_TOL = 1e-18  # ||S^-1 L^K S||_F^2 (S: the states' scales) below which a steady stretch's far steps skip the covariance recursion
_MAX_DOUBLINGS = 20
_MAX_JITTER_COUPLING = 1e-3  # bound on the jitter's j^2 term in the stretch's Lyapunov solve (else: recursion)
_MAX_JITTER_SWEEPS = 12


@numba.njit(cache=True)
def _steady_adjoint_run(t, tape, system, options, cot, grad, state, cache, sx, want):
    """Backward steps t, t-1, ..., s0 of a steady stretch: static system, every component
    observed and ``P_s`` (``tape``: :class:`_Tape`) bitwise ``cache.P``, whose update is ``cache``
    (:class:`_SteadyCache`).  ``state`` (:class:`_ReverseState`): ``abar, Pbar`` the cotangents of
    ``a_{t+1}, P_{t+1}`` in, of ``a_s0, P_s0`` out; ``Grq += Gs``.  Returns ``s0 - 1``, the next step to
    process.

    With ``S = T^T G T + sym(Pf_bar_out)`` (G = sym(P'_bar)) the gain terms of the generic step
    cancel up to the jitter's: ``K_bar = -S M - 2 j S K + a_f_bar v^T`` and
    ``M_bar = -S K + K_bar F^{-1}`` leave, after symmetrization, ``A^T S A - j (A^T S N + N^T S A)``
    (``N = K F^{-1} Z``) because ``K F = M``; that is ``Aj^T S Aj - j^2 N^T S N`` with
    ``Aj = A - j N``.  So ``Mo_bar = a_f_bar w^T`` (w = F^{-1} v), ``X = sym(F_bar)``,
    ``F_bar = -ll_bar/2 (F^{-1} - w w^T) - (K^T a_f_bar) w^T (+ F_bar_out)`` and the covariance
    cotangent obeys ``P_bar_s = Phi(sym(P_bar_{s+1})) + C_s`` with
    ``Phi(G) = Lss^T G Lss - j^2 (T N)^T G (T N)``, ``Lss = T Aj``, and

        C_s = Aj^T W Aj - j^2 N^T W N + Z^T X Z + sym(Mo_bar Z) + sym(P_bar_out[s]),  W = sym(Pf_bar_out).

    The covariance-path parameter cotangents are linear in ``Gs = sum_s sym(P_bar_{s+1})`` and in
    the sums of ``X``, ``Mo_bar`` and ``sym(Pf_bar_out)``; :func:`_steady_flush` applies them once.
    Telescoping the recursion gives ``Gs = Phi(Gs) + (sum C + E - P_bar_s0)`` (E = entering
    cotangent), one Lyapunov equation (:func:`_steady_gs`), so on a long stretch only the ``K`` steps
    nearest ``s0`` (where ``||S^-1 Lss^K S||_F^2 <= 1e-18``, S the states' scales) run the O(m^3) recursion, for ``P_bar_s0``; the
    others do only the O(m p + m^2) mean path (a, v, y, d, c and the a_f-dependent T and Z terms) and
    the sums.  Short stretches, a closed loop without that decay, or a jitter whose ``j^2`` term is
    not small (:func:`_steady_window`) run the recursion on every step.
    """
    y, Pp, Pbar = tape.y, tape.P, state.Pbar
    p = y.shape[1]
    m = Pp.shape[1]
    s0 = t
    while s0 >= 0 and fully_observed(y, s0, options) and _row_same(Pp, s0, cache.P):
        s0 -= 1
    s0 += 1
    window = _steady_window(cache, t - s0 + 1, Pp[0])
    exact = window == 0  # full recursion on every step, Gs summed directly
    stretch = _Stretch(t, s0, window)
    sw, sw_own = _steady_work(m, p)
    sums = _SteadySums(np.zeros((m, m)), np.zeros((m, m)), np.zeros((p, p)), np.zeros((m, p)))
    E = np.empty((m, m))  # sym(covariance cotangent entering the stretch)
    sym_into(Pbar, E)
    _steady_reverse_steps(stretch, tape, system, cot, grad, state, cache, sw, sums)
    if not exact:
        G = _steady_lyapunov_rhs(stretch, system.Z[0], cache, cot, E, Pbar, sw, sums)
        copy_into(_steady_gs(cache, G), sums.Gs)
    _steady_flush(system, grad.system, cache, sums, state.Grq, sx, want.T)
    keep_alive(sw_own)
    return s0 - 1


@numba.njit(cache=True, inline="always")
def _steady_work(m, p):
    """An uninitialized :class:`_SteadyWork` of borrowed arrays, and their owners."""
    own = _SteadyWork(
        np.empty(p), np.empty(p), np.empty(p), np.empty(m), np.empty(m), np.empty((m, m)), np.empty((m, m)),
        np.empty((m, m)), np.empty((m, m)), np.empty((p, p)), np.empty((p, m)),
    )
    v, w, u, af, af_bar, G, S, W1, P_bar_new, X_bar, W2 = own
    work = _SteadyWork(
        borrowed(v), borrowed(w), borrowed(u), borrowed(af), borrowed(af_bar), borrowed(G), borrowed(S),
        borrowed(W1), borrowed(P_bar_new), borrowed(X_bar), borrowed(W2),
    )
    return work, own


@numba.njit(cache=True, inline="always")
def _steady_reverse_steps(stretch, tape, system, cot, grad, state, cache, sw, sums):
    """Steps t, ..., s0 of :func:`_steady_adjoint_run` (``stretch``: :class:`_Stretch`): on every step the
    mean path and the sums (recompute ``v``, ``w = F^{-1} v``, ``a_f = a + K v``; reverse ``a' = T a_f + c``,
    the likelihood and ``v = y - d - Z a``; ``state.abar``: cotangent of ``a_{s+1}`` in, of ``a_s`` out), on
    the steps of the window (all when ``window = 0``) the covariance recursion (:func:`_steady_cov_step`).

    One function on purpose: the arrays are unpacked before the loop, so that a step binds none (a
    per-step helper taking the NamedTuples would incref/decref their ~40 arrays on every call)."""
    t, s0, window = stretch
    y, ap = tape.y, tape.a
    abar, Pbar = state.abar, state.Pbar
    p = y.shape[1]
    m = ap.shape[1]
    exact = window == 0
    c, d, Tt, Zt = system.c, system.d, system.T[0], system.Z[0]
    K, L, Finv = cache.K, cache.L, cache.Finv
    gy, gc, gd, gT, gZ = grad.y, grad.system.c, grad.system.d, grad.system.T[0], grad.system.Z[0]
    _, g_llobs, g_af, g_Pf, g_ap, _, g_v, g_F = cot
    has_llobs, has_af, has_Pf, has_ap, has_v, has_F = (
        _has(g_llobs), _has(g_af), _has(g_Pf), _has(g_ap), _has(g_v), _has(g_F)
    )
    v, w, u, af, af_bar, _, _, W1, _, X_bar, _ = sw
    _, Ss, Xs, Ms = sums
    for s in range(t, s0 - 1, -1):
        recursion = exact or s < s0 + window
        if recursion and not exact and s == s0 + window - 1:
            Pbar[:, :] = 0.0  # far steps' contribution to P_bar_s0 is below ||S^-1 Lss^K S||^2: dropped
        ic, idd = ti(c, s), ti(d, s)
        innovation(y, d, Zt, ap, s, L, v, w)  # recompute v, w = F^{-1} v and a_f = a + K v
        for i in range(m):
            x = ap[s, i]
            for j in range(p):
                x += K[i, j] * v[j]
            af[i] = x
        for i in range(m):  # a' = T a_f + c: c_bar += a'_bar, a_f_bar = T^T a'_bar, T_bar += a'_bar a_f^T
            gc[ic, i] += abar[i]
            af_bar[i] = g_af[s, i] if has_af else 0.0
        for l in range(m):  # T^T a'_bar by rows of T: the same sums, in the same order, without a chain of adds
            x = abar[l]
            for i in range(m):
                af_bar[i] += Tt[l, i] * x
            for j in range(m):
                gT[l, j] += x * af[j]
        ll_bar = cot.loglik + (g_llobs[s] if has_llobs else 0.0)
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
        for i in range(p):  # v = y - d - Z a: v_bar = u - ll_bar w (+ g_v); a_bar = a_f_bar - Z^T v_bar
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
        if recursion:
            _steady_cov_step(s, exact, Zt, cache, has_Pf, cot.predicted_cov, Pbar, sw, sums.Gs)


@numba.njit(cache=True)
def _jitter_congruence(X, N, j2, G, W, out, beta):
    """out = X^T G X - j2 N^T G N + beta out (``W`` scratch): the steady stretch's covariance
    maps (:func:`_steady_adjoint_run`); ``j2 = 0`` is a plain congruence."""
    congruence(X, G, W, out, beta)
    if j2 != 0.0:
        matmul(G, N, W)
        matmul(N.T, W, out, -j2, 1.0)


@numba.njit(cache=True)
def _steady_cov_step(s, exact, Zt, cache, has_Pf, g_Pp, Pbar, sw, Gs):
    """The covariance recursion at step s:
    ``P_bar = Phi(G) + Aj^T W Aj - j^2 N^T W N + Z^T X Z + Mo_bar Z`` (symmetrized by :func:`_carry_cov`;
    ``W = sym(Pf_bar_out)``, ``Phi`` of :func:`_steady_adjoint_run`), ``G = sym(Pbar)`` (added to
    ``Gs`` when ``exact``)."""
    p, m = sw.W2.shape
    _, w, _, _, af_bar, G, S, W1, P_bar_new, X_bar, W2 = sw
    j2 = cache.j * cache.j
    sym_into(Pbar, G)
    if exact:
        for i in range(m):
            for j in range(m):
                Gs[i, j] += G[i, j]
    _jitter_congruence(cache.Lss, cache.TN, j2, G, S, P_bar_new, 0.0)
    if has_Pf:
        _jitter_congruence(cache.Aj, cache.N, j2, W1, S, P_bar_new, 1.0)
    matmul(X_bar, Zt, W2)
    for i in range(m):
        for j in range(m):
            x = 0.0
            for l in range(p):
                x += Zt[l, i] * W2[l, j] + af_bar[i] * w[l] * Zt[l, j]
            P_bar_new[i, j] += x
    _carry_cov(P_bar_new, s, g_Pp, Pbar)


@numba.njit(cache=True, inline="always")
def _steady_lyapunov_rhs(stretch, Zt, cache, cot, E, Pbar, sw, sums):
    """The right-hand side ``sum C + E - P_bar_s0`` of ``Gs = Phi(Gs) + (sum C + E - P_bar_s0)``, with
    ``sum C = Z^T Xs Z + sym(Ms Z) + Aj^T Ss Aj - j^2 N^T Ss N + Cs``, ``Cs`` the sum of
    sym(cotangent of predicted_cov[s]) over the stretch ``s = t, ..., s0``."""
    t, s0 = stretch.t, stretch.s0
    p, m = sw.W2.shape
    W2, S, Ms = sw.W2, sw.S, sums.Ms
    Cs = np.zeros((m, m))
    if _has(cot.predicted_cov):
        g_Pp = cot.predicted_cov
        for s in range(t, s0 - 1, -1):
            for i in range(m):
                for j in range(m):
                    Cs[i, j] += 0.5 * (g_Pp[s, i, j] + g_Pp[s, j, i])
    G = np.empty((m, m))
    matmul(sums.Xs, Zt, W2)
    matmul(Zt.T, W2, G)
    for i in range(m):
        for j in range(m):
            x = 0.0
            for l in range(p):
                x += Ms[i, l] * Zt[l, j] + Ms[j, l] * Zt[l, i]
            G[i, j] += 0.5 * x + Cs[i, j] + E[i, j] - 0.5 * (Pbar[i, j] + Pbar[j, i])
    if _has(cot.filtered_cov):
        _jitter_congruence(cache.Aj, cache.N, cache.j * cache.j, sums.Ss, S, G, 1.0)
    return G


@numba.njit(cache=True, inline="always")
def _steady_flush(system, gsystem, cache, sums, Grq, sx, want_T):
    """Add the covariance-path parameter cotangents of a steady stretch (the sums of
    :func:`_steady_adjoint_run`) to ``gsystem`` (static: row 0): the predict reverse with ``G = Gs`` (its
    R/Q part through ``Grq += Gs``, applied once by the caller); with ``S = T^T Gs T + Ss``:
    ``Z_bar -= K^T S Aj (P + P^T) + j B^T S A (P + P^T)``, ``H_bar += K^T S K + j (K^T S B + B^T S K)``;
    and ``H_bar += Xs``, ``Z_bar += Xs Z (P + P^T) + Ms^T P``.  (The generic step's terms, summed
    with the gain terms cancelled as in :func:`_steady_adjoint_run`.)"""
    Tt, Zt = system.T[0], system.Z[0]
    gT, gZ, gH = gsystem.T[0], gsystem.Z[0], gsystem.H[0]
    m = Tt.shape[0]
    p = Zt.shape[0]
    Gs, Ss, Xs, Ms = sums
    P, K, Pf, j = cache.P, cache.K, cache.Pf, cache.j
    predict_cov_vjp(Gs, Tt, Pf, gT, Ss, 1.0, np.empty((m, m)), sx, np.empty((m, m)), -1, want_T)  # Ss <- S
    Psum = np.empty((m, m))
    for i in range(m):
        for l in range(m):
            Grq[i, l] += Gs[i, l]
            Psum[i, l] = P[i, l] + P[l, i]
    SA = np.empty((m, m))
    A_bar = np.empty((m, m))
    matmul(Ss, cache.Aj, SA)
    matmul(SA, Psum, A_bar)
    matmul(K.T, A_bar, gZ, -1.0, 1.0)
    SK = np.empty((m, p))
    matmul(Ss, K, SK)
    matmul(K.T, SK, gH, 1.0, 1.0)
    if j != 0.0:
        matmul(Ss, cache.A, SA)
        matmul(SA, Psum, A_bar)
        matmul(cache.B.T, A_bar, gZ, -j, 1.0)
        KSB = np.empty((p, p))
        matmul(SK.T, cache.B, KSB)
        for i in range(p):
            for l in range(p):
                gH[i, l] += j * (KSB[i, l] + KSB[l, i])
    for i in range(p):
        for l in range(p):
            gH[i, l] += Xs[i, l]
    XZ = np.empty((p, m))
    matmul(Xs, Zt, XZ)
    matmul(XZ, Psum, gZ, 1.0, 1.0)
    matmul(Ms.T, P, gZ, 1.0, 1.0)


# ---------------------------------------------------------------------------
# The stretch's Lyapunov equation
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def _steady_window(cache, n_steps, P0):
    """Number ``K`` (a power of two) of steps nearest a stretch's start that run the covariance
    recursion: the first with ``||S^-1 Lss^K S||_F^2 <= _WINDOW_TOL``, ``S = diag(s)``,
    ``s_i^2 = P_ii + P0_ii`` (the stretch's predicted variance plus the initial one).  0 (the recursion on
    every step) if that needs ``K >= n_steps`` (short stretch, or ``Lss`` not stable enough), if some
    ``s_i`` is 0 or not finite, or if the jitter's ``j^2`` term of ``Phi`` is not small against the
    Lyapunov solve's gain (``j^2 ||S^-1 T N S||_F^2 prod_k (1 + ||S^-1 Lss^(2^k) S||_F^2) > _MAX_JITTER_COUPLING``:
    that bounds the contraction of the sweeps of :func:`_steady_gs`).

    Scale-free: rescaling the states by a diagonal D maps ``Lss -> D Lss D^-1``, ``T N -> D T N D^-1`` and
    ``s -> |D| s``, so the weighted norms, hence ``K``, are the same for every scaling.  The dropped part of
    ``P_bar_s0`` is ``Phi^K`` of the cotangent entering the window: in the scaling where ``s = 1`` (states of
    comparable variance) it is below ``_WINDOW_TOL`` relative to that cotangent, entry by entry after
    scaling back (``P_bar -> D^-1 P_bar D^-1``).  An unweighted norm would let the entries of a state
    orders of magnitude smaller than another hide a slow decay (or demand needless doublings)."""
    m = cache.Lss.shape[0]
    sc = np.empty(m)
    for i in range(m):
        v = cache.P[i, i] + P0[i, i]
        if not (v > 0.0 and v <= 1.7e308):
            return 0
        sc[i] = np.sqrt(v)
    Pk = cache.Lss.copy()
    Pn = np.empty((m, m))
    gain = 1.0
    for k in range(_MAX_DOUBLINGS + 1):
        if (1 << k) >= n_steps:
            return 0
        nrm = _weighted_norm2(Pk, sc)
        if not np.isfinite(nrm):
            return 0
        if nrm <= _WINDOW_TOL:
            break
        gain *= 1.0 + nrm
        if k == _MAX_DOUBLINGS:
            return 0
        matmul(Pk, Pk, Pn)
        copy_into(Pn, Pk)
    if cache.j != 0.0:
        if not (cache.j * cache.j * _weighted_norm2(cache.TN, sc) * gain <= _MAX_JITTER_COUPLING):
            return 0
    return 1 << k


@numba.njit(cache=True, inline="always")
def _weighted_norm2(X, sc):
    """``||S^-1 X S||_F^2`` for ``S = diag(sc)``."""
    m = X.shape[0]
    nrm = 0.0
    for i in range(m):
        for j in range(m):
            x = X[i, j] * (sc[j] / sc[i])
            nrm += x * x
    return nrm


@numba.njit(cache=True, inline="always")
def _steady_gs(cache, rhs):
    """Solve ``Gs = Lss^T Gs Lss - j^2 (T N)^T Gs (T N) + rhs`` (:func:`_steady_adjoint_run`):
    the Lyapunov equation of ``Lss^T`` by Smith's doubling (:func:`iterops.linalg.lyapunov._doubling`,
    elementwise relative tolerance of machine precision), and for ``j != 0`` fixed-point sweeps on
    the ``j^2`` term until they change no entry by more than machine precision relative to itself, or
    ``_MAX_JITTER_SWEEPS`` (they contract by :func:`_steady_window`'s bound).  NaN if doubling does not converge."""
    m = rhs.shape[0]
    eps = np.finfo(np.float64).eps
    LT = np.ascontiguousarray(cache.Lss.T)
    Gs, ok = _doubling(LT, rhs, eps, 100)
    if not ok:
        return np.full((m, m), np.nan)
    if cache.j == 0.0:
        return Gs
    j2 = cache.j * cache.j
    X = np.empty((m, m))
    W = np.empty((m, m))
    for _ in range(_MAX_JITTER_SWEEPS):
        copy_into(rhs, X)
        matmul(Gs, cache.TN, W)
        matmul(cache.TN.T, W, X, -j2, 1.0)
        Gn, ok = _doubling(LT, X, eps, 100)
        if not ok:
            return np.full((m, m), np.nan)
        done = True  # each entry relative to itself (as the doubling's stop): scale-free
        for i in range(m):
            for j in range(m):
                done &= abs(Gn[i, j] - Gs[i, j]) <= eps * abs(Gn[i, j])
        Gs = Gn
        if done:
            break
    return Gs
