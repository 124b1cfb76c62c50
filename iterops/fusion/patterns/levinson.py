r"""The Levinson-Durbin recursion as a Scan -> the same recursion fused (:mod:`iterops.ts.levinson_recursion`).

``levinson_durbin`` (Durbin's recursion over ``k = 0..p-1``, the coefficients
carried in a zero-padded vector of length ``p``)::

    def step(k, phi, v, gamma):
        kappa = (gamma[k + 1] - pt.sum(phi[:k] * gamma[1:k + 1][::-1])) / v
        new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
        new_phi = pt.set_subtensor(new_phi[k], kappa)
        return new_phi, v * (1 - kappa**2), kappa

    (phis, vs, kappas) = pytensor.scan(step, sequences=[pt.arange(p)],
                                       outputs_info=[pt.zeros(p), gamma[0], None],
                                       non_sequences=[gamma])
    phi, sigma2, pacf = phis[-1], vs[-1], kappas

Recognized spellings: the inner product as ``pt.sum(phi[:k] * g)`` or
``phi[:k] @ g`` (``.dot``), with ``g = gamma[1:k + 1][::-1]`` or
``gamma[k:0:-1]``; ``v * (1 - kappa**2)`` or ``v - kappa**2 * v`` (whatever
canonicalization makes equal); the per-step ``kappa`` output is optional.
Argument order, names, output order: free.

Replacement: :func:`iterops.ts.levinson_recursion.levinson_recursion`, the
same recursion in one kernel in the loop's dtype, without early exits: on
every input the loop runs on (a non-positive-definite sequence included,
where ``|kappa| >= 1`` and the loop goes on with finite numbers, or
``gamma_0 = 0``, where it divides by zero) ``phi``, ``sigma2`` and ``kappa``
agree to rounding, and gradients are the exact adjoint of the recursion
(autodiff of the loop).  Autocovariances shorter than ``order + 1`` make the
loop's ``gamma[k + 1]`` raise an ``IndexError``; the replacement raises one
too.  Conditions checked on the outer graph (otherwise the Scan stays): the
loop index is ``arange`` counting from 0; ``n_steps`` is a constant ``p`` and
the coefficients start as ``p`` zeros; ``v`` starts as ``gamma[0]`` of the
same ``gamma``; only the final ``phi`` and ``v`` are used (the ``kappa``
trace may be).
"""

from __future__ import annotations

import pytensor.tensor as pt
from pytensor.raise_op import CheckAndRaise
from pytensor.tensor.subtensor import Subtensor, indices_from_subtensor

from iterops.fusion.matcher import constant_value
from iterops.fusion.patterns._common import is_counter_sequence
from iterops.fusion.registry import Pattern, Role, register_pattern
from iterops.ts.levinson_recursion import levinson_recursion

__all__: list[str] = []


def _step(inner, lags):
    def step(k, phi, v, gamma):
        g = gamma[1:k + 1][::-1] if lags == "reverse" else gamma[k:0:-1]
        acc = pt.sum(phi[:k] * g) if inner == "sum" else phi[:k] @ g
        kappa = (gamma[k + 1] - acc) / v
        new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
        new_phi = pt.set_subtensor(new_phi[k], kappa)
        return new_phi, v * (1 - kappa**2), kappa

    return step


def _first_of(v):
    """``x`` if ``v`` is ``x[0]``, else None."""
    node = v.owner
    if node is None or not isinstance(node.op, Subtensor):
        return None
    idx = indices_from_subtensor(node.inputs[1:], node.op.idx_list)
    if len(idx) == 1 and not isinstance(idx[0], slice) and constant_value(idx[0]) == 0:
        return node.inputs[0]
    return None


def _order(m):
    return m.n_steps_value()


def _check(m):
    reason = is_counter_sequence(m.outer["k"])
    if reason:
        return reason
    p = _order(m)
    if p is None or p < 1:
        return "n_steps (the AR order) is not a constant >= 1"
    phi0 = m.outer["phi"]
    if constant_value(phi0) != 0 or phi0.type.shape[-1:] != (p,):
        return f"the coefficients do not start as {p} zeros (a vector of static length n_steps)"
    gamma = m.outer["gamma"]
    if _first_of(m.outer["v"]) is not gamma:
        return "v does not start as gamma[0] of the autocovariances the loop reads"
    if gamma.type.ndim != 1:
        return "the autocovariances are not a vector"
    n = gamma.type.shape[0]
    if n is not None and n < p + 1:
        return f"the autocovariances have {n} entries, the loop reads gamma[{p}]"
    return None


_TOO_SHORT = CheckAndRaise(IndexError, "the loop reads gamma[order], past the end of the autocovariances")


def _build(m):
    p, gamma = _order(m), m.outer["gamma"]
    gamma = _TOO_SHORT(gamma, pt.ge(gamma.shape[0], p + 1))
    res = levinson_recursion(gamma, p)
    return {"phi": res.phi, "v": res.sigma2, "kappa": res.kappa}


register_pattern(Pattern(
    name="levinson_durbin",
    replaces_with="iterops.ts.levinson_recursion",
    step=tuple(_step(i, g) for i in ("sum", "dot") for g in ("reverse", "slice")),
    sequences=(Role("k", 0, dtype="int64"),),
    states=(Role("phi", 1), Role("v", 0)),
    non_sequences=(Role("gamma", 1),),
    outputs=(Role("kappa", 0),),
    provides={"phi": "last", "v": "last"},
    check=_check,
    build=_build,
    doc="Durbin's recursion for the Yule-Walker equations (phi, v, kappa over k = 0..p-1)",
))
