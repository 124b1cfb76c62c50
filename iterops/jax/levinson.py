r"""JAX implementations of the Levinson-Durbin Ops: :class:`~iterops.ts.levinson.LevinsonDurbin`,
:class:`~iterops.ts.levinson.AutoCov`, and the loop replica
:class:`~iterops.ts.levinson_recursion.LevinsonRecursion` with its gradient Op.

Each is the Numba kernel's recursion as a ``lax.scan`` over the order ``k`` (the order is static), with
the inner sums over ``j < k`` written as masked vector operations.  Failure values as the kernels:
``levinson_durbin`` returns all-NaN for ``gamma_0 <= 0``, a non-positive-definite Toeplitz matrix
(``v_k <= 0``), non-finite input or ``m < order + 1``; the loop replica has no failure of its own (its
arithmetic, inf/NaN where the loop has them), except all-NaN when ``gamma`` is shorter than
``order + 1``; ``acovf`` gives NaN for lags ``>= n``.

Gradients: ``LevinsonDurbin`` and ``AutoCov`` are differentiated by PyTensor (implicit Toeplitz solve,
convolutions), so a JAX gradient graph holds :class:`~iterops.ts.toeplitz.SolveToeplitz` and
:class:`~iterops.ts.ar.ARDerivative` (see :mod:`iterops.jax.toeplitz`, :mod:`iterops.jax.ar`).
``LevinsonRecursionGrad`` is the reverse pass of the recursion as run: the reverse-mode derivative of
the ``lax.scan`` below (``jax.vjp``), the same exact adjoint of the same steps as the Numba kernel's
hand-written ``_step_vjp`` (disconnected cotangents count as zero).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from iterops.jax._common import cast_outputs, masked_reverse

__all__ = ["levinson_recursion", "levinson_recursion_vjp", "levinson_durbin", "acovf"]


def _numerator(gamma, k, phi):
    """``gamma[k + 1] - sum_{j<k} phi[j] gamma[k - j]``."""
    p = phi.shape[0]
    j = jnp.arange(p)
    g = gamma[jnp.clip(k - j, 0, gamma.shape[0] - 1)]
    return gamma[k + 1] - jnp.sum(jnp.where(j < k, phi * g, 0))


def _step(gamma, k, phi, v):
    """Step ``k`` of Durbin's recursion: ``(new phi, new v, kappa)``."""
    kappa = _numerator(gamma, k, phi) / v
    j = jnp.arange(phi.shape[0])
    new = jnp.where(j < k, phi - kappa * masked_reverse(phi, k), phi)
    new = jnp.where(j == k, kappa, new)
    return new, v * (1 - kappa * kappa), kappa


def _recursion(gamma, order):
    def body(c, k):
        phi, v = c
        phi, v, kappa = _step(gamma, k, phi, v)
        return (phi, v), kappa

    (phi, v), kappa = lax.scan(body, (jnp.zeros(order, gamma.dtype), gamma[0]), jnp.arange(order))
    return phi, v, kappa


def levinson_recursion(gamma, order):
    """The user's Levinson loop on one ``gamma`` (n,), in its dtype: ``(phi (order,), sigma2, kappa (order,))``."""
    if gamma.shape[0] < order + 1:
        nan = jnp.full(order, jnp.nan, gamma.dtype)
        return nan, jnp.asarray(jnp.nan, gamma.dtype), nan
    if order == 0:
        return jnp.zeros(0, gamma.dtype), gamma[0], jnp.zeros(0, gamma.dtype)
    return _recursion(gamma, order)


def levinson_recursion_vjp(gamma, order, phi_bar, v_bar, kappa_bar):
    """``gamma_bar`` (n,) from the cotangents of ``(phi, sigma2, kappa)``."""
    if gamma.shape[0] < order + 1:
        return jnp.full(gamma.shape, jnp.nan, gamma.dtype)
    _, vjp = jax.vjp(lambda g: levinson_recursion(g, order), gamma)
    dt = gamma.dtype
    (g,) = vjp((phi_bar.astype(dt), jnp.asarray(v_bar, dt), kappa_bar.astype(dt)))
    return g


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def levinson_durbin(acov, order):
    """Durbin's recursion on float64 ``acov`` (m,): ``(phi, sigma2, pacf)``, all NaN on failure.

    ``jax.grad`` follows the Op's pullback: the implicit function theorem on ``Gamma_p phi = gamma_{1:p}``
    (a symmetric Toeplitz solve), ``sigma2 = gamma_0 - gamma_{1:p} . phi`` directly, ``pacf = ar_to_pacf(phi)``
    through its linearization."""
    return _durbin(acov, order)


def _durbin_fwd(acov, order):
    out = _durbin(acov, order)
    return out, (acov, out[0])


def _durbin_bwd(order, res, cts):
    from iterops.jax.ar import ar_derivative
    from iterops.jax.toeplitz import diagonal_sums, solve_toeplitz

    acov, phi = res
    phi_bar, sigma2_bar, pacf_bar = cts
    p = order
    phi_total = phi_bar + ar_derivative("ar_to_pacf", "vjp", phi, pacf_bar) - sigma2_bar * acov[1 : p + 1]
    acov_bar = jnp.zeros_like(acov).at[0].add(sigma2_bar).at[1 : p + 1].add(-sigma2_bar * phi)
    lam = solve_toeplitz(acov[:p], acov[:p], phi_total[:, None])[:, 0]
    S = diagonal_sums(-jnp.outer(lam, phi))  # S[p - 1 + d]: diagonal i - j = d
    sym = S[p - 1 :] + jnp.concatenate([jnp.zeros(1), S[: p - 1][::-1]])
    return (acov_bar.at[:p].add(sym).at[1 : p + 1].add(lam),)


levinson_durbin.defvjp(_durbin_fwd, _durbin_bwd)


def _durbin(acov, order):
    p = order
    nan = (jnp.full(p, jnp.nan), jnp.asarray(jnp.nan), jnp.full(p, jnp.nan))
    if acov.shape[0] < p + 1:
        return nan
    a = acov[: p + 1]
    ok = jnp.all(jnp.isfinite(a)) & (a[0] > 0.0)
    a = jnp.where(ok, a, jnp.where(jnp.arange(p + 1) == 0, 1.0, 0.0))  # keep the loop finite

    def body(c, k):
        phi, v, good = c
        phi, v, kappa = _step(a, k, phi, v)
        return (phi, v, good & (v > 0.0)), kappa

    (phi, v, good), pacf = lax.scan(body, (jnp.zeros(p), a[0], ok), jnp.arange(p))
    return tuple(jnp.where(good, x, n) for x, n in zip((phi, v, pacf), nan))


def acovf(x, nlags, adjusted=False):
    """``sum_t x[t+k] x[t] / d_k`` for k = 0..nlags (float64), NaN for ``k >= n``."""
    n = x.shape[0]
    out = []
    for k in range(nlags + 1):
        if k >= n:
            out.append(jnp.asarray(jnp.nan))
        else:
            out.append(jnp.dot(x[k:], x[: n - k]) / ((n - k) if adjusted else n))
    return jnp.stack(out) if out else jnp.zeros(0)


def register(jax_funcify):
    from iterops.ts.levinson import AutoCov, LevinsonDurbin
    from iterops.ts.levinson_recursion import LevinsonRecursion, LevinsonRecursionGrad

    @jax_funcify.register(LevinsonRecursion)
    def _recursion_fn(op, node=None, **kwargs):
        order, dt = op.order, node.outputs[0].type.dtype

        def levinson_recursion_fn(gamma):
            return cast_outputs(node, levinson_recursion(gamma.astype(dt), order))

        return levinson_recursion_fn

    @jax_funcify.register(LevinsonRecursionGrad)
    def _recursion_grad_fn(op, node=None, **kwargs):
        order, dt = op.order, node.outputs[0].type.dtype

        def levinson_recursion_grad_fn(gamma, phi_bar, v_bar, kappa_bar):
            return cast_outputs(node, levinson_recursion_vjp(gamma.astype(dt), order, phi_bar, v_bar, kappa_bar))

        return levinson_recursion_grad_fn

    @jax_funcify.register(LevinsonDurbin)
    def _durbin_fn(op, node=None, **kwargs):
        order = op.order

        def levinson_durbin_fn(acov):
            return cast_outputs(node, levinson_durbin(acov.astype(jnp.float64), order))

        return levinson_durbin_fn

    @jax_funcify.register(AutoCov)
    def _acov_fn(op, node=None, **kwargs):
        nlags, adjusted = op.nlags, op.adjusted

        def autocov_fn(x):
            return cast_outputs(node, acovf(x.astype(jnp.float64), nlags, adjusted))

        return autocov_fn
