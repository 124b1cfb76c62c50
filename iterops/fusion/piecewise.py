"""Exact symbolic evaluation of integer index expressions as piecewise-linear functions of one length.

The matcher must prove that an index the user wrote into a Scan's output
(after PyTensor's ``local_subtensor_merge`` has folded ``out[:N][-1]`` or
``out[1:][-1]`` into ``switch``/``minimum`` clamps of the buffer length
``L``) selects the last row *for every* ``L``.  Such an expression, built
from ``L`` and integer constants with ``+ - neg abs max min switch``,
comparisons, boolean logic and multiplication by constants, is a
piecewise-linear function of ``L`` on the integers.  :class:`PiecewiseLinear`
represents it exactly (integer coefficients, integer breakpoints), so the
proof costs O(nodes x pieces), independent of the constants' magnitudes
(``out[:10**8][-1]`` is as cheap as ``out[:3][-1]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytensor.scalar as ps
from pytensor.graph.basic import Constant
from pytensor.graph.traversal import io_toposort
from pytensor.tensor.basic import ScalarFromTensor, TensorFromScalar
from pytensor.tensor.elemwise import DimShuffle, Elemwise

__all__ = ["PiecewiseLinear", "evaluate"]


@dataclass(frozen=True)
class PiecewiseLinear:
    """``f(L) = a_j L + b_j`` for integer ``L`` in ``[start_j, start_{j+1})``, the last piece unbounded.

    ``pieces``: tuple of ``(start, a, b)`` with strictly increasing starts; the
    domain is ``L >= pieces[0][0]``.  Coefficients are Python ints (or
    Fractions, never produced by the supported operations).
    """

    pieces: tuple

    @classmethod
    def constant(cls, lo: int, c) -> PiecewiseLinear:
        return cls(((lo, 0, c),))

    @classmethod
    def identity(cls, lo: int) -> PiecewiseLinear:
        return cls(((lo, 1, 0),))

    def starts(self):
        return [s for s, _, _ in self.pieces]

    def at(self, L):
        """The piece ``(a, b)`` in force at ``L``."""
        a = b = None
        for s, pa, pb in self.pieces:
            if s > L:
                break
            a, b = pa, pb
        return a, b

    def __call__(self, L):
        a, b = self.at(L)
        return a * L + b

    def refined(self, starts) -> PiecewiseLinear:
        """The same function on the union of its breakpoints and ``starts`` (those inside the domain)."""
        lo = self.pieces[0][0]
        all_starts = sorted({*self.starts(), *(s for s in starts if s > lo)})
        return PiecewiseLinear(tuple((s, *self.at(s)) for s in all_starts))


def _roots(a, b, lo, hi):
    """Breakpoints where the sign of ``a L + b`` may change on the integers of ``(lo, hi)``."""
    if a == 0:
        return []
    r = Fraction(-b) / Fraction(a)
    cands = {math.ceil(r), math.floor(r) + 1}
    return [c for c in cands if lo < c and (hi is None or c < hi)]


def _common(*fs):
    """The functions refined to a common set of breakpoints (same pieces)."""
    starts = sorted({s for f in fs for s in f.starts()})
    return [f.refined(starts) for f in fs]


def _split_by_sign(fs, diffs):
    """Refine ``fs`` (common pieces) so that each linear ``diff(f..)`` has a constant sign per piece."""
    fs = _common(*fs)
    extra = []
    pieces = list(zip(*(f.pieces for f in fs)))
    for j, ps_ in enumerate(pieces):
        lo = ps_[0][0]
        hi = pieces[j + 1][0][0] if j + 1 < len(pieces) else None
        coeffs = [(p[1], p[2]) for p in ps_]
        for diff in diffs:
            a, b = diff(coeffs)
            extra += _roots(a, b, lo, hi)
    return [f.refined(extra) for f in fs]


def _map(fs, fn):
    """``fn(L0, [(a, b) per f]) -> (a, b)`` on each common piece (``L0`` its start)."""
    pieces = zip(*(f.pieces for f in fs))
    return PiecewiseLinear(tuple((p[0][0], *fn(p[0][0], [(q[1], q[2]) for q in p])) for p in pieces))


def _sign_at(L0, a, b):
    v = a * L0 + b
    return (v > 0) - (v < 0)


def _linear(op, fs):
    fs = _common(*fs)
    if op is ps.Add:
        return _map(fs, lambda L0, c: (sum(a for a, _ in c), sum(b for _, b in c)))
    if op is ps.Sub:
        return _map(fs, lambda L0, c: (c[0][0] - c[1][0], c[0][1] - c[1][1]))
    if op is ps.Neg:
        return _map(fs, lambda L0, c: (-c[0][0], -c[0][1]))
    if op in (ps.Cast, ps.Identity):
        return fs[0]
    raise NotImplementedError(op)


_COMPARE = {
    ps.LT: lambda s: s < 0, ps.LE: lambda s: s <= 0, ps.GT: lambda s: s > 0, ps.GE: lambda s: s >= 0,
    ps.EQ: lambda s: s == 0, ps.NEQ: lambda s: s != 0,
}


def _apply(op, fs, node_inputs) -> PiecewiseLinear:
    if op in (ps.Add, ps.Sub, ps.Neg, ps.Cast, ps.Identity):
        return _linear(op, fs)
    if op is ps.Mul:
        consts = [f for f, x in zip(fs, node_inputs) if isinstance(x, Constant)]
        k = math.prod(int(f.pieces[0][2]) for f in consts)
        rest = [f for f, x in zip(fs, node_inputs) if not isinstance(x, Constant)]
        if len(rest) > 1:
            raise NotImplementedError("product of two non-constants")
        if not rest:
            return consts[0].__class__.constant(consts[0].pieces[0][0], k)
        return _map([rest[0]], lambda L0, c: (k * c[0][0], k * c[0][1]))
    if op is ps.Abs:
        (f,) = _split_by_sign([fs[0]], [lambda c: c[0]])
        return _map([f], lambda L0, c: c[0] if _sign_at(L0, *c[0]) >= 0 else (-c[0][0], -c[0][1]))
    if op in (ps.Maximum, ps.Minimum):
        f, g = _split_by_sign(fs, [lambda c: (c[0][0] - c[1][0], c[0][1] - c[1][1])])
        take_f = (lambda s: s >= 0) if op is ps.Maximum else (lambda s: s <= 0)
        return _map([f, g], lambda L0, c: c[0] if take_f(_sign_at(L0, c[0][0] - c[1][0], c[0][1] - c[1][1])) else c[1])
    if op in _COMPARE:
        f, g = _split_by_sign(fs, [lambda c: (c[0][0] - c[1][0], c[0][1] - c[1][1])])
        rel = _COMPARE[op]
        return _map([f, g], lambda L0, c: (0, int(rel(_sign_at(L0, c[0][0] - c[1][0], c[0][1] - c[1][1])))))
    if op in (ps.AND, ps.OR, ps.XOR, ps.Invert):
        fs = _common(*fs)
        if any(a != 0 or b not in (0, 1) for f in fs for _, a, b in f.pieces):
            raise NotImplementedError("bitwise logic on non-boolean values")
        logic = {ps.AND: lambda v: int(all(v)), ps.OR: lambda v: int(any(v)), ps.XOR: lambda v: sum(v) % 2,
                 ps.Invert: lambda v: 1 - v[0]}[op]
        return _map(fs, lambda L0, c: (0, logic([b for _, b in c])))
    if op is ps.Switch:
        cond, x, y = _common(*fs)
        if any(a != 0 for _, a, _ in cond.pieces):
            raise NotImplementedError("switch on a non-boolean condition")
        return _map([cond, x, y], lambda L0, c: c[1] if c[0][1] else c[2])
    raise NotImplementedError(op)


def evaluate(output, length, lo: int) -> PiecewiseLinear | None:
    """``output`` (an integer scalar graph of the variable ``length`` and constants) as a function of ``length >= lo``.

    Returns None when the graph holds anything else (floats, other inputs,
    division, products of two non-constants, ...).
    """
    values = {length: PiecewiseLinear.identity(lo)}
    for node in io_toposort([length], [output]):
        if isinstance(node.op, ScalarFromTensor | TensorFromScalar) or (
                isinstance(node.op, DimShuffle) and node.inputs[0].type.ndim == 0):
            src = node.inputs[0]
        elif isinstance(node.op, Elemwise | ps.ScalarOp):
            src = None
        else:
            return None
        ins = []
        for x in node.inputs:
            if x in values:
                ins.append(values[x])
            elif isinstance(x, Constant):
                data = np.asarray(x.data)
                if data.size != 1 or data.dtype.kind not in "biu":
                    return None
                ins.append(PiecewiseLinear.constant(lo, int(data.reshape(()))))
            else:
                return None  # depends on something else than the length
        out = node.outputs[0]
        if str(out.type.dtype).startswith(("float", "complex")):
            return None
        if src is not None:
            values[out] = values.get(src) or ins[0]
            continue
        sop = node.op.scalar_op if isinstance(node.op, Elemwise) else node.op
        try:
            values[out] = _apply(type(sop), ins, node.inputs)
        except NotImplementedError:
            return None
    return values.get(output)
