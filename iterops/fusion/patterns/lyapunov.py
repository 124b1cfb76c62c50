r"""Lyapunov loops -> the same iteration fused (:mod:`iterops.linalg.lyapunov_iteration`).

The undamped loops sum the series :math:`X = \sum_k A^k Q (A^T)^k`, the solution of
``A X A^T - X + Q = 0`` when ``A`` is stable:

``lyapunov_doubling`` (Smith's doubling, the loop PyMC users write for a
stationary covariance)::

    def step(alpha, gamma, tol):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)
    (alphas, gammas), _ = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[tol], n_steps=max_iter)
    X = gammas[-1]

``lyapunov_fixed_point``::

    def step(X, A, Q, tol):
        X_new = A @ X @ A.T + Q          # or A.T @ X @ A + Q: the same iteration for A^T (fused with A.mT)
        return X_new, until(pt.max(pt.abs(X_new - X)) < tol)

Accepted stop rules: max-abs change ``<`` or ``<=`` tol, ``all(|change| < tol)``,
Frobenius norm of the change ``< tol`` (either sign of the change), or none
(``n_steps`` iterations); ``tol`` a non-sequence or a constant.

Replacement: :func:`iterops.linalg.lyapunov_iteration.smith_doubling_loop`
and :func:`~iterops.linalg.lyapunov_iteration.lyapunov_fixed_point_loop`, one
Numba kernel that runs *the loop's own iteration* from the loop's own start
values, with its stop rule, tolerance and ``n_steps`` guard, in the loop's
dtype; its gradient is the exact adjoint of the iteration as run (what
autodiff of the Scan computes).  So the replacement is exact on every input
the loop runs on: unit roots whose limit depends on the start value,
rotations that never converge, multi-scale solutions, a loop stopped by its
guard, ``n_steps`` of 0 (an untraced ``alpha`` keeps its start value; reading
``gammas[-1]`` of an empty trace raises as in the loop), an unstable ``A``
(overflow to inf/NaN as in the loop).  Rounding may differ in the last bits
(products are associated as written in the reference), which can move a stop
decision taken exactly at the tolerance by one step.

``lyapunov_damped_fixed_point``, the damped fixed point (same limit for ``w != 0``, other iterates, stop
step and gradient), replaced by :func:`~iterops.linalg.lyapunov_iteration.lyapunov_fixed_point_loop`
with ``w=`` (the same kernel, damped as written; gradient with respect to ``w`` too)::

    def step(X, A, Q, w, tol):
        X_new = (1 - w) * X + w * (A @ X @ A.T + Q)
        return X_new, until(pt.max(pt.abs(X_new - X)) < tol)

``w`` is a scalar non-sequence or a constant (``0.5 * X + 0.5 * (...)``: the constant for ``X`` must be
``1 - w`` of the other), any real value (``w = 0``, ``w > 1`` included).  The same stop rules as above.

=========================================  ========  ==============================================
spelling of the update                     fused?    note
=========================================  ========  ==============================================
``(1 - w) * X + w * (A @ X @ A.T + Q)``    yes       ``damping="convex"``; ``1.0 - w`` too
``w * (...) + (1 - w) * X``, ``X * (1 -    yes       operands of ``+``, ``*`` in any order,
w) + (Q + A @ X @ A.T) * w``                         ``Q`` on either side
``X + w * (A @ X @ A.T + Q - X)``          yes       ``damping="increment"``; ``(... - X) * w + X``,
                                                     ``-X + A @ X @ A.T + Q`` inside
``0.7 * X + 0.3 * (...)``                  yes       constants with ``0.7 == 1 - 0.3`` (to 1e-12)
``X - w * (X - (A @ X @ A.T + Q))``        kept      another sum of signed terms (not listed)
``(1 - w) X + w A X A^T + w Q``            kept      ``w`` distributed: other rounding, not listed
``X - w X + w Y``                          kept      not listed
``(2 - w) X + ...``, ``0.4 X + 0.5 Y``     kept      another iteration
``(1 - v) X + w Y`` (two factors)          kept      another iteration
``w`` a sequence, a narrowing cast         kept      general conditions
=========================================  ========  ==============================================

Conditions (otherwise the Scan stays): only the final ``gamma`` / ``alpha``
(``X``) are used, never intermediate iterates; ``A`` and ``Q`` are not
statically non-square; the general matcher's conditions (no truncated
gradient, no narrowing cast in the step, ...).
"""

from __future__ import annotations

import pytensor.tensor as pt
from pytensor.scan.utils import until

from iterops.fusion.patterns._common import STOP_KINDS, STOP_RULES, static_square
from iterops.fusion.registry import Pattern, Role, register_pattern
from iterops.linalg.lyapunov_iteration import lyapunov_fixed_point_loop, smith_doubling_loop

__all__: list[str] = []


def _doubling_step(stop):
    if stop is None:
        return _doubling_step_no_stop

    def step(alpha, gamma, tol):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(stop(new_gamma, gamma, tol))

    return step


def _doubling_step_no_stop(alpha, gamma, tol):
    return alpha @ alpha, gamma + alpha @ gamma @ alpha.T


def _check_doubling(m):
    return static_square("A (alpha's initial value)", m.outer["alpha"]) or static_square(
        "Q (gamma's initial value)", m.outer["gamma"])


def _build_doubling(m):
    alpha, gamma = smith_doubling_loop(m.outer["alpha"], m.outer["gamma"], m.outer.get("tol", 0.0), m.n_steps,
                                       stop=STOP_KINDS[m.variant])
    return {"alpha": alpha, "gamma": gamma}


register_pattern(Pattern(
    name="lyapunov_doubling",
    replaces_with="iterops.linalg.smith_doubling_loop",
    step=tuple(_doubling_step(s) for s in STOP_RULES),
    states=(Role("alpha", 2), Role("gamma", 2)),
    non_sequences=(Role("tol", 0, constant_ok=True),),
    provides={"alpha": "last", "gamma": "last"},
    check=_check_doubling,
    build=_build_doubling,
    doc="Smith doubling gamma <- gamma + alpha gamma alpha^T, alpha <- alpha^2",
))


def _fixed_point_update(transposed):
    """``A X A^T + Q``, or ``A^T X A + Q`` (the same iteration for ``A^T``, products associated alike)."""
    if transposed:
        return lambda X, A, Q: A.T @ X @ A + Q
    return lambda X, A, Q: A @ X @ A.T + Q


def _fixed_point_step(stop, transposed=False):
    update = _fixed_point_update(transposed)
    if stop is None:
        return lambda X, A, Q, tol: update(X, A, Q)

    def step(X, A, Q, tol):
        X_new = update(X, A, Q)
        return X_new, until(stop(X_new, X, tol))

    return step


#: (transposed, stop kind) of each reference variant of the undamped fixed point, in the order of the step functions
_FIXED_POINT_VARIANTS = tuple((t, kind) for t in (False, True) for kind in STOP_KINDS)


def _check_fixed_point(m):
    return static_square("A", m.outer["A"]) or static_square("Q", m.outer["Q"])


def _build_fixed_point(m):
    transposed, stop = _FIXED_POINT_VARIANTS[m.variant]
    A = m.outer["A"].mT if transposed else m.outer["A"]
    X = lyapunov_fixed_point_loop(A, m.outer["Q"], m.outer["X"], m.outer.get("tol", 0.0), m.n_steps, stop=stop)
    return {"X": X}


register_pattern(Pattern(
    name="lyapunov_fixed_point",
    replaces_with="iterops.linalg.lyapunov_fixed_point_loop",
    step=tuple(_fixed_point_step(stop, t) for t in (False, True) for stop in STOP_RULES),
    states=(Role("X", 2),),
    non_sequences=(Role("A", 2), Role("Q", 2), Role("tol", 0, constant_ok=True)),
    provides={"X": "last"},
    check=_check_fixed_point,
    build=_build_fixed_point,
    doc="fixed point X <- A X A^T + Q, or A^T X A + Q (until converged, or n_steps times)",
))


def _damped_update(form):
    """The damped update as written: ``(1 - w) X + w Y`` (``"convex"``) or ``X + w (Y - X)`` (``"increment"``),
    ``Y = A X A^T + Q``."""
    if form == "convex":
        return lambda X, A, Q, w: (1 - w) * X + w * (A @ X @ A.T + Q)
    return lambda X, A, Q, w: X + w * (A @ X @ A.T + Q - X)


def _damped_step(form, stop):
    update = _damped_update(form)
    if stop is None:
        return lambda X, A, Q, w, tol: update(X, A, Q, w)

    def step(X, A, Q, w, tol):
        X_new = update(X, A, Q, w)
        return X_new, until(stop(X_new, X, tol))

    return step


_DAMPED_FORMS = ("convex", "increment")
#: (form, stop kind) of each reference variant, in the order of the step functions
_DAMPED_VARIANTS = tuple((form, kind) for form in _DAMPED_FORMS for kind in STOP_KINDS)


def _build_damped(m):
    form, stop = _DAMPED_VARIANTS[m.variant]
    w = pt.cast(m.outer["w"], m.dtype)  # a constant w (e.g. an integer 2) enters the loop in its dtype
    X = lyapunov_fixed_point_loop(m.outer["A"], m.outer["Q"], m.outer["X"], m.outer.get("tol", 0.0), m.n_steps,
                                  stop=stop, w=w, damping=form)
    return {"X": X}


register_pattern(Pattern(
    name="lyapunov_damped_fixed_point",
    replaces_with="iterops.linalg.lyapunov_fixed_point_loop(..., w=w)",
    step=tuple(_damped_step(form, stop) for form in _DAMPED_FORMS for stop in STOP_RULES),
    states=(Role("X", 2),),
    non_sequences=(Role("A", 2), Role("Q", 2), Role("w", 0, constant_ok=True), Role("tol", 0, constant_ok=True)),
    provides={"X": "last"},
    check=_check_fixed_point,
    build=_build_damped,
    doc="damped fixed point X <- (1 - w) X + w (A X A^T + Q) (until converged, or n_steps times)",
))
