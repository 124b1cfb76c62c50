r"""JAX implementation of :class:`~iterops.ts.kalman.KalmanFilterDiffuse` (``kalman_filter(..., diffuse=...)``)
and of its gradient Op :class:`~iterops.ts.kalman.KalmanFilterDiffuseGrad`.

Same equations as the Numba kernels (:mod:`iterops.ts._kalman_diffuse`): the exact initial steps, one
observed component at a time, while ``sum(P_inf ** 2) > 1e-10``; from the first step ``d`` with
``P_inf = 0``, the ordinary filter (:func:`iterops.jax.kalman.kalman_filter`) from ``(a_d, P_d)``.

Static shapes: the diffuse steps are one ``lax.scan`` over all ``n`` steps whose carry stops changing at
step ``d`` (a step after ``d`` computes and discards); the ordinary filter runs on ``y`` shifted by ``d``
rows (``y[d:]`` followed by ``d`` missing rows, time-varying matrices shifted alike, their last row
repeated), and its outputs are shifted back by a gather, so no shape depends on ``d``.  Rows ``t < d`` come
from the diffuse scan, the others from the ordinary filter.  Branches are ``jnp.where`` with safe
denominators (1 in the branch not taken), so the gradient is that of the branch taken.

Gradient: the diffuse scan is a ``jax.custom_vjp`` whose backward pass is the Numba adjoint's
(:func:`iterops.ts._kalman_diffuse.diffuse_adjoint`), not autodiff through the diffuse iterations: a reverse
``lax.scan`` over the ``n`` steps, the steps ``t >= d`` passing the cotangents through; step ``t < d``
recomputes its components from its prediction ``(a_t, P_t, P_inf,t)`` (the tape of the forward scan),
reverses the prediction ``a' = T a + c``, ``P' = T P T^T + R sym(Q) R^T``, ``P_inf' = T P_inf T^T``, adds the
cotangents of the filtered outputs, reverses the components ``p-1, ..., 0`` (``_component_vjp``: both the
diffuse and the ordinary branch, the one taken selected; missing or failing components pass through) and the
multivariate report of a step with missing components, then adds those of the step's predictions.  It starts
from the cotangents of ``(a_d, P_d)``, which the ordinary filter's own ``custom_vjp``
(:func:`iterops.jax.kalman.kalman_filter`, on the shifted series) and the gathers of the outputs give by
``jax.vjp`` of this module's glue.  NaN where the log-likelihood is ``-inf``, as the Numba adjoint
(:func:`kalman_filter_diffuse_vjp`).  Failure values as the Numba Op: ``loglik = -inf`` and NaN
outputs from the failing step on (a component with ``F_inf`` and ``F_star <= 1e-10``, a non-diagonal ``H`` in
a diffuse step), or ``loglik = -inf`` alone if ``P_inf`` is still nonzero after the last step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from iterops._constants import LOG_2PI
from iterops.jax._common import register_op
from iterops.jax.kalman import KalmanOptions, _cotangents, kalman_filter
from iterops.ts._kalman_diffuse import DIFFUSE_TOL  # statsmodels' tolerance_diffuse
from iterops.ts.kalman import SYSTEM_NAMES

__all__ = ["kalman_filter_diffuse", "kalman_filter_diffuse_vjp", "register"]

def _missing(yt, opts):
    miss = jnp.isnan(yt)
    if opts.missing_value is not None:
        miss = miss | (yt == opts.missing_value)
    return miss


def _component(yi, miss, di, z, h, a, P, Pi):
    """One component's update (as ``_kalman_diffuse._component``); ``miss``: skip it.
    Returns ``(a, P, Pi, ll, v, F, fail, extra)``, ``extra`` what :func:`_component_vjp` needs."""
    v = yi - di - z @ a
    M = P @ z
    Mi = Pi @ z
    F = z @ M + h
    Fi = z @ Mi
    finite = jnp.isfinite(F) & jnp.isfinite(Fi) & jnp.isfinite(v)
    diffuse = finite & (Fi > DIFFUSE_TOL)
    ordinary = finite & ~diffuse & (F > DIFFUSE_TOL)
    Fi_s = jnp.where(diffuse, Fi, 1.0)
    F_s = jnp.where(ordinary, F, 1.0)
    F_d = jnp.where(diffuse, F, 0.0)
    v_d = jnp.where(diffuse, v, 0.0)
    v_o = jnp.where(ordinary, v, 0.0)
    a_d = a + Mi * (v_d / Fi_s)
    P_d = P - (jnp.outer(M, Mi) + jnp.outer(Mi, M)) / Fi_s + jnp.outer(Mi, Mi) * (F_d / (Fi_s * Fi_s))
    Pi_d = Pi - jnp.outer(Mi, Mi) / Fi_s
    ll_d = -0.5 * (LOG_2PI + jnp.log(Fi_s))
    a_o = a + M * (v_o / F_s)
    P_o = P - jnp.outer(M, M) / F_s
    ll_o = -0.5 * (LOG_2PI + jnp.log(F_s) + v_o * v_o / F_s)
    take_d = diffuse & ~miss
    take_o = ordinary & ~miss
    a = jnp.where(take_d, a_d, jnp.where(take_o, a_o, a))
    P = jnp.where(take_d, P_d, jnp.where(take_o, P_o, P))
    Pi = jnp.where(take_d, Pi_d, Pi)
    ll = jnp.where(take_d, ll_d, jnp.where(take_o, ll_o, 0.0))
    fail = ~miss & ~(diffuse | ordinary)
    extra = (M, Mi, F, Fi, diffuse, ordinary, take_d | take_o, v)
    return a, P, Pi, ll, jnp.where(miss, jnp.nan, v), jnp.where(miss, 0.0, F), fail, extra


def _diffuse_scan(y, a0, P0, Pinf, system, opts):
    """The diffuse steps: per-step outputs (rows ``t < d``; zero from row ``d`` on), ``d``, ``(a_d, P_d)``,
    failure flags.  A ``jax.custom_vjp`` whose reverse is :func:`_diffuse_bwd` (the Numba adjoint's)."""
    return _diffuse_core(opts)(y, a0, P0, Pinf, system)


@functools.lru_cache(maxsize=None)
def _diffuse_core(opts):
    @jax.custom_vjp
    def core(y, a0, P0, Pinf, system):
        return _diffuse_fwd(y, a0, P0, Pinf, system, opts)[0]

    def fwd(y, a0, P0, Pinf, system):
        return _diffuse_fwd(y, a0, P0, Pinf, system, opts)

    def bwd(res, cts):
        return _diffuse_bwd(res, cts, opts)

    core.defvjp(fwd, bwd)
    return core


def _system_at(system, opts, t_slice):
    """The matrices of one step from the per-step slices ``t_slice`` of the time-varying ones."""
    tv = dict(zip([k for k, f in zip(SYSTEM_NAMES, opts.time_varying) if f], t_slice))
    return tuple(tv[k] if f else x[0] for k, x, f in zip(SYSTEM_NAMES, system, opts.time_varying))


def _step_components(yt, miss, st, a, P, Pi):
    """The components of one diffuse step (forward), keeping what the reverse needs."""
    c, dd, T, Z, R, H, Q = st
    p = yt.shape[0]
    ll = 0.0
    fail = jnp.any(jnp.where(~jnp.eye(p, dtype=bool), H != 0.0, False))
    tape = []
    for i in range(p):
        before = (a, P, Pi)
        a, P, Pi, ll_i, v_i, F_i, f_i, extra = _component(yt[i], miss[i], dd[i], Z[i], H[i, i], a, P, Pi)
        tape.append((before, extra, v_i, F_i))
        ll = ll + ll_i
        fail = fail | f_i
    return a, P, Pi, ll, fail, tape


def _diffuse_fwd(y, a0, P0, Pinf, system, opts):
    n, p = y.shape
    tv = tuple(x for x, f in zip(system, opts.time_varying) if f)

    def step(carry, xs):
        a, P, Pi, active, d, failed = carry
        yt, tvt, t = xs
        st = _system_at(system, opts, tvt)
        c, dd, T, Z, R, H, Q = st
        active = active & (jnp.sum(Pi * Pi) > DIFFUSE_TOL)
        miss = _missing(yt, opts)
        af, Pf, Pif, ll, fail, tape = _step_components(yt, miss, st, a, P, Pi)
        v_seq = jnp.stack([e[2] for e in tape])
        F_diag = jnp.diag(jnp.stack([e[3] for e in tape]))
        # a step with missing components: statsmodels' multivariate report
        y0 = jnp.where(miss, 0.0, yt)
        v_mv = jnp.where(miss, jnp.nan, y0 - dd - Z @ a)
        F_mv = Z @ jnp.where(t == 0, P0, P) @ Z.T + H  # P0 itself at step 0, as the Numba kernel
        any_miss = jnp.any(miss)
        v_out = jnp.where(any_miss, v_mv, v_seq)
        F_out = jnp.where(any_miss, F_mv, F_diag)
        a_next, P_next, Pi_next = _predict(af, Pf, Pif, T, c, R, Q)
        fail_now = active & fail & ~failed
        go = active & ~fail & ~failed
        # rows t < d: the step's outputs; zero from row d on (not used, no cotangent), except the sequential
        # v, F of a failing step (as the Numba kernel, which stops before the multivariate report)
        v_out = jnp.where(fail_now, v_seq, jnp.where(go, v_out, 0.0))
        F_out = jnp.where(fail_now, F_diag, jnp.where(go, F_out, 0.0))
        outs = (*(jnp.where(go, x, 0.0) for x in (ll, af, Pf, a, P)), v_out, F_out)
        carry = (
            jnp.where(go, a_next, a), jnp.where(go, P_next, P), jnp.where(go, Pi_next, Pi), go,
            d + go.astype(d.dtype), failed | fail_now,
        )
        return carry, (outs, (a, P, Pi))

    Ps, Pis = 0.5 * (P0 + P0.T), 0.5 * (Pinf + Pinf.T)
    init = (a0, Ps, Pis, jnp.bool_(True), jnp.int32(0), jnp.bool_(False))
    (a_d, P_d, Pi_d, _, d, failed), (outs, tape) = lax.scan(step, init, (y, tv, jnp.arange(n)), length=n)
    ended = jnp.sum(Pi_d * Pi_d) <= DIFFUSE_TOL
    primal = (outs, d, a_d, P_d, failed, ended)
    return primal, (y, a0, P0, Pinf, system, tape, d)


def _predict(af, Pf, Pif, T, c, R, Q):
    """a' = T a + c, P' = T P T^T + R sym(Q) R^T, P_inf' = T P_inf T^T."""
    Qs = 0.5 * (Q + Q.T)
    return T @ af + c, T @ Pf @ T.T + R @ Qs @ R.T, T @ Pif @ T.T


def _predict_vjp(af, Pf, Pif, T, R, Q, a_bar, P_bar, Pi_bar):
    """Reverse of :func:`_predict` (as ``_kalman_diffuse._predict_vjp``): the cotangents of
    ``(a_f, P_f, P_inf,f)`` and of ``(T, c, R, Q)``."""
    Qs = 0.5 * (Q + Q.T)
    T_bar = (jnp.outer(a_bar, af) + P_bar @ T @ Pf.T + P_bar.T @ T @ Pf + Pi_bar @ T @ Pif.T
             + Pi_bar.T @ T @ Pif)
    R_bar = (P_bar + P_bar.T) @ R @ Qs
    Qs_bar = R.T @ P_bar @ R
    Q_bar = 0.5 * (Qs_bar + Qs_bar.T)
    return T.T @ a_bar, T.T @ P_bar @ T, T.T @ Pi_bar @ T, T_bar, a_bar, R_bar, Q_bar


def _component_vjp(ex, v, z, a, P, Pi, ll_bar, v_bar, F_bar, a_bar, P_bar, Pi_bar):
    """Reverse of :func:`_component` (as ``_kalman_diffuse._component_vjp``), both branches computed and the
    one taken selected; a skipped (missing or failing) component passes the cotangents through.
    Returns ``(a_bar, P_bar, Pi_bar, v_bar, h_bar, z_bar)`` (``y``: ``v_bar``, ``d``: ``-v_bar``)."""
    M, Mi, F, Fi, diffuse, ordinary, take, _ = ex
    Fi_s = jnp.where(diffuse, Fi, 1.0)
    F_s = jnp.where(ordinary, F, 1.0)
    v_s = jnp.where(take, v, 0.0)
    Gs = P_bar + P_bar.T
    Gi = Pi_bar + Pi_bar.T
    # diffuse branch
    g = v_s / Fi_s
    s2 = F / (Fi_s * Fi_s)
    g_bar = a_bar @ Mi
    M_bar_d = -(Gs @ Mi) / Fi_s
    Mi_bar_d = a_bar * g - (Gs @ M) / Fi_s + s2 * (Gs @ Mi) - (Gi @ Mi) / Fi_s
    q = M @ P_bar @ Mi + Mi @ P_bar @ M
    s_bar = Mi @ P_bar @ Mi
    qi = Mi @ Pi_bar @ Mi
    F2 = Fi_s * Fi_s
    F_bar_d = F_bar + s_bar / F2
    Fi_bar_d = q / F2 - 2.0 * s_bar * F / (F2 * Fi_s) + qi / F2 - g_bar * v_s / F2 - 0.5 * ll_bar / Fi_s
    v_bar_d = v_bar + g_bar / Fi_s
    # ordinary branch
    go = v_s / F_s
    g_bar_o = a_bar @ M
    M_bar_o = a_bar * go - (Gs @ M) / F_s
    s_bar_o = M @ P_bar @ M
    F_bar_o = F_bar + s_bar_o / (F_s * F_s) - g_bar_o * v_s / (F_s * F_s) + ll_bar * (
        -0.5 / F_s + 0.5 * v_s * v_s / (F_s * F_s))
    v_bar_o = v_bar + g_bar_o / F_s - ll_bar * v_s / F_s
    M_bar = jnp.where(diffuse, M_bar_d, M_bar_o)
    Mi_bar = jnp.where(diffuse, Mi_bar_d, 0.0)
    F_bar = jnp.where(diffuse, F_bar_d, F_bar_o)
    Fi_bar = jnp.where(diffuse, Fi_bar_d, 0.0)
    v_bar = jnp.where(diffuse, v_bar_d, v_bar_o)
    # F = z M + h, F_inf = z M_inf, M = P z, M_inf = P_inf z, v = y - d - z a
    M_bar = M_bar + F_bar * z
    Mi_bar = Mi_bar + Fi_bar * z
    z_bar = F_bar * M + Fi_bar * Mi - v_bar * a + P.T @ M_bar + Pi.T @ Mi_bar
    a_new = a_bar - v_bar * z
    P_new = P_bar + jnp.outer(M_bar, z)
    Pi_new = Pi_bar + jnp.outer(Mi_bar, z)
    return (jnp.where(take, a_new, a_bar), jnp.where(take, P_new, P_bar), jnp.where(take, Pi_new, Pi_bar),
            jnp.where(take, v_bar, 0.0), jnp.where(take, F_bar, 0.0), jnp.where(take, z_bar, 0.0))


def _diffuse_bwd(res, cts, opts):
    """Reverse of the diffuse steps ``d-1, ..., 0`` (``_kalman_diffuse.diffuse_adjoint``) as a reverse
    ``lax.scan`` over all ``n`` steps, steps ``t >= d`` passing the cotangents through: each step recomputes
    its components from its prediction (the tape), reverses the prediction, adds the filtered outputs'
    cotangents, reverses the components ``p-1, ..., 0`` and the multivariate report of a step with missing
    components, then adds the prediction outputs' cotangents."""
    y, a0, P0, Pinf, system, (A, PP, PPi), d = res
    (llo_b, af_b, Pf_b, ap_b, Pp_b, v_b, F_b), _, a_bar, P_bar, _, _ = cts
    n, p = y.shape
    m = a0.shape[0]
    tv = tuple(x for x, f in zip(system, opts.time_varying) if f)

    def step(carry, xs):
        a_bar, P_bar, Pi_bar, P0_raw_bar = carry
        yt, tvt, t, a, P, Pi, llb, afb, Pfb, apb, Ppb, vb, Fb = xs
        st = _system_at(system, opts, tvt)
        c, dd, T, Z, R, H, Q = st
        miss = _missing(yt, opts)
        af, Pf, Pif, _, _, tape = _step_components(yt, miss, st, a, P, Pi)
        a_b, P_b, Pi_b, T_bar, c_bar, R_bar, Q_bar = _predict_vjp(af, Pf, Pif, T, R, Q, a_bar, P_bar, Pi_bar)
        a_b = a_b + afb
        P_b = P_b + Pfb
        any_miss = jnp.any(miss)
        Z_bar = jnp.zeros_like(Z)
        d_bar = jnp.zeros_like(dd)
        H_bar = jnp.zeros_like(H)
        y_bar = jnp.zeros_like(yt)
        for i in range(p - 1, -1, -1):
            (ai, Pi_i, Pii), ex, _, _ = tape[i]
            v_i = ex[-1]
            vo = jnp.where(any_miss, 0.0, vb[i])
            Fo = jnp.where(any_miss, 0.0, Fb[i, i])
            a_b, P_b, Pi_b, vbar, hbar, zbar = _component_vjp(ex, v_i, Z[i], ai, Pi_i, Pii, llb, vo, Fo, a_b, P_b,
                                                              Pi_b)
            y_bar = y_bar.at[i].add(vbar)
            d_bar = d_bar.at[i].add(-vbar)
            H_bar = H_bar.at[i, i].add(hbar)
            Z_bar = Z_bar.at[i].add(zbar)
        # the multivariate report of a step with missing components: v = y - d - Z a, F = Z P_t Z^T + H
        gv = jnp.where(any_miss & ~miss, vb, 0.0)
        gF = jnp.where(any_miss, Fb, 0.0)
        Pm = jnp.where(t == 0, P0, P)
        y_bar = y_bar + gv
        d_bar = d_bar - gv
        Z_bar = Z_bar - jnp.outer(gv, a) + gF @ Z @ Pm.T + gF.T @ Z @ Pm
        H_bar = H_bar + gF
        a_b = a_b - Z.T @ gv
        Pm_bar = Z.T @ gF @ Z
        P_b = P_b + jnp.where(t == 0, 0.0, Pm_bar)
        P0r = P0_raw_bar + jnp.where(t == 0, Pm_bar, 0.0)
        # this step's prediction outputs (row 0: the carry sym(P0))
        a_b = a_b + apb
        P_b = P_b + Ppb
        on = t < d
        new = (jnp.where(on, a_b, a_bar), jnp.where(on, P_b, P_bar), jnp.where(on, Pi_b, Pi_bar),
               jnp.where(on, P0r, P0_raw_bar))
        gsys = tuple(jnp.where(on, g, 0.0) for g in (c_bar, d_bar, T_bar, Z_bar, R_bar, H_bar, Q_bar))
        return new, (jnp.where(on, y_bar, 0.0), gsys)

    init = (a_bar, P_bar, jnp.zeros((m, m)), jnp.zeros((m, m)))
    xs = (y, tv, jnp.arange(n), A, PP, PPi, llo_b, af_b, Pf_b, ap_b, Pp_b, v_b, F_b)
    (a_bar, P_bar, Pi_bar, P0_raw_bar), (y_bar, gsys) = lax.scan(step, init, xs, reverse=True)
    sym = lambda X: 0.5 * (X + X.T)  # noqa: E731
    g_system = tuple(g if f else jnp.sum(g, axis=0, keepdims=True) for g, f in zip(gsys, opts.time_varying))
    return y_bar, a_bar, sym(P_bar) + P0_raw_bar, sym(Pi_bar), g_system


def _shift(x, d, n, fill=None):
    """Rows ``d, d+1, ...`` of ``x`` (n rows), the last row repeated (or ``fill``) past the end."""
    s = jnp.arange(n) + d
    out = jnp.take(x, jnp.minimum(s, n - 1), axis=0)
    if fill is not None:
        out = jnp.where((s < n).reshape((n,) + (1,) * (x.ndim - 1)), out, fill)
    return out


def _filter(y, a0, P0, Pinf, system, opts):
    n = y.shape[0]
    (llo_d, af_d, Pf_d, ap_d, Pp_d, v_d, F_d), d, a_d, P_d, failed, ended = _diffuse_scan(y, a0, P0, Pinf, system,
                                                                                            opts)
    # P0 itself at row 0 (the scan carries sym(P0)), as the Numba Op
    Pp_d = Pp_d.at[0].set(P0)
    y_s = _shift(y, d, n, jnp.nan)
    sys_s = tuple(_shift(x, d, n) if f else x for x, f in zip(system, opts.time_varying))
    P_hand = jnp.where(d == 0, P0, P_d)
    ll_o, llo_o, af_o, Pf_o, ap_o, Pp_o, v_o, F_o = kalman_filter(y_s, a_d, P_hand, *sys_s, options=opts)
    t = jnp.arange(n)
    idx = jnp.clip(t - d, 0, n - 1)
    diff = t < d

    def merge(xd, xo):
        w = diff.reshape((n,) + (1,) * (xd.ndim - 1))
        return jnp.where(w, xd, jnp.take(xo, idx, axis=0))

    llo = merge(llo_d, llo_o)
    af, Pf, v, F = merge(af_d, af_o), merge(Pf_d, Pf_o), merge(v_d, v_o), merge(F_d, F_o)
    t1 = jnp.arange(n + 1)
    idx1 = jnp.clip(t1 - d, 0, n)
    w1 = t1 < d
    ap = jnp.where(w1[:, None], jnp.concatenate([ap_d, a_d[None]]), jnp.take(ap_o, idx1, axis=0))
    Pp = jnp.where(w1[:, None, None], jnp.concatenate([Pp_d, P_d[None]]), jnp.take(Pp_o, idx1, axis=0))
    total = jnp.sum(jnp.where(diff, llo_d, 0.0)) + ll_o
    # failure in a diffuse step (d = that step): -inf there, NaN after; P_inf not ended: -inf
    nan = jnp.nan
    llo = jnp.where(failed, jnp.where(t == d, -jnp.inf, jnp.where(t > d, nan, llo)), llo)
    af = jnp.where(failed & (t >= d)[:, None], nan, af)
    Pf = jnp.where(failed & (t >= d)[:, None, None], nan, Pf)
    v = jnp.where(failed & (t > d)[:, None], nan, v)
    F = jnp.where(failed & (t > d)[:, None, None], nan, F)
    v = jnp.where((failed & (t == d))[:, None], v_d, v)  # the failing step's own v, F
    F = jnp.where((failed & (t == d))[:, None, None], F_d, F)
    ap = jnp.where(failed & (t1 > d)[:, None], nan, ap)
    Pp = jnp.where(failed & (t1 > d)[:, None, None], nan, Pp)
    total = jnp.where(failed | ~ended, -jnp.inf, total)
    return total, llo, af, Pf, ap, Pp, v, F


def kalman_filter_diffuse(y, a0, P0, Pinf, c, d, T, Z, R, H, Q, options=KalmanOptions()):
    """The exact diffuse filter of one series (core shapes of :class:`~iterops.ts.kalman.KalmanFilterDiffuse`);
    the 8 outputs of :func:`iterops.jax.kalman.kalman_filter`, in float64."""
    f64 = jnp.float64
    y, a0, P0, Pinf = (jnp.asarray(x, f64) for x in (y, a0, P0, Pinf))
    system = tuple(jnp.asarray(x, f64) for x in (c, d, T, Z, R, H, Q))
    return _filter(y, a0, P0, Pinf, system, options)


def kalman_filter_diffuse_vjp(inputs, cotangents, options=KalmanOptions()):
    """Cotangents of the 11 inputs from those of the 8 outputs (``None`` or zero-size: zero); NaN on failure."""
    inputs = tuple(jnp.asarray(x, jnp.float64) for x in inputs)
    outs, pull = jax.vjp(lambda y, a0, P0, Pinf, *system: _filter(y, a0, P0, Pinf, system, options), *inputs)
    cts = [jnp.zeros_like(out) if g is None else g for g, out in zip(_cotangents(cotangents, outs), outs)]
    grads = pull(tuple(cts))
    failed = jnp.isneginf(outs[0])
    return tuple(jnp.where(failed, jnp.nan, g) for g in grads)


def register(jax_funcify):
    from iterops.ts.kalman import KalmanFilterDiffuse, KalmanFilterDiffuseGrad

    def options(op):
        return KalmanOptions(tuple(op.time_varying), 0.0, op.missing_value)

    @register_op(jax_funcify, KalmanFilterDiffuse, work=jnp.float64)
    def _filter_op(op, node):
        opts = options(op)
        return lambda *inputs: kalman_filter_diffuse(*inputs, options=opts)

    @register_op(jax_funcify, KalmanFilterDiffuseGrad, work=jnp.float64)
    def _grad_op(op, node):
        opts = options(op)
        # inputs (11), predicted_state and predicted_cov (recomputed), the 8 output cotangents
        return lambda *args: kalman_filter_diffuse_vjp(args[:11], args[13:], opts)
