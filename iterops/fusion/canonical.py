"""Stage 1 of the matcher: canonical inner graphs.

Nothing here knows a specific algorithm (see :mod:`iterops.fusion.matcher`
for the stages together).

The user's inner graph (a mutable copy) and the pattern's reference step
(built on fresh symbolic inputs, one per role) are canonicalized with the
same PyTensor rewrites (``canonicalize``, iterops' own rewrites excluded).
This removes most spelling differences: ``@`` / ``dot`` / ``matrix_dot``
all become ``Dot``; ``.T`` / ``.mT`` / ``transpose`` one transpose; ``conj``
of a real matrix disappears; constants fold.  Before that, the user's
inner graph is rebuilt on inputs without static shapes (canonicalization
specializes on them: a sum over a length-1 axis becomes a squeeze) and
both graphs inline ``OpFromGraph`` nodes (e.g. ``pt.diag``) and spell a
matrix-vector ``dot`` as ``@``.

Also here: :func:`constant_value` and :func:`provably_equal` (proofs by
canonicalization), and the user's inner graph bound to the Scan's outer
variables (:func:`_user_graph`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.configdefaults import config
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.scalar import ScalarType
from pytensor.graph.traversal import io_toposort
from pytensor.scan.utils import ScanArgs
from pytensor.tensor.basic import get_underlying_scalar_constant_value
from pytensor.tensor.math import Dot
from pytensor.tensor.type import TensorType

__all__ = ["constant_value", "provably_equal"]


def constant_value(v):
    """The scalar value of ``v`` if it is a (folded) constant, else None."""
    if isinstance(v, Variable) and not isinstance(v.type, TensorType | ScalarType):
        return None  # e.g. a random generator
    c = get_underlying_scalar_constant_value(v, raise_not_constant=False)
    if isinstance(c, Variable):
        return None
    c = np.asarray(c)
    return c.item() if c.size == 1 else None


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


#: (Scan op, lift) -> its canonical :class:`_UserGraph`.  Keyed by the op itself: Scan ops compare by their
#: (interned) inner graphs, so equal steps -- rebuilt by PyTensor's rewrites, or built again by the user -- are
#: canonicalized once per process
_USER_CACHE: OrderedDict = OrderedDict()


def _user_graph(node, lift=False) -> _UserGraph:
    """The canonicalized inner graph of ``node`` (cached per Scan op), bound to its outer variables."""
    op = node.op
    ug = _USER_CACHE.get((op, lift))
    if ug is not None:
        _USER_CACHE.move_to_end((op, lift))
    else:
        ug = _canonical_user_graph(node, lift)
        _USER_CACHE[(op, lift)] = ug
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
    except Exception:  # noqa: BLE001  (a guard, not a verdict: an Op whose make_node needs static shapes)
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
    with config.change_flags(traceback__limit=0):  # private copies: no user needs their creation stack
        return _canonical_user_graph_untraced(node, lift)


def _canonical_user_graph_untraced(node, lift):
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
    unsupported = unsupported_loop(op)
    return _UserGraph(
        inner_inputs=list(fg.inputs[:n_ins]), inner_outputs=list(fg.outputs), kind=kind, states=states,
        updates=updates, outputs=list(a.inner_out_nit_sot), static=static, cond=a.cond[0] if a.cond else None,
        dtype=dtypes[0] if dtypes else None, unsupported=unsupported, lifted=lifted, liftable=bool(consts),
    )


def unsupported_loop(op) -> str | None:
    """Why no pattern can replace the Scan ``op`` whatever its step computes, or None."""
    info = op.info
    if info.n_mit_mot or info.n_mit_sot:
        return "the loop has multi-tap (mit-sot/mit-mot) states"
    if op.truncate_gradient != -1:
        # the fused Ops' gradients are full; reproducing a truncated one is not worth a pattern
        return f"the loop truncates its gradient (truncate_gradient={op.truncate_gradient})"
    if any(not isinstance(v.type, TensorType) for v in op.inner_inputs):
        return "the loop carries non-tensor values (e.g. a random generator)"
    return None


def _inner_inputs(a: ScanArgs):
    return [*a.inner_in_seqs, *itertools.chain(*a.inner_in_mit_mot), *itertools.chain(*a.inner_in_mit_sot),
            *a.inner_in_sit_sot, *a.inner_in_shared, *a.inner_in_non_seqs]


def _inner_outputs(a: ScanArgs):
    return [*itertools.chain(*a.inner_out_mit_mot), *a.inner_out_mit_sot, *a.inner_out_sit_sot,
            *a.inner_out_nit_sot, *a.inner_out_shared, *a.cond]

