"""Stage 3 of the matcher: how the Scan's outputs are used in the outer graph.

Nothing here knows a specific algorithm (see :mod:`iterops.fusion.matcher`
for the stages together).

The outer graph is checked: states the replacement cannot provide are
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
"""

from __future__ import annotations

import pytensor.tensor as pt
from pytensor.graph.fg import FunctionGraph, Output
from pytensor.graph.rewriting.utils import rewrite_graph
from pytensor.tensor.basic import AllocEmpty, ScalarFromTensor
from pytensor.tensor.elemwise import DimShuffle
from pytensor.tensor.shape import Shape, Shape_i
from pytensor.tensor.subtensor import IncSubtensor, Subtensor, indices_from_subtensor

from iterops.fusion import piecewise
from iterops.fusion.canonical import constant_value, provably_equal
from iterops.fusion.unify import _shape_access

__all__ = ["initial_value"]


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
