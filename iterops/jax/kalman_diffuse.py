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

Gradient: ``jax.vjp`` of that function (through the ordinary filter's own ``custom_vjp``); NaN where the
log-likelihood is ``-inf``, as the Numba adjoint.  Failure values as the Numba Op: ``loglik = -inf`` and NaN
outputs from the failing step on (a component with ``F_inf`` and ``F_star <= 1e-10``, a non-diagonal ``H`` in
a diffuse step), or ``loglik = -inf`` alone if ``P_inf`` is still nonzero after the last step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from iterops.jax.kalman import KalmanOptions, kalman_filter

__all__ = ["kalman_filter_diffuse", "kalman_filter_diffuse_vjp", "register"]

LOG_2PI = float(np.log(2.0 * np.pi))
TOL = 1e-10  # statsmodels' tolerance_diffuse, as iterops.ts._kalman_diffuse.DIFFUSE_TOL
NAMES = ("c", "d", "T", "Z", "R", "H", "Q")


def _missing(yt, opts):
    miss = jnp.isnan(yt)
    if opts.missing_value is not None:
        miss = miss | (yt == opts.missing_value)
    return miss


def _component(yi, miss, di, z, h, a, P, Pi):
    """One component's update (as ``_kalman_diffuse._component``); ``miss``: skip it.
    Returns ``(a, P, Pi, ll, v, F, fail)``."""
    v = yi - di - z @ a
    M = P @ z
    Mi = Pi @ z
    F = z @ M + h
    Fi = z @ Mi
    finite = jnp.isfinite(F) & jnp.isfinite(Fi) & jnp.isfinite(v)
    diffuse = finite & (Fi > TOL)
    ordinary = finite & ~diffuse & (F > TOL)
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
    return a, P, Pi, ll, jnp.where(miss, jnp.nan, v), jnp.where(miss, 0.0, F), fail


def _diffuse_scan(y, a0, P0, Pinf, system, opts):
    """The diffuse steps: per-step outputs (valid for rows ``t < d``), ``d``, ``(a_d, P_d)``, failure flags."""
    n, p = y.shape
    tv = {k: x for k, x, f in zip(NAMES, system, opts.time_varying) if f}
    static = {k: x[0] for k, x, f in zip(NAMES, system, opts.time_varying) if not f}
    off_diag = ~jnp.eye(p, dtype=bool)

    def step(carry, xs):
        a, P, Pi, active, d, failed = carry
        yt, tvt, t = xs
        st = {**static, **tvt}
        c, dd, T, Z, R, H, Q = (st[k] for k in NAMES)
        active = active & (jnp.sum(Pi * Pi) > TOL)
        miss = _missing(yt, opts)
        af, Pf, Pif = a, P, Pi
        ll = 0.0
        vs, Fs = [], []
        fail = jnp.any(jnp.where(off_diag, H != 0.0, False))
        for i in range(p):
            af, Pf, Pif, ll_i, v_i, F_i, f_i = _component(yt[i], miss[i], dd[i], Z[i], H[i, i], af, Pf, Pif)
            ll = ll + ll_i
            vs.append(v_i)
            Fs.append(F_i)
            fail = fail | f_i
        v_seq, F_diag = jnp.stack(vs), jnp.diag(jnp.stack(Fs))
        # a step with missing components: statsmodels' multivariate report
        y0 = jnp.where(miss, 0.0, yt)
        v_mv = jnp.where(miss, jnp.nan, y0 - dd - Z @ a)
        F_mv = Z @ jnp.where(t == 0, P0, P) @ Z.T + H  # P0 itself at step 0, as the Numba kernel
        any_miss = jnp.any(miss)
        v_out = jnp.where(any_miss, v_mv, v_seq)
        F_out = jnp.where(any_miss, F_mv, F_diag)
        Qs = 0.5 * (Q + Q.T)
        a_next = T @ af + c
        P_next = T @ Pf @ T.T + R @ Qs @ R.T
        Pi_next = T @ Pif @ T.T
        fail_now = active & fail & ~failed
        go = active & ~fail & ~failed
        outs = (jnp.where(fail_now, -jnp.inf, ll), af, Pf, a, P, v_out, F_out)
        carry = (
            jnp.where(go, a_next, a), jnp.where(go, P_next, P), jnp.where(go, Pi_next, Pi), go,
            d + go.astype(d.dtype), failed | fail_now,
        )
        return carry, outs

    Ps, Pis = 0.5 * (P0 + P0.T), 0.5 * (Pinf + Pinf.T)
    init = (a0, Ps, Pis, jnp.bool_(True), jnp.int32(0), jnp.bool_(False))
    (a_d, P_d, Pi_d, _, d, failed), outs = lax.scan(step, init, (y, tv, jnp.arange(n)), length=n)
    ended = jnp.sum(Pi_d * Pi_d) <= TOL
    return outs, d, a_d, P_d, failed, ended


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
    cts = []
    for g, out in zip(cotangents, outs):
        if g is None or (np.size(g) == 0 and out.size != 0):
            cts.append(jnp.zeros_like(out))
        else:
            cts.append(jnp.broadcast_to(jnp.asarray(g, jnp.float64), out.shape))
    grads = pull(tuple(cts))
    failed = jnp.isneginf(outs[0])
    return tuple(jnp.where(failed, jnp.nan, g) for g in grads)


def register(jax_funcify):
    from iterops.ts.kalman import KalmanFilterDiffuse, KalmanFilterDiffuseGrad

    def options(op):
        return KalmanOptions(tuple(op.time_varying), 0.0, op.missing_value)

    @jax_funcify.register(KalmanFilterDiffuse)
    def _filter_op(op, node=None, **kwargs):
        opts = options(op)

        def kalman_filter_diffuse_fn(*inputs):
            return kalman_filter_diffuse(*inputs, options=opts)

        return kalman_filter_diffuse_fn

    @jax_funcify.register(KalmanFilterDiffuseGrad)
    def _grad_op(op, node=None, **kwargs):
        opts = options(op)

        def kalman_filter_diffuse_grad_fn(*args):
            inputs, cots = args[:11], args[13:]
            return kalman_filter_diffuse_vjp(inputs, cots, opts)

        return kalman_filter_diffuse_grad_fn
