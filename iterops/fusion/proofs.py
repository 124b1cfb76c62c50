"""Structural proofs about the outer inputs of a matched loop: symmetry, positive semi-definiteness, signs.

A fused Kalman filter reads the covariance inputs through their symmetric
part and reports a failed Cholesky factorisation as ``-inf``; a user's loop
reads the raw entries and may run on through an indefinite ``F``.  The two
agree exactly when the covariances are symmetric (and, for loops that never
factorise, positive semi-definite), so the patterns ask for a *proof* from
how the matrices are built, and keep the Scan without one.  Free symbolic
matrices prove nothing; the ways models build covariances do:

===============================  ==========  ====  ===========
expression                       symmetric   PSD   diagonal
===============================  ==========  ====  ===========
constant (or ``C[i]`` of one)    by value    by eigenvalues
``eye``, ``identity_like``       yes         yes   yes
``diag(v)``                      yes         if ``v >= 0``  yes
``X @ X.T``, ``X @ S @ X.T``     yes         yes (``S`` PSD)
``S1 + S2``, ``c * S``           if both     if both / ``c >= 0``
``X + X.T``, ``S.T``             yes         as ``S``
elementwise of symmetric         yes         --
``set/inc`` on the diagonal      if base     if base diagonal and values >= 0
fused Lyapunov solution          if ``Q``    if ``Q``
===============================  ==========  ====  ===========

Casts, ``specify_shape`` and ``Blockwise`` wrappers are looked through.
Non-negative scalars and vectors: non-negative constants, ``x**2`` (even
integer powers), ``abs``, ``exp``, ``sqrt``, ``softplus``, ``sigmoid``, and
sums, products, maxima of non-negative values.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytensor.scalar as ps
from pytensor.compile.ops import DeepCopyOp, ViewOp
from pytensor.graph.basic import Constant
from pytensor.tensor.basic import Alloc, ExtractDiag, Eye, get_underlying_scalar_constant_value
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.math import Dot
from pytensor.tensor.shape import Reshape, SpecifyShape
from pytensor.tensor.subtensor import AdvancedIncSubtensor, AdvancedSubtensor, IncSubtensor, Subtensor, indices_from_subtensor

__all__ = ["is_symmetric", "is_psd", "is_nonneg"]

_NONNEG_UNARY = tuple(getattr(ps, name) for name in ("Abs", "Exp", "Sqrt", "Sqr", "Softplus", "Sigmoid", "Exp2",
                                                     "Cosh", "Erfc", "Erfcx") if hasattr(ps, name))
_NONNEG_NARY = (ps.Add, ps.Mul, ps.Maximum, ps.TrueDiv)


def _core(v):
    """``v`` with casts to float, specify_shape and copies looked through."""
    while v.owner is not None:
        op = v.owner.op
        if isinstance(op, SpecifyShape | DeepCopyOp | ViewOp):
            v = v.owner.inputs[0]
        elif isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Cast | ps.Identity):
            v = v.owner.inputs[0]
        else:
            return v
    return v


def _op(v):
    op = v.owner.op if v.owner is not None else None
    return op.core_op if isinstance(op, Blockwise) else op


def _scalar_op(v):
    op = _op(v)
    return op.scalar_op if isinstance(op, Elemwise) else None


def _is_broadcast_scalar(v):
    """``v`` is a scalar broadcast to a matrix (``ExpandDims``) or a 0-d / size-1 value."""
    v = _core(v)
    if v.type.ndim == 0 or all(v.type.broadcastable):
        return True
    return isinstance(_op(v), DimShuffle) and _core(v.owner.inputs[0]).type.ndim == 0


def _transposed(v):
    """``x`` if ``v`` is ``x.T`` (a matrix transpose, or ``x.mT`` of a batch of matrices), else None."""
    op = _op(v)
    if isinstance(op, DimShuffle):
        nd = op.input_ndim
        if nd >= 2 and tuple(op.new_order) == (*range(nd - 2), nd - 1, nd - 2):
            return _core(v.owner.inputs[0])
    return None


@lru_cache(maxsize=4096)
def is_nonneg(v) -> bool:
    """Every entry of ``v`` is >= 0 (or NaN) for every input."""
    v = _core(v)
    if isinstance(v, Constant):
        data = np.asarray(v.data)
        return data.dtype.kind in "biuf" and bool(np.all(~(data < 0)))
    if v.owner is None:
        return False
    op = _op(v)
    if isinstance(op, DimShuffle | Reshape | Subtensor | AdvancedSubtensor | ExtractDiag):
        return is_nonneg(v.owner.inputs[0])  # a rearrangement of the same entries
    s = _scalar_op(v)
    if s is None:
        if isinstance(op, Eye):
            return True  # zeros and ones
        if isinstance(op, Alloc) or _diag_of(v) is not None:
            return is_nonneg(v.owner.inputs[0])
        return False
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
    if isinstance(s, _NONNEG_NARY):
        return all(is_nonneg(x) for x in v.owner.inputs)
    return False


def _diag_of(v):
    """The vector ``x`` if ``v`` is ``diag(x)`` (an ``AllocDiag`` with offset 0), else None."""
    op = _op(v)
    if op is not None and type(op).__name__ == "AllocDiag" and getattr(op, "offset", 0) == 0:
        return v.owner.inputs[0]
    return None


def _is_lyapunov(op):
    # iterops' solver returns NaN for an unstable A, so its solution is PSD whenever Q is
    return type(op).__name__ == "DiscreteLyapunov"


def _diagonal_write(v):
    """``(base, values)`` if ``v`` writes ``values`` at diagonal positions of ``base`` only, else None."""
    op = _op(v)
    if isinstance(op, AdvancedIncSubtensor):
        base, values, *idx = v.owner.inputs
        if len(idx) == 2:
            i, j = (_core(x) for x in idx)
            if i is j or (isinstance(i, Constant) and isinstance(j, Constant)
                          and np.array_equal(np.asarray(i.data), np.asarray(j.data))):
                return base, values
    elif isinstance(op, IncSubtensor):
        base, values, *rest = v.owner.inputs
        idx = indices_from_subtensor(rest, op.idx_list)
        if len(idx) == 2 and not any(isinstance(x, slice) for x in idx):
            i, j = (_core(x) if hasattr(x, "owner") else x for x in idx)
            if i is j or (isinstance(i, Constant) and isinstance(j, Constant) and np.asarray(i.data) == np.asarray(j.data)):
                return base, values
    return None


def _full_write(v):
    """``(base, values)`` if ``v`` writes ``values`` over the whole matrix ``base[:, :]``, else None."""
    op = _op(v)
    if isinstance(op, IncSubtensor):
        base, values, *rest = v.owner.inputs
        idx = indices_from_subtensor(rest, op.idx_list)
        if len(idx) <= 2 and all(isinstance(x, slice) and x == slice(None) for x in idx):
            return base, values
    return None


def _constant_data(v):
    """The value of ``v`` if it is a constant, or a constant read with constant indices (``C[0]``), else None."""
    v = _core(v)
    if isinstance(v, Constant):
        return np.asarray(v.data)
    op = _op(v)
    if isinstance(op, Subtensor) and isinstance(_core(v.owner.inputs[0]), Constant):
        idx = indices_from_subtensor(v.owner.inputs[1:], op.idx_list)
        try:
            key = tuple(slice(*(None if x is None else int(get_underlying_scalar_constant_value(x))
                                for x in (i.start, i.stop, i.step))) if isinstance(i, slice)
                        else int(get_underlying_scalar_constant_value(i)) for i in idx)
        except (NotScalarConstantError, TypeError, ValueError):
            return None
        return np.asarray(_core(v.owner.inputs[0]).data)[key]
    return None


@lru_cache(maxsize=4096)
def _facts(v) -> tuple[bool, bool, bool]:
    """``(symmetric, psd, diagonal)`` for the matrix ``v`` (last two axes)."""
    v = _core(v)
    no = (False, False, False)
    if v.type.ndim < 2:
        return no
    if v.type.shape[-2:] == (1, 1):
        return True, is_nonneg(v), True  # a 1 x 1 matrix
    if (data := _constant_data(v)) is not None:
        data = np.asarray(data, dtype=float)
        if data.shape[-1] != data.shape[-2]:
            return no
        sym = bool(np.array_equal(data, np.swapaxes(data, -1, -2)))
        diag = sym and bool(np.array_equal(data, data * np.eye(data.shape[-1])))
        psd = sym and bool(np.all(np.linalg.eigvalsh(data) >= 0)) if np.all(np.isfinite(data)) else False
        return sym, psd, diag
    if v.owner is None:
        return no
    op = _op(v)
    if isinstance(op, Eye):
        n, m, k = (_core(x) for x in v.owner.inputs)
        ok = isinstance(k, Constant) and int(np.asarray(k.data)) == 0 and (n is m or (
            isinstance(n, Constant) and isinstance(m, Constant) and np.asarray(n.data) == np.asarray(m.data)))
        return (ok, ok, ok)
    if isinstance(op, Alloc) and len(v.owner.inputs) >= 3 and _is_broadcast_scalar(v.owner.inputs[0]):
        value, *shape = v.owner.inputs
        n, m = (_core(x) for x in shape[-2:])
        if not (n is m or (isinstance(n, Constant) and isinstance(m, Constant)
                           and np.asarray(n.data) == np.asarray(m.data))):
            return no
        c = _core(value)
        zero = isinstance(c, Constant) and bool(np.all(np.asarray(c.data) == 0))
        return True, is_nonneg(value), zero  # every entry the same value
    if (x := _diag_of(v)) is not None:
        return True, is_nonneg(x), True
    if (x := _transposed(v)) is not None:
        return _facts(x)
    if isinstance(op, Dot):
        return _product_facts(v)
    if (w := _diagonal_write(v)) is not None:
        sym, psd, diag = _facts(w[0])
        pos = is_nonneg(w[1])
        return sym, psd and diag and pos, diag
    if (w := _full_write(v)) is not None:
        if _is_broadcast_scalar(w[1]):
            return True, is_nonneg(w[1]), False  # every entry the same value
        return _facts(w[1])
    if _is_lyapunov(op):
        q = v.owner.inputs[1]
        sym, psd, _ = _facts(q)
        return sym, psd, False
    s = _scalar_op(v)
    if s is None:
        return no
    ins = v.owner.inputs
    mats = [x for x in ins if not _is_broadcast_scalar(x)]
    if isinstance(s, ps.Add) and len(ins) == 2 and (t := _transposed(ins[1])) is not None and t is _core(ins[0]):
        return True, False, False  # X + X.T
    facts = [_facts(x) for x in mats]
    sym = bool(mats) and all(f[0] for f in facts)
    diag = sym and all(f[2] for f in facts) and isinstance(s, ps.Add | ps.Mul | ps.Sub | ps.Neg)
    if isinstance(s, ps.Add):
        psd = sym and all(f[1] for f in facts) and all(is_nonneg(x) for x in ins if _is_broadcast_scalar(x))
    elif isinstance(s, ps.Mul):
        psd = sym and len(mats) == 1 and facts[0][1] and all(is_nonneg(x) for x in ins if x not in mats)
    else:
        psd = False
    return sym, psd, diag


def _product_facts(v):
    """``X @ X.T`` (PSD), ``X @ S @ X.T`` (symmetric / PSD as ``S``), products of diagonal matrices."""
    a, b = (_core(x) for x in v.owner.inputs)
    if (t := _transposed(b)) is not None:
        if t is a:
            return True, True, False
        if a.owner is not None and isinstance(_op(a), Dot):
            x, s = (_core(y) for y in a.owner.inputs)
            if x is t:
                sym, psd, _ = _facts(s)
                return sym, psd, False
    fa, fb = _facts(a), _facts(b)
    if fa[2] and fb[2]:
        return True, False, True
    return False, False, False


def is_symmetric(v) -> bool:
    """``v`` (a square matrix) equals its transpose for every input."""
    return _facts(v)[0]


def is_psd(v) -> bool:
    """``v`` is symmetric positive semi-definite for every input (in exact arithmetic)."""
    return _facts(v)[1]
