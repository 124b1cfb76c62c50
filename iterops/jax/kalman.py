r"""JAX implementations of the Kalman Ops: :class:`~iterops.ts.kalman.KalmanFilter`, its gradient Op
:class:`~iterops.ts.kalman.KalmanFilterGrad`, and :class:`~iterops.ts.kalman_smoother.KalmanSmoother`.

Same model, notation and arithmetic as :mod:`iterops.ts.kalman` (Durbin & Koopman; statsmodels' layout),
one ``lax.scan`` over the time steps; per step ``t`` (``o`` the observed components, ``j`` the jitter)::

    v   = y_t - d_t - Z_t a                     (NaN where missing)
    S   = sym(P);  F = Z S Z^T + sym(H) + j I   (all p rows)
    L   = chol(F_oo);  K = S Z_o^T F_oo^{-1}
    ll  = -(k log 2 pi + log|F_oo| + v_o^T F_oo^{-1} v_o) / 2
    a_f = a + K v_o;   P_f = S - K M^T - j K K^T + j I
    a'  = T a_f + c;   P' = T P_f T^T + R sym(Q) R^T

The observed subset has a data-dependent size, which JAX cannot index with static shapes, so missing
components are masked instead of dropped: ``F_oo`` is ``F`` with the missing rows and columns replaced by
those of the identity (its Cholesky factor is then ``chol(F_oo)`` on the observed block and the identity
elsewhere, with the same determinant), ``v_o`` and the missing rows of ``Z_o`` are zero.  That is exactly
"drop the missing components" (pymc-extras' masking), so the values are those of the Numba kernel to
rounding.  Symmetric matrices are computed on the upper triangle and mirrored, as the kernels do.  For up
to 4 observables the Cholesky factor of ``F_oo`` and its solves are unrolled element operations (a LAPACK
call per time step costs more than a small matrix's arithmetic).  The
steady-state shortcut of the Numba kernel (freezing ``P`` once converged to ``1e-14``) is not taken: the
full recursion runs, which changes results only at that relative level.

Options (the Op's props): ``time_varying`` (7 flags for c, d, T, Z, R, H, Q: a time-varying matrix is a
scan input, a static one has a time axis of length 1), ``cov_jitter``, ``missing_value`` (NaN is always
missing).

Failure is a value, as in the kernel: if ``F_oo`` is not positive definite (or not finite) at step ``t``,
``loglik = -inf``, ``loglik_obs[t] = -inf``, later ``loglik_obs`` and every filtered/predicted quantity
from step ``t`` on are NaN (``forecast_error[t]``, ``forecast_error_cov[t]`` keep their values); the
gradient is NaN.

Gradient (``KalmanFilterGrad``): the reverse-mode adjoint of this recursion for the cotangents of all
eight outputs, computed as the reverse pass of the ``lax.scan`` (``jax.vjp``: the stored per-step values
play the role of the Numba adjoint's recomputed updates).  It is the same exact adjoint of the same
steps as :mod:`iterops.ts._kalman_adjoint` (without its steady-state stretch shortcut); a disconnected
cotangent reaches the Op as a zero-size placeholder and counts as zero; ``y`` gets a zero cotangent where
missing.  The Op's ``predicted_state``/``predicted_cov`` inputs are not needed (the scan recomputes them).

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

__all__ = ["KalmanOptions", "kalman_filter", "kalman_filter_vjp", "kalman_smoother"]

LOG_2PI = float(np.log(2.0 * np.pi))
SYSTEM_NAMES = ("c", "d", "T", "Z", "R", "H", "Q")


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
_SMALL_P = 4


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
    v_all = (y0 - d) - Z @ a
    v = jnp.where(obs, v_all, jnp.nan)
    vo = jnp.where(obs, v_all, 0.0)
    S = _mirror_upper(_sym(P))
    PZ = S @ Z.T
    eye_p = jnp.eye(p)
    F = _mirror_upper(Z @ PZ + _sym(H)) + jit * eye_p
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
    return -0.5 * (k * LOG_2PI + logdet + u.vo @ w), w


def _filter_scan(y, a0, P0, system, opts):
    """The forward scan; returns ``(loglik, FilterResult tuple)`` with NaN/-inf failure values."""
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
        ll, _ = _loglik(u)
        af = a + u.K @ u.vo
        Pf = _mirror_upper(u.S - u.K @ (u.M + jit * u.K).T) + jit * eye_m
        a_next = T @ af + c
        RQ = R @ (0.5 * (Q + Q.T))
        P_next = _mirror_upper((T @ Pf) @ T.T + RQ @ R.T)
        fail_now = ~failed & ~u.ok
        dead = failed | fail_now
        ll = jnp.where(failed, nan, jnp.where(fail_now, -jnp.inf, ll))
        v = jnp.where(failed, nan, u.v)
        F = jnp.where(failed, nan, u.F)
        af, Pf, a_next, P_next = (jnp.where(dead, nan, x) for x in (af, Pf, a_next, P_next))
        return (a_next, P_next, dead), (ll, af, Pf, a_next, P_next, v, F)

    (_, _, failed), (llo, af, Pf, ap, Pp, v, F) = lax.scan(step, (a0, P0, jnp.bool_(False)), (y, tv), length=n)
    ap = jnp.concatenate([a0[None], ap], axis=0)
    Pp = jnp.concatenate([P0[None], Pp], axis=0)
    total = jnp.where(failed, -jnp.inf, jnp.sum(jnp.where(failed, 0.0, llo)))
    return total, llo, af, Pf, ap, Pp, v, F


def kalman_filter(y, a0, P0, c, d, T, Z, R, H, Q, options=KalmanOptions()):
    """The Kalman filter of one series (core shapes of :class:`~iterops.ts.kalman.KalmanFilter`: each system
    matrix with its time axis, of length n if flagged in ``options.time_varying``, else 1).

    Returns ``(loglik, loglik_obs, filtered_state, filtered_cov, predicted_state, predicted_cov,
    forecast_error, forecast_error_cov)`` in float64.  ``jax.grad`` runs :func:`kalman_filter_vjp` (a
    ``jax.custom_vjp``: NaN gradients where the filter fails, as the Numba adjoint)."""
    f64 = jnp.float64
    inputs = tuple(jnp.asarray(x, f64) for x in (y, a0, P0, c, d, T, Z, R, H, Q))
    return _filter(options, *inputs)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _filter(options, y, a0, P0, *system):
    return _filter_scan(y, a0, P0, system, options)


def _filter_fwd(options, *inputs):
    return _filter(options, *inputs), inputs


def _filter_bwd(options, inputs, cts):
    return kalman_filter_vjp(inputs, cts, options)


_filter.defvjp(_filter_fwd, _filter_bwd)


def kalman_filter_vjp(inputs, cotangents, options=KalmanOptions()):
    """Cotangents of the 10 inputs from the cotangents of the 8 outputs (``None`` or a zero-size array:
    disconnected, i.e. zero); all NaN when the filter fails."""
    inputs = tuple(jnp.asarray(x, jnp.float64) for x in inputs)
    outs, pull = jax.vjp(lambda y, a0, P0, *system: _filter_scan(y, a0, P0, system, options), *inputs)
    cts = []
    for g, out in zip(cotangents, outs):
        if g is None or (np.size(g) == 0 and out.size != 0):
            cts.append(jnp.zeros_like(out))
        else:
            cts.append(jnp.broadcast_to(jnp.asarray(g, jnp.float64), out.shape))
    grads = pull(tuple(cts))
    failed = jnp.isneginf(outs[0])
    return tuple(jnp.where(failed, jnp.nan, g) for g in grads)


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
        Lt = T @ (eye_m - u.K @ u.Zo)
        r = u.Zo.T @ w + Lt.T @ r
        N = _sym(Lt.T @ (N @ Lt) + u.Zo.T @ (Finv @ u.Zo))
        a_s = a + P @ r
        P_s = _sym(P - P @ (N @ P))
        return (r, N), (a_s, P_s)

    xs = (y, ap[:-1], Pp[:-1], tv)
    _, (a_s, P_s) = lax.scan(back, (jnp.zeros(m), jnp.zeros((m, m))), xs, length=n, reverse=True)
    bad = jnp.isneginf(ll)
    return jnp.where(bad, jnp.nan, a_s), jnp.where(bad, jnp.nan, P_s)


def register(jax_funcify):
    from iterops.ts.kalman import KalmanFilter, KalmanFilterGrad
    from iterops.ts.kalman_smoother import KalmanSmoother

    def options(op):
        return KalmanOptions(tuple(op.time_varying), float(op.cov_jitter), op.missing_value)

    @jax_funcify.register(KalmanFilter)
    def _filter(op, node=None, **kwargs):
        opts = options(op)

        def kalman_filter_fn(*inputs):
            return kalman_filter(*inputs, options=opts)

        return kalman_filter_fn

    @jax_funcify.register(KalmanFilterGrad)
    def _filter_grad(op, node=None, **kwargs):
        opts = options(op)

        def kalman_filter_grad_fn(*args):
            inputs, cots = args[:10], args[12:]
            return kalman_filter_vjp(inputs, cots, opts)

        return kalman_filter_grad_fn

    @jax_funcify.register(KalmanSmoother)
    def _smoother(op, node=None, **kwargs):
        opts = options(op)

        def kalman_smoother_fn(*inputs):
            return kalman_smoother(*inputs, options=opts)

        return kalman_smoother_fn

    from iterops.jax import kalman_diffuse  # kalman_filter(..., diffuse=...): its own module

    kalman_diffuse.register(jax_funcify)
