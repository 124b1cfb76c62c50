"""Stage 2 of the matcher: unification of the user's step with a pattern's reference step.

Nothing here knows a specific algorithm (see :mod:`iterops.fusion.matcher`
for the stages together).  The reference step is built on fresh symbolic
inputs, one per role, and canonicalized like the user's graph
(:func:`_ref_graph`).

The two graphs are *unified*: walking both from the outputs, reference
inputs (roles) are bound to user inner inputs of the same kind (sequence,
state, non-sequence), so the order and names of the user's sequences,
states, non-sequences and outputs do not matter.  Operand order of
commutative operations (``add``, ``mul``, ``maximum``, ``and``, ...) is
free, nested ``add``/``mul`` are flattened, sums with ``sub``/``neg``/
``-1 *`` are compared as sums of signed terms, chains of ``Dot`` (and
matrix-vector products) are compared as products (associativity),
``a > b`` equals ``b < a``, widening float casts of inputs and constants
and ``specify_shape`` are transparent (a narrowing cast, or a widening
one of a computed value, is a different computation and never matches), and a role marked ``constant_ok`` (a tolerance, a jitter) may
be a constant in the user's step, also where the reference broadcasts it.
A step holding non-scalar constants (``pytensor.scan`` moves constant
non-sequences such as ``np.eye(1)`` into the step) that matches no
pattern is matched again with those constants lifted to non-sequence
inputs, so constant system matrices bind to matrix roles.
Static shape constants match ``x.shape[d]`` when ``x``'s static shape says
so, and a reference expression of shapes and constant roles (``eye(m) *
jitter``) matches a user constant when, specialized to the user's static
shapes and constants, it folds to that constant;
Per-step outputs (``outputs_info=None``) of the user's loop that are used
outside must each unify with one of the pattern's ``outputs``.

A failed unification is a :class:`~iterops.fusion.registry.Rejection` value
(nothing is raised) naming the deepest point where the graphs differ in the
furthest stage reached (stop rule, state updates, per-step outputs), which
``iterops.explain`` shows for near misses; a difference inside an
alternative of a ``one_of`` counts only when no alternative unifies.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.ops import DeepCopyOp, ViewOp
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.graph.traversal import ancestors
from pytensor.scan.utils import until
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Dot
from pytensor.tensor.shape import Shape, Shape_i, SpecifyShape
from pytensor.tensor.subtensor import Subtensor

from iterops.fusion.canonical import _canonicalize, _rebuild, _UserGraph
from iterops.fusion.registry import OneOf, Pattern, Rejection

__all__ = ["Rejection"]

_COMMUTATIVE = (ps.Add, ps.Mul, ps.Maximum, ps.Minimum, ps.AND, ps.OR, ps.XOR, ps.EQ, ps.NEQ)
_ASSOCIATIVE = (ps.Add, ps.Mul, ps.Maximum, ps.Minimum, ps.AND, ps.OR, ps.XOR)
_FLIP = {ps.GT: ps.LT, ps.GE: ps.LE}


# ---------------------------------------------------------------------------
# Reference graphs
# ---------------------------------------------------------------------------


@dataclass
class _RefGraph:
    role_of: dict  # ref input -> (Role, kind)
    updates: list  # per state role, canonical update
    outputs: list  # per output role, canonical per-step output
    cond: Variable | None
    used_roles: frozenset  # roles the states' updates and the stop read


_REF_CACHE: dict = {}


def _parse_step_return(ret):
    """``(outputs, until condition or None)`` of a step's return value."""
    cond = None
    if isinstance(ret, until):
        return [], ret.condition
    if isinstance(ret, tuple | list) and ret and isinstance(ret[-1], until):
        cond = ret[-1].condition
        ret = ret[0] if len(ret) == 2 and isinstance(ret[0], tuple | list) else ret[:-1]
    if isinstance(ret, Variable):
        ret = [ret]
    return list(ret), cond


def _is_one_of(v) -> bool:
    return v.owner is not None and isinstance(v.owner.op, OneOf)


def _mandatory_roles(outputs, role_of) -> set:
    """The role inputs every way of matching ``outputs`` reads (a :func:`~iterops.fusion.registry.one_of`
    requires only the roles all of its alternatives read)."""
    memo: dict = {}

    def need(v):
        if v in memo:
            return memo[v]
        memo[v] = set()  # (graphs are acyclic: a placeholder only)
        if v in role_of:
            out = {v}
        elif v.owner is None:
            out = set()
        elif _is_one_of(v):
            out = set.intersection(*(need(a) for a in v.owner.inputs))
        else:
            out = set().union(*(need(i) for i in v.owner.inputs))
        memo[v] = out
        return out

    return set().union(*(need(o) for o in outputs))


def _ref_graph(pattern: Pattern, variant: int, dtype: str) -> _RefGraph | Rejection:
    """The canonical reference step of ``pattern``'s ``variant`` for ``dtype`` (cached), or the
    :class:`Rejection` the variant returned (it cannot be built in this process)."""
    key = (pattern.name, variant, dtype)
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    role_of, inputs = {}, []
    for kind, roles in (("seq", pattern.sequences), ("state", pattern.states), ("nonseq", pattern.non_sequences)):
        for r in roles:
            v = pt.tensor(dtype=r.dtype or dtype, shape=(None,) * r.ndim, name=r.name)
            role_of[v] = (r, kind)
            inputs.append(v)
    ret = pattern.step[variant](*inputs)
    if isinstance(ret, Rejection):
        return ret  # not cached: the library it needs may be imported later
    outs, cond = _parse_step_return(ret)
    ns, no = len(pattern.states), len(pattern.outputs)
    if len(outs) != ns + no:
        raise ValueError(f"pattern {pattern.name}: step returns {len(outs)} values, expected {ns} states "
                         f"and {no} per-step outputs")
    outs = [pt.as_tensor_variable(o) for o in outs]
    fg = FunctionGraph(inputs, _rebuild(inputs, [*outs, *([cond] if cond is not None else [])], inputs),
                       clone=False)
    _canonicalize(fg)
    reached = _mandatory_roles([*fg.outputs[:ns], *fg.outputs[ns + no:]], role_of)
    ref = _RefGraph(role_of=role_of, updates=list(fg.outputs[:ns]), outputs=list(fg.outputs[ns:ns + no]),
                    cond=fg.outputs[ns + no] if cond is not None else None,
                    used_roles=frozenset(r.name for v, (r, _) in role_of.items() if v in reached))
    _REF_CACHE[key] = ref
    return ref


# ---------------------------------------------------------------------------
# Unification
# ---------------------------------------------------------------------------


_FLOAT_BITS = {"float16": 16, "float32": 32, "float64": 64}


def _widens(src: str, dst: str) -> bool:
    """A float cast ``src -> dst`` that loses nothing (float16 -> float32 -> float64, or the same dtype).

    A narrowing cast (``float64 -> float16``, even when cast back) rounds the
    step's values: a different computation, never transparent.  A widening
    cast is transparent only on an input or a constant (an exact conversion
    of data): on a computed value it means the computation below it ran in
    the lower precision.
    """
    return src in _FLOAT_BITS and dst in _FLOAT_BITS and _FLOAT_BITS[src] <= _FLOAT_BITS[dst]


def _strip(v):
    """Look through widening float casts, specify_shape, view/deep copies."""
    while v.owner is not None:
        op = v.owner.op
        if isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Cast | ps.Identity):
            src = v.owner.inputs[0]
            if isinstance(op.scalar_op, ps.Identity) or (src.owner is None and _widens(src.type.dtype, v.type.dtype)):
                v = src
                continue
        if isinstance(op, SpecifyShape | DeepCopyOp | ViewOp):
            v = v.owner.inputs[0]
            continue
        break
    return v


def _shape_access(v):
    """``(x, d)`` if ``v`` is ``x.shape[d]`` (``Shape_i`` or ``Shape(x)[d]`` with constant ``d``), else None."""
    if v.owner is None:
        return None
    if isinstance(v.owner.op, Shape_i):
        return v.owner.inputs[0], v.owner.op.i
    if isinstance(v.owner.op, Subtensor) and len(v.owner.inputs) == 2:
        src = v.owner.inputs[0]
        if src.owner is not None and isinstance(src.owner.op, Shape) and isinstance(v.owner.inputs[1], Constant):
            return src.owner.inputs[0], int(np.asarray(v.owner.inputs[1].data))
    return None


def _scalar_type(v):
    if v.owner is not None and isinstance(v.owner.op, Elemwise):
        return type(v.owner.op.scalar_op)
    return None


def _flatten(v, stype):
    """Operands of nested ``stype`` elemwise nodes (associativity)."""
    v = _strip(v)
    if _scalar_type(v) is stype:
        return [x for i in v.owner.inputs for x in _flatten(i, stype)]
    return [v]


def _matvec(v):
    """``(X, x)`` if ``v`` is ``X @ x`` as canonicalized (``squeeze(dot(X, expand_dims(x, 1)), 1)``), else None.

    ``pt.dot(X, x)`` of a vector stays a ``Dot`` of the vector; both are the
    product ``X x``.
    """
    node = v.owner
    if node is None or not isinstance(node.op, DimShuffle) or tuple(node.op.new_order) != (0,):
        return None
    d = _strip(node.inputs[0])
    if d.owner is None or not isinstance(d.owner.op, Dot) or d.type.ndim != 2:
        return None
    X, e = d.owner.inputs
    e = _strip(e)
    if e.owner is not None and isinstance(e.owner.op, DimShuffle) and tuple(e.owner.op.new_order) == (0, "x"):
        return X, e.owner.inputs[0]
    if _scalar_type(e) in (ps.Add, ps.Sub, ps.Neg):
        # X @ (y - Z a) with the expand_dims lifted into the sum: the vector is the squeezed sum
        x = _reshape_term(node.op, e)
        if x is not None:
            return X, x
    return None


def _dot_factors(v):
    v = _strip(v)
    mv = _matvec(v)
    if mv is not None:
        return [x for i in mv for x in _dot_factors(i)]
    if v.owner is not None and isinstance(v.owner.op, Dot):
        return [x for i in v.owner.inputs for x in _dot_factors(i)]
    return [v]


def _is_constant(v):
    return isinstance(v, Constant)


def _const_equal(a, b) -> bool:
    x, y = np.asarray(a.data), np.asarray(b.data)
    if x.size == 1 and y.size == 1:
        x, y = x.reshape(()), y.reshape(())
    elif x.shape != y.shape:
        return False
    if x.dtype.kind == "f" or y.dtype.kind == "f":
        rtol = 1e-6 if "float32" in (x.dtype.name, y.dtype.name) else 1e-12
        return bool(np.all(np.isclose(x, y, rtol=rtol, atol=0.0)))
    return bool(np.all(x == y))


def _op_key(op):
    if isinstance(op, Elemwise):
        s = op.scalar_op
        return ("elemwise", type(s), getattr(s, "o_type", None))
    props = getattr(type(op), "__props__", None)
    if isinstance(op, OpFromGraph) and props:
        # e.g. AllocDiag: equal ops built for inputs of different static shapes
        return ("ofg", type(op), tuple(getattr(op, p) for p in props))
    return op


def _describe(v) -> str:
    v = _strip(v)
    if isinstance(v, Constant):
        return f"constant {np.asarray(v.data).tolist()}"
    if v.owner is None:
        return f"input {v.name or v}"
    op = v.owner.op
    if isinstance(op, Elemwise):
        return type(op.scalar_op).__name__
    return str(op)


def _expression(v, depth) -> str:
    """``v`` as a compact expression down to ``depth`` levels (deeper operands as ``...``)."""
    v = _strip(v)
    if v.owner is None or depth == 0:
        return _describe(v) if v.owner is None else f"{_describe(v)}(...)"
    args = ", ".join(_expression(x, depth - 1) for x in v.owner.inputs)
    return f"{_describe(v)}({args})"


def _difference(r, u) -> str:
    """The first difference between the reference ``r`` and the user's ``u``, with enough context to see it.

    Operations that print alike (``Squeeze{axis=1}`` applied to different
    operands) are shown with their operands, one level deeper at a time, up
    to three levels.
    """
    if r is None or u is None:
        return "the graphs differ"
    for depth in range(4):
        a, b = _expression(r, depth), _expression(u, depth)
        if a != b:
            return f"expected {a}, found {b}"
    return f"expected {a}, found the same expression built differently (types {r.type} vs {u.type})"


class _Env:
    """Copy-on-write bindings role -> user variable, plus pending shape constraints."""

    __slots__ = ("roles", "users", "pending")

    def __init__(self, roles=None, users=None, pending=()):
        self.roles = roles or {}
        self.users = users or {}
        self.pending = pending

    def bind(self, role, u):
        roles = dict(self.roles)
        roles[role] = u
        users = dict(self.users)
        if not _is_constant(u):
            users[u] = role
        return _Env(roles, users, self.pending)

    def add_pending(self, item):
        return _Env(self.roles, self.users, (*self.pending, item))


def _signed_terms(v, sign=1):
    """Terms of nested add / sub / neg as ``(sign, term)``: ``a - (b - c)`` is ``[(1, a), (-1, b), (1, c)]``."""
    v = _strip(v)
    st = _scalar_type(v)
    if st is ps.Add:
        return [t for i in v.owner.inputs for t in _signed_terms(i, sign)]
    if st is ps.Sub:
        return [*_signed_terms(v.owner.inputs[0], sign), *_signed_terms(v.owner.inputs[1], -sign)]
    if st is ps.Neg:
        return _signed_terms(v.owner.inputs[0], -sign)
    if st is ps.Mul and len(v.owner.inputs) == 2:
        # (-1) * x
        for i, x in enumerate(v.owner.inputs):
            if _is_constant(_strip(x)) and np.all(np.asarray(_strip(x).data) == -1) and \
                    np.asarray(_strip(x).data).ndim <= v.type.ndim:
                other = v.owner.inputs[1 - i]
                if other.type.broadcastable == v.type.broadcastable:
                    return _signed_terms(other, -sign)
    ds = _reshaped_sum(v)
    if ds is not None:
        # expand_dims / squeeze of a sum: the sum of the reshaped terms (canonicalization lifts these
        # DimShuffles through sums or not depending on how many clients a term has)
        op, inner = ds
        terms = [(s, _reshape_term(op, t)) for s, t in _signed_terms(inner, sign)]
        if all(t is not None for _, t in terms):
            return terms
    return [(sign, v)]


def _reshaped_sum(v):
    """``(op, x)`` if ``v`` is an expand_dims or squeeze DimShuffle ``op`` of a sum ``x``, else None."""
    if v.owner is None or not isinstance(v.owner.op, DimShuffle):
        return None
    op = v.owner.op
    if not (op.is_expand_dims or op.is_squeeze):
        return None
    x = _strip(v.owner.inputs[0])
    if _scalar_type(x) in (ps.Add, ps.Sub, ps.Neg):
        return op, x
    return None


_RESHAPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reshape_term(op, t):
    """The expand_dims / squeeze ``op`` applied to ``t``, cancelling an inverse DimShuffle of ``t``
    (``squeeze(expand_dims(x, k), k)`` is ``x``); one node per ``(op, t)``; None if ``op`` does not apply."""
    t = _strip(t)
    if t.owner is not None and isinstance(t.owner.op, DimShuffle):
        inner = t.owner.op
        if (inner.is_expand_dims and op.is_squeeze and inner.augment == op.drop) or \
                (inner.is_squeeze and op.is_expand_dims and inner.drop == op.augment):
            return t.owner.inputs[0]
    memo = _RESHAPED.setdefault(t, {})
    if op not in memo:
        # DimShuffle.make_node's conditions: the input's ndim, and no static length but 1 where it squeezes
        fits = t.type.ndim == op.input_ndim and all(t.type.shape[d] in (1, None) for d in op.drop)
        memo[op] = op(t) if fits else None
    return memo[op]


_NEG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _negated(v):
    """``-v`` (one node per ``v``, so signatures are cached).  A boolean term (``1 - mask``) is negated as
    the ``int8`` PyTensor's arithmetic upcasts it to (``neg`` rejects booleans)."""
    n = _NEG.get(v)
    if n is None:
        n = _NEG[v] = pt.neg(pt.cast(v, "int8") if v.type.dtype == "bool" else v)
    return n


def _form(v):
    """``(key, children, ordered)`` of a non-leaf variable, after normalization."""
    op = v.owner.op
    st = _scalar_type(v)
    if isinstance(op, Dot) or _matvec(v) is not None:
        return "dot", _dot_factors(v), True
    if st in (ps.Add, ps.Sub) or _reshaped_sum(v) is not None:
        # a sum of signed terms: (y - Z a) - d equals (y - d) - Z a
        return ps.Add, [t if sgn > 0 else _negated(t) for sgn, t in _signed_terms(v)], False
    if st in _ASSOCIATIVE:
        return st, _flatten(v, st), False
    if st in _COMMUTATIVE:
        return st, list(v.owner.inputs), False
    if st in _FLIP:
        return _FLIP[st], list(reversed(v.owner.inputs)), True
    if st in _FLIP.values():
        return st, list(v.owner.inputs), True
    return (_op_key(op), v.owner.outputs.index(v)), list(v.owner.inputs), True


#: The signature of a reference graph holding :class:`~iterops.fusion.registry.OneOf` alternatives
#: (``hash`` never returns -1): it filters nothing.
_WILD = -1


def _expansions(key, children):
    """The operand lists of a reference node of form ``key`` with each ``one_of`` operand replaced by one
    of its alternatives, flattened as the user's graph is (a product in a chain of products, a sum in a
    sum).  ``[children]`` when no operand has alternatives."""
    for j, c in enumerate(children):
        neg = key is ps.Add and c.owner is not None and _scalar_type(c) is ps.Neg and _is_one_of(_strip(c.owner.inputs[0]))
        alt_node = _strip(c.owner.inputs[0]) if neg else _strip(c)
        if not _is_one_of(alt_node):
            continue
        out = []
        for alt in alt_node.owner.inputs:
            if key == "dot":
                parts = _dot_factors(alt)
            elif key is ps.Add:
                parts = [t if sgn > 0 else _negated(t) for sgn, t in _signed_terms(alt, -1 if neg else 1)]
            elif isinstance(key, type) and key in _ASSOCIATIVE:
                parts = _flatten(alt, key)
            else:
                return [children]  # an ordered operand: unify() tries the alternatives one by one
            out.extend(_expansions(key, [*children[:j], *parts, *children[j + 1:]]))
        return out
    return [children]


class _Unifier:
    def __init__(self, ref: _RefGraph, user: _UserGraph):
        self.ref = ref
        self.user = user
        self.worst = ((-1, -1), "")  # ((stage, depth), message) of the deepest difference in the furthest stage
        self.stage = 0  # 0 the stop rule, 1 the state updates, 2 the per-step outputs (see :meth:`staged`)
        self._rsig, self._usig = {}, {}

    def sig(self, v, memo):
        """A cheap structural signature (leaves anonymous): a filter only."""
        v = _strip(v)
        s = memo.get(v)
        if s is None:
            if v.owner is None or _shape_access(v) is not None:
                s = 0
            elif _is_one_of(v):
                s = _WILD
            else:
                key, children, ordered = _form(v)
                cs = [self.sig(x, memo) for x in children]
                # a reference graph holding alternatives below: no filter
                s = _WILD if _WILD in cs else hash((key, ordered, tuple(cs) if ordered else tuple(sorted(cs))))
            memo[v] = s
        return s

    def fail(self, depth, r, u, why=None, parent=None):
        if (self.stage, depth) > self.worst[0]:
            msg = why or _difference(r, u)
            if parent is not None and why is None:
                msg += f" (as an operand of {_expression(parent[0], 1)} / {_expression(parent[1], 1)})"
            self.worst = ((self.stage, depth), msg)

    def unify(self, r, u, env, depth=0, parent=None):
        r, u = _strip(r), _strip(u)
        ref_role = self.ref.role_of.get(r)
        if ref_role is not None:
            yield from self._bind_role(ref_role, r, u, env, depth)
            return
        if _is_one_of(r):
            yield from self._alternatives([lambda alt=alt: self.unify(alt, u, env, depth, parent)
                                           for alt in r.owner.inputs])
            return
        u = self.user.lifted.get(u, u)  # a lifted constant where the reference computes something
        if _is_constant(r):
            if _is_constant(u) and _const_equal(r, u):
                yield env
            else:
                self.fail(depth, r, u, parent=parent)
            return
        if u.owner is None:
            # x.shape[d] in the reference, a static constant in the user's graph
            acc = _shape_access(r)
            if _is_constant(u) and acc is not None and acc[0] in self.ref.role_of and np.asarray(u.data).size == 1:
                role = self.ref.role_of[acc[0]][0]
                yield env.add_pending(("dim", role.name, acc[1], int(np.asarray(u.data))))
                return
            if _is_constant(u):
                # a scalar role broadcast in the reference, a folded constant in the user's graph
                scalar = self._broadcast_scalar_role(r)
                if scalar is not None and np.asarray(u.data).size == 1:
                    yield from self._bind_role(self.ref.role_of[scalar], scalar,
                                               pt.constant(np.asarray(u.data).reshape(())), env, depth)
                    return
                # a computation on shapes and constant scalars (e.g. eye(m) * jitter), folded to a constant
                roles = _shape_determined(r, self.ref.role_of)
                if roles is not None:
                    yield env.add_pending(("expr", r, u, roles))
                    return
            self.fail(depth, r, u, parent=parent)
            return
        rkey, rch, ordered = _form(r)
        ukey, uch, _ = _form(u)
        if rkey != ukey:
            self.fail(depth, r, u, parent=parent)
            return
        seq = self.unify_seq if ordered else self.unify_bag
        expansions = _expansions(rkey, rch)
        if len(expansions) == 1:
            yield from seq(expansions[0], uch, env, depth + 1, (r, u))
        else:
            yield from self._alternatives([lambda ch=ch: seq(ch, uch, env, depth + 1, (r, u)) for ch in expansions])

    def staged(self, stage, envs):
        """The environments of the search ``envs``, its differences recorded as found in ``stage``."""
        while True:
            self.stage = stage
            e = next(envs, None)
            if e is None:
                return
            yield e

    def _alternatives(self, searches):
        """The environments of each search in turn (the alternatives of a ``one_of``).  Differences found
        inside them are reported only when none unifies: a spelling the user did not write is not the reason
        a loop is kept."""
        inner, matched = ((-1, -1), ""), False
        for search in searches:
            it = search()
            while True:
                outer, self.worst = self.worst, ((-1, -1), "")
                e = next(it, None)
                if self.worst[0] > inner[0]:
                    inner = self.worst
                self.worst = outer
                if e is None:
                    break
                matched = True
                yield e
        if not matched and inner[0] > self.worst[0]:
            self.worst = inner

    def _broadcast_scalar_role(self, r):
        """The scalar ``constant_ok`` role ``r`` broadcasts (``ExpandDims``), else None."""
        if r.owner is not None and isinstance(r.owner.op, DimShuffle) and all(
                d == "x" for d in r.owner.op.new_order):
            x = _strip(r.owner.inputs[0])
            role = self.ref.role_of.get(x)
            if role is not None and role[0].constant_ok and role[0].ndim == 0:
                return x
        return None

    def _bind_role(self, ref_role, r, u, env, depth):
        role, kind = ref_role
        bound = env.roles.get(role.name)
        lifted = self.user.lifted
        if u in lifted and not (kind == "nonseq" and role.ndim == u.type.ndim):
            u = lifted[u]  # e.g. a constant tolerance array where the reference has a scalar role
        if bound is not None:
            cb, cu = lifted.get(bound, bound), lifted.get(u, u)
            if bound is u or (_is_constant(cb) and _is_constant(cu) and _const_equal(cb, cu)):
                yield env
            else:
                self.fail(depth, r, u, f"{role.name} is used with two different values "
                                       f"({_describe(bound)} and {_describe(u)})")
            return
        if _is_constant(u):
            if role.constant_ok and role.ndim == 0 and np.asarray(u.data).size == 1:
                yield env.bind(role.name, u)
            else:
                self.fail(depth, r, u, f"{role.name} must be a {kind} input, found {_describe(u)}")
            return
        ukind = self.user.kind.get(u)
        if role.time_varying_ok and (kind, ukind) == ("nonseq", "seq"):
            ukind = kind  # a time-varying matrix: the loop reads one row of a sequence per step
        if ukind != kind or (u in env.users and u not in lifted) or u.type.ndim != role.ndim:
            self.fail(depth, r, u, f"{role.name} must be a {kind} input of ndim {role.ndim}, found {_describe(u)}")
            return
        yield env.bind(role.name, u)

    def unify_seq(self, rs, us, env, depth, parent=None):
        if len(rs) != len(us):
            self.fail(depth, None, None, f"{len(rs)} factors/arguments expected, found {len(us)}")
            return
        if not rs:
            yield env
            return
        for e in self.unify(rs[0], us[0], env, depth, parent):
            yield from self.unify_seq(rs[1:], us[1:], e, depth, parent)

    def unify_bag(self, rs, us, env, depth, parent=None):
        if len(rs) != len(us):
            self.fail(depth, None, None, f"{len(rs)} terms expected in a sum/product, found {len(us)}")
            return
        if not rs:
            yield env
            return
        r0 = rs[0]
        s0 = self.sig(r0, self._rsig)
        same = [] if s0 == _WILD else [j for j, u in enumerate(us) if self.sig(u, self._usig) == s0]
        # operands of the same shape of graph first; the others only to locate a mismatch
        for j in same or range(len(us)):
            for e in self.unify(r0, us[j], env, depth, parent):
                yield from self.unify_bag(rs[1:], us[:j] + us[j + 1:], e, depth, parent)


def _shape_determined(r, role_of):
    """The roles whose shapes or constant values determine ``r``, or None.

    ``r`` qualifies when it reads roles only through their shapes (``Shape``
    of anything) or ``constant_ok`` scalar roles (tolerances, jitters), e.g.
    ``eye(m) * jitter``: the user's canonical graph may hold it folded to a
    constant.
    """
    roles, stack, seen = set(), [r], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in role_of:
            role = role_of[v][0]
            if not (role.constant_ok and role.ndim == 0):
                return None
            roles.add(v)
            continue
        if v.owner is None:
            continue
        if isinstance(v.owner.op, Shape | Shape_i):
            roles.update(x for x in ancestors([v.owner.inputs[0]]) if x in role_of)
            continue
        stack.extend(v.owner.inputs)
    return frozenset(roles)


def _specialize(r, roles, values):
    """``r`` rebuilt on inputs of the user's static shapes (constants for constant roles), canonicalized."""
    roles = list(roles)
    new = [values[x] for x in roles]
    out = _rebuild(roles, [r], new)[0]
    fg = FunctionGraph([v for v in new if not isinstance(v, Constant)], [out], clone=False)
    rewrite_graph(fg, include=("ShapeOpt", "canonicalize"), exclude=("iterops",))
    return _strip(fg.outputs[0])


class _LoopUnification:
    """The complete environments binding every role of ``ref`` to the user's loop: iterate over it.

    ``used_outputs``: indices of the user's per-step outputs used outside the
    loop; each must unify with one of the pattern's per-step outputs (bound as
    ``env.roles[output role] = index``).  After an iteration that yielded
    nothing, ``rejection`` says why (the deepest difference found).
    """

    def __init__(self, pattern: Pattern, ref: _RefGraph, user: _UserGraph, used_outputs=()):
        self.pattern, self.ref, self.user, self.used_outputs = pattern, ref, user, tuple(used_outputs)
        self.rejection: Rejection | None = None

    def __iter__(self):
        pattern, ref, user, used_outputs = self.pattern, self.ref, self.user, self.used_outputs
        un = _Unifier(ref, user)
        state_roles = [r.name for r in pattern.states]
        ref_upd = dict(zip(state_roles, ref.updates))

        def states(i, env):
            if i == len(state_roles):
                yield env
                return
            name = state_roles[i]
            bound = env.roles.get(name)
            cands = [bound] if bound is not None else [s for s in user.states if s not in env.users]
            for s in cands:
                e0 = env if bound is not None else env.bind(name, s)
                if s.type.ndim != pattern.role(name).ndim:
                    continue
                for e in un.staged(1, un.unify(ref_upd[name], user.updates[s], e0, 1)):
                    # the state's own input must be the one bound to its role
                    if e.roles.get(name) is s:
                        yield from states(i + 1, e)

        out_roles = [r.name for r in pattern.outputs]

        def outputs(i, env):
            if i == len(used_outputs):
                yield env
                return
            j = used_outputs[i]
            for name, r_out in zip(out_roles, ref.outputs):
                if name in env.roles:
                    continue
                for e in un.staged(2, un.unify(r_out, user.outputs[j], env, 1)):
                    yield from outputs(i + 1, _Env({**e.roles, name: j}, e.users, e.pending))

        env = _Env()
        if ref.cond is not None and user.cond is None:
            self.rejection = Rejection("the loop has no convergence stop (until) where the pattern needs one", 0.5)
            return
        if ref.cond is None and user.cond is not None:
            self.rejection = Rejection("the loop has an until stop the pattern does not have", 0.5)
            return
        envs = un.staged(0, un.unify(ref.cond, user.cond, env, 1)) if ref.cond is not None else [env]
        found = False
        for e0 in envs:
            for e1 in states(0, e0):
                if any(name not in e1.roles for name in ref.used_roles):
                    continue
                for e in outputs(0, e1):
                    found = True
                    yield e
        if not found:
            (stage, depth), why = un.worst
            # a difference in a later stage is closer (the states unified); within a stage, a deeper one
            self.rejection = Rejection(f"the step differs from the reference: {why}", 1.0 + 16 * stage + min(depth, 15))
