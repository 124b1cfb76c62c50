"""Facts the fusion patterns need about covariance inputs, from PyTensor's assumption system.

A fused Kalman filter reads the covariances through their symmetric part and
reports a failed Cholesky factorisation; the user's loop reads the raw
entries and may run on through an indefinite ``F``.  The two agree when the
covariances are symmetric (and, for loops that never factorise, positive
semi-definite), so the patterns ask :func:`is_symmetric` / :func:`is_psd` and
keep the Scan without a proof (contract: :mod:`iterops.fusion`, item 2).

* **symmetric**: PyTensor's ``SYMMETRIC`` (declared with ``assume(x,
  symmetric=True)`` or inferred by its rules), or PSD below, or a symmetric
  constant or 1 x 1 matrix.  Registered here on ``SYMMETRIC``: writes on the
  diagonal of a symmetric matrix (set or inc), iterops' ``block_diag``, and
  Lyapunov solutions (iterops' and PyTensor's) of a symmetric or PSD ``Q``.
* **positive semi-definite**: iterops' key ``positive_semidefinite`` (PyTensor's
  inferred ``positive_definite`` counts ``X X^T`` as definite and any Lyapunov
  solution as definite).  Declared ``positive_definite`` counts; inferred:

  ==============================================  ===============================
  constant                                        symmetric, eigenvalues >= 0
  ``eye``, ``diag(v)``, scalar fill ``c``           ``v >= 0``, ``c >= 0``
  ``X @ X.T``, ``X.T @ X``, ``M @ S @ M.T``          ``S`` PSD
  ``r * q * r.T`` (``r`` a column)                 ``q >= 0``
  ``S1 + S2``, ``S1 * S2`` (Schur), ``c * S``, ``S / c``  operands PSD, scalars ``>= 0``
  ``inc_subtensor(S[:, :], W)``                     ``S`` and ``W`` PSD
  diagonal write: ``inc`` / ``set``                ``S`` PSD / PSD and diagonal; values ``>= 0``
  block diagonals, Kronecker products, transposes  blocks PSD
  ==============================================  ===============================

  Not inferred: Lyapunov solutions (PSD only for a stable ``A``), inverses.
  The key is iterops' own, so PyTensor's rewrites never act on these facts.
* **non-negative** scalars (:func:`is_nonneg`): non-negative constants, even
  powers, ``abs``, ``exp``, ``sqrt``, ``softplus``, ``sigmoid``, and sums,
  products and maxima of non-negative values.

Facts are inferred on the graph of the matrix alone, so a promise read off a
use (``solve(S, b, assume_a="pos")``) counts only inside its construction.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytensor.scalar as ps
from pytensor.assumptions import (
    DIAGONAL,
    POSITIVE_DEFINITE,
    SYMMETRIC,
    AssumptionFeature,
    AssumptionKey,
    FactState,
    SpecifyAssumptions,
    register_assumption,
    register_matrix_property_rules,
)
from pytensor.assumptions.alloc import alloc_diag_rule, eye_identity_rule
from pytensor.assumptions.core import register_constant_inference, true_if
from pytensor.assumptions.dimshuffle import conjugate_transpose_input
from pytensor.assumptions.dot import match_congruence
from pytensor.compile.ops import DeepCopyOp, ViewOp
from pytensor.graph.basic import Constant
from pytensor.graph.fg import FunctionGraph
from pytensor.tensor.basic import Alloc, AllocDiag, ExtractDiag, Eye, get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.linalg.constructors import BlockDiagonal
from pytensor.tensor.linalg.products import KroneckerProduct
from pytensor.tensor.linalg.solvers.linear_control import SolveBilinearDiscreteLyapunov
from pytensor.tensor.math import Dot
from pytensor.tensor.shape import Reshape, SpecifyShape
from pytensor.tensor.subtensor import AdvancedIncSubtensor, AdvancedSubtensor, IncSubtensor, Subtensor, indices_from_subtensor

from iterops.linalg.block_diag import BlockDiag
from iterops.linalg.lyapunov import DiscreteLyapunov

__all__ = ["PSD", "is_symmetric", "is_psd", "is_nonneg"]

#: Positive semi-definite (symmetric, ``x^T S x >= 0``): ``assume(S, positive_semidefinite=True)``.
PSD = AssumptionKey("positive_semidefinite", short_name="psd")

_NONNEG_UNARY = tuple(getattr(ps, name) for name in ("Abs", "Exp", "Sqrt", "Sqr", "Softplus", "Sigmoid", "Exp2",
                                                     "Cosh", "Erfc", "Erfcx") if hasattr(ps, name))
_NONNEG_NARY = (ps.Add, ps.Mul, ps.Maximum, ps.TrueDiv)


def _core(v):
    """``v`` with casts to float, specify_shape and copies looked through."""
    while v.owner is not None:
        op = v.owner.op
        if isinstance(op, SpecifyShape | DeepCopyOp | ViewOp | SpecifyAssumptions):
            v = v.owner.inputs[0]
        elif isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Cast | ps.Identity):
            v = v.owner.inputs[0]
        else:
            return v
    return v


def _scalar_like(x):
    """``x`` is the same value at every entry of a matrix it broadcasts to (a 0-d or 1 x 1 value)."""
    return x.type.ndim == 0 or (x.type.ndim >= 2 and all(x.type.broadcastable[-2:])) or x.type.shape[-2:] == (1, 1)


@lru_cache(maxsize=4096)
def is_nonneg(v) -> bool:
    """Every entry of ``v`` is >= 0 (or NaN) for every input."""
    v = _core(v)
    if isinstance(v, Constant):
        data = np.asarray(v.data)
        return data.dtype.kind in "biuf" and bool(np.all(~(data < 0)))
    if v.owner is None:
        return False
    op = v.owner.op
    op = getattr(op, "core_op", op)
    if isinstance(op, DimShuffle | Reshape | Subtensor | AdvancedSubtensor | ExtractDiag | AllocDiag | Alloc):
        return is_nonneg(v.owner.inputs[0])  # a rearrangement of the same entries (and zeros)
    if isinstance(op, Eye):
        return True
    if not isinstance(op, Elemwise):
        return False
    s = op.scalar_op
    if isinstance(s, _NONNEG_UNARY):
        return True
    if isinstance(s, ps.Pow):
        base, expo = v.owner.inputs
        try:
            e = float(get_underlying_scalar_constant_value(expo))
        except (NotScalarConstantError, TypeError, ValueError):
            e = None
        if e is not None and e == round(e) and e % 2 == 0:
            return True  # an even integer power
        return is_nonneg(base)
    if isinstance(s, ps.Mul) and len(v.owner.inputs) == 2 and _core(v.owner.inputs[0]) is _core(v.owner.inputs[1]):
        return True  # x * x
    if isinstance(s, _NONNEG_NARY):
        return all(is_nonneg(x) for x in v.owner.inputs)
    return False


def _feature(v):
    """Facts on the graph of ``v`` alone: they come from how ``v`` is built, not from the rest of the user's graph."""
    feature = AssumptionFeature()
    FunctionGraph(outputs=[v], clone=False).attach_feature(feature)
    return feature


def _symmetric(feature, x):
    return feature.check(x, SYMMETRIC) or feature.check(x, PSD)


def is_symmetric(v) -> bool:
    """``v`` (square, last two axes) equals its transpose, by declaration or proof."""
    if v.type.ndim >= 2 and v.type.shape[-2:] == (1, 1):
        return True
    if isinstance(c := _core(v), Constant):
        return _symmetric_constant(c) is FactState.TRUE
    return _symmetric(_feature(v), v)


def is_psd(v) -> bool:
    """``v`` is symmetric positive semi-definite, by declaration (``positive_definite``,
    ``positive_semidefinite``) or proof (in exact arithmetic)."""
    if _scalar_like(v) and v.type.ndim >= 2:
        return is_nonneg(v)
    return _feature(v).check(v, PSD)


# ---------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------


def _psd(feature, x):
    """``x`` is PSD as an operand of an entrywise operation (a scalar-like value: >= 0)."""
    if _scalar_like(x):
        return is_nonneg(x)
    return x.type.ndim >= 2 and feature.check(x, PSD)


def _symmetric_constant(var):
    data = np.asarray(var.data)
    if data.ndim < 2 or data.shape[-1] != data.shape[-2] or data.dtype.kind not in "biufc":
        return FactState.UNKNOWN
    return true_if(bool(np.array_equal(data, np.swapaxes(data, -1, -2))), else_false=True)[0]


def _psd_constant(var):
    data = np.asarray(var.data)
    if data.ndim < 2 or data.shape[-1] != data.shape[-2] or data.dtype.kind not in "biuf":
        return FactState.UNKNOWN
    data = data.astype(float)
    if not (np.all(np.isfinite(data)) and np.array_equal(data, np.swapaxes(data, -1, -2))):
        return FactState.UNKNOWN
    return true_if(bool(np.all(np.linalg.eigvalsh(data) >= 0)))[0]


register_constant_inference(PSD, _psd_constant)
register_matrix_property_rules(PSD)  # batch views, reshapes, Alloc along batch axes, set_subtensor
register_assumption(PSD, Eye)(eye_identity_rule)


@register_assumption(PSD, SpecifyAssumptions)
def _declared_positive_definite(key, op, feature, fgraph, node, input_states):
    return true_if(any(k == POSITIVE_DEFINITE and s is FactState.TRUE for k, s in op.assumptions))


@register_assumption(PSD, DeepCopyOp, ViewOp)
def _same_value(key, op, feature, fgraph, node, input_states):
    return [input_states[0]]


@register_assumption(PSD, AllocDiag)
@alloc_diag_rule
def _alloc_diag(key, op, feature, fgraph, node, input_states):
    return true_if(op.offset == 0 and is_nonneg(node.inputs[0]))


def _same_size(n, m):
    n, m = _core(n), _core(m)
    return n is m or (isinstance(n, Constant) and isinstance(m, Constant) and np.asarray(n.data) == np.asarray(m.data))


@register_assumption(PSD, Alloc)
def _alloc_fill(key, op, feature, fgraph, node, input_states):
    """``c`` at every entry of a square matrix: ``c 1 1^T``, PSD for ``c >= 0``."""
    value, *shape = node.inputs
    return true_if(len(shape) >= 2 and _scalar_like(value) and _same_size(*shape[-2:]) and is_nonneg(value))


@register_assumption(PSD, DimShuffle)
def _transpose(key, op, feature, fgraph, node, input_states):
    return true_if(op.is_matrix_transpose and input_states[0] is FactState.TRUE)


@register_assumption(PSD, Dot)
def _gram(key, op, feature, fgraph, node, input_states):
    """``X X^T``, ``X^T X``; ``M S M^T`` with ``S`` PSD (real matrices)."""
    a, b = node.inputs
    if a.type.dtype.startswith("complex"):
        return [FactState.UNKNOWN]
    if conjugate_transpose_input(b) is a or conjugate_transpose_input(a) is b:
        return [FactState.TRUE]
    s = match_congruence(node)
    return true_if(s is not None and _psd(feature, s))


@register_assumption(PSD, Elemwise)
def _entrywise(key, op, feature, fgraph, node, input_states):
    """Sums and (Schur) products of PSD matrices and non-negative scalars; ``S / c``; casts."""
    s, ins = op.scalar_op, node.inputs
    if node.outputs[0].type.ndim < 2:
        return [FactState.UNKNOWN] * len(node.outputs)
    if isinstance(s, ps.Cast | ps.Identity):
        return [input_states[0]]
    if isinstance(s, ps.Mul):
        # a column times its transpose, broadcast: the outer product x x^T
        ins, pairs = _without_transpose_pairs(_factors(node.outputs[0]), column=True)
        return true_if((pairs or any(not _scalar_like(x) for x in ins)) and all(_psd(feature, x) for x in ins))
    if isinstance(s, ps.Add):
        return true_if(any(not _scalar_like(x) for x in ins) and all(_psd(feature, x) for x in ins))
    if isinstance(s, ps.TrueDiv):
        return true_if(_psd(feature, ins[0]) and _scalar_like(ins[1]) and is_nonneg(ins[1]))
    return [FactState.UNKNOWN]


def _factors(x):
    """The operands of the (nested) entrywise product ``x``."""
    if x.owner is not None and isinstance(x.owner.op, Elemwise) and isinstance(x.owner.op.scalar_op, ps.Mul):
        return [f for i in x.owner.inputs for f in _factors(i)]
    return [x]


def _without_transpose_pairs(ins, column=False):
    """``ins`` without the pairs ``(X, X.T)`` (``X`` a column, shape ``(n, 1)``, if ``column``), and how many."""
    rest, pairs = list(ins), 0
    for x in ins:
        t = conjugate_transpose_input(x)
        if t is None or x not in rest or t not in rest or (column and t.type.shape[-1:] != (1,)):
            continue
        rest.remove(x)
        rest.remove(t)
        pairs += 1
    return rest, pairs


def _diagonal_write(node):
    """``(base, values)`` if ``node`` writes ``values`` at diagonal positions of ``base`` only, else None."""
    op = node.op
    base, values, *idx = node.inputs
    if isinstance(op, IncSubtensor):
        idx = indices_from_subtensor(idx, op.idx_list)
        if any(isinstance(x, slice) for x in idx):
            return None
    elif not isinstance(op, AdvancedIncSubtensor):
        return None
    if len(idx) != 2 or base.type.ndim != 2:
        return None
    i, j = (_core(x) if hasattr(x, "owner") else x for x in idx)
    if i is j or (isinstance(i, Constant) and isinstance(j, Constant)
                  and np.array_equal(np.asarray(i.data), np.asarray(j.data))):
        return base, values
    return None


@register_assumption(SYMMETRIC, IncSubtensor, AdvancedIncSubtensor)
def _symmetric_diagonal_write(key, op, feature, fgraph, node, input_states):
    """Setting or adding to diagonal entries keeps a matrix symmetric."""
    return true_if(_diagonal_write(node) is not None and input_states[0] is FactState.TRUE)


@register_assumption(PSD, IncSubtensor, AdvancedIncSubtensor)
def _psd_write(key, op, feature, fgraph, node, input_states):
    """``inc`` of a PSD matrix over the whole matrix (PSD + PSD), or ``values >= 0`` on the diagonal:
    ``inc`` adds ``diag(values)``; ``set`` replaces the diagonal, PSD only if the base is diagonal."""
    if (w := _diagonal_write(node)) is not None:
        base, values = w
        ok = input_states[0] is FactState.TRUE and is_nonneg(values)
        return true_if(ok and (not op.set_instead_of_inc or feature.check(base, DIAGONAL)))
    if isinstance(op, IncSubtensor) and not op.set_instead_of_inc and all(
            x == slice(None) for x in op.idx_list[-2:]) and len(op.idx_list) >= min(2, node.inputs[0].type.ndim):
        return true_if(input_states[0] is FactState.TRUE and _psd(feature, node.inputs[1]))
    return [FactState.UNKNOWN]


def _all_inputs(test):
    def rule(key, op, feature, fgraph, node, input_states):
        return true_if(all(test(feature, x, key) for x in node.inputs))
    return rule


_blocks_have_key = _all_inputs(lambda feature, x, key: feature.check(x, key))
register_assumption(PSD, BlockDiagonal, KroneckerProduct)(_all_inputs(lambda feature, x, key: _psd(feature, x)))
# iterops' Ops: block_diag of a stack of blocks; the Lyapunov solution is symmetric for a symmetric Q
# wherever the equation has a unique solution (elsewhere the solver returns NaN), PSD only for a stable A
register_assumption(PSD, BlockDiag)(_blocks_have_key)
for _key in (SYMMETRIC, POSITIVE_DEFINITE, DIAGONAL):
    register_assumption(_key, BlockDiag)(_blocks_have_key)


@register_assumption(SYMMETRIC, DiscreteLyapunov, SolveBilinearDiscreteLyapunov)
def _lyapunov_symmetric(key, op, feature, fgraph, node, input_states):
    return true_if(_symmetric(feature, node.inputs[1]))
