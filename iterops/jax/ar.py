r"""JAX implementations of the AR lattice maps of :mod:`iterops.ts.ar`: :class:`PacfToAR` (step-up),
:class:`ARToPacf` (step-down), :class:`ARToAcov` and their linearization Op :class:`ARDerivative`.

The recursions of the Numba kernels as ``lax.scan`` loops over the (static) order, in float64; the
levels ``A[k, :k+1] = phi_{k+1, 1..k+1}`` are the scan's outputs.  Failure values as the kernels: all-NaN
for ``|pacf_k| >= 1`` (pacf_to_ar), a non-stationary ``phi`` (ar_to_pacf, ar_to_acov), non-finite input
(and a non-finite ``sigma2``).

``ARDerivative`` (what PyTensor's gradient graphs of these maps and of ``levinson_durbin`` hold) is the
linearization of the same recursion: ``jax.vjp`` / ``jax.jvp`` of the lattice scans below, i.e. the
reverse (forward) pass of the recursion step by step, as the Numba kernel's hand-written
``_step_up_vjp`` / ``_step_down_vjp`` / ``_acov_vjp``; NaN where the map itself fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from iterops.jax._common import masked_reverse

__all__ = ["pacf_to_ar", "ar_to_pacf", "ar_to_acov", "ar_derivative"]


def _step_up(kappa):
    """The last level of the step-up recursion (no validity check)."""
    p = kappa.shape[0]
    j = jnp.arange(p)

    def body(phi, k):
        kap = kappa[k]
        new = jnp.where(j < k, phi - kap * masked_reverse(phi, k), phi)
        return jnp.where(j == k, kap, new), None

    phi, _ = lax.scan(body, jnp.zeros(p, kappa.dtype), jnp.arange(p))
    return phi


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


def pacf_to_ar(kappa):
    """AR(p) coefficients from partial autocorrelations; NaN unless every ``|kappa| < 1``."""
    ok = _pacf_ok(kappa)
    return jnp.where(ok, _step_up(jnp.where(ok, kappa, 0.0)), jnp.nan)


def ar_to_pacf(phi):
    """Partial autocorrelations of a stationary AR(p); NaN if ``phi`` is not stationary."""
    kappa, _, ok = _step_down(phi)
    return jnp.where(ok, kappa, jnp.nan)


def ar_to_acov(phi, sigma2, nlags):
    """gamma_0..gamma_nlags of a stationary AR(p); NaN if not stationary or not finite."""
    kappa, levels, ok = _step_down(phi)
    ok = ok & jnp.isfinite(sigma2)
    gam = _acov(jnp.where(ok, kappa, 0.0), levels, jnp.where(ok, sigma2, 1.0), nlags)
    return jnp.where(ok, gam, jnp.nan)


_MAPS = {
    "pacf_to_ar": (lambda x, nlags: _step_up(x), _pacf_ok),
    "ar_to_pacf": (lambda x, nlags: _step_down(x)[0], lambda x: _step_down(x)[2]),
    "ar_to_acov": (lambda x, nlags: _acov(*_step_down(x)[:2], 1.0, nlags), lambda x: _step_down(x)[2]),
}


def ar_derivative(fn, mode, x, v, nlags=-1):
    """``J(x)^T v`` (mode "vjp") or ``J(x) v`` ("jvp") of one lattice map at ``x``; NaN where the map fails."""
    f, valid = _MAPS[fn]
    ok = valid(x)
    x_ = jnp.where(ok, x, 0.0)
    if mode == "vjp":
        _, pull = jax.vjp(lambda z: f(z, nlags), x_)
        (out,) = pull(v)
    else:
        _, out = jax.jvp(lambda z: f(z, nlags), (x_,), (v,))
    return jnp.where(ok, out, jnp.nan)


def register(jax_funcify):
    from iterops.ts.ar import ARDerivative, ARToAcov, ARToPacf, PacfToAR

    def _vec(kernel):
        def funcify(op, node=None, **kwargs):
            out = node.outputs[0].type.dtype

            def lattice_map(x):
                return kernel(x.astype(jnp.float64)).astype(out)

            return lattice_map

        return funcify

    jax_funcify.register(PacfToAR)(_vec(pacf_to_ar))
    jax_funcify.register(ARToPacf)(_vec(ar_to_pacf))

    @jax_funcify.register(ARToAcov)
    def _ar_to_acov(op, node=None, **kwargs):
        out, nlags = node.outputs[0].type.dtype, op.nlags

        def ar_to_acov_fn(phi, sigma2):
            return ar_to_acov(phi.astype(jnp.float64), jnp.asarray(sigma2, jnp.float64), nlags).astype(out)

        return ar_to_acov_fn

    @jax_funcify.register(ARDerivative)
    def _ar_derivative(op, node=None, **kwargs):
        out, fn, mode, nlags = node.outputs[0].type.dtype, op.fn, op.mode, op.nlags

        def ar_derivative_fn(x, v):
            f64 = jnp.float64
            return ar_derivative(fn, mode, x.astype(f64), v.astype(f64), nlags).astype(out)

        return ar_derivative_fn
