r"""Lyapunov loops -> :func:`iterops.solve_discrete_lyapunov`.

Both loops compute the series :math:`X = \sum_k A^k Q (A^T)^k`, the solution of
``A X A^T - X + Q = 0``:

``lyapunov_doubling`` (Smith's doubling, seed 003)::

    def step(alpha, gamma, tol):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)
    (alphas, gammas), _ = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[tol], n_steps=max_iter)
    X = gammas[-1]

``lyapunov_fixed_point``::

    def step(X, A, Q, tol):
        X_new = A @ X @ A.T + Q
        return X_new, until(pt.max(pt.abs(X_new - X)) < tol)

Accepted stop rules: max-abs change ``<`` or ``<=`` tol, ``all(|change| < tol)``,
Frobenius norm of the change ``< tol`` (either sign of the change); ``tol`` a
non-sequence or a constant.

Accuracy of the replacement: ``solve_discrete_lyapunov(A, Q, method="doubling")``
sums the same series until its relative change is below machine epsilon, so
it is at least as accurate as the loop; the two differ by the loop's own
truncation error (for the doubling loop at most about ``tol``; for the
fixed-point loop about ``tol / (1 - rho(A)^2)``).  For an unstable ``A`` both
diverge: the loop returns huge/inf values, the replacement NaN.

Safety rules (otherwise the Scan stays):

* only the final ``X`` (``gamma``) is used, never intermediate iterates;
  ``alpha`` is unused;
* the doubling loop stops on convergence (``until``), with ``n_steps``
  symbolic (a max-iteration guard) or a constant >= 30 (2^30 summed terms); a
  doubling loop *without* a stop needs a constant ``n_steps >= 60`` (2^60
  terms: the infinite sum to rounding for every spectral radius below
  1 - 1e-15);
* the fixed-point loop stops on convergence with ``n_steps`` symbolic or a
  constant >= 500; without a stop it is a truncated series and stays a Scan;
* ``A`` and ``Q`` are not statically non-square.

A loop that reaches its symbolic max-iteration guard before its stop rule
returns a truncated sum; the replacement returns the converged one.
"""

from __future__ import annotations

from pytensor.scan.utils import until

from iterops.fusion.patterns._common import CONVERGENCE_STOPS, static_square
from iterops.fusion.registry import Pattern, Role, register_pattern
from iterops.linalg.lyapunov import solve_discrete_lyapunov

__all__: list[str] = []

DOUBLING_MIN_STEPS_WITH_STOP = 30
DOUBLING_MIN_STEPS_WITHOUT_STOP = 60
FIXED_POINT_MIN_STEPS = 500


def _doubling_step(stop):
    def step(alpha, gamma, tol):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(stop(new_gamma, gamma, tol))

    return step


def _doubling_step_no_stop(alpha, gamma, tol):
    return alpha @ alpha, gamma + alpha @ gamma @ alpha.T


def _check_doubling(m):
    n = m.n_steps_value()
    if m.as_while:
        if n is not None and n < DOUBLING_MIN_STEPS_WITH_STOP:
            return (f"n_steps={n} may stop the doubling before it converges "
                    f"(needs a symbolic guard or >= {DOUBLING_MIN_STEPS_WITH_STOP})")
    elif n is None or n < DOUBLING_MIN_STEPS_WITHOUT_STOP:
        return (f"the loop has no convergence stop and n_steps={'symbolic' if n is None else n} "
                f"(a fixed count needs >= {DOUBLING_MIN_STEPS_WITHOUT_STOP} doublings to reach the sum)")
    return static_square("A (alpha's initial value)", m.outer["alpha"]) or static_square(
        "Q (gamma's initial value)", m.outer["gamma"])


def _build_doubling(m):
    return {"gamma": solve_discrete_lyapunov(m.outer["alpha"], m.outer["gamma"], method="doubling")}


register_pattern(Pattern(
    name="lyapunov_doubling",
    replaces_with="iterops.solve_discrete_lyapunov",
    step=(*(_doubling_step(s) for s in CONVERGENCE_STOPS), _doubling_step_no_stop),
    states=(Role("alpha", 2), Role("gamma", 2)),
    non_sequences=(Role("tol", 0, constant_ok=True),),
    provides={"alpha": None, "gamma": "last"},
    check=_check_doubling,
    build=_build_doubling,
    doc="Smith doubling gamma <- gamma + alpha gamma alpha^T, alpha <- alpha^2",
))


def _fixed_point_step(stop):
    def step(X, A, Q, tol):
        X_new = A @ X @ A.T + Q
        return X_new, until(stop(X_new, X, tol))

    return step


def _check_fixed_point(m):
    n = m.n_steps_value()
    if n is not None and n < FIXED_POINT_MIN_STEPS:
        return (f"n_steps={n} may stop the fixed-point iteration before it converges "
                f"(needs a symbolic guard or >= {FIXED_POINT_MIN_STEPS})")
    return static_square("A", m.outer["A"]) or static_square("Q", m.outer["Q"])


def _build_fixed_point(m):
    return {"X": solve_discrete_lyapunov(m.outer["A"], m.outer["Q"], method="doubling")}


register_pattern(Pattern(
    name="lyapunov_fixed_point",
    replaces_with="iterops.solve_discrete_lyapunov",
    step=tuple(_fixed_point_step(s) for s in CONVERGENCE_STOPS),
    states=(Role("X", 2),),
    non_sequences=(Role("A", 2), Role("Q", 2), Role("tol", 0, constant_ok=True)),
    provides={"X": "last"},
    check=_check_fixed_point,
    build=_build_fixed_point,
    doc="fixed point X <- A X A^T + Q until converged",
))
