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
from pytensor.graph.replace import graph_replace
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
        The solver's output ``x*`` (held fixed: no gradient flows through it).
    params
        The solver's inputs.  The same variable may appear more than once
        (e.g. a symmetric Toeplitz system passed as ``(c, c)``): each position
        gets its own cotangent.
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
    # Build the residual's VJP on fresh leaves (one per parameter *position*,
    # so repeated inputs are not double counted), then plug the real
    # variables in.  Only the leaves are replaced, so no existing graph is
    # cloned: the result stays connected to the cotangent (PyTensor's
    # double-pullback pushforward differentiates w.r.t. it) and to the
    # solution (second derivatives flow through x*).
    x_, lam_ = _leaf(solution), _leaf(lam)
    params_ = [_leaf(p) for p in params]
    F = residual(x_, *params_)
    grads = grad(
        cost=None,
        wrt=params_,
        known_grads={F: lam_},
        disconnected_inputs="ignore",
        return_disconnected="disconnected",
    )
    grads = _plug(grads, {x_: solution, lam_: lam, **dict(zip(params_, params))})
    # A parameter entering F linearly gets ``lam`` itself as cotangent, which
    # is also an intermediate of the other cotangents; PyTensor's pullback of
    # several ``f`` sharing ancestors overrides instead of accumulating, so
    # hand out a distinct variable.
    return [pt.tensor_copy(g) if g is lam else g for g in grads]


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
    pairs = [(i, t) for i, t in enumerate(tangents) if not isinstance(t.type, DisconnectedType)]
    if not pairs:
        return disconnected_type()
    x_ = _leaf(solution)
    params_ = [_leaf(p) for p in params]
    F = residual(x_, *params_)
    # One pushforward per parameter, summed: PyTensor 3.3's double-pullback
    # pushforward drops terms when a parameter enters the residual linearly
    # (its pullback is the cotangent itself), so never pass several at once.
    replace = {x_: solution, **dict(zip(params_, params))}
    dF = 0
    for i, t in pairs:
        t_ = _leaf(t)
        replace[t_] = t
        dF = dF + pushforward(F, params_[i], t_, disconnected_outputs="ignore")
    (dF,) = _plug([dF], replace)
    return solve_tangent(-dF)


def _leaf(v: Variable) -> Variable:
    return pt.as_tensor_variable(v).type()


def _plug(outputs, replace):
    """Substitute leaves by the real variables (no other node is cloned)."""
    keep = [o for o in outputs if not isinstance(o.type, DisconnectedType)]
    if not keep:
        return list(outputs)
    new = iter(graph_replace(keep, replace, strict=False))
    return [o if isinstance(o.type, DisconnectedType) else next(new) for o in outputs]
