r"""JAX implementations of the Lyapunov Ops: :class:`~iterops.linalg.lyapunov.DiscreteLyapunov` and the
loop replicas of :mod:`iterops.linalg.lyapunov_iteration` (with their gradient Ops).

``solve_discrete_lyapunov(A, Q)`` solves ``A X A^H - X + Q = 0`` exactly as the Numba kernel
(:func:`iterops.linalg.lyapunov.lyapunov_kernel`) does: Smith's doubling with the per-entry relative stop
rule (a ``lax.while_loop``), accepted for ``method="auto"`` when it converged and its relative residual is
below ``100 eps``, otherwise Kitagawa's method on the complex Schur form (``jax.scipy.linalg.schur``,
CPU only in JAX; the triangular equation is solved column by column in a ``lax.fori_loop``).  Failure
values as the kernel: an all-NaN ``X`` for non-finite input, a (near) singular equation
(``|lambda_i conj(lambda_j) - 1| < 1e3 eps``) or non-convergence.  Its gradient is not a JAX function:
PyTensor builds it from the Op itself (implicit function theorem), so a JAX gradient graph holds
``DiscreteLyapunov`` again.  ``on_failure="raise"`` cannot raise inside ``jit``: under JAX it returns the
NaN ``X`` (documented difference).

The loop Ops run the user's loop (``lax.while_loop``; same association of products, same dtypes, same
stop rules compared in float64; the damped fixed point ``(1 - w) X + w Y`` or ``X + w (Y - X)`` as written).  Their gradient Ops run the reverse pass of the module docstring of
:mod:`iterops.linalg.lyapunov_iteration` step by step (``_doubling_step_vjp`` / ``_fixed_point_step_vjp``
below mirror the Numba ones).  The iterates are kept in a buffer of ``n_steps + 1`` slots when ``n_steps``
is a graph constant (the usual case: a fused Scan), as the Scan's gradient does; with a symbolic
``n_steps`` (shapes must be static under ``jit``) each reverse step recomputes its iterate from the start,
O(K^2) steps for K steps run.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from iterops._constants import FLOAT64_EPS
from iterops.jax._common import constant_int, register_op
from iterops.linalg.lyapunov import _METHODS  # the methods' and stop rules' codes, as the Numba kernels read them
from iterops.linalg.lyapunov_iteration import _STOPS

__all__ = [
    "solve_discrete_lyapunov",
    "smith_doubling_loop",
    "smith_doubling_loop_vjp",
    "lyapunov_fixed_point_loop",
    "lyapunov_fixed_point_loop_vjp",
    "damped_fixed_point_loop",
    "damped_fixed_point_loop_vjp",
]

#: above this many stored iterates the gradient recomputes instead of storing (memory)
_MAX_TAPE = 1 << 20


def _ct(M):
    return jnp.conj(M).T


# ---------------------------------------------------------------------------
# solve_discrete_lyapunov
# ---------------------------------------------------------------------------


def _doubling(A, Q, tol, max_iter):
    """Smith's doubling with the elementwise relative stop; returns ``(X, converged)`` (as the Numba kernel)."""

    def cond(c):
        k, _, _, done, bad = c
        return (k < max_iter) & ~done & ~bad

    def body(c):
        k, alpha, gamma, _, _ = c
        term = (alpha @ gamma) @ _ct(alpha)
        g = gamma + term
        bad = ~jnp.all(jnp.isfinite(g))
        done = jnp.all(jnp.abs(term) <= tol * jnp.abs(g))
        return k + 1, alpha @ alpha, g, done & ~bad, bad

    init = (jnp.int32(0), A, Q, jnp.bool_(False), jnp.bool_(False))
    _, _, gamma, done, _ = lax.while_loop(cond, body, init)
    return gamma, done


def _schur(A, Q):
    """Kitagawa's method on the complex Schur form; returns ``(X complex, ok)``."""
    n = A.shape[0]
    T, U = jax.scipy.linalg.schur(A.astype(jnp.complex128), output="complex")
    T = jnp.triu(T)
    Uh = _ct(U)
    C = Uh @ (Q.astype(jnp.complex128) @ U)
    sing = 1e3 * FLOAT64_EPS
    idx = jnp.arange(n)
    eye = jnp.eye(n, dtype=jnp.complex128)

    def column(i, c):
        Y, ok = c
        j = n - 1 - i
        # (conj(T_jj) T - I) y_j = -c_j - T w_j,  w_j = sum_{l>j} conj(T_jl) y_l
        w = Y @ jnp.where(idx > j, jnp.conj(T[j]), 0)
        rhs = -C[:, j] - T @ w
        tjj = jnp.conj(T[j, j])
        ok = ok & jnp.all(jnp.abs(tjj * jnp.diagonal(T) - 1.0) >= sing)
        y = jax.scipy.linalg.solve_triangular(tjj * T - eye, rhs, lower=False)
        return Y.at[:, j].set(y), ok

    Y, ok = lax.fori_loop(0, n, column, (jnp.zeros((n, n), jnp.complex128), jnp.bool_(True)))
    return U @ (Y @ Uh), ok


def _relative_residual(A, Q, X):
    R = (A @ X) @ _ct(A) - X + Q
    nA = jnp.max(jnp.abs(A))
    nX = jnp.max(jnp.abs(X))
    return jnp.max(jnp.abs(R)) / jnp.maximum(nA * nA * nX + nX + jnp.max(jnp.abs(Q)), 1e-300)


def solve_discrete_lyapunov(A, Q, method="auto", tol=0.0, max_iter=100):
    """``X`` with ``A X A^H - X + Q = 0`` for one (n, n) system (float64 or complex128), NaN on failure.

    Same algorithm, stop rule and failure values as :func:`iterops.linalg.lyapunov.lyapunov_kernel`.
    Differentiable in reverse mode (``jax.grad``, which PyMC's JAX samplers use) by the implicit function
    theorem, as the Op's pullback: with ``S`` solving ``A^H S A - S + X_bar = 0`` (this function again),
    ``Q_bar = S`` and ``A_bar = S A X^H + S^H A X``; reverse mode twice too (the rule is written with this
    function).  Forward mode (``jax.jvp``, ``jax.hessian``'s outer ``jacfwd``) is not supported (a
    ``jax.custom_vjp``).  For complex inputs these are the gradients
    ``dL/dRe + i dL/dIm`` (``X_bar`` likewise); JAX's cotangents are their conjugates, which the rule
    converts.
    """
    A = jnp.asarray(A)
    Q = jnp.asarray(Q)
    dtype = jnp.result_type(A, Q)
    return _lyapunov(A.astype(dtype), Q.astype(dtype), method, float(tol), int(max_iter))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _lyapunov(A, Q, method, tol, max_iter):
    return _lyapunov_solve(A, Q, method, tol, max_iter)


def _lyapunov_fwd(A, Q, method, tol, max_iter):
    # X through this rule again (not the solver itself), so that reverse mode over this rule
    # (second derivatives: jax.jacrev(jax.jacrev(...))) differentiates X by the implicit function theorem
    X = _lyapunov(A, Q, method, tol, max_iter)
    return X, (A, X)


def _lyapunov_bwd(method, tol, max_iter, res, X_bar):
    A, X = res
    # JAX's cotangent of a complex value is the conjugate of the gradient G = dL/dRe + i dL/dIm; the
    # adjoint below is in terms of G (the real inner product Re tr(U^H V)), so conjugate in and out.
    G = jnp.conj(X_bar.astype(A.dtype))
    S = _lyapunov(_ct(A), G, method, tol, max_iter)  # A^H S A - S + G = 0
    return jnp.conj(S @ A @ _ct(X) + _ct(S) @ A @ X), jnp.conj(S)


_lyapunov.defvjp(_lyapunov_fwd, _lyapunov_bwd)


def _lyapunov_solve(A, Q, method, tol, max_iter):
    dtype = A.dtype
    n = A.shape[0]
    nan = jnp.full((n, n), jnp.nan, dtype=dtype)
    if n == 0:
        return nan
    code = _METHODS[method] if isinstance(method, str) else int(method)
    tol = FLOAT64_EPS if tol <= 0.0 else float(tol)
    finite = jnp.all(jnp.isfinite(A)) & jnp.all(jnp.isfinite(Q))
    # a non-finite input must not reach the Schur decomposition (LAPACK on NaN)
    A_ = jnp.where(finite, A, 0)
    Q_ = jnp.where(finite, Q, 0)

    def by_schur(_):
        Xs, ok = _schur(A_, Q_)
        X = Xs if jnp.iscomplexobj(nan) else Xs.real
        return X.astype(dtype), ok & jnp.all(jnp.isfinite(X))

    if code == 2:
        X, ok = by_schur(None)
    else:
        Xd, conv = _doubling(A_, Q_, tol, int(max_iter))
        if code == 1:
            X, ok = Xd, conv
        else:
            accept = conv & (_relative_residual(A_, Q_, Xd) <= 100.0 * FLOAT64_EPS)
            X, ok = lax.cond(accept, lambda _: (Xd, jnp.bool_(True)), by_schur, None)
    return jnp.where(finite & ok, X, nan)


# ---------------------------------------------------------------------------
# The loops: step, stop rule, step adjoint (mirroring the Numba kernels)
# ---------------------------------------------------------------------------


def _stopped(new, old, tol, stop):
    """The user's ``until(...)``; False whenever the change is NaN (NaN compares false)."""
    if stop == 0:
        return jnp.bool_(False)
    d = new - old
    if stop == 3:  # pt.linalg.norm(d) < tol, summed in the loop dtype
        return jnp.sqrt(jnp.sum(d * d)).astype(jnp.float64) < tol
    mx = jnp.max(jnp.abs(d)).astype(jnp.float64)  # NaN-propagating, like PyTensor's Max
    return mx < tol if stop == 1 else mx <= tol


def _doubling_step(state):
    alpha, gamma = state
    return alpha @ alpha, gamma + (alpha @ gamma) @ alpha.T


def _doubling_step_vjp(state, Ga, Gg):
    """Cotangents of (alpha, gamma) before a step from those after it (Giles 2008)."""
    alpha, gamma = state
    P = Gg @ alpha
    Gg_out = alpha.T @ P + Gg
    Ga_out = Ga @ alpha.T + alpha.T @ Ga + P @ gamma.T + Gg.T @ (alpha @ gamma)
    return Ga_out.astype(Ga.dtype), Gg_out.astype(Gg.dtype)


def _fixed_point_step(X, A, Q):
    return (A @ X) @ A.T + Q


def _fixed_point_step_vjp(X, A, G):
    """(cotangent of X_k, A_bar increment); Q_bar's increment is G itself."""
    P = G @ A
    return A.T @ P, P @ X.T + G.T @ (A @ X)


def _run(step, watch, init, tol, n_steps, stop):
    """Run ``state <- step(state)`` while ``k < n_steps`` and the stop rule on ``watch(state)`` has not held.

    Returns (final state, steps run)."""

    def cond(c):
        k, _, done = c
        return (k < n_steps) & ~done

    def body(c):
        k, s, _ = c
        new = step(s)
        return k + 1, new, _stopped(watch(new), watch(s), tol, stop)

    n_steps = jnp.asarray(n_steps)
    k, state, _ = lax.while_loop(cond, body, (jnp.zeros_like(n_steps), init, jnp.bool_(False)))
    return state, k


def _tape(step, watch, init, tol, n_steps, stop, length):
    """The loop as a masked ``lax.scan`` of ``length`` steps: the iterate entering each step and whether the
    step ran (for the reverse pass)."""

    def body(c, _):
        s, active = c
        new = step(s)
        done = _stopped(watch(new), watch(s), tol, stop)
        nxt = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, s)
        return (nxt, active & ~done), (s, active)

    active0 = n_steps > 0
    _, (states, actives) = lax.scan(body, (init, active0), None, length=length)
    idx = jnp.arange(length)
    return states, actives & (idx < n_steps)


def _reverse(step, watch, init, tol, n_steps, stop, static_n, vjp_step, cot0):
    """Apply ``cot <- vjp_step(state_k, cot)`` for k = K-1 .. 0 over the K steps the loop ran."""
    if static_n is not None and 0 < static_n <= _MAX_TAPE:
        states, actives = _tape(step, watch, init, tol, n_steps, stop, static_n)

        def back(cot, xs):
            s, active = xs
            new = vjp_step(s, cot)
            return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, cot), None

        cot, _ = lax.scan(back, cot0, (states, actives), reverse=True)
        return cot
    if static_n is not None and static_n <= 0:
        return cot0
    _, K = _run(step, watch, init, tol, n_steps, stop)

    def back_recompute(i, cot):
        k = K - 1 - i
        s = lax.fori_loop(0, k, lambda _, x: step(x), init)
        return vjp_step(s, cot)

    return lax.fori_loop(0, K, back_recompute, cot0)


def _no_cotangent(x):
    """The cotangent of an integer input (``float0``) or a zero one for a float input."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return np.zeros(x.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(x)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def smith_doubling_loop(A, Q, tol, n_steps, stop="max_lt", static_n=None):
    """``(alpha, gamma)`` after the doubling loop (one (m, m) system, dtypes as given).

    ``jax.grad`` runs :func:`smith_doubling_loop_vjp` (``static_n``: ``n_steps`` when it is a known
    constant, to keep the iterates instead of recomputing them); ``tol`` gets a zero cotangent."""
    (alpha, gamma), _ = _run(_doubling_step, lambda s: s[1], (A, Q), tol, n_steps, _STOPS[stop])
    return alpha, gamma


def _doubling_fwd(A, Q, tol, n_steps, stop, static_n):
    return smith_doubling_loop(A, Q, tol, n_steps, stop, static_n), (A, Q, tol, n_steps)


def _doubling_bwd(stop, static_n, res, cts):
    A, Q, tol, n_steps = res
    A_bar, Q_bar = smith_doubling_loop_vjp(A, Q, tol, n_steps, *cts, stop=stop, static_n=static_n)
    return A_bar, Q_bar, _no_cotangent(tol), _no_cotangent(n_steps)


smith_doubling_loop.defvjp(_doubling_fwd, _doubling_bwd)


def smith_doubling_loop_vjp(A, Q, tol, n_steps, Ga, Gg, stop="max_lt", static_n=None):
    """``(A_bar, Q_bar)``: the reverse pass of the doubling loop, in ``Q``'s dtype (``A_bar`` in ``A``'s)."""
    cot0 = (Ga.astype(Q.dtype), Gg.astype(Q.dtype))
    Ga_, Gg_ = _reverse(
        _doubling_step, lambda s: s[1], (A, Q), tol, n_steps, _STOPS[stop], static_n,
        lambda s, c: _doubling_step_vjp(s, *c), cot0,
    )
    return Ga_.astype(A.dtype), Gg_


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def lyapunov_fixed_point_loop(A, Q, X0, tol, n_steps, stop="max_lt", static_n=None):
    """``X`` after the fixed-point loop ``X <- (A X) A^T + Q`` (one (m, m) system).

    ``jax.grad`` runs :func:`lyapunov_fixed_point_loop_vjp`; ``tol`` gets a zero cotangent."""
    X, _ = _run(lambda X: _fixed_point_step(X, A, Q), lambda X: X, X0, tol, n_steps, _STOPS[stop])
    return X


def _fixed_point_fwd(A, Q, X0, tol, n_steps, stop, static_n):
    return lyapunov_fixed_point_loop(A, Q, X0, tol, n_steps, stop, static_n), (A, Q, X0, tol, n_steps)


def _fixed_point_bwd(stop, static_n, res, G):
    A, Q, X0, tol, n_steps = res
    A_bar, Q_bar, X0_bar = lyapunov_fixed_point_loop_vjp(A, Q, X0, tol, n_steps, G, stop=stop, static_n=static_n)
    return A_bar, Q_bar, X0_bar, _no_cotangent(tol), _no_cotangent(n_steps)


lyapunov_fixed_point_loop.defvjp(_fixed_point_fwd, _fixed_point_bwd)


def lyapunov_fixed_point_loop_vjp(A, Q, X0, tol, n_steps, G, stop="max_lt", static_n=None):
    """``(A_bar, Q_bar, X0_bar)``: the reverse pass of the fixed-point loop."""
    zero = jnp.zeros_like(X0)

    def vjp_step(X, cot):
        G_k, GA, GQ = cot
        G_prev, dA = _fixed_point_step_vjp(X, A, G_k)
        return G_prev, GA + dA, GQ + G_k

    G_k, GA, GQ = _reverse(
        lambda X: _fixed_point_step(X, A, Q), lambda X: X, X0, tol, n_steps, _STOPS[stop], static_n,
        vjp_step, (G.astype(X0.dtype), zero, zero),
    )
    return GA, GQ, G_k


def _damped_step(X, A, Q, w, damping):
    """``(1 - w) X + w Y`` or ``X + w (Y - X)``, ``Y = (A X) A^T + Q`` (as the Numba ``_damp_into``)."""
    Y = _fixed_point_step(X, A, Q)
    return (1 - w) * X + w * Y if damping == "convex" else X + w * (Y - X)


def _damped_step_vjp(X, A, Q, w, G):
    """(cotangent of X_k, A_bar, Q_bar and w_bar increments) of a damped step (either form: the same
    derivatives); ``Y`` is recomputed, as the Numba ``_damped_step_vjp`` does."""
    Y = _fixed_point_step(X, A, Q)
    Gy = w * G
    G_prev, dA = _fixed_point_step_vjp(X, A, Gy)
    return G_prev + (1 - w) * G, dA, Gy, jnp.sum(G * (Y - X))


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def damped_fixed_point_loop(A, Q, X0, tol, n_steps, w, damping="convex", stop="max_lt", static_n=None):
    """``X`` after the damped fixed-point loop (one (m, m) system, ``w`` a scalar of the loop dtype).

    ``jax.grad`` runs :func:`damped_fixed_point_loop_vjp`; ``tol`` gets a zero cotangent."""
    X, _ = _run(lambda X: _damped_step(X, A, Q, w, damping), lambda X: X, X0, tol, n_steps, _STOPS[stop])
    return X


def _damped_fwd(A, Q, X0, tol, n_steps, w, damping, stop, static_n):
    out = damped_fixed_point_loop(A, Q, X0, tol, n_steps, w, damping, stop, static_n)
    return out, (A, Q, X0, tol, n_steps, w)


def _damped_bwd(damping, stop, static_n, res, G):
    A, Q, X0, tol, n_steps, w = res
    A_bar, Q_bar, X0_bar, w_bar = damped_fixed_point_loop_vjp(A, Q, X0, tol, n_steps, w, G, damping, stop,
                                                              static_n)
    return A_bar, Q_bar, X0_bar, _no_cotangent(tol), _no_cotangent(n_steps), w_bar.astype(jnp.asarray(w).dtype)


damped_fixed_point_loop.defvjp(_damped_fwd, _damped_bwd)


def damped_fixed_point_loop_vjp(A, Q, X0, tol, n_steps, w, G, damping="convex", stop="max_lt", static_n=None):
    """``(A_bar, Q_bar, X0_bar, w_bar)``: the reverse pass of the damped fixed-point loop."""
    zero = jnp.zeros_like(X0)

    def vjp_step(X, cot):
        G_k, GA, GQ, Gw = cot
        G_prev, dA, dQ, dw = _damped_step_vjp(X, A, Q, w, G_k)
        return G_prev, GA + dA, GQ + dQ, Gw + dw

    G_k, GA, GQ, Gw = _reverse(
        lambda X: _damped_step(X, A, Q, w, damping), lambda X: X, X0, tol, n_steps, _STOPS[stop], static_n,
        vjp_step, (G.astype(X0.dtype), zero, zero, jnp.zeros((), X0.dtype)),
    )
    return GA, GQ, G_k, Gw


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def register(jax_funcify):
    from iterops.linalg.lyapunov import DiscreteLyapunov
    from iterops.linalg.lyapunov_iteration import (
        LyapunovFixedPointLoop, LyapunovFixedPointLoopGrad, SmithDoublingLoop, SmithDoublingLoopGrad,
    )

    @register_op(jax_funcify, DiscreteLyapunov)
    def _lyapunov(op, node):
        work = jnp.complex128 if np.dtype(node.outputs[0].type.dtype).kind == "c" else jnp.float64

        def discrete_lyapunov(A, Q):
            return solve_discrete_lyapunov(A.astype(work), Q.astype(work), op.method, op.tol, op.max_iter)

        return discrete_lyapunov

    # the loops compute in their own dtype; n_steps is an integer (input 3 of the doubling Ops, 4 of the others)
    @register_op(jax_funcify, SmithDoublingLoop, integer=(3,))
    def _doubling_loop(op, node):
        static_n = constant_int(node.inputs[3])
        return lambda A, Q, tol, n_steps: smith_doubling_loop(A, Q, tol, n_steps, op.stop, static_n)

    @register_op(jax_funcify, SmithDoublingLoopGrad, integer=(3,))
    def _doubling_loop_grad(op, node):
        static_n = constant_int(node.inputs[3])
        return lambda *args: smith_doubling_loop_vjp(*args, stop=op.stop, static_n=static_n)

    @register_op(jax_funcify, LyapunovFixedPointLoop, integer=(4,))
    def _fixed_point_loop(op, node):
        static_n = constant_int(node.inputs[4])
        if op.damping:
            return lambda *args: damped_fixed_point_loop(*args, op.damping, op.stop, static_n)
        return lambda *args: lyapunov_fixed_point_loop(*args, op.stop, static_n)

    @register_op(jax_funcify, LyapunovFixedPointLoopGrad, integer=(4,))
    def _fixed_point_loop_grad(op, node):
        static_n = constant_int(node.inputs[4])
        if op.damping:
            return lambda *args: damped_fixed_point_loop_vjp(*args, op.damping, op.stop, static_n)
        return lambda *args: lyapunov_fixed_point_loop_vjp(*args, stop=op.stop, static_n=static_n)
