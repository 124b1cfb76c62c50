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

Accepted spellings (each part independently):

===================  ================================================================
inner product        ``pt.sum(phi[:k] * g)`` or ``phi[:k] @ g`` (``.dot``)
lagged ``gamma``     ``g = gamma[1:k + 1][::-1]`` or ``gamma[k:0:-1]``
variance update      ``v * (1 - kappa**2)``, ``v - kappa**2 * v`` or
                     ``v * (1 - kappa) * (1 + kappa)`` (the fused recursion runs the
                     spelling the loop uses: ``v_update=``, so that cancellation near
                     ``|kappa| = 1``, signed zeros and overflow are the loop's)
``kappa`` output     optional
===================  ================================================================

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
from iterops.fusion.registry import Pattern, Role, one_of, register_pattern
from iterops.reference_loops import LEVINSON_V_UPDATES
from iterops.ts.levinson_recursion import V_UPDATES, levinson_recursion

__all__: list[str] = []


def _step(v_update):
    def step(k, phi, v, gamma):
        g = one_of(gamma[1:k + 1][::-1], gamma[k:0:-1])
        acc = one_of(pt.sum(phi[:k] * g), phi[:k] @ g)
        kappa = (gamma[k + 1] - acc) / v
        new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
        new_phi = pt.set_subtensor(new_phi[k], kappa)
        return new_phi, LEVINSON_V_UPDATES[v_update](v, kappa), kappa

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
    res = levinson_recursion(gamma, p, v_update=V_UPDATES[m.variant])
    return {"phi": res.phi, "v": res.sigma2, "kappa": res.kappa}


register_pattern(Pattern(
    name="levinson_durbin",
    replaces_with="iterops.ts.levinson_recursion",
    step=tuple(_step(u) for u in V_UPDATES),
    sequences=(Role("k", 0, dtype="int64"),),
    states=(Role("phi", 1), Role("v", 0)),
    non_sequences=(Role("gamma", 1),),
    outputs=(Role("kappa", 0),),
    provides={"phi": "last", "v": "last"},
    check=_check,
    build=_build,
    doc="Durbin's recursion for the Yule-Walker equations (phi, v, kappa over k = 0..p-1)",
))
