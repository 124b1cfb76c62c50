"""Generic implicit-function-theorem gradients for equation solvers.

An equation solver returns ``x*(theta)`` defined by a residual
``F(x*, theta) = 0``.  Differentiating the identity gives (jaxopt's
``custom_root``, optimistix's ``ImplicitAdjoint``):

* reverse mode: solve the transposed linear system
  ``(dF/dx)^H lam = -x_bar`` for ``lam``; then ``theta_bar = (dF/dtheta)^H lam``,
  i.e. the vector-Jacobian product of the *residual* with ``lam``;
* forward mode: ``x_dot = -(dF/dx)^{-1} (dF/dtheta) theta_dot``, i.e. the
  Jacobian-vector product of the residual, then one linear solve.

The residual is an ordinary PyTensor expression (a module-level function of
the solver module); its VJP/JVP come from PyTensor autodiff of that small,
loop-free graph.  The linear solves are supplied by the solver (usually a call
of the solver itself, so the backward pass runs the same fused kernel and
higher derivatives compose).  Nothing here knows about a specific equation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type, grad, pushforward
from pytensor.graph.basic import Variable

__all__ = ["implicit_pullback", "implicit_pushforward"]


def implicit_pullback(
    residual: Callable[..., Variable],
    solution: Variable,
    params: Sequence[Variable],
    cotangent: Variable,
    solve_adjoint: Callable[[Variable], Variable],
) -> list[Variable]:
    """Reverse-mode gradient of ``x*(params)`` where ``residual(x*, *params) == 0``.

    Parameters
    ----------
    residual
        ``residual(x, *params) -> F`` with ``F`` of the shape of ``x``.
    solution
        The solver's output ``x*`` (treated as a constant).
    params
        The solver's inputs.
    cotangent
        ``x_bar``, the cotangent of the output.
    solve_adjoint
        ``solve_adjoint(rhs)`` returns ``lam`` with ``(dF/dx)^H lam = rhs``.

    Returns
    -------
    One cotangent per parameter (``DisconnectedType`` where ``F`` does not
    depend on it).
    """
    if isinstance(cotangent.type, DisconnectedType):
        return [disconnected_type() for _ in params]
    lam = solve_adjoint(-cotangent)
    x = pt.as_tensor_variable(solution).type()  # a fresh leaf: x is held fixed
    F = residual(x, *params)
    grads = grad(
        cost=None,
        wrt=list(params),
        known_grads={F: lam},
        disconnected_inputs="ignore",
        return_disconnected="disconnected",
    )
    # A parameter entering F linearly gets ``lam`` itself as cotangent, which is
    # also an intermediate of the other cotangents.  PyTensor's double-pullback
    # pushforward (``pullback`` with several ``f`` sharing ancestors) then
    # overrides instead of accumulating, so hand out distinct variables.
    grads = [g if isinstance(g.type, DisconnectedType) or g is not lam else pt.tensor_copy(g) for g in grads]
    return _substitute(grads, {x: solution})


def implicit_pushforward(
    residual: Callable[..., Variable],
    solution: Variable,
    params: Sequence[Variable],
    tangents: Sequence[Variable],
    solve_tangent: Callable[[Variable], Variable],
) -> Variable:
    """Forward-mode tangent of ``x*(params)`` where ``residual(x*, *params) == 0``.

    ``solve_tangent(rhs)`` returns ``y`` with ``(dF/dx) y = rhs``.
    """
    pairs = [(p, t) for p, t in zip(params, tangents) if not isinstance(t.type, DisconnectedType)]
    if not pairs:
        return disconnected_type()
    x = pt.as_tensor_variable(solution).type()
    F = residual(x, *params)
    # One pushforward per parameter, summed: PyTensor 3.3's double-pullback
    # pushforward drops terms when a parameter enters the residual linearly
    # (its pullback is the cotangent itself), so never pass several at once.
    dF = sum(pushforward(F, p, t, disconnected_outputs="ignore") for p, t in pairs)
    (dF,) = _substitute([dF], {x: solution})
    return solve_tangent(-dF)


def _substitute(outputs, replace):
    from pytensor.graph.replace import graph_replace

    keep = [o for o in outputs if not isinstance(o.type, DisconnectedType)]
    if not keep:
        return list(outputs)
    new = iter(graph_replace(keep, replace, strict=False))
    return [o if isinstance(o.type, DisconnectedType) else next(new) for o in outputs]
