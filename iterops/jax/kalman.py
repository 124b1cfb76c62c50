r"""JAX implementations of the Kalman Ops: :class:`~iterops.ts.kalman.KalmanFilter`, its gradient Op
:class:`~iterops.ts.kalman.KalmanFilterGrad`, :class:`~iterops.ts._kalman_second.KalmanFilterHVP` and
:class:`~iterops.ts.kalman_smoother.KalmanSmoother`.

Same model, notation, shapes and arithmetic as :mod:`iterops.ts.kalman` (Durbin & Koopman; statsmodels'
layout), one ``lax.scan`` over the time steps; per step ``t`` (``o`` the observed components, ``j`` the jitter)::

    v   = y_t - d_t - Z_t a                     (NaN where missing)
    S   = sym(P);  F = Z S Z^T + sym(H) + j I   (all p rows)
    L   = chol(F_oo);  K = S Z_o^T F_oo^{-1}
    ll  = -(k log 2 pi + log|F_oo| + v_o^T F_oo^{-1} v_o) / 2
    a_f = a + K v_o;   P_f = S - K M^T - j K K^T + j I
    a'  = T a_f + c;   P' = T P_f T^T + R sym(Q) R^T

Failure value, as in the kernel: if ``F_oo`` is not positive definite (or not finite) at step ``t``,
``loglik = -inf``, ``loglik_obs[t] = -inf``, later ``loglik_obs`` and every filtered/predicted quantity
from step ``t`` on are NaN (``forecast_error[t]``, ``forecast_error_cov[t]`` keep their values); the
gradient is NaN.

Code map: :func:`_update` (one step's update, with :func:`_chol`, :func:`_cho_solve`), :func:`_filter_scan`
(the forward scan), :func:`kalman_filter` and its ``jax.custom_vjp`` (:func:`_filter_fwd`,
:func:`_filter_bwd`), :func:`_adjoint` (the reverse scan), :func:`kalman_smoother`, :func:`register`
(PyTensor's JAX dispatch of the Ops).

Options (the Op's props): ``time_varying`` (7 flags for c, d, T, Z, R, H, Q: a time-varying matrix is a
scan input, a static one has a time axis of length 1), ``cov_jitter``, ``missing_value`` (NaN is always
missing).

Differences from the Numba kernel:

* Missing components are masked, not dropped (JAX needs static shapes): ``F_oo`` is ``F`` with the missing
  rows and columns replaced by the identity's, ``v_o`` and the missing rows of ``Z_o`` are zero.  This is
  "drop the missing components" (pymc-extras' masking): the kernel's values to rounding.
* Up to 8 observables, ``chol(F_oo)`` and its solves are unrolled element operations, and small products
  are broadcast products (:func:`iterops.jax._common.mm`): inside a ``lax.scan`` on CPU a LAPACK call or
  a ``dot`` costs more than a small matrix's arithmetic.
* No steady-state shortcut: the full recursion runs, which changes results only at the kernel's
  freezing tolerance, ``1e-14`` per entry relative to its own scale (why: ``benchmarks/RESULTS.md``, JAX section).
* Symmetric matrices are computed on the upper triangle and mirrored, as in the kernels.

Gradient (``KalmanFilterGrad`` and ``jax.grad``, one ``jax.custom_vjp``): the hand-written adjoint of
:mod:`iterops.ts._kalman_adjoint`, as a reverse ``lax.scan`` (:func:`_adjoint`).

* Cotangents of all eight outputs; each reverse step undoes a forward step's stages in the opposite order.
* Not JAX autodiff of the forward scan, which stores every intermediate of every step and is slower
  (``benchmarks/bench_jax.py``).  No steady-stretch shortcut.
* A disconnected cotangent (a JAX symbolic zero, or a zero-size placeholder from PyTensor's gradient Op)
  counts as zero and costs nothing; ``y`` gets a zero cotangent where missing.
* The Op's ``predicted_state``/``predicted_cov`` inputs are not read: the forward scan runs again.

The smoother is the Durbin-Koopman backward recursion of :mod:`iterops.ts.kalman_smoother` over the
filter's predictions (a reverse ``lax.scan``); all NaN where the filter fails.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from iterops.jax._common import mm, register_op
from iterops._constants import LOG_2PI
from iterops.ts.kalman import INPUT_NAMES, SYSTEM_NAMES

__all__ = ["KalmanOptions", "kalman_filter", "kalman_filter_vjp", "kalman_filter_hvp", "kalman_smoother"]


class KalmanOptions(NamedTuple):
    """The Op's props: which system matrices carry a time axis of length n, the jitter, the missing sentinel."""

    time_varying: tuple = (False,) * 7
    cov_jitter: float = 0.0
    missing_value: float | None = None


def _sym(X):
    return 0.5 * (X + X.T)


def _mirror_upper(X):
    """The upper triangle mirrored (what the kernels compute on one triangle)."""
    n = X.shape[0]
    i = jnp.arange(n)
    return jnp.where(i[:, None] <= i[None, :], X, X.T)


def _missing(yt, opts):
    miss = jnp.isnan(yt)
    if opts.missing_value is not None:
        miss = miss | (yt == opts.missing_value)
    return miss


def _split_system(system, opts):
    """(scan inputs of the time-varying matrices, step-0 matrices of the static ones)."""
    tv = {name: x for name, x, f in zip(SYSTEM_NAMES, system, opts.time_varying) if f}
    static = {name: x[0] for name, x, f in zip(SYSTEM_NAMES, system, opts.time_varying) if not f}
    return tv, static


class _Update(NamedTuple):
    obs: jax.Array  # (p,) bool
    v: jax.Array  # (p,) forecast error, NaN where missing
    vo: jax.Array  # (p,) v_o, zero where missing
    F: jax.Array  # (p, p) full forecast error covariance
    L: jax.Array  # (p, p) chol(F_oo) (identity on missing rows/columns)
    ok: jax.Array  # bool: F_oo positive definite and finite
    K: jax.Array  # (m, p) gain (zero columns where missing)
    Zo: jax.Array  # (p, m) Z with missing rows zeroed
    S: jax.Array  # (m, m) sym(P)
    M: jax.Array  # (m, p) S Z_o^T


#: up to this many observables, the Cholesky factor and its solves are unrolled element operations (a
#: LAPACK call per time step costs more than the arithmetic of a small matrix)
_SMALL_P = 8


def _chol(F):
    """Lower Cholesky factor (NaN where not positive definite)."""
    p = F.shape[0]
    if p > _SMALL_P:
        return jnp.linalg.cholesky(F)
    L = [[jnp.zeros((), F.dtype)] * p for _ in range(p)]
    for j in range(p):
        s = F[j, j] - sum((L[j][k] * L[j][k] for k in range(j)), jnp.zeros((), F.dtype))
        L[j][j] = jnp.sqrt(s)
        for i in range(j + 1, p):
            t = F[i, j] - sum((L[i][k] * L[j][k] for k in range(j)), jnp.zeros((), F.dtype))
            L[i][j] = t / L[j][j]
    return jnp.stack([jnp.stack(row) for row in L])


def _cho_solve(L, b):
    """``(L L^T)^{-1} b`` for ``b`` of shape (p,) or (p, k) (forward then backward substitution)."""
    p = L.shape[0]
    if p > _SMALL_P:
        return jax.scipy.linalg.cho_solve((L, True), b)
    x = [None] * p
    for i in range(p):
        x[i] = (b[i] - sum((L[i, k] * x[k] for k in range(i)), jnp.zeros_like(b[i]))) / L[i, i]
    for i in range(p - 1, -1, -1):
        x[i] = (x[i] - sum((L[k, i] * x[k] for k in range(i + 1, p)), jnp.zeros_like(b[i]))) / L[i, i]
    return jnp.stack(x)


def _update(a, P, yt, d, Z, H, opts):
    """The measurement update of one step (before the likelihood), masked for missing components."""
    p = yt.shape[0]
    jit = opts.cov_jitter
    miss = _missing(yt, opts)
    obs = ~miss
    y0 = jnp.where(obs, yt, 0.0)
    v_all = (y0 - d) - mm(Z, a)
    v = jnp.where(obs, v_all, jnp.nan)
    vo = jnp.where(obs, v_all, 0.0)
    S = _mirror_upper(_sym(P))
    PZ = mm(S, Z.T)
    eye_p = jnp.eye(p)
    F = _mirror_upper(mm(Z, PZ) + _sym(H)) + jit * eye_p
    both = obs[:, None] & obs[None, :]
    Foo = jnp.where(both, F, eye_p)
    ok = jnp.all(jnp.isfinite(Foo))
    L = _chol(jnp.where(ok, Foo, eye_p))
    ok = ok & jnp.all(jnp.isfinite(L)) & jnp.all(jnp.diagonal(L) > 0.0)
    L = jnp.where(ok, L, eye_p)
    M = jnp.where(obs[None, :], PZ, 0.0)
    K = _cho_solve(L, M.T).T
    Zo = jnp.where(obs[:, None], Z, 0.0)
    return _Update(obs, v, vo, F, L, ok, K, Zo, S, M)


def _loglik(u):
    k = jnp.sum(u.obs)
    w = _cho_solve(u.L, u.vo)
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(u.L)))
    return -0.5 * (k * LOG_2PI + logdet + jnp.sum(u.vo * w)), w


class _Residuals(NamedTuple):
    """Per-step quantities of the forward pass that its reverse reads (stacked over t; zero on missing
    components), besides the filter's outputs."""

    K: jax.Array  # (n, m, p) gain
    Finv: jax.Array  # (n, p, p) F_oo^{-1}
    w: jax.Array  # (n, p) F_oo^{-1} v_o
    failed: jax.Array  # () bool


def _filter_scan(y, a0, P0, system, opts, residuals=False):
    """The forward scan; returns ``(loglik, loglik_obs, filtered_state, filtered_cov, predicted_state,
    predicted_cov, forecast_error, forecast_error_cov)`` with NaN/-inf failure values, and with
    ``residuals`` a :class:`_Residuals` after them."""
    n, p = y.shape
    m = a0.shape[0]
    jit = opts.cov_jitter
    tv, static = _split_system(system, opts)
    eye_m = jnp.eye(m)
    nan = jnp.nan

    def step(carry, xs):
        a, P, failed = carry
        yt, tvt = xs
        st = {**static, **tvt}
        c, d, T, Z, R, H, Q = (st[name] for name in SYSTEM_NAMES)
        u = _update(a, P, yt, d, Z, H, opts)
        ll, w = _loglik(u)
        af = a + mm(u.K, u.vo)
        Pf = _mirror_upper(u.S - mm(u.K, (u.M + jit * u.K).T)) + jit * eye_m
        a_next = mm(T, af) + c
        RQ = mm(R, 0.5 * (Q + Q.T))
        P_next = _mirror_upper(mm(mm(T, Pf), T.T) + mm(RQ, R.T))
        fail_now = ~failed & ~u.ok
        dead = failed | fail_now
        ll = jnp.where(failed, nan, jnp.where(fail_now, -jnp.inf, ll))
        v = jnp.where(failed, nan, u.v)
        F = jnp.where(failed, nan, u.F)
        af, Pf, a_next, P_next = (jnp.where(dead, nan, x) for x in (af, Pf, a_next, P_next))
        out = (ll, af, Pf, a_next, P_next, v, F)
        if residuals:
            both = u.obs[:, None] & u.obs[None, :]
            Finv = jnp.where(both, _cho_solve(u.L, jnp.eye(p)), 0.0)
            out = out + (u.K, Finv, w)
        return (a_next, P_next, dead), out

    (_, _, failed), outs = lax.scan(step, (a0, P0, jnp.bool_(False)), (y, tv), length=n)
    llo, af, Pf, ap, Pp, v, F = outs[:7]
    ap = jnp.concatenate([a0[None], ap], axis=0)
    Pp = jnp.concatenate([P0[None], Pp], axis=0)
    total = jnp.where(failed, -jnp.inf, jnp.sum(jnp.where(failed, 0.0, llo)))
    result = (total, llo, af, Pf, ap, Pp, v, F)
    if residuals:
        return result, _Residuals(*outs[7:], failed)
    return result


def kalman_filter(y, a0, P0, c, d, T, Z, R, H, Q, options=KalmanOptions()):
    """The Kalman filter of one series (core shapes of :class:`~iterops.ts.kalman.KalmanFilter`: each system
    matrix with its time axis, of length n if flagged in ``options.time_varying``, else 1).

    Returns ``(loglik, loglik_obs, filtered_state, filtered_cov, predicted_state, predicted_cov,
    forecast_error, forecast_error_cov)`` in float64.  ``jax.grad`` runs the hand-written adjoint
    (:func:`_adjoint`, a ``jax.custom_vjp``: NaN gradients where the filter fails, as the Numba adjoint)."""
    f64 = jnp.float64
    inputs = tuple(jnp.asarray(x, f64) for x in (y, a0, P0, c, d, T, Z, R, H, Q))
    return _filter(options, *inputs)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _filter(options, y, a0, P0, *system):
    return _filter_scan(y, a0, P0, system, options)


def _filter_fwd(options, *primals):
    inputs = tuple(x.value for x in primals)  # symbolic_zeros: CustomVJPPrimal(value, perturbed)
    outs, res = _filter_scan(inputs[0], inputs[1], inputs[2], inputs[3:], options, residuals=True)
    return outs, (inputs, outs, res)


def _filter_bwd(options, saved, cts):
    inputs, outs, res = saved
    return _adjoint(inputs, outs, res, _cotangents(cts, outs), options)


_filter.defvjp(_filter_fwd, _filter_bwd, symbolic_zeros=True)


def _cotangents(cts, outs):
    """Output cotangents with ``None`` for a disconnected one (a JAX symbolic zero, ``None`` or, from
    PyTensor's gradient Op, a zero-size placeholder); the others float64 of their output's shape."""
    from jax.custom_derivatives import SymbolicZero

    result = []
    for g, out in zip(cts, outs):
        if g is None or isinstance(g, SymbolicZero) or (np.size(g) == 0 and out.size != 0):
            result.append(None)
        else:
            result.append(jnp.broadcast_to(jnp.asarray(g, jnp.float64), out.shape))
    return result


def kalman_filter_vjp(inputs, cotangents, options=KalmanOptions()):
    """Cotangents of the 10 inputs from the cotangents of the 8 outputs (``None`` or a zero-size array:
    disconnected, i.e. zero); all NaN when the filter fails.  Runs the forward scan (keeping its
    per-step gains) and then :func:`_adjoint`, as the Numba adjoint recomputes each step's update."""
    inputs = tuple(jnp.asarray(x, jnp.float64) for x in inputs)
    outs, res = _filter_scan(inputs[0], inputs[1], inputs[2], inputs[3:], options, residuals=True)
    return _adjoint(inputs, outs, res, _cotangents(cotangents, outs), options)


def kalman_filter_hvp(inputs, cotangents, directions, options=KalmanOptions(), with_gradient=False):
    """The second derivatives of :class:`~iterops.ts._kalman_second.KalmanFilterHVP`: ``(x_bar, J w)`` with
    ``x_bar = d/de J(x + e w)^T g`` and ``J w`` the tangents of the 8 outputs, each of its cotangent's shape (a
    zero-size placeholder gets an empty one); ``with_gradient``: then ``J(x)^T g`` (the primal of ``x_bar``).
    Forward mode (``jax.jvp``) over :func:`kalman_filter_vjp`'s scans."""
    inputs = tuple(jnp.asarray(x, jnp.float64) for x in inputs)
    directions = tuple(jnp.asarray(x, jnp.float64) for x in directions)

    def both(x):
        outs, res = _filter_scan(x[0], x[1], x[2], x[3:], options, residuals=True)
        return _adjoint(x, outs, res, _cotangents(cotangents, outs), options), outs

    (u, _), (x_bar, tangents) = jax.jvp(both, (inputs,), (directions,))
    jw = (t if np.size(g) == t.size else jnp.zeros(np.shape(g)) for g, t in zip(cotangents, tangents))
    return (*x_bar, *jw, *(u if with_gradient else ()))


def _adjoint(inputs, outs, res, cts, opts):
    r"""The reverse pass of :func:`_filter_scan`: a reverse ``lax.scan`` whose step reverses a forward
    step's stages in the opposite order (:mod:`iterops.ts._kalman_steps`: ``predict_vjp``, ``loglik_vjp``,
    ``update_vjp``, ``observe_vjp``), the output cotangents of step ``t`` joining where their output is
    made.  With ``G = sym(P'_bar)``, ``S = sym(P_f_bar)``, ``M = sym(P) Z_o^T``::

        P_f_bar = T^T G T;  a_f_bar = T^T a'_bar;  c_bar += a'_bar;  T_bar += a'_bar a_f^T + 2 G T P_f
        R_bar += G R (Q + Q^T);  Q_bar += R^T G R                     (static R, Q: once, on sum G)
        v_o_bar = -ll_bar w + K^T a_f_bar;  F_oo_bar = -ll_bar/2 (F_oo^{-1} - w w^T)
        K_bar = (-S M - 2 j S K + a_f_bar v_o^T) F_oo^{-1};  M_bar = -S K + K_bar
        X = sym(F_bar + F_oo_bar - K^T K_bar);  H_bar += X;  Z_bar += 2 X Z sym(P)
        P_bar = sym(Z^T X Z + S + M_bar Z_o);  Z_o_bar = M_bar^T sym(P)
        y_bar = v_o_bar;  d_bar -= v_o_bar;  Z_bar += Z_o_bar - v_o_bar a^T;  a_bar = a_f_bar - Z_o^T v_o_bar

    (``F_bar``: the cotangent of ``forecast_error_cov[t]``; ``v_o_bar`` also gets ``forecast_error[t]``'s,
    ``a_f_bar``, ``P_f_bar``, ``a_bar``, ``P_bar`` those of ``filtered_*[t]``, ``predicted_*[t]``.)  Missing
    components are the zero rows/columns of ``K``, ``F_oo^{-1}``, ``w``, ``Z_o``.  A static matrix's
    cotangent is summed in the scan's carry, a time-varying one is a scan output."""
    y, a0, P0, *system = inputs
    _, _, af, Pf, ap, Pp, v, _ = outs
    g_ll, g_llo, g_af, g_Pf, g_ap, g_Pp, g_v, g_F = cts
    n, p = y.shape
    m = a0.shape[0]
    jit = opts.cov_jitter
    tv, static = _split_system(system, opts)
    sum_rq = "R" in static and "Q" in static
    zero = {name: jnp.zeros_like(x) for name, x in static.items()}
    ll_bar0 = 0.0 if g_ll is None else g_ll
    per_step = {"llo": g_llo, "af": g_af, "Pf": g_Pf, "ap": None if g_ap is None else g_ap[:-1],
                "Pp": None if g_Pp is None else g_Pp[:-1], "v": g_v, "F": g_F}
    per_step = {k: x for k, x in per_step.items() if x is not None}

    def step(carry, xs):
        abar, Pbar, acc, Grq = carry
        yt, a, P, aft, Pft, vt, K, Finv, w, tvt, ct = xs
        st = {**static, **tvt}
        c, d, T, Z, R, H, Q = (st[name] for name in SYSTEM_NAMES)
        obs = ~_missing(yt, opts)
        vo = jnp.where(obs, vt, 0.0)
        Ps = _mirror_upper(_sym(P))
        Zo = jnp.where(obs[:, None], Z, 0.0)
        M = mm(Ps, Zo.T)
        gs = {}
        # predict: a' = T a_f + c, P' = T P_f T^T + R sym(Q) R^T
        G = _sym(Pbar)
        GT = mm(G, T)
        Pf_bar = mm(T.T, GT) + ct.get("Pf", 0.0)
        af_bar = mm(T.T, abar) + ct.get("af", 0.0)
        gs["c"] = abar
        gs["T"] = jnp.outer(abar, aft) + 2.0 * mm(GT, Pft)
        if sum_rq:
            Grq = Grq + G
        else:
            GR = mm(G, R)
            gs["R"] = mm(GR, Q + Q.T)
            gs["Q"] = mm(R.T, GR)
        # loglik: ll = -(k log 2 pi + log|F_oo| + v_o^T w) / 2
        ll_bar = ll_bar0 + ct.get("llo", 0.0)
        # update: P_f = Ps - K M^T - j K K^T + j I, a_f = a + K v_o, K = M F_oo^{-1}
        S = _sym(Pf_bar)
        M_bar = -mm(S, K)
        K_bar = mm(-mm(S, M) + jnp.outer(af_bar, vo) + (2.0 * jit) * M_bar, Finv)
        M_bar = M_bar + K_bar
        vo_bar = mm(K.T, af_bar) - ll_bar * w
        X = -0.5 * ll_bar * (Finv - jnp.outer(w, w)) - mm(K.T, K_bar) + ct.get("F", 0.0)
        X = _sym(X)
        gs["H"] = X
        XZ = mm(X, Z)
        P_bar_new = mm(Z.T, XZ) + S + mm(M_bar, Zo)
        # observe: v_o = y_o - d_o - Z_o a
        if "v" in ct:
            vo_bar = vo_bar + jnp.where(obs, ct["v"], 0.0)
        gs["d"] = -vo_bar
        gs["Z"] = 2.0 * mm(XZ, Ps) + mm(M_bar.T, Ps) - jnp.outer(vo_bar, a)
        abar = af_bar - mm(Zo.T, vo_bar) + ct.get("ap", 0.0)
        Pbar = _sym(P_bar_new) + ct.get("Pp", 0.0)
        acc = {name: acc[name] + gs[name] for name in acc}
        return (abar, Pbar, acc, Grq), (vo_bar, {name: gs[name] for name in tv})

    acc0 = {name: z for name, z in zero.items() if not (sum_rq and name in "RQ")}
    carry0 = (
        jnp.zeros(m) if g_ap is None else g_ap[n],
        jnp.zeros((m, m)) if g_Pp is None else g_Pp[n],
        acc0,
        jnp.zeros((m, m)),
    )
    xs = (y, ap[:-1], Pp[:-1], af, Pf, v, res.K, res.Finv, res.w, tv, per_step)
    (abar, Pbar, acc, Grq), (y_bar, g_tv) = lax.scan(step, carry0, xs, length=n, reverse=True)
    if sum_rq:
        R, Q = static["R"], static["Q"]
        GR = Grq @ R
        acc["R"] = GR @ (Q + Q.T)
        acc["Q"] = R.T @ GR
    grads = {**{name: x[None] for name, x in acc.items()}, **g_tv}
    result = (y_bar, abar, Pbar, *(grads[name] for name in SYSTEM_NAMES))
    return tuple(jnp.where(res.failed, jnp.nan, g) for g in result)


def kalman_smoother(y, a0, P0, c, d, T, Z, R, H, Q, options=KalmanOptions()):
    """``(smoothed_state (n, m), smoothed_cov (n, m, m))`` by the Durbin-Koopman backward recursion."""
    f64 = jnp.float64
    y, a0, P0 = (jnp.asarray(x, f64) for x in (y, a0, P0))
    system = tuple(jnp.asarray(x, f64) for x in (c, d, T, Z, R, H, Q))
    ll, _, _, _, ap, Pp, _, _ = _filter_scan(y, a0, P0, system, options)
    n, m = y.shape[0], a0.shape[0]
    tv, static = _split_system(system, options)
    eye_m = jnp.eye(m)

    def back(carry, xs):
        r, N = carry
        yt, a, P, tvt = xs
        st = {**static, **tvt}
        T, Z, H, d = st["T"], st["Z"], st["H"], st["d"]
        u = _update(a, P, yt, d, Z, H, options)
        _, w = _loglik(u)
        Finv = _cho_solve(u.L, jnp.eye(yt.shape[0]))
        Lt = mm(T, eye_m - mm(u.K, u.Zo))
        r = mm(u.Zo.T, w) + mm(Lt.T, r)
        N = _sym(mm(Lt.T, mm(N, Lt)) + mm(u.Zo.T, mm(Finv, u.Zo)))
        a_s = a + mm(P, r)
        P_s = _sym(P - mm(P, mm(N, P)))
        return (r, N), (a_s, P_s)

    xs = (y, ap[:-1], Pp[:-1], tv)
    _, (a_s, P_s) = lax.scan(back, (jnp.zeros(m), jnp.zeros((m, m))), xs, length=n, reverse=True)
    bad = jnp.isneginf(ll)
    return jnp.where(bad, jnp.nan, a_s), jnp.where(bad, jnp.nan, P_s)




def op_inputs(args):
    """``(filter inputs, the rest)`` of an Op's inputs: the one place that knows their layout."""
    k = len(INPUT_NAMES)
    return tuple(args[:k]), tuple(args[k:])


def register(jax_funcify):
    from iterops.ts._kalman_second import KalmanFilterHVP
    from iterops.ts.kalman import KalmanFilter, KalmanFilterGrad
    from iterops.ts.kalman_smoother import KalmanSmoother

    def options(op):
        return KalmanOptions(tuple(op.time_varying), float(op.cov_jitter), op.missing_value)

    @register_op(jax_funcify, KalmanFilter, work=jnp.float64)
    def _filter(op, node):
        opts = options(op)
        return lambda *args: kalman_filter(*op_inputs(args)[0], options=opts)

    @register_op(jax_funcify, KalmanFilterGrad, work=jnp.float64)
    def _filter_grad(op, node):
        opts = options(op)

        def kalman_filter_grad_fn(*args):
            inputs, rest = op_inputs(args)
            return kalman_filter_vjp(inputs, rest[2:], opts)  # predicted_state/_cov: recomputed

        return kalman_filter_grad_fn

    @register_op(jax_funcify, KalmanFilterHVP, work=jnp.float64)
    def _filter_hvp(op, node):
        opts = options(op)

        def kalman_filter_hvp_fn(*args):
            inputs, rest = op_inputs(args)
            return kalman_filter_hvp(inputs, rest[:8], rest[8:], opts, op.with_gradient)

        return kalman_filter_hvp_fn

    @register_op(jax_funcify, KalmanSmoother, work=jnp.float64)
    def _smoother(op, node):
        opts = options(op)
        return lambda *args: kalman_smoother(*op_inputs(args)[0], options=opts)

    from iterops.jax import kalman_diffuse  # kalman_filter(..., diffuse=...): its own module

    kalman_diffuse.register(jax_funcify)
