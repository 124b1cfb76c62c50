"""A generic structural matcher of Scan inner graphs against reference steps.

Nothing here knows a specific algorithm.  For a ``Scan`` node and a
:class:`~iterops.fusion.registry.Pattern`:

1. the user's inner graph (a mutable copy) and the pattern's reference step
   (built on fresh symbolic inputs, one per role) are canonicalized with the
   same PyTensor rewrites (``canonicalize``, iterops' own rewrites excluded).
   This removes most spelling differences: ``@`` / ``dot`` / ``matrix_dot``
   all become ``Dot``; ``.T`` / ``.mT`` / ``transpose`` one transpose; ``conj``
   of a real matrix disappears; constants fold.  Before that, the user's
   inner graph is rebuilt on inputs without static shapes (canonicalization
   specializes on them: a sum over a length-1 axis becomes a squeeze) and
   both graphs inline ``OpFromGraph`` nodes (e.g. ``pt.diag``) and spell a
   matrix-vector ``dot`` as ``@``;
2. the two graphs are *unified*: walking both from the outputs, reference
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
   outside must each unify with one of the pattern's ``outputs``;
3. the outer graph is checked: states the replacement cannot provide are
   unused, states provided only as a final value are used only through their
   last element, traced states through ``pytensor.scan``'s views (the trace,
   its last element, the buffer with the initial value).  "The last element"
   is any index provably selecting the last row (``-1``, ``out.shape[0] -
   1``, ``n_steps - 1`` without ``until``, the index expressions
   ``local_subtensor_merge`` makes of ``out[1:][-1]`` or ``out[-1:][0]``),
   also with trailing indices (``out[-1, 0, 0]``) or through a transpose of
   the rows; the number of rows may only serve such an index (see ``_uses``);
   other extra outputs are unused, and the pattern's own ``check`` accepts
   ``n_steps`` and the initial values.

A failed unification reports the deepest point where the graphs differ, which
``iterops.explain`` shows for near misses.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.ops import DeepCopyOp, ViewOp
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.traversal import ancestors, io_toposort
from pytensor.graph.fg import FunctionGraph, Output
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.scan.utils import ScanArgs, until
from pytensor.tensor.basic import AllocEmpty, ScalarFromTensor, get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.math import Dot
from pytensor.tensor.shape import Shape, Shape_i, SpecifyShape
from pytensor.tensor.type import TensorType
from pytensor.tensor.subtensor import IncSubtensor, Subtensor, indices_from_subtensor

from iterops.fusion import piecewise
from iterops.fusion.registry import Pattern

__all__ = ["Match", "Reject", "match_scan", "constant_value"]

_COMMUTATIVE = (ps.Add, ps.Mul, ps.Maximum, ps.Minimum, ps.AND, ps.OR, ps.XOR, ps.EQ, ps.NEQ)
_ASSOCIATIVE = (ps.Add, ps.Mul, ps.Maximum, ps.Minimum, ps.AND, ps.OR, ps.XOR)
_FLIP = {ps.GT: ps.LT, ps.GE: ps.LE}


class Reject(Exception):
    """A Scan does not match a pattern; ``str(err)`` says why, ``score`` how close it came."""

    def __init__(self, reason: str, score: float = 0.0):
        super().__init__(reason)
        self.score = score


@dataclass
class Match:
    """A Scan node matched to a pattern.

    ``outer[role]`` is the outer variable bound to each role: the initial value
    of a state, the outer sequence, the outer non-sequence (or the constant the
    user wrote in the step).  ``inner[role]`` the user's inner variable.
    """

    pattern: Pattern
    node: object
    args: ScanArgs
    inner: dict
    outer: dict
    n_steps: Variable
    as_while: bool
    dtype: str
    uses: dict = field(default_factory=dict)  # state -> list of (outer var, kind)
    variant: int = 0
    #: outer var -> (row-wise wrappers, trailing indices): how a use reads the value (see ``_uses``)
    views: dict = field(default_factory=dict)

    def n_steps_value(self):
        """``n_steps`` as a Python int if constant, else None."""
        return constant_value(self.n_steps)


def constant_value(v):
    """The scalar value of ``v`` if it is a (folded) constant, else None."""
    try:
        return np.asarray(get_underlying_scalar_constant_value(v)).item()
    except (NotScalarConstantError, TypeError, ValueError):
        return None


def provably_equal(a, b) -> bool:
    """True when the scalar graphs ``a`` and ``b`` are equal for every input.

    Proof by canonicalization: ``eq(a, b)`` folds to the constant 1 when the
    two sides merge (same computation, or equal static shapes).
    """
    a, b = pt.as_tensor_variable(a), pt.as_tensor_variable(b)
    ca, cb = constant_value(a), constant_value(b)
    if ca is not None and cb is not None:
        return ca == cb
    fg = FunctionGraph(outputs=[pt.eq(a, b)], clone=True, copy_inputs=False)
    rewrite_graph(fg, include=("ShapeOpt", "canonicalize"), exclude=("iterops",))
    out = fg.outputs[0]
    return isinstance(out, Constant) and bool(np.all(out.data))


# ---------------------------------------------------------------------------
# Canonical inner graphs
# ---------------------------------------------------------------------------


def _canonicalize(fg: FunctionGraph) -> FunctionGraph:
    rewrite_graph(fg, include=("canonicalize",), exclude=("iterops",))
    return fg


@dataclass
class _UserGraph:
    inner_inputs: list  # canonicalized inner graph, Scan's input order
    inner_outputs: list
    kind: dict  # inner input -> "seq" | "state" | "nonseq"
    states: list  # inner state inputs (sit-sot then untraced)
    updates: dict  # inner state input -> inner update
    outputs: list  # inner per-step (nit-sot) outputs
    static: dict  # inner input -> the static shape the user's graph gives it
    cond: Variable | None
    dtype: str | None
    unsupported: str | None
    lifted: dict = field(default_factory=dict)  # inner input standing for a constant -> the constant
    liftable: bool = False  # the inner graph holds non-scalar constants (see ``_canonical_user_graph``)
    # per node (outer graph):
    args: ScanArgs | None = None
    outer_state: dict = field(default_factory=dict)  # inner state -> (outer output, traced, outer init buffer)
    extra_outputs: list = field(default_factory=list)  # outer outputs that are not states
    outer_outputs: list = field(default_factory=list)  # outer nit-sot outputs, as ``outputs``


_USER_CACHE: OrderedDict = OrderedDict()


def _user_graph(node, lift=False) -> _UserGraph:
    """The canonicalized inner graph of ``node`` (cached per Scan op), bound to its outer variables."""
    op = node.op
    hit = _USER_CACHE.get((id(op), lift))
    if hit is not None and hit[0] is op:
        ug = hit[1]
    else:
        ug = _canonical_user_graph(node, lift)
        _USER_CACHE[(id(op), lift)] = (op, ug)
        while len(_USER_CACHE) > 64:
            _USER_CACHE.popitem(last=False)
    a = ScanArgs(node.inputs, node.outputs, ug.inner_inputs, ug.inner_outputs, op.info)
    outer_state = {}
    for v, o, init in zip(a.inner_in_sit_sot, a.outer_out_sit_sot, a.outer_in_sit_sot):
        outer_state[v] = (o, True, init)
    for v, o, init in zip(a.inner_in_shared, a.outer_out_shared, a.outer_in_shared):
        outer_state[v] = (o, False, init)
    extra = [*a.outer_out_mit_mot, *a.outer_out_mit_sot, *a.outer_out_nit_sot]
    return _UserGraph(**{**ug.__dict__, "args": a, "outer_state": outer_state, "extra_outputs": extra,
                         "outer_outputs": list(a.outer_out_nit_sot)})


def _rebuild(inputs, outputs, new_inputs):
    """``outputs`` rebuilt on ``new_inputs`` (types recomputed), inlining ``OpFromGraph`` nodes.

    An ``OpFromGraph`` keeps the static types it was built for (calling it on
    a less specific input inserts a ``specify_shape``), so its inner graph is
    rebuilt in place instead; a matrix-vector ``Dot`` becomes ``@`` (the two
    canonicalize differently).  The reference steps get the same treatment.
    """
    memo = dict(zip(inputs, new_inputs))
    for node in io_toposort(inputs, outputs):
        ins = [memo.get(i, i) for i in node.inputs]
        if isinstance(node.op, Dot) and sorted(i.type.ndim for i in ins) == [1, 2]:
            # pt.dot(X, x) of a vector, spelled X @ x: canonicalized alike
            outs = [pt.matmul(*ins)]
        elif isinstance(node.op, OpFromGraph):
            fg = node.op.fgraph.unfreeze() if hasattr(node.op.fgraph, "unfreeze") else node.op.fgraph.clone()
            outs = _rebuild(list(fg.inputs), list(fg.outputs), ins)
        else:
            outs = node.clone_with_new_inputs(ins, strict=False).outputs
        for o, n in zip(node.outputs, outs):
            memo[o] = n
    return [memo.get(o, o) for o in outputs]


def _erase_static_shapes(inputs, outputs):
    """The inner graph rebuilt on inputs without static shapes.

    The reference steps are built on such inputs, and canonicalization
    specializes on static shapes (a length-1 sum becomes a squeeze, ``eye(m)``
    a constant), so both sides are canonicalized alike.  Returns
    ``(inputs, outputs, static)`` with ``static[new input]`` = the original
    static shape; the graph unchanged if it cannot be rebuilt.
    """
    new = [v.type.clone(shape=(None,) * v.type.ndim)() if getattr(v.type, "ndim", 0) else v for v in inputs]
    try:
        outs = _rebuild(inputs, outputs, new)
    except Exception:  # noqa: BLE001  (an Op that needs its static shapes: keep them)
        return inputs, outputs, {v: getattr(v.type, "shape", ()) for v in inputs}
    for n, v in zip(new, inputs):
        n.name = v.name
    return new, outs, {n: getattr(v.type, "shape", ()) for n, v in zip(new, inputs)}


def _canonical_user_graph(node, lift=False) -> _UserGraph:
    """The user's inner graph, static shapes erased, canonicalized.

    ``lift``: every non-scalar constant of the step (``pytensor.scan`` moves
    constant non-sequences, e.g. ``np.eye(1)`` system matrices, into the inner
    graph) is first replaced by a fresh input of kind ``"nonseq"`` (without
    static shape), so canonicalization does not fold it into the computation
    (a product with a constant ``[[1.]]`` becomes an elementwise product, ...)
    and it can be bound to a non-sequence role of the reference; where the
    reference has no role, the unifier compares the constant itself.
    """
    op = node.op
    args = ScanArgs.from_node(node, clone=True)
    ins, outs, static = _erase_static_shapes(_inner_inputs(args), _inner_outputs(args))
    n_ins = len(ins)
    consts = list(dict.fromkeys(
        x for n in io_toposort(ins, outs) for x in n.inputs
        if isinstance(x, Constant) and getattr(x.type, "ndim", 0) >= 1))
    lifted = {}
    if lift and consts:
        new = [c.type.clone(shape=(None,) * c.type.ndim)(name=f"constant{tuple(c.type.shape)}") for c in consts]
        outs = _rebuild([*ins, *consts], outs, [*ins, *new])
        lifted = dict(zip(new, consts))
        static = {**static, **{v: c.type.shape for v, c in zip(new, consts)}}
        ins = [*ins, *new]
    fg = FunctionGraph(ins, outs, clone=False)
    _canonicalize(fg)
    a = ScanArgs(node.inputs, node.outputs, fg.inputs[:n_ins], fg.outputs, op.info)
    kind = {v: "nonseq" for v in lifted}
    for v in a.inner_in_seqs:
        kind[v] = "seq"
    for v in (*a.inner_in_sit_sot, *a.inner_in_shared):
        kind[v] = "state"
    for v in a.inner_in_non_seqs:
        kind[v] = "nonseq"
    states = [*a.inner_in_sit_sot, *a.inner_in_shared]
    updates = dict(zip(states, [*a.inner_out_sit_sot, *a.inner_out_shared]))
    dtypes = [v.type.dtype for v in states if str(getattr(v.type, "dtype", "")).startswith("float")]
    unsupported = None
    if a.mit_mot_in_slices or a.mit_sot_in_slices:
        unsupported = "the loop has multi-tap (mit-sot/mit-mot) states"
    elif op.truncate_gradient != -1:
        # the fused Ops' gradients are full; reproducing a truncated one is not worth a pattern
        unsupported = f"the loop truncates its gradient (truncate_gradient={op.truncate_gradient})"
    elif any(not isinstance(v.type, TensorType) for v in ins):
        unsupported = "the loop carries non-tensor values (e.g. a random generator)"
    return _UserGraph(
        inner_inputs=list(fg.inputs[:n_ins]), inner_outputs=list(fg.outputs), kind=kind, states=states,
        updates=updates, outputs=list(a.inner_out_nit_sot), static=static, cond=a.cond[0] if a.cond else None,
        dtype=dtypes[0] if dtypes else None, unsupported=unsupported, lifted=lifted, liftable=bool(consts),
    )


def _inner_inputs(a: ScanArgs):
    return [*a.inner_in_seqs, *itertools.chain(*a.inner_in_mit_mot), *itertools.chain(*a.inner_in_mit_sot),
            *a.inner_in_sit_sot, *a.inner_in_shared, *a.inner_in_non_seqs]


def _inner_outputs(a: ScanArgs):
    return [*itertools.chain(*a.inner_out_mit_mot), *a.inner_out_mit_sot, *a.inner_out_sit_sot,
            *a.inner_out_nit_sot, *a.inner_out_shared, *a.cond]


@dataclass
class _RefGraph:
    role_of: dict  # ref input -> (Role, kind)
    updates: list  # per state role, canonical update
    outputs: list  # per output role, canonical per-step output
    cond: Variable | None
    used_roles: frozenset  # roles the states' updates and the stop read


_REF_CACHE: dict = {}


def _parse_step_return(ret):
    cond = None
    if isinstance(ret, until):
        return [], ret.condition
    if isinstance(ret, tuple | list) and ret and isinstance(ret[-1], until):
        cond = ret[-1].condition
        ret = ret[0] if len(ret) == 2 and isinstance(ret[0], tuple | list) else ret[:-1]
    if isinstance(ret, Variable):
        ret = [ret]
    return list(ret), cond


def _ref_graph(pattern: Pattern, variant: int, dtype: str) -> _RefGraph:
    key = (pattern.name, variant, dtype)
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    role_of, inputs = {}, []
    for kind, roles in (("seq", pattern.sequences), ("state", pattern.states), ("nonseq", pattern.non_sequences)):
        for r in roles:
            v = pt.tensor(dtype=r.dtype or dtype, shape=(None,) * r.ndim, name=r.name)
            role_of[v] = (r, kind)
            inputs.append(v)
    outs, cond = _parse_step_return(pattern.step[variant](*inputs))
    ns, no = len(pattern.states), len(pattern.outputs)
    if len(outs) != ns + no:
        raise ValueError(f"pattern {pattern.name}: step returns {len(outs)} values, expected {ns} states "
                         f"and {no} per-step outputs")
    outs = [pt.as_tensor_variable(o) for o in outs]
    fg = FunctionGraph(inputs, _rebuild(inputs, [*outs, *([cond] if cond is not None else [])], inputs),
                       clone=False)
    _canonicalize(fg)
    reached = set(ancestors([*fg.outputs[:ns], *fg.outputs[ns + no:]]))
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
    return [(sign, v)]


_NEG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _negated(v):
    """``-v`` (one node per ``v``, so signatures are cached)."""
    n = _NEG.get(v)
    if n is None:
        n = _NEG[v] = pt.neg(v)
    return n


def _form(v):
    """``(key, children, ordered)`` of a non-leaf variable, after normalization."""
    op = v.owner.op
    st = _scalar_type(v)
    if isinstance(op, Dot) or _matvec(v) is not None:
        return "dot", _dot_factors(v), True
    if st in (ps.Add, ps.Sub):
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


class _Unifier:
    def __init__(self, ref: _RefGraph, user: _UserGraph):
        self.ref = ref
        self.user = user
        self.worst = (-1, "")
        self._rsig, self._usig = {}, {}

    def sig(self, v, memo):
        """A cheap structural signature (leaves anonymous): a filter only."""
        v = _strip(v)
        s = memo.get(v)
        if s is None:
            if v.owner is None or _shape_access(v) is not None:
                s = 0
            else:
                key, children, ordered = _form(v)
                cs = [self.sig(x, memo) for x in children]
                s = hash((key, ordered, tuple(cs) if ordered else tuple(sorted(cs))))
            memo[v] = s
        return s

    def fail(self, depth, r, u, why=None, parent=None):
        if depth > self.worst[0]:
            msg = why or _difference(r, u)
            if parent is not None and why is None:
                msg += f" (as an operand of {_expression(parent[0], 1)} / {_expression(parent[1], 1)})"
            self.worst = (depth, msg)

    def unify(self, r, u, env, depth=0, parent=None):
        r, u = _strip(r), _strip(u)
        ref_role = self.ref.role_of.get(r)
        if ref_role is not None:
            yield from self._bind_role(ref_role, r, u, env, depth)
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
        if ordered:
            yield from self.unify_seq(rch, uch, env, depth + 1, (r, u))
        else:
            yield from self.unify_bag(rch, uch, env, depth + 1, (r, u))

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
        same = [j for j, u in enumerate(us) if self.sig(u, self._usig) == s0]
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


def _unify_loop(pattern: Pattern, ref: _RefGraph, user: _UserGraph, used_outputs=()):
    """Yield complete environments binding every role of ``ref`` to the user's loop.

    ``used_outputs``: indices of the user's per-step outputs used outside the
    loop; each must unify with one of the pattern's per-step outputs (bound as
    ``env.roles[output role] = index``).
    """
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
            for e in un.unify(ref_upd[name], user.updates[s], e0, 1):
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
            for e in un.unify(r_out, user.outputs[j], env, 1):
                yield from outputs(i + 1, _Env({**e.roles, name: j}, e.users, e.pending))

    env = _Env()
    if ref.cond is not None:
        if user.cond is None:
            raise Reject("the loop has no convergence stop (until) where the pattern needs one", 0.5)
        envs = un.unify(ref.cond, user.cond, env, 1)
    else:
        if user.cond is not None:
            raise Reject("the loop has an until stop the pattern does not have", 0.5)
        envs = iter([env])
    found = False
    for e0 in envs:
        for e1 in states(0, e0):
            if any(name not in e1.roles for name in ref.used_roles):
                continue
            for e in outputs(0, e1):
                found = True
                yield e
    if not found:
        raise Reject(f"the step differs from the reference: {un.worst[1]}", 1.0 + un.worst[0])


# ---------------------------------------------------------------------------
# Outer graph
# ---------------------------------------------------------------------------


def initial_value(buffer):
    """The initial state held by a sit-sot outer buffer (``buffer[0]``)."""
    node = buffer.owner
    if node is not None and isinstance(node.op, IncSubtensor) and node.op.set_instead_of_inc:
        x, y = node.inputs[0], node.inputs[1]
        idx = indices_from_subtensor(node.inputs[2:], node.op.idx_list)
        if x.owner is not None and isinstance(x.owner.op, AllocEmpty) and isinstance(idx[0], slice) and idx[0].start is None:
            if y.owner is not None and isinstance(y.owner.op, DimShuffle) and y.owner.op.new_order[:1] == ("x",) \
                    and tuple(y.owner.op.new_order[1:]) == tuple(range(y.type.ndim - 1)):
                return y.owner.inputs[0]
            return y[0]
    return buffer[0]


def _is_const(v, value):
    if v is None:
        return value is None
    c = constant_value(v)
    return c is not None and c == value


def _is_last_index(i, v, buffer, start) -> bool:
    """The scalar index ``i`` into ``v`` (= ``buffer[start:]``, rows of a Scan output) provably selects its last row.

    Accepted: the constant ``-1``, or any expression provably equal to
    ``v.shape[0] - 1`` (equivalently ``buffer.shape[0] - 1 - start``): e.g.
    ``n_steps - 1`` into the trace of a loop without ``until`` (whose length
    is ``n_steps``), ``trace.shape[0] - 1``, or the index expression
    ``local_subtensor_merge`` makes of ``trace[-1]``.  For a loop with a
    convergence stop the length is only known at run time, so a fixed index
    such as ``max_iter - 1`` is not accepted (it reads an intermediate state,
    or fails, when the loop stops early).
    """
    c = constant_value(i)
    if c is not None and c == -1:
        return True
    if i.owner is not None and isinstance(i.owner.op, ScalarFromTensor):
        i = i.owner.inputs[0]  # Subtensor indices are scalars
    if not str(getattr(i.type, "dtype", "")).startswith(("int", "uint")) or getattr(i.type, "ndim", 0) != 0:
        return False
    try:
        i = pt.as_tensor_variable(i)
        if (provably_equal(i, -1) or provably_equal(i, v.shape[0] - 1)
                or (start is not None and provably_equal(i, buffer.shape[0] - (1 + start)))):
            return True
        return _last_by_length(i, buffer, start) if start is not None else False
    except Exception:  # noqa: BLE001  (no proof)
        return False


def _last_by_length(i, buffer, start) -> bool | str:
    """``i`` is a function of ``buffer``'s length ``L`` alone selecting the last row of ``buffer[start:]`` for every ``L``.

    The index expressions ``local_subtensor_merge`` builds for ``out[1:][-1]``,
    ``out[:N][-1]`` or ``out[-1:][0]`` (``switch``/``minimum`` clamps of
    ``L``) do not fold by canonicalization.  After shape inference, ``i`` must
    depend on nothing but ``L`` (``buffer.shape[0]``) and integer constants;
    it is then evaluated exactly as a piecewise-linear function of ``L``
    (:mod:`iterops.fusion.piecewise`, cost independent of the constants) and
    must equal ``L - 1 - start`` or ``-1`` on every piece with at least one
    row (``L > start``) and at least one step (``L >= 2``).  After 0 steps
    (``L = 1``, the initial value alone) the index may select it, or be out of
    bounds: then ``"nonempty"`` is returned, and the replacement raises after 0
    steps as the user's graph does (see ``replacements_for``).
    """
    B = buffer.type()  # the buffer as an input: its length is the only unknown
    (i,) = _rebuild_with([pt.cast(i, "int64")], {buffer: B})
    fg = FunctionGraph(outputs=[i], clone=True, copy_inputs=False)
    rewrite_graph(fg, include=("ShapeOpt", "canonicalize"), exclude=("iterops",))
    L = pt.scalar("L", dtype="int64")
    length_of_buffer = []
    for node in fg.toposort():
        acc = _shape_access(node.outputs[0])
        if acc is not None and acc[1] == 0 and acc[0] is B:
            length_of_buffer.append(node.outputs[0])
    (out,) = _rebuild_with(fg.outputs, {x: pt.cast(L, x.dtype) for x in length_of_buffer})
    f = piecewise.evaluate(out, L, start + 1)
    if f is None:
        return False
    # buffer lengths of at least one step (the buffer holds the initial value first)
    if not all((a, b) in ((1, -1 - start), (0, -1)) for lo, a, b in f.refined([2]).pieces if lo >= 2):
        return False
    if start > 0:
        return True
    k = f(1)  # a loop of 0 steps: the buffer holds the initial value only
    if k in (0, -1):
        return True
    return "nonempty"  # out of bounds: the user's graph raises after 0 steps


def _rebuild_with(outputs, replace):
    """``outputs`` with the variables in ``replace`` substituted (the graph above them dropped)."""
    from pytensor.graph.replace import graph_replace  # noqa: PLC0415

    return graph_replace(outputs, replace, strict=False)


def _rowwise(op) -> bool:
    """``op`` (one input) acts on each row of its input alone and keeps axis 0 first: a transpose of the rows."""
    return isinstance(op, DimShuffle) and op.input_ndim >= 1 and tuple(op.new_order[:1]) == (0,) \
        and 0 not in op.drop


def _uses(fgraph, var, traced: bool):
    """Uses of a state's outer output: list of ``(variable, kind, (wrappers, rest))``.

    kind: ``"last"`` (the final state), ``"last_row"`` (the final state as a
    1-row array, ``out[-1:]``), ``"buffer"`` (the traced output with the
    initial value first), ``"trace"`` (the states after each step:
    ``buffer[1:]``, what ``pytensor.scan`` returns) or ``"other"``.

    The use may read the rows through row-wise ``wrappers`` (a ``DimShuffle``
    keeping axis 0 first, e.g. ``trace.mT``) and select from the rows it
    takes with trailing indices ``rest`` (``trace[-1, 0, :2]``, as
    ``local_subtensor_merge`` writes ``trace[-1][0, :2]``); the replacement
    applies the same wrappers and indices.  A row index counts as the last
    one only when :func:`_is_last_index` proves it.
    """
    if not traced:
        return [(var, "last", ((), ()))] if fgraph.clients.get(var) else []
    out = []

    def whole(start):
        return "buffer" if start == 0 else "trace" if start == 1 else "other"

    def walk(v, start, wrappers):
        # v: the rows buffer[start:] (start None: some suffix of the rows), read through ``wrappers``
        for client, i in fgraph.clients.get(v, []):
            op = client.op
            res = client.outputs[0] if client.outputs else None  # None: a graph output
            if isinstance(op, Subtensor) and i == 0:
                idx = indices_from_subtensor(client.inputs[1:], op.idx_list)
                first, rest = idx[0], tuple(idx[1:])
                if not isinstance(first, slice):
                    last = _is_last_index(first, v, var, start)
                    if last:
                        out.append((res, "last" if last is True else "last_nonempty", (wrappers, rest)))
                        continue
                elif first.stop is None and (first.step is None or _is_const(first.step, 1)):
                    s = 0 if first.start is None else constant_value(first.start)
                    new_start = None if start is None or s is None or s < 0 else start + s
                    if s is not None and s >= 0 and (not rest or whole(new_start) != "other"):
                        if rest:
                            out.append((res, whole(new_start), (wrappers, rest)))
                        else:
                            walk(res, new_start, wrappers)
                        continue
                    if first.start is not None and _is_last_index(first.start, v, var, start) is True:
                        out.append((res, "last_row", (wrappers, rest)))  # v[-1:]
                        continue
                    if s is not None and s < 0 and not rest:
                        walk(res, None, wrappers)  # v[-k:]: still a suffix of the rows
                        continue
                # any other selection reads v as a whole (replaced exactly if v is the buffer or the trace)
            if _rowwise(op) and i == 0:
                walk(res, start, (*wrappers, op))
                continue
            if isinstance(op, Shape | Shape_i):
                shapes.append((res, v, start, wrappers))
                continue
            out.append((v, whole(start), (wrappers, ())))
            return

    shapes: list = []
    walk(var, 0, ())
    # the rows' count may only serve to index the last row (``out[out.shape[0] - 1]``, merged slices): the
    # replacement does not know how many steps a loop with a stop ran
    last_nodes = {res.owner for res, kind, _ in out if kind in ("last", "last_nonempty", "last_row")}
    memo: dict = {}
    # other uses of the count read the rows as a whole (exact for a replaced trace or buffer)
    out += [(v, whole(start), (wrappers, ())) for s, v, start, wrappers in shapes
            if not _only_indexes(fgraph, s, last_nodes, memo)]
    return out


def _only_indexes(fgraph, v, nodes, memo) -> bool:
    """Every use of ``v`` ends, through any computation, in an index input of one of ``nodes``."""
    if v in memo:
        return memo[v]
    memo[v] = False
    ok = True
    for client, i in fgraph.clients.get(v, []):
        if client in nodes and i >= 1:
            continue
        if isinstance(client.op, Output) or not all(_only_indexes(fgraph, o, nodes, memo) for o in client.outputs):
            ok = False
            break
    memo[v] = ok
    return ok


def _has_clients(fgraph, v):
    return bool(fgraph.clients.get(v))


def match_scan(fgraph, node, patterns) -> tuple[Match | None, list[tuple[str, Reject]]]:
    """Match ``node`` against ``patterns``; returns (match or None, rejections).

    A step holding non-scalar constants is tried a second time with them
    lifted to inputs (see :func:`_canonical_user_graph`).
    """
    patterns = list(patterns)
    user = _user_graph(node)
    best: dict = {}
    for lift in (False, True):
        if lift:
            if not user.liftable:
                break
            user = _user_graph(node, lift=True)
        for pattern in patterns:
            try:
                return _match_pattern(fgraph, node, user, pattern), []
            except Reject as err:
                if pattern.name not in best or err.score > best[pattern.name].score:
                    best[pattern.name] = err
    rejections = sorted(best.items(), key=lambda pr: -pr[1].score)
    return None, rejections


def _match_pattern(fgraph, node, user: _UserGraph, pattern: Pattern) -> Match:
    if user.unsupported:
        raise Reject(user.unsupported, 0.0)
    if user.dtype is None or user.dtype not in ("float32", "float64"):
        raise Reject("the loop has no float32/float64 state", 0.0)
    if len(user.states) < len(pattern.states) or len(user.args.inner_in_seqs) < len(pattern.sequences):
        raise Reject(
            f"needs {len(pattern.states)} state(s) and {len(pattern.sequences)} sequence(s), the loop has "
            f"{len(user.states)} and {len(user.args.inner_in_seqs)}", 0.0)
    used_outputs = [j for j, o in enumerate(user.outer_outputs) if _has_clients(fgraph, o)]
    if pattern.outputs and len(used_outputs) > len(pattern.outputs):
        raise Reject(f"the loop has {len(used_outputs)} used per-step outputs, the pattern at most "
                     f"{len(pattern.outputs)}", 0.0)
    best = None
    for variant in range(len(pattern.step)):
        ref = _ref_graph(pattern, variant, user.dtype)
        try:
            for env in _unify_loop(pattern, ref, user, used_outputs if pattern.outputs else ()):
                return _check_outer(fgraph, node, user, pattern, env, variant, ref)
        except Reject as err:
            if best is None or err.score > best.score:
                best = err
    raise best


def _check_outer(fgraph, node, user, pattern, env, variant, ref) -> Match:
    a = user.args
    inner_to_outer = {}
    for v, o in zip(a.inner_in_seqs, a.outer_in_seqs):
        inner_to_outer[v] = o
    for v, o in zip(a.inner_in_non_seqs, a.outer_in_non_seqs):
        inner_to_outer[v] = o
    for v, (_, _, init) in user.outer_state.items():
        inner_to_outer[v] = initial_value(init)
    inner_to_outer.update(user.lifted)
    out_roles = {r.name for r in pattern.outputs}
    outer = {}
    for role, u in env.roles.items():
        if role in out_roles:
            continue
        outer[role] = u if _is_constant(u) else inner_to_outer[u]
    # pending static-shape constraints: x.shape[d] (or eye(m), ...) written as a constant
    def static_shape(role):
        u = env.roles.get(role)  # the inner variable: per-step static shape
        return user.static.get(u, u.type.shape) if u is not None and not _is_constant(u) else ()

    for item in env.pending:
        if item[0] == "dim":
            _, role, d, c = item
            shp = static_shape(role)
            if d >= len(shp) or shp[d] != c:
                raise Reject(f"the step uses the constant {c} where the reference uses {role}.shape[{d}], "
                             "and the static shape does not prove them equal", 50.0)
        else:
            _, r, u, roles = item
            values = {}
            for x in roles:
                name = ref.role_of[x][0].name
                bound = env.roles.get(name)
                if bound is None:
                    values = None
                    break
                values[x] = (pt.constant(np.asarray(bound.data).reshape(x.type.shape), dtype=x.type.dtype)
                             if _is_constant(bound) else x.type.clone(shape=static_shape(name))())
            folded = _specialize(r, roles, values) if values is not None else None
            if not (_is_constant(folded) and _const_equal(folded, u)):
                raise Reject(f"the step uses the constant {_describe(u)} where the reference computes it from "
                             "shapes and constants, and the static shapes do not prove them equal", 50.0)
    score = 100.0
    uses, views = {}, {}
    bound_states = {env.roles[r.name]: r.name for r in pattern.states}
    for v, (o, traced, _) in user.outer_state.items():
        use = _uses(fgraph, o, traced)
        views.update((var, how) for var, _, how in use)
        use = [(var, kind) for var, kind, _ in use]
        name = bound_states.get(v)
        if name is None:
            if use:
                raise Reject("the loop carries an extra state whose values are used outside", score)
            continue
        kinds = {k for _, k in use}
        provides = pattern.provides[name]
        if use and provides is None:
            raise Reject(f"the state {name} is used outside the loop (the replacement only computes the others)", score)
        if "other" in kinds:
            raise Reject(f"{name} is used through an index, slice or shape that is not provably its final "
                         "value (intermediate states, or the number of steps run)", score)
        if provides == "last" and kinds - {"last", "last_nonempty", "last_row"}:
            raise Reject(f"intermediate values of {name} (or the number of steps run) are used "
                         "(only its final value can be replaced)", score)
        uses[name] = use
    bound_outputs = {user.outer_outputs[env.roles[name]]: name for name in out_roles if name in env.roles}
    for o in user.extra_outputs:
        if o in bound_outputs:
            uses[bound_outputs[o]] = [(o, "trace")]
        elif _has_clients(fgraph, o):
            raise Reject("the loop has extra outputs that are used outside", score)
    if not any(uses.values()):
        raise Reject("no output of the loop is used", score)
    m = Match(pattern=pattern, node=node, args=a, inner=dict(env.roles), outer=outer, n_steps=a.n_steps,
              as_while=a.as_while, dtype=user.dtype, uses=uses, variant=variant, views=views)
    if pattern.check is not None:
        reason = pattern.check(m)
        if reason:
            raise Reject(reason, score + 1)
    return m
