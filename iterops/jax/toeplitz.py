r"""JAX implementation of :class:`~iterops.ts.toeplitz.SolveToeplitz`: ``toeplitz(c, r) x = b`` by Levinson's
recursion, as :func:`iterops.ts.toeplitz.levinson_kernel` (forward and backward vectors grown one order
at a time in a ``lax.fori_loop``, every right-hand side updated in the same step), in float64.

Failure values as the kernel: all-NaN ``x`` when a pivot (``c[0]`` or ``1 - eps_f eps_g``) is zero or
not finite, an input is not finite or the result is not finite.  The gradient is PyTensor's implicit
graph (another :class:`SolveToeplitz` with the transposed matrix, and ``convolve1d``, which PyTensor's JAX
backend supports)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from iterops.jax._common import register_op

__all__ = ["solve_toeplitz", "diagonal_sums"]


@jax.custom_vjp
def solve_toeplitz(c, r, b):
    """``x`` (n, k) with ``toeplitz(c, r) x = b`` for float64 ``c`` (n,), ``r`` (n,), ``b`` (n, k).

    ``jax.grad`` uses the implicit function theorem, as the Op's pullback: ``lam = T^{-T} x_bar`` (this
    function on the transposed matrix), ``b_bar = lam``, and ``c_bar``/``r_bar`` the sums along the diagonals
    of ``-lam x^T`` (``r[0]`` gets none)."""
    return _levinson(c, r, b)


def diagonal_sums(D):
    """``S[n - 1 + d] = sum_{i - j = d} D[i, j]`` for an (n, n) ``D`` (length ``2 n - 1``)."""
    n = D.shape[0]
    i = jnp.arange(n)
    return jnp.zeros(max(2 * n - 1, 0), D.dtype).at[(i[:, None] - i[None, :] + n - 1).ravel()].add(D.ravel())


def _solve_fwd(c, r, b):
    x = _levinson(c, r, b)
    return x, (c, r, x)


def _solve_bwd(res, x_bar):
    c, r, x = res
    n = c.shape[0]
    lam = solve_toeplitz(jnp.concatenate([c[:1], r[1:]]), c, x_bar)
    S = diagonal_sums(-lam @ x.T)
    c_bar = S[n - 1:]
    r_bar = jnp.concatenate([jnp.zeros(1, S.dtype), S[: n - 1][::-1]])[:n]
    return c_bar, r_bar, lam


solve_toeplitz.defvjp(_solve_fwd, _solve_bwd)


def _levinson(c, r, b):
    n, k = b.shape
    if n == 0:
        return jnp.zeros((0, k))
    idx = jnp.arange(n)
    finite = jnp.all(jnp.isfinite(c)) & jnp.all(jnp.isfinite(r)) & jnp.all(jnp.isfinite(b)) & (c[0] != 0.0)
    c0 = jnp.where(finite, c[0], 1.0)
    f = jnp.where(idx == 0, 1.0 / c0, 0.0)  # T_m f = e_1
    g = f  # T_m g = e_m
    x = jnp.zeros((n, k)).at[0].set(b[0] / c0)

    def body(m, carry):
        f, g, x, ok = carry
        below = idx < m
        cm = c[jnp.clip(m - idx, 0, n - 1)]  # c[m - i] for i < m
        eps_f = jnp.sum(jnp.where(below, cm * f, 0.0))
        eps_g = jnp.sum(jnp.where(below, r[jnp.clip(idx + 1, 0, n - 1)] * g, 0.0))
        den = 1.0 - eps_f * eps_g
        ok = ok & (den != 0.0) & jnp.isfinite(den)
        den = jnp.where(ok, den, 1.0)
        g_shift = jnp.where(idx >= 1, jnp.roll(g, 1), 0.0)  # [0; g]
        upto = idx <= m
        f_new = jnp.where(upto, (f - eps_f * g_shift) / den, 0.0)
        g_new = jnp.where(upto, (g_shift - eps_g * f) / den, 0.0)
        # x <- [x; 0] + (b_m - T_{m,:m} x) g
        eps_x = jnp.sum(jnp.where(below[:, None], cm[:, None] * x, 0.0), axis=0)
        d = b[m] - eps_x
        x = x + g_new[:, None] * d[None, :]
        return f_new, g_new, x, ok

    _, _, x, ok = lax.fori_loop(1, n, body, (f, g, x, finite))
    ok = ok & jnp.all(jnp.isfinite(x))
    return jnp.where(ok, x, jnp.nan)


def register(jax_funcify):
    from iterops.ts.toeplitz import SolveToeplitz

    register_op(jax_funcify, SolveToeplitz, work=jnp.float64)(lambda op, node: solve_toeplitz)
