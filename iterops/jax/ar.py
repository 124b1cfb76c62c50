r"""JAX implementations of the AR lattice maps of :mod:`iterops.ts.ar`: :class:`PacfToAR` (step-up),
:class:`ARToPacf` (step-down), :class:`ARToAcov` and their linearization Op :class:`ARDerivative`.

The recursions of the Numba kernels as ``lax.scan`` loops over the (static) order, in float64; the
levels ``A[k, :k+1] = phi_{k+1, 1..k+1}`` are the scan's outputs.  Failure values as the kernels: all-NaN
for ``|pacf_k| >= 1`` (pacf_to_ar), a non-stationary ``phi`` (ar_to_pacf, ar_to_acov), non-finite input
(and a non-finite ``sigma2``).

``ARDerivative`` (what PyTensor's gradient graphs of these maps and of ``levinson_durbin`` hold), and
``jax.grad`` of the three maps (each a ``jax.custom_vjp``), are the Numba kernel's hand-written
linearizations of the same recursions: ``_step_up_vjp`` / ``_step_up_jvp``, ``_step_down_vjp`` /
``_step_down_jvp``, ``_acov_vjp`` / ``_acov_jvp``, each a ``lax.scan`` next to the recursion it reverses
(not JAX autodiff of the scans); NaN where the map itself fails.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from iterops.jax._common import masked_reverse, register_op

__all__ = ["pacf_to_ar", "ar_to_pacf", "ar_to_acov", "ar_derivative"]


def _prev(levels):
    """Row k: level k - 1 (zeros for k = 0)."""
    return jnp.concatenate([jnp.zeros_like(levels[:1]), levels[:-1]], axis=0)


def _step_up_levels(kappa):
    """Levels ``A[k, :k+1] = phi_{k+1, 1..k+1}`` of the step-up recursion (no validity check)."""
    p = kappa.shape[0]
    j = jnp.arange(p)

    def body(phi, k):
        kap = kappa[k]
        new = jnp.where(j < k, phi - kap * masked_reverse(phi, k), phi)
        new = jnp.where(j == k, kap, new)
        return new, new

    _, levels = lax.scan(body, jnp.zeros(p, kappa.dtype), jnp.arange(p))
    return levels


def _step_up(kappa):
    """The last level of the step-up recursion (no validity check)."""
    if kappa.shape[0] == 0:
        return kappa
    return _step_up_levels(kappa)[-1]


def _step_up_vjp(kappa, A, phi_bar):
    """Cotangent of ``kappa`` from that of the last level (:func:`iterops.ts.ar._step_up_vjp`): for
    ``k = p-1..0``, ``kappa_bar_k = g_k - sum_{i<k} g_i phi_{k-1,k-1-i}``, ``g_i <- g_i - kappa_k g_{k-1-i}``."""
    p = kappa.shape[0]
    j = jnp.arange(p)

    def back(g, xs):
        k, kap, prev = xs
        low = j < k
        kb = g[k] - jnp.sum(jnp.where(low, g * masked_reverse(prev, k), 0.0))
        return jnp.where(low, g - kap * masked_reverse(g, k), 0.0), kb

    _, kappa_bar = lax.scan(back, phi_bar, (j, kappa, _prev(A)), reverse=True)
    return kappa_bar


def _step_up_jvp(kappa, A, kappa_dot):
    """Tangent of the last level given ``kappa_dot`` (:func:`iterops.ts.ar._step_up_jvp`):
    ``d_{k,j} = d_{k-1,j} - kappa_dot_k phi_{k-1,k-1-j} - kappa_k d_{k-1,k-1-j}``, ``d_{k,k} = kappa_dot_k``."""
    p = kappa.shape[0]
    j = jnp.arange(p)

    def body(d, xs):
        k, kap, kd, prev = xs
        new = jnp.where(j < k, d - kd * masked_reverse(prev, k) - kap * masked_reverse(d, k), 0.0)
        return jnp.where(j == k, kd, new), None

    d, _ = lax.scan(body, jnp.zeros(p), (j, kappa, kappa_dot, _prev(A)))
    return d


def _pacf_ok(kappa):
    return jnp.all(jnp.abs(kappa) < 1.0)  # False for NaN


def _step_down(phi):
    """``(kappa, levels (p, p), ok)`` of the step-down recursion from ``phi`` (p,)."""
    p = phi.shape[0]
    j = jnp.arange(p)

    def body(c, k):
        level, ok = c
        kap = level[k]
        ok = ok & (jnp.abs(kap) < 1.0)
        d = jnp.where(ok, 1.0 - kap * kap, 1.0)  # keep a failed recursion finite (its result is NaN)
        lower = jnp.where(j < k, (level + kap * masked_reverse(level, k)) / d, 0.0)
        return (lower, ok), (level, kap)

    (_, ok), (levels, kappa) = lax.scan(body, (phi, jnp.bool_(True)), jnp.arange(p - 1, -1, -1))
    return kappa[::-1], levels[::-1], ok


def _step_down_vjp(A, kappa_bar, level_bar):
    """Cotangent of ``phi`` from those of ``kappa`` and of every level (:func:`iterops.ts.ar._step_down_vjp`):
    for ``k = 0..p-1`` (``g``: cotangent of level k-1, ``d = 1 - kappa_k^2``),
    ``g'_k = level_bar_{k,k} + kappa_bar_k + sum_{j<k} g_j (phi_{k,k-1-j} + 2 kappa_k phi_{k-1,j}) / d``,
    ``g'_i = level_bar_{k,i} + (g_i + kappa_k g_{k-1-i}) / d`` (i < k)."""
    p = kappa_bar.shape[0]
    j = jnp.arange(p)

    def body(g, xs):
        k, level, prev, kb, lb = xs
        kap = level[k]
        d = 1.0 - kap * kap
        low = j < k
        kb = lb[k] + kb + jnp.sum(jnp.where(low, g * (masked_reverse(level, k) + 2.0 * kap * prev), 0.0)) / d
        new = jnp.where(low, lb + (g + kap * masked_reverse(g, k)) / d, 0.0)
        return jnp.where(j == k, kb, new), None

    g, _ = lax.scan(body, jnp.zeros(p), (j, A, _prev(A), kappa_bar, level_bar))
    return g


def _step_down_jvp(A, phi_dot):
    """``(kappa_dot, level tangents D)`` given ``phi_dot`` (:func:`iterops.ts.ar._step_down_jvp`): for
    ``k = p-1..0``, ``kd = D_{k,k}``, ``D_{k-1,j} = (D_{k,j} + kd phi_{k,k-1-j} + kappa_k D_{k,k-1-j}
    + 2 kappa_k kd phi_{k-1,j}) / (1 - kappa_k^2)``."""
    p = phi_dot.shape[0]
    j = jnp.arange(p)

    def body(D, xs):
        k, level, prev = xs
        kap, kd = level[k], D[k]
        lower = (D + kd * masked_reverse(level, k) + kap * masked_reverse(D, k) + 2.0 * kap * kd * prev)
        lower = jnp.where(j < k, lower / (1.0 - kap * kap), 0.0)
        return lower, (D, kd)

    _, (D, kappa_dot) = lax.scan(body, phi_dot, (j, A, _prev(A)), reverse=True)
    return kappa_dot, D


def _acov(kappa, levels, sigma2, nlags):
    """gamma_0..gamma_nlags from the lattice levels."""
    p = kappa.shape[0]
    gam = jnp.zeros(nlags + 1).at[0].set(sigma2 / jnp.prod(1.0 - kappa * kappa))
    if p == 0 or nlags == 0:
        return gam
    jj = jnp.arange(1, p + 1)

    def body(gam, m):
        q = jnp.minimum(m, p)
        row = levels[q - 1]  # phi_{q, 1..p} (zeros beyond q)
        terms = jnp.where(jj <= q, row * gam[jnp.clip(m - jj, 0, nlags)], 0.0)
        return gam.at[m].set(jnp.sum(terms)), None

    gam, _ = lax.scan(body, gam, jnp.arange(1, nlags + 1))
    return gam


def _acov_vjp(kappa, A, gam, gam_bar):
    """``(kappa_bar, level_bar)`` of :func:`_acov` with ``sigma2`` fixed (:func:`iterops.ts.ar._acov_vjp`): for
    ``m = nlags..1``, ``q = min(m, p)``: ``level_bar_{q-1,j-1} += gb_m gamma_{m-j}``, ``gb_{m-j} += gb_m
    phi_{q,j}``; then ``kappa_bar_k = 2 gb_0 gamma_0 kappa_k / (1 - kappa_k^2)``."""
    p = kappa.shape[0]
    nlags = gam.shape[0] - 1
    level_bar = jnp.zeros((p, p))
    gb = gam_bar
    if p > 0 and nlags > 0:
        jj = jnp.arange(1, p + 1)

        def back(c, m):
            gb, level_bar = c
            q = jnp.minimum(m, p)
            use = jj <= q
            lag = jnp.clip(m - jj, 0, nlags)
            level_bar = level_bar.at[q - 1].add(jnp.where(use, gb[m] * gam[lag], 0.0))
            gb = gb.at[lag].add(jnp.where(use, gb[m] * A[q - 1], 0.0))
            return (gb, level_bar), None

        (gb, level_bar), _ = lax.scan(back, (gb, level_bar), jnp.arange(1, nlags + 1), reverse=True)
    return gb[0] * gam[0] * 2.0 * kappa / (1.0 - kappa * kappa), level_bar


def _acov_jvp(kappa, A, gam, kappa_dot, D):
    """Tangent of :func:`_acov` (``sigma2`` fixed) from those of ``kappa`` and the levels
    (:func:`iterops.ts.ar._acov_jvp`)."""
    p = kappa.shape[0]
    nlags = gam.shape[0] - 1
    gd = jnp.zeros(nlags + 1).at[0].set(gam[0] * jnp.sum(2.0 * kappa * kappa_dot / (1.0 - kappa * kappa)))
    if p == 0 or nlags == 0:
        return gd
    jj = jnp.arange(1, p + 1)

    def body(gd, m):
        q = jnp.minimum(m, p)
        lag = jnp.clip(m - jj, 0, nlags)
        terms = jnp.where(jj <= q, D[q - 1] * gam[lag] + A[q - 1] * gd[lag], 0.0)
        return gd.at[m].set(jnp.sum(terms)), None

    gd, _ = lax.scan(body, gd, jnp.arange(1, nlags + 1))
    return gd


@jax.custom_vjp
def pacf_to_ar(kappa):
    """AR(p) coefficients from partial autocorrelations; NaN unless every ``|kappa| < 1``.  ``jax.grad``:
    :func:`ar_derivative` (the hand-written step-up adjoint)."""
    ok = _pacf_ok(kappa)
    return jnp.where(ok, _step_up(jnp.where(ok, kappa, 0.0)), jnp.nan)


pacf_to_ar.defvjp(lambda x: (pacf_to_ar(x), x), lambda x, g: (ar_derivative("pacf_to_ar", "vjp", x, g),))


@jax.custom_vjp
def ar_to_pacf(phi):
    """Partial autocorrelations of a stationary AR(p); NaN if ``phi`` is not stationary.  ``jax.grad``:
    :func:`ar_derivative` (the hand-written step-down adjoint)."""
    kappa, _, ok = _step_down(phi)
    return jnp.where(ok, kappa, jnp.nan)


ar_to_pacf.defvjp(lambda x: (ar_to_pacf(x), x), lambda x, g: (ar_derivative("ar_to_pacf", "vjp", x, g),))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def ar_to_acov(phi, sigma2, nlags):
    """gamma_0..gamma_nlags of a stationary AR(p); NaN if not stationary or not finite.  ``jax.grad``: as the
    Op's pullback, ``phi_bar = sigma2 J^T g`` (:func:`ar_derivative`), ``sigma2_bar = g . gamma(phi, 1)``."""
    kappa, levels, ok = _step_down(phi)
    ok = ok & jnp.isfinite(sigma2)
    gam = _acov(jnp.where(ok, kappa, 0.0), levels, jnp.where(ok, sigma2, 1.0), nlags)
    return jnp.where(ok, gam, jnp.nan)


def _ar_to_acov_fwd(phi, sigma2, nlags):
    return ar_to_acov(phi, sigma2, nlags), (phi, sigma2)


def _ar_to_acov_bwd(nlags, res, g):
    phi, sigma2 = res
    phi_bar = sigma2 * ar_derivative("ar_to_acov", "vjp", phi, g, nlags)
    return phi_bar, jnp.sum(g * ar_to_acov(phi, jnp.ones_like(sigma2), nlags)).astype(jnp.result_type(sigma2))


ar_to_acov.defvjp(_ar_to_acov_fwd, _ar_to_acov_bwd)


def ar_derivative(fn, mode, x, v, nlags=-1):
    """``J(x)^T v`` (mode "vjp") or ``J(x) v`` ("jvp") of one lattice map at ``x`` (``ar_to_acov`` with
    ``sigma2 = 1``), by the hand-written reverse (forward) passes above, as
    :func:`iterops.ts.ar.ar_derivative_kernel`; NaN where the map fails."""
    p = x.shape[0]
    if p == 0:  # an empty map: J is (0, 0), or (nlags + 1, 0) for ar_to_acov
        return jnp.zeros(nlags + 1 if (fn == "ar_to_acov" and mode == "jvp") else 0)
    if fn == "pacf_to_ar":
        ok = _pacf_ok(x)
        x_ = jnp.where(ok, x, 0.0)
        A = _step_up_levels(x_)
        out = _step_up_vjp(x_, A, v) if mode == "vjp" else _step_up_jvp(x_, A, v)
        return jnp.where(ok, out, jnp.nan)
    _, _, ok = _step_down(x)
    kappa, A, _ = _step_down(jnp.where(ok, x, 0.0))
    if fn == "ar_to_pacf":
        out = _step_down_vjp(A, v, jnp.zeros((p, p))) if mode == "vjp" else _step_down_jvp(A, v)[0]
    elif mode == "vjp":
        gam = _acov(kappa, A, 1.0, nlags)
        out = _step_down_vjp(A, *_acov_vjp(kappa, A, gam, v))
    else:
        gam = _acov(kappa, A, 1.0, nlags)
        out = _acov_jvp(kappa, A, gam, *_step_down_jvp(A, v))
    return jnp.where(ok, out, jnp.nan)


def register(jax_funcify):
    from iterops.ts.ar import ARDerivative, ARToAcov, ARToPacf, PacfToAR

    f64 = jnp.float64
    register_op(jax_funcify, PacfToAR, work=f64)(lambda op, node: pacf_to_ar)
    register_op(jax_funcify, ARToPacf, work=f64)(lambda op, node: ar_to_pacf)

    @register_op(jax_funcify, ARToAcov, work=f64)
    def _ar_to_acov(op, node):
        return lambda phi, sigma2: ar_to_acov(phi, sigma2, op.nlags)

    @register_op(jax_funcify, ARDerivative, work=f64)
    def _ar_derivative(op, node):
        return lambda x, v: ar_derivative(op.fn, op.mode, x, v, op.nlags)
