r"""JAX implementations of the Levinson-Durbin Ops: :class:`~iterops.ts.levinson.LevinsonDurbin`,
:class:`~iterops.ts.levinson.AutoCov`, and the loop replica
:class:`~iterops.ts.levinson_recursion.LevinsonRecursion` with its gradient Op.

Each is the Numba kernel's recursion as a ``lax.scan`` over the order ``k`` (the order is static), with
the inner sums over ``j < k`` written as masked vector operations.  Failure values as the kernels:
``levinson_durbin`` returns all-NaN for ``gamma_0 <= 0``, a non-positive-definite Toeplitz matrix
(``v_k <= 0``), non-finite input or ``m < order + 1``; the loop replica has no failure of its own (its
arithmetic, inf/NaN where the loop has them), except all-NaN when ``gamma`` is shorter than
``order + 1``; ``acovf`` gives NaN for lags ``>= n``.

Gradients: ``LevinsonDurbin``'s pullback is its gradient Op :class:`~iterops.ts.levinson.LevinsonDurbinGrad`
(here :func:`levinson_durbin_vjp`: a symmetric Toeplitz solve by :mod:`iterops.jax.toeplitz` and diagonal
sums), with :class:`~iterops.ts.ar.ARDerivative` for a ``pacf`` cotangent (:mod:`iterops.jax.ar`);
``AutoCov``'s is PyTensor's (convolutions).
``LevinsonRecursionGrad`` (and ``jax.grad`` of
:func:`levinson_recursion`, a ``jax.custom_vjp``) is the Numba kernel's hand-written adjoint: the forward
scan again keeping its tape (``phi^(k)``, ``v_k`` entering each step), then a reverse ``lax.scan`` of
:func:`_step_vjp`, the adjoint of :func:`_step` written next to it (disconnected cotangents count as
zero).  ``v_form`` (how the loop spells ``v (1 - kappa^2)``) is followed as the kernel does.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from iterops.jax._common import masked_reverse, register_op

__all__ = ["levinson_recursion", "levinson_recursion_vjp", "levinson_durbin", "levinson_durbin_vjp", "acovf"]


def _numerator(gamma, k, phi):
    """``gamma[k + 1] - sum_{j<k} phi[j] gamma[k - j]``."""
    p = phi.shape[0]
    j = jnp.arange(p)
    g = gamma[jnp.clip(k - j, 0, gamma.shape[0] - 1)]
    return gamma[k + 1] - jnp.sum(jnp.where(j < k, phi * g, 0))


def _new_v(v, kappa, v_form):
    """``v (1 - kappa^2)`` as the loop spells it (:data:`iterops.ts.levinson_recursion.V_UPDATES`)."""
    if v_form == 1:
        return v - (kappa * kappa) * v
    if v_form == 2:
        return v * (1 - kappa) * (1 + kappa)
    return v * (1 - kappa * kappa)


def _step(gamma, k, phi, v, v_form=0):
    """Step ``k`` of Durbin's recursion: ``(new phi, new v, kappa)``."""
    kappa = _numerator(gamma, k, phi) / v
    j = jnp.arange(phi.shape[0])
    new = jnp.where(j < k, phi - kappa * masked_reverse(phi, k), phi)
    new = jnp.where(j == k, kappa, new)
    return new, _new_v(v, kappa, v_form), kappa


def _step_vjp(gamma, k, phi, v, kappa, phi_bar, v_bar, kappa_bar, gamma_bar):
    """Adjoint of :func:`_step` (:func:`iterops.ts.levinson_recursion._step_vjp`): from the cotangents
    of the step's new ``phi``, new ``v`` and its ``kappa``, those of ``phi`` and ``v`` entering it, with
    ``gamma_bar`` accumulated.  Returns ``(phi_bar, v_bar, gamma_bar)``."""
    n, p = gamma.shape[0], phi.shape[0]
    j = jnp.arange(p)
    low = j < k
    v_bar_in = v_bar * (1 - kappa * kappa)  # v_new = v (1 - kappa^2)
    kb = kappa_bar - (v_bar * v) * (kappa + kappa)
    kb = kb + phi_bar[k]  # new_phi[k] = kappa
    kb = kb - jnp.sum(jnp.where(low, phi_bar * masked_reverse(phi, k), 0))  # new_phi[:k] = phi - kappa phi[::-1]
    phi_bar = jnp.where(low, phi_bar - kappa * masked_reverse(phi_bar, k), 0)  # I - kappa R is symmetric
    num = _numerator(gamma, k, phi)  # kappa = num / v
    num_bar = kb / v
    v_bar_in = v_bar_in - (kb * num) / (v * v)
    # num = gamma[k + 1] - sum_{j<k} phi[j] gamma[k - j]
    lag = jnp.clip(k - j, 0, n - 1)
    phi_bar = phi_bar - jnp.where(low, num_bar * gamma[lag], 0)
    gamma_bar = gamma_bar.at[k + 1].add(num_bar).at[lag].add(jnp.where(low, -num_bar * phi, 0))
    return phi_bar, v_bar_in, gamma_bar


def _recursion(gamma, order, v_form=0):
    """``(phi, v, kappa)`` and the tape ``(phi^(k), v_k)`` entering each step."""

    def body(c, k):
        phi, v = c
        new, v_new, kappa = _step(gamma, k, phi, v, v_form)
        return (new, v_new), (kappa, phi, v)

    (phi, v), (kappa, phis, vs) = lax.scan(body, (jnp.zeros(order, gamma.dtype), gamma[0]), jnp.arange(order))
    return (phi, v, kappa), (phis, vs)


def _short(gamma, order):
    return gamma.shape[0] < order + 1


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def levinson_recursion(gamma, order, v_form=0):
    """The user's Levinson loop on one ``gamma`` (n,), in its dtype: ``(phi (order,), sigma2, kappa (order,))``.

    ``jax.grad`` runs :func:`levinson_recursion_vjp` (the hand-written adjoint, a ``jax.custom_vjp``)."""
    if _short(gamma, order):
        nan = jnp.full(order, jnp.nan, gamma.dtype)
        return nan, jnp.asarray(jnp.nan, gamma.dtype), nan
    if order == 0:
        return jnp.zeros(0, gamma.dtype), gamma[0], jnp.zeros(0, gamma.dtype)
    return _recursion(gamma, order, v_form)[0]


def _recursion_fwd(gamma, order, v_form):
    return levinson_recursion(gamma, order, v_form), gamma


def _recursion_bwd(order, v_form, gamma, cts):
    return (levinson_recursion_vjp(gamma, order, *cts, v_form=v_form),)


levinson_recursion.defvjp(_recursion_fwd, _recursion_bwd)


def levinson_recursion_vjp(gamma, order, phi_bar, v_bar, kappa_bar, v_form=0):
    """``gamma_bar`` (n,) from the cotangents of ``(phi, sigma2, kappa)``: the forward scan again, keeping
    its tape, then a reverse ``lax.scan`` of :func:`_step_vjp` over ``k = order-1..0``, and
    ``gamma_bar[0] += v_bar_0`` (as :func:`iterops.ts.levinson_recursion.levinson_recursion_vjp_kernel`)."""
    dt = gamma.dtype
    if _short(gamma, order):
        return jnp.full(gamma.shape, jnp.nan, dt)
    phi_bar, v_bar, kappa_bar = (jnp.asarray(x).astype(dt) for x in (phi_bar, v_bar, kappa_bar))
    gamma_bar = jnp.zeros_like(gamma)
    if order == 0:
        return gamma_bar.at[0].add(v_bar)
    (_, _, kappa), (phis, vs) = _recursion(gamma, order, v_form)

    def back(c, xs):
        phi_bar, v_bar, gamma_bar = c
        k, phi, v, kap, kb = xs
        return _step_vjp(gamma, k, phi, v, kap, phi_bar, v_bar, kb, gamma_bar), None

    xs = (jnp.arange(order), phis, vs, kappa, jnp.broadcast_to(kappa_bar, (order,)))
    (_, v_bar, gamma_bar), _ = lax.scan(back, (jnp.broadcast_to(phi_bar, (order,)), v_bar, gamma_bar), xs,
                                        reverse=True)
    return gamma_bar.at[0].add(v_bar)


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

    acov, phi = res
    phi_bar, sigma2_bar, pacf_bar = cts
    phi_bar = phi_bar + ar_derivative("ar_to_pacf", "vjp", phi, pacf_bar)
    return (levinson_durbin_vjp(acov, phi, phi_bar, sigma2_bar, order),)


def levinson_durbin_vjp(acov, phi, phi_bar, sigma2_bar, order):
    """``acov_bar`` from the cotangents of ``phi`` (pacf's included) and ``sigma2``, as
    :class:`~iterops.ts.levinson.LevinsonDurbinGrad`: ``lam = Gamma_p^{-1} (phi_bar - sigma2_bar gamma_{1:p})``
    (a symmetric Toeplitz solve), then the symmetric diagonal sums of ``-lam phi^T``."""
    from iterops.jax.toeplitz import diagonal_sums, solve_toeplitz

    p = order
    lam = solve_toeplitz(acov[:p], acov[:p], (phi_bar - sigma2_bar * acov[1 : p + 1])[:, None])[:, 0]
    acov_bar = jnp.zeros_like(acov).at[0].add(sigma2_bar).at[1 : p + 1].add(-sigma2_bar * phi)
    S = diagonal_sums(-jnp.outer(lam, phi))  # S[p - 1 + d]: diagonal i - j = d
    sym = S[p - 1 :] + jnp.concatenate([jnp.zeros(1), S[: p - 1][::-1]])
    return acov_bar.at[:p].add(sym).at[1 : p + 1].add(lam)


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
    from iterops.ts.levinson import AutoCov, LevinsonDurbin, LevinsonDurbinGrad
    from iterops.ts.levinson_recursion import LevinsonRecursion, LevinsonRecursionGrad

    f64 = jnp.float64

    @register_op(jax_funcify, LevinsonRecursion)  # in the loop's dtype
    def _recursion_fn(op, node):
        return lambda gamma: levinson_recursion(gamma, op.order, op.v_form)

    @register_op(jax_funcify, LevinsonRecursionGrad)
    def _recursion_grad_fn(op, node):
        return lambda gamma, *cts: levinson_recursion_vjp(gamma, op.order, *cts, v_form=op.v_form)

    @register_op(jax_funcify, LevinsonDurbin, work=f64)
    def _durbin_fn(op, node):
        return lambda acov: levinson_durbin(acov, op.order)

    @register_op(jax_funcify, LevinsonDurbinGrad, work=f64)
    def _durbin_grad_fn(op, node):
        return lambda acov, phi, phi_bar, sigma2_bar: levinson_durbin_vjp(acov, phi, phi_bar, sigma2_bar, op.order)

    @register_op(jax_funcify, AutoCov, work=f64)
    def _acov_fn(op, node):
        return lambda x: acovf(x, op.nlags, op.adjusted)
