r"""JAX implementation of :class:`iterops.linalg.riccati.DiscreteARE` (the discrete algebraic Riccati equation).

Same algorithm, stop rule and failure values as :func:`iterops.linalg.riccati.dare_kernel`: the
structure-preserving doubling ``(A_k, G_k, H_k)`` from ``A_0 = A``, ``G_0 = B R^{-1} B^T``, ``H_0 = Q``,
stopped when ``max|H_{k+1} - H_k| <= tol * max|H_{k+1}|``; an all-NaN ``X`` when an input is not finite,
a solve fails, the iteration does not converge in ``max_iter`` steps, the relative residual exceeds
``1e-8`` or the solution is not stabilising.

Reverse mode (``jax.grad``, which PyMC's JAX samplers use) by the implicit function theorem, as the Op's
pullback: with ``A_c = A - B K`` the closed loop, the adjoint ``S`` solves the discrete Lyapunov equation
``A_c S A_c^T - S + X_bar = 0`` (:func:`iterops.jax.lyapunov.solve_discrete_lyapunov`), and the
cotangents of ``A, B, Q, R`` are the vector-Jacobian product of the residual
``F(X) = A^T X A - A^T X B (R + B^T X B)^{-1} B^T X A + Q - X`` with ``S``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from iterops._constants import FLOAT64_EPS
from iterops.jax._common import register_op
from iterops.jax.lyapunov import solve_discrete_lyapunov
from iterops.linalg.riccati import _MAX_RELATIVE_RESIDUAL  # the kernel's a-posteriori check

__all__ = ["solve_discrete_are", "register"]



def _sym(M):
    return 0.5 * (M + M.T)


def _residual(X, A, B, Q, R):
    XA = X @ A
    gain = jnp.linalg.solve(_sym(R) + B.T @ X @ B, B.T @ XA)
    return A.T @ XA - A.T @ X @ B @ gain + _sym(Q) - X


def _closed_loop(X, A, B, R):
    return A - B @ jnp.linalg.solve(_sym(R) + B.T @ X @ B, B.T @ X @ A)


def _sda(A, G, H, tol, max_iter):
    """The doubling from ``(A, G, H)``: ``(X, converged)`` (``converged`` False on a failed solve)."""
    n = A.shape[0]
    eye = jnp.eye(n, dtype=A.dtype)

    def step(c):
        Ak, Gk, Hk, _, k, _ = c
        W = eye + Gk @ Hk
        S = jnp.linalg.solve(W, jnp.concatenate([Ak, Gk], axis=1))
        WA, WG = S[:, :n], S[:, n:]
        A_new = Ak @ WA
        G_new = _sym(Gk + Ak @ WG @ Ak.T)
        H_new = _sym(Hk + Ak.T @ Hk @ WA)
        ok = jnp.all(jnp.isfinite(S)) & jnp.all(jnp.isfinite(H_new))
        done = jnp.max(jnp.abs(H_new - Hk)) <= tol * jnp.max(jnp.abs(H_new))
        return A_new, G_new, H_new, done & ok, k + 1, ok

    def cond(c):
        _, _, _, done, k, ok = c
        return ok & ~done & (k < max_iter)

    _, _, X, done, _, ok = lax.while_loop(cond, step, (A, G, H, jnp.bool_(False), 0, jnp.bool_(True)))
    return X, done & ok


def _dare_solve(A, B, Q, R, tol, max_iter):
    n, m = B.shape
    nan = jnp.full((n, n), jnp.nan, dtype=jnp.float64)
    if n == 0:
        return nan
    tol = 1e2 * FLOAT64_EPS if tol <= 0.0 else float(tol)
    finite = jnp.all(jnp.isfinite(A)) & jnp.all(jnp.isfinite(B)) & jnp.all(jnp.isfinite(Q)) & jnp.all(jnp.isfinite(R))
    # non-finite inputs must not reach LAPACK (the solves, the eigenvalues)
    A_, B_ = jnp.where(finite, A, 0.0), jnp.where(finite, B, 0.0)
    Qs, Rs = _sym(jnp.where(finite, Q, 0.0)), _sym(jnp.where(finite, R, jnp.eye(m)))
    G = _sym(B_ @ jnp.linalg.solve(Rs, B_.T)) if m else jnp.zeros((n, n))
    ok_g = jnp.all(jnp.isfinite(G))
    X, conv = _sda(A_, jnp.where(ok_g, G, 0.0), Qs, tol, int(max_iter))
    X_ = jnp.where(conv & ok_g, X, 0.0)
    Rinner = Rs + B_.T @ X_ @ B_
    K = jnp.linalg.solve(Rinner, B_.T @ X_ @ A_) if m else jnp.zeros((0, n))
    Res = A_.T @ X_ @ A_ - A_.T @ X_ @ B_ @ K + Qs - X_
    rel = jnp.max(jnp.abs(Res)) / (jnp.max(jnp.abs(X_)) + jnp.max(jnp.abs(Qs)) + 1e-300)
    Acl = A_ - B_ @ K
    stable = jnp.max(jnp.abs(jnp.linalg.eigvals(Acl))) < 1.0
    ok = finite & ok_g & conv & jnp.all(jnp.isfinite(K)) & (rel <= _MAX_RELATIVE_RESIDUAL) & stable
    return jnp.where(ok, X, nan)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dare(A, B, Q, R, tol, max_iter):
    return _dare_solve(A, B, Q, R, tol, max_iter)


def _dare_fwd(A, B, Q, R, tol, max_iter):
    X = _dare_solve(A, B, Q, R, tol, max_iter)
    return X, (A, B, Q, R, X)


def _dare_bwd(tol, max_iter, res, X_bar):
    A, B, Q, R, X = res
    S = solve_discrete_lyapunov(_closed_loop(X, A, B, R), X_bar)  # A_c S A_c^T - S + X_bar = 0
    _, vjp = jax.vjp(lambda a, b, q, r: _residual(X, a, b, q, r), A, B, Q, R)
    return vjp(S)


_dare.defvjp(_dare_fwd, _dare_bwd)


def solve_discrete_are(A, B, Q, R, tol=0.0, max_iter=100):
    """Stabilising ``X`` of ``X = A^T X A - A^T X B (R + B^T X B)^{-1} B^T X A + Q`` for one system.

    ``A`` (n, n), ``B`` (n, m), ``Q`` (n, n), ``R`` (m, m), computed in float64; NaN on failure (module
    docstring).  Differentiable in reverse mode by the implicit function theorem.
    """
    args = [jnp.asarray(x, dtype=jnp.float64) for x in (A, B, Q, R)]
    return _dare(*args, float(tol), int(max_iter))


def register(jax_funcify):
    from iterops.linalg.riccati import DiscreteARE

    @register_op(jax_funcify, DiscreteARE, work=jnp.float64)
    def _discrete_are(op, node):
        return lambda A, B, Q, R: solve_discrete_are(A, B, Q, R, op.tol, op.max_iter)
