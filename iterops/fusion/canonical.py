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
matrix-vector ``dot`` as ``@``.  After it, :func:`_normalize_gaussian` gives
the terms of a Gaussian log density that ``canonicalize`` leaves apart one
of two forms, by where it fails (``v^T F^{-1} v`` by ``inv`` or ``solve``, or
by a Cholesky factor: ``cho_solve``, a whitened residual; ``log det F`` by a
Cholesky factor), in either operand order, so a reference holds one spelling
of each; it costs one pass over the nodes and builds its forms as
``canonicalize`` writes them.

Also here: :func:`constant_value` and :func:`provably_equal` (proofs by
canonicalization), and the user's inner graph bound to the Scan's outer
variables (:func:`_user_graph`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.configdefaults import config
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.basic import dfs_rewriter
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.graph.traversal import io_toposort
from pytensor.scalar import ScalarType
from pytensor.scan.utils import ScanArgs
from pytensor.tensor.basic import ExtractDiag, get_underlying_scalar_constant_value
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.linalg.decomposition.cholesky import Cholesky
from pytensor.tensor.linalg.solvers.general import Solve
from pytensor.tensor.linalg.solvers.psd import CholeskySolve
from pytensor.tensor.linalg.solvers.triangular import SolveTriangular
from pytensor.tensor.math import Dot, Prod, Sum
from pytensor.tensor.rewriting.elemwise import local_dimshuffle_lift
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
    """PyTensor's ``canonicalize`` (iterops' rewrites excluded), then :func:`_normalize_gaussian`."""
    rewrite_graph(fg, include=("canonicalize",), exclude=("iterops",))
    _normalize_gaussian(fg)
    return fg


# ---------------------------------------------------------------------------
# Normal forms of Gaussian log-density terms
# ---------------------------------------------------------------------------
#
# ``canonicalize`` leaves the spellings of ``log det F`` and ``v^T F^{-1} v`` apart.  Each becomes one of two
# normal forms, by what it does where ``F`` is not positive definite:
#
# * general (NaN only where ``F`` is singular, or ``det F < 0``): ``v . (inv(F) @ v)`` for ``solve(F, v)``
#   with ``assume_a`` ``"gen"`` or ``"sym"``; ``log(det(F))`` is left as written;
# * positive definite (NaN, or a raise under FAST_COMPILE, where the Cholesky factor fails):
#   ``v . cho_solve((cholesky(F), True), v)`` for ``solve(F, v, assume_a="pos")``, ``cho_solve`` of either
#   factor and the whitened residual ``|solve_triangular(L, v, lower=True)|^2``; ``c/2 ld`` for ``c`` times half
#   the log-determinant ``sum(log(diag(L)))`` or ``log(prod(diag(L)))`` of a lower, upper or transposed factor
#   ``L`` (constants folded as ``canonicalize`` folds them), with ``ld = 2 sum(log(diag(cholesky(F))))``.
#
# Each rule is an identity for a symmetric ``F`` (``"sym"``, ``"pos"`` and the factors read one triangle of
# it): a pattern whose reference holds these forms proves its inputs symmetric (the Kalman patterns prove
# ``P0``, ``H`` and ``Q`` symmetric, the textbook ones positive semi-definite, which is where it may accept
# both forms).  An inner product ``x . w`` (``x @ w``, ``sum(x * w)``) whose first operand is a product
# (``M @ u``, a solve) and the second not is written ``w . x``.  The normalized graph is only compared, never
# run.  Only steps holding a Cholesky factor, a solve of a vector, or an inner product with a product first
# are touched; the others cost one pass over the nodes.


def _core_op(node):
    return getattr(node.op, "core_op", node.op)


def _owner_op(v, op_type):
    """``v``'s node if its (core) Op is an ``op_type``, else None."""
    return v.owner if v.owner is not None and isinstance(_core_op(v.owner), op_type) else None


def _dimshuffle(v, order):
    """The input of ``v`` if ``v`` is a DimShuffle with ``new_order == order``, else None."""
    if v.owner is not None and isinstance(v.owner.op, DimShuffle) and tuple(v.owner.op.new_order) == order:
        return v.owner.inputs[0]
    return None


def _elemwise(v, scalar_type):
    if v.owner is not None and isinstance(v.owner.op, Elemwise) and isinstance(v.owner.op.scalar_op, scalar_type):
        return v.owner.inputs
    return None


def _cholesky_of(L, lower=None):
    """``F`` if ``L`` is a Cholesky factor of ``F``: ``cholesky(F)`` or its transpose (with ``lower`` given:
    a lower factor when ``lower``, an upper one otherwise), else None."""
    node, flipped = _owner_op(L, Cholesky), False
    if node is None:
        t = _dimshuffle(L, (1, 0))
        node, flipped = (_owner_op(t, Cholesky), True) if t is not None else (None, False)
    if node is None or node.inputs[0].type.ndim != 2:
        return None
    if lower is not None and (_core_op(node).lower != flipped) != lower:
        return None
    return node.inputs[0]


def _is_lower_factor(L):
    """``L`` is ``cholesky(F, lower=True)`` itself (the factor of the positive-definite normal forms)."""
    node = _owner_op(L, Cholesky)
    return node is not None and _core_op(node).lower


def _vector_solve(v):
    """``(F, b, pd)`` if ``v`` is ``F^{-1} b`` of a vector ``b`` spelled as a solve (not ``inv(F) @ b``), ``pd``
    whether it fails where ``F`` is not positive definite; else None."""
    node = _owner_op(v, Solve)
    if node is not None and _core_op(node).b_ndim == 1 and node.inputs[0].type.ndim == 2:
        return node.inputs[0], node.inputs[1], _core_op(node).assume_a == "pos"
    node = _owner_op(v, CholeskySolve)
    if node is not None and _core_op(node).b_ndim == 1:
        F = _cholesky_of(node.inputs[0], lower=_core_op(node).lower)
        if F is not None:
            return F, node.inputs[1], True
    return None


def _is_product(v):
    """``v`` is a matrix-vector product (canonical ``M @ u``) or a solve of a vector."""
    if _vector_solve(v) is not None:
        return True
    d = _dimshuffle(v, (0,))
    return d is not None and _owner_op(d, Dot) is not None


def _inner_product(node):
    """``(x, w)`` if ``node`` computes the inner product of the vectors ``x`` and ``w``, else None."""
    out = node.outputs[0]
    if out.type.ndim != 0:
        return None
    if isinstance(node.op, DimShuffle) and tuple(node.op.new_order) == ():  # squeeze(dot(x[None], col))
        d = _owner_op(node.inputs[0], Dot)
        if d is None:
            return None
        row, col = d.inputs
        x = _dimshuffle(row, ("x", 0))
        w = _dimshuffle(col, (0, "x"))
        if w is None and _owner_op(col, Dot) is not None and col.type.shape[-1] == 1:
            w = pt.squeeze(col, axis=1)  # the matrix-vector product M @ u, as a vector
        return (x, w) if x is not None and w is not None else None
    if isinstance(_core_op(node), Dot) and all(i.type.ndim == 1 for i in node.inputs):
        return tuple(node.inputs)
    if isinstance(node.op, Sum) and node.inputs[0].type.ndim == 1:
        t = node.inputs[0]
        if (xs := _elemwise(t, ps.Mul)) is not None and len(xs) == 2:
            return tuple(xs)
        if (xs := _elemwise(t, ps.Sqr)) is not None:
            return xs[0], xs[0]
        if (xs := _elemwise(t, ps.Pow)) is not None and constant_value(xs[1]) == 2:
            return xs[0], xs[0]
    return None


def _dot_form(x, col):
    """``x . w`` as ``canonicalize`` writes it: ``squeeze(dot(x[None, :], col))`` with ``col = w[:, None]`` (or
    ``dot(M, u[:, None])`` for ``w = M @ u``)."""
    return pt.squeeze(_DOT(pt.expand_dims(x, 0), col), axis=(0, 1))


def _solve_column(F, b, pd):
    """``F^{-1} b`` of a vector ``b`` in its normal form (``pd``: the positive-definite one), as a column."""
    if pd:
        return pt.expand_dims(pt.linalg.cho_solve((pt.linalg.cholesky(F, lower=True), True), b), 1)
    return _DOT(pt.linalg.inv(F), pt.expand_dims(b, 1))


def _column(w):
    """``w`` as the column operand of :func:`_dot_form`: ``w[:, None]``, or ``dot(M, u[:, None])`` if ``w`` is the
    canonical ``M @ u``."""
    d = _dimshuffle(w, (0,))
    return d if d is not None and _owner_op(d, Dot) is not None else pt.expand_dims(w, 1)


def _is_normal_solve(w):
    """``w`` is a solve of a vector in its normal form already: ``cho_solve((cholesky(F), True), b)``."""
    node = _owner_op(w, CholeskySolve)
    return node is not None and _core_op(node).lower and _is_lower_factor(node.inputs[0])


def _normal_inner_product(node):
    """The normal form of the inner product ``node`` computes (see above), or None if it is one already.

    An inner product of two plain vectors keeps its operand order (and its spelling: the unifier compares
    ``sum(x * w)`` commutatively).
    """
    xw = _inner_product(node)
    if xw is None:
        return None
    x, w = xw
    if x is w and (st := _owner_op(w, SolveTriangular)) is not None:
        op = _core_op(st)
        F = _cholesky_of(st.inputs[0], lower=True)
        if F is not None and op.lower and not op.unit_diagonal and op.b_ndim == 1:
            b = st.inputs[1]
            return _dot_form(b, _solve_column(F, b, pd=True))  # |L^{-1} b|^2 = b^T (L L^T)^{-1} b
    if not (_is_product(x) or _is_product(w)):
        return None
    changed = not isinstance(node.op, DimShuffle)  # sum(x * w) or a dot of vectors: spelled x @ w
    if _is_product(x) and not _is_product(w):
        x, w, changed = w, x, True
    if (fbp := _vector_solve(w)) is not None and not _is_normal_solve(w):
        return _dot_form(x, _solve_column(*fbp))
    return _dot_form(x, _column(w)) if changed else None


def _factor_logdet(v):
    """``L`` if ``v`` is ``sum(log(diag(L)))`` or ``log(prod(diag(L)))`` with ``L`` a Cholesky factor (``v =
    log det(F) / 2``), else None."""
    node = v.owner
    if node is None or v.type.ndim != 0:
        return None
    if isinstance(node.op, Sum) and node.inputs[0].type.ndim == 1:  # sum(log(diag(L)))
        logs = _elemwise(node.inputs[0], ps.Log)
        diag = logs[0] if logs is not None else None
    elif (xs := _elemwise(v, ps.Log)) is not None:  # log(prod(diag(L)))
        prod = xs[0].owner
        diag = prod.inputs[0] if prod is not None and isinstance(prod.op, Prod) and xs[0].type.ndim == 0 else None
    else:
        return None
    d = _owner_op(diag, ExtractDiag) if diag is not None else None
    if d is None or _core_op(d).offset != 0 or d.inputs[0].type.ndim != 2:
        return None
    return d.inputs[0] if _cholesky_of(d.inputs[0]) is not None else None


def _scaled(v):
    """``(c, x)`` if ``v`` is ``c * x`` with ``c`` a constant scalar, else None."""
    xs = _elemwise(v, ps.Mul)
    if xs is not None and len(xs) == 2:
        for c, x in (xs, xs[::-1]):
            if (cv := constant_value(c)) is not None:
                return cv, x
    return None


def _normal_logdet(fg, node):
    """The positive-definite normal form ``c/2 * ld`` (``ld`` itself for ``c = 2``) of ``c * h``, ``h / 2`` of ``h``
    outside such a product, where ``h`` is half the log-determinant of ``F`` from a Cholesky factor
    (:func:`_factor_logdet`) and ``ld = 2 sum(log(diag(cholesky(F))))`` (lower factor); else None."""
    out = node.outputs[0]
    if (ch := _scaled(out)) is not None:
        c, h = ch
        L = _factor_logdet(h)
        if L is None or (c == 2 and isinstance(h.owner.op, Sum) and _is_lower_factor(L)):
            return None
        ld = _pd_logdet(_cholesky_of(L), out.type.dtype)
        return ld if c == 2 else pt.mul(pt.constant(c / 2, dtype=out.type.dtype), ld)
    L = _factor_logdet(out)
    if L is None or any(not isinstance(c, str) and _scaled(c.outputs[0]) is not None for c, _ in fg.clients[out]):
        return None  # (rewritten at the product)
    return pt.mul(pt.constant(0.5, dtype=out.type.dtype), _pd_logdet(_cholesky_of(L), out.type.dtype))


def _pd_logdet(F, dtype):
    """``2 sum(log(diag(cholesky(F))))`` as ``canonicalize`` writes it."""
    return pt.mul(pt.constant(2.0, dtype=dtype), pt.sum(pt.log(_DIAG(pt.linalg.cholesky(F, lower=True)))))


_DOT = Dot()
_DIAG = ExtractDiag(offset=0, axis1=0, axis2=1, view=True)
_GAUSSIAN_OPS = (Cholesky, Solve, CholeskySolve)


def _normalize_gaussian(fg: FunctionGraph) -> bool:
    """Rewrite ``fg``'s Gaussian log-density terms to their normal forms (see above), built as ``canonicalize``
    writes them (no second ``canonicalize``: only its expand_dims lifting, over the changed graph); whether any
    changed."""
    nodes = fg.toposort()
    if not any(isinstance(_core_op(n), _GAUSSIAN_OPS) for n in nodes) and not any(
            (xw := _inner_product(n)) is not None and _is_product(xw[0]) for n in nodes):
        return False
    pairs = []
    for n in nodes:
        new = _normal_logdet(fg, n)
        if new is None:
            new = _normal_inner_product(n)
        if new is not None:
            old = n.outputs[0]
            pairs.append((old, pt.cast(new, old.type.dtype) if new.type.dtype != old.type.dtype else new))
    if pairs:
        fg.replace_all(pairs, reason="iterops_gaussian_normal_form", import_missing=True)
        # what canonicalize does to the new nodes: expand_dims lifted through elementwise operations
        dfs_rewriter(local_dimshuffle_lift).rewrite(fg)
    return bool(pairs)


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

