"""Rewrite gradient Scans' mit-mot tapes as sit-sot running adjoints.

Reverse-mode autodiff of a ``Scan`` (``Scan.pullback``) turns every forward
sit-sot state ``x[t+1] = f(x[t], ...)`` into a *mit-mot* output of the backward
Scan: a buffer ``B`` of ``n_steps + 1`` rows, initialised with the reversed
cotangents of the forward trace, that step ``s`` reads at rows ``s`` and
``s + 1`` and writes at row ``s + 1``::

    B = dC_dxs[::-1]                       # outer initial buffer B0
    for s in range(n_steps):               # in-taps (0, 1), out-tap (1)
        B[s + 1] = vjp_f(x[t], B[s]) + B[s + 1]

When the cost uses only the last state (``xs[-1]``) every row of ``B0`` but the
first is zero, so ``B[s + 1]`` always reads a zero and the tape is pure
overhead (PyTensor issue #1687, "Rewrite mit-mot Scans as sit-sot").  The loop is then
exactly the sit-sot recurrence::

    a[0] = B0[0]
    for s in range(n_steps):
        a[s + 1] = vjp_f(x[t], a[s]) + 0

whose trace ``a`` equals the final ``B`` row by row.  As a sit-sot, PyTensor's
own memory rewrites (``scan_save_mem``, ``scan_sit_sot_to_untraced``) can keep
only the last step instead of the whole tape.

:func:`scan_mit_mot_to_sit_sot` is a node rewrite that performs this
conversion.  It fires only when it is exact:

* the mit-mot has in-taps ``(0, 1)`` and out-tap ``(1,)`` (the form
  ``Scan.pullback`` gives forward sit-sot states), with equal inner types;
* the outer initial buffer is *provably* zero in every row except row 0: it is
  analysed structurally through ``Alloc`` of zeros, constants, ``IncSubtensor``/
  ``SetSubtensor`` with constant row indices or ``[a:]`` slices, reversals
  ``[::-1]``, ``[a:]`` slices and elementwise ``+``/``-`` (:func:`nonzero_rows`),
  with symbolic lengths proven equal so numpy-style runtime broadcasting cannot
  spread a row;
* the buffer provably holds exactly ``n_steps + 1`` rows (a shorter mit-mot
  wraps around and reads its own writes; a longer one, as built for
  ``truncate_gradient``, keeps rows a sit-sot would not, and PyTensor's memory
  rewrites assume a sit-sot's last row is its last step).

Other mit-mots of the same Scan stay as they are; a Scan with no qualifying
mit-mot is left untouched, and so is a Scan whose step has more than
:data:`MAX_INNER_NODES` nodes (below).  The tap-1 read is replaced by zeros in
*all* inner outputs (its value is zero at every step).  The sit-sot starts from the default
Scan buffer built from the seed row alone (``AllocEmpty`` + row 0, see
:func:`row_value`), so the zero tape is never allocated; if the seed row cannot
be expressed without the tape, the tape itself is the initial buffer.

Both rewrites here leave Scans with large steps alone (more than
:data:`MAX_INNER_NODES` nodes in the inner graph, a cheap structural criterion):
what they save is one trace's memory traffic per step; what they cost is a
rebuilt Scan whose step PyTensor rewrites (and Numba compiles) once more, in
proportion to the step's size.  On small steps (a scalar recurrence, a GRU's
gradient) the saving wins; on the gradients of pymc-extras' Kalman filters
(180-630 inner nodes) the compile costs more than the run saves (measured in
``benchmarks/RESULTS.md``, do-no-harm section).

Registration (in :mod:`iterops.rewrites`): ``optdb`` position 1.59 (after ``stabilize`` at 1.5, before
``scan_eqopt2`` at 1.6 and the memory rewrites at 1.605-1.62), tags
``fast_run``, ``scan`` and ``iterops``; ``mode.excluding("iterops")`` turns it
off.  Scans' inner graphs are compiled with the same optimizer, so gradient
Scans nested inside another Scan's step are rewritten too.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.graph.replace import clone_replace
from pytensor.graph.rewriting.basic import copy_stack_trace, node_rewriter
from pytensor.scalar import basic as ps
from pytensor.scan.op import Scan
from pytensor.scan.utils import ScanArgs, expand_empty
from pytensor.tensor.basic import Alloc, ScalarFromTensor, TensorFromScalar
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.shape import SpecifyShape
from pytensor.tensor.subtensor import IncSubtensor, Subtensor, get_constant_idx

__all__ = ["MAX_INNER_NODES", "nonzero_rows", "scan_mit_mot_to_sit_sot", "scan_reversed_tail"]


# ---------------------------------------------------------------------------
# Integer scalar expressions as linear forms
# ---------------------------------------------------------------------------
# A linear form is a frozenset of (atom, coefficient) pairs plus a constant,
# stored as a tuple ``(const, frozenset(...))``.  Atoms are variables (after
# stripping integer casts) or ``("min", form, form)`` for min(p, q) written as
# ``minimum`` or ``switch(p < q, p, q)``.


def _form(const=0, terms=None):
    terms = {k: v for k, v in (terms or {}).items() if v != 0}
    return (int(const), frozenset(terms.items()))


def _const_form(form) -> int | None:
    return form[0] if form is not None and not form[1] else None


def _add_forms(a, b, sign=1):
    if a is None or b is None:
        return None
    terms = Counter(dict(a[1]))
    for k, v in b[1]:
        terms[k] += sign * v
    return _form(a[0] + sign * b[0], terms)


def _scalar_op(var):
    """The scalar op of ``var``'s owner, looking through ``Elemwise``."""
    node = var.owner
    if node is None:
        return None
    op = node.op
    if isinstance(op, Elemwise):
        return op.scalar_op
    if isinstance(op, ps.ScalarOp):
        return op
    return None


def _strip(var):
    """Drop integer casts and scalar/tensor conversions (value-preserving here)."""
    while var.owner is not None:
        op, sop = var.owner.op, _scalar_op(var)
        if isinstance(op, ScalarFromTensor | TensorFromScalar | SpecifyShape):
            var = var.owner.inputs[0]
        elif isinstance(sop, ps.Cast | ps.Identity) and var.owner.inputs[0].dtype in ("int32", "int64", "uint32"):
            var = var.owner.inputs[0]
        else:
            break
    return var


def _same_pair(ab, pq) -> bool:
    """Whether the comparison operands ``ab`` are the switch branches ``pq``."""
    return all(
        (fx := linear_form(x)) is not None and fx == linear_form(y) for x, y in zip(ab, pq, strict=True)
    )


def _atom(var, depth: int = 6):
    """Structural key of a variable: equal for equal computations (up to ``depth``)."""
    if isinstance(var, Constant):
        data = np.asarray(var.data)
        return ("const", str(data.dtype), data.shape, data.tobytes())
    node = var.owner
    if node is None or depth == 0:
        return var
    return (node.op, node.outputs.index(var), tuple(_atom(i, depth - 1) for i in node.inputs))


def _min_atom(p, q):
    fp, fq = linear_form(p), linear_form(q)
    if fp is None or fq is None:
        return None
    if fp == fq:
        return fp
    return _form(0, {_min_key(fp, fq): 1})


def _min_key(fp, fq):
    return ("min", *sorted((fp, fq), key=repr))


def _subst(form, atom, value: int):
    """``form`` with ``atom`` replaced by the constant ``value``."""
    terms = dict(form[1])
    coef = terms.pop(atom, 0)
    return _form(form[0] + coef * value, terms)


def linear_form(var):
    """Linear form of an integer scalar expression, or None if not linear."""
    var = _strip(var)
    if isinstance(var, Constant):
        data = np.asarray(var.data)
        if data.size == 1 and data.dtype.kind in "iu":
            return _form(int(data.reshape(())))
        return None
    sop = _scalar_op(var)
    if sop is None:
        return _form(0, {_atom(var): 1})
    ins = var.owner.inputs
    if isinstance(sop, ps.Add):
        out = _form()
        for i in ins:
            out = _add_forms(out, linear_form(i))
        return out
    if isinstance(sop, ps.Sub):
        return _add_forms(linear_form(ins[0]), linear_form(ins[1]), -1)
    if isinstance(sop, ps.Neg):
        return _add_forms(_form(), linear_form(ins[0]), -1)
    if isinstance(sop, ps.Minimum):
        return _min_atom(*ins)
    if isinstance(sop, ps.Switch):
        cond, p, q = ins
        csop = _scalar_op(cond)
        if isinstance(csop, ps.LT | ps.LE) and _same_pair(cond.owner.inputs, (p, q)):
            return _min_atom(p, q)
    return _form(0, {_atom(var): 1})


def _proves_len_is_steps_plus_one(length_form, n_steps) -> bool:
    """Whether ``length == n_steps + 1`` holds for every value of the atoms."""
    return _const_form(_add_forms(length_form, linear_form(n_steps), -1)) == 1


# ---------------------------------------------------------------------------
# Which rows of a tensor may be non-zero
# ---------------------------------------------------------------------------


def _is_zero_constant(var) -> bool:
    var = _strip(var)
    return isinstance(var, Constant) and not np.any(np.asarray(var.data))


def _row_form(idx, length):
    """Row selected by a constant integer index on an axis of length ``length``."""
    if not isinstance(idx, int | np.integer):
        return None
    return _form(int(idx)) if idx >= 0 else _add_forms(length, _form(int(idx)))


def nonzero_rows(var):
    """Rows of ``var`` (along axis 0) that may be non-zero, and its length.

    Returns ``(rows, length)``: ``rows`` is a frozenset of linear forms (row
    positions), ``length`` the linear form of ``var.shape[0]``; every row not
    in ``rows`` is exactly zero.  Returns None when the structure is not
    understood (the caller must then assume any row may be non-zero).
    """
    if var.type.ndim == 0:
        return None
    if isinstance(var, Constant):
        data = np.asarray(var.data)
        rows = np.flatnonzero(data.reshape(data.shape[0], -1).any(axis=1))
        return frozenset(_form(int(r)) for r in rows), _form(data.shape[0])
    node = var.owner
    if node is None:
        return None
    op = node.op
    if isinstance(op, SpecifyShape):
        return nonzero_rows(node.inputs[0])
    if isinstance(op, Alloc):
        value, *dims = node.inputs
        if not _is_zero_constant(value):
            return None
        length = linear_form(dims[0])
        return (frozenset(), length) if length is not None else None
    if isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Add | ps.Sub | ps.Neg):
        rows, length = frozenset(), None
        for inp in node.inputs:
            res = nonzero_rows(inp)
            if res is None:
                return None
            if inp.type.shape[0] == 1 and var.type.shape[0] != 1 and res[0]:
                return None  # broadcasting a non-zero row along axis 0
            rows |= res[0]
            if inp.type.shape[0] != 1:
                length = res[1]
        if length is None:
            length = _form(1) if var.type.shape[0] == 1 else None
        return (rows, length) if length is not None else None
    if isinstance(op, Subtensor):
        base = nonzero_rows(node.inputs[0])
        if base is None:
            return None
        rows, length = base
        idx = get_constant_idx(op.idx_list, node.inputs, allow_partial=True)
        first, rest = idx[0], idx[1:]
        if not isinstance(first, slice) or any(r != slice(None) for r in rest):
            return None
        if first == slice(None, None, -1):
            last = _add_forms(length, _form(-1))
            return frozenset(_add_forms(last, r, -1) for r in rows), length
        if (
            isinstance(first.start, int | np.integer)
            and first.start >= 0
            and first.stop is None
            and first.step in (None, 1)
        ):
            a = _form(int(first.start))
            new_len = _add_forms(length, _form(0, {_min_key(a, length): 1}), -1)
            if _const_form(length) is not None:
                new_len = _form(max(_const_form(length) - int(first.start), 0))
            new_rows = frozenset(_add_forms(r, a, -1) for r in rows)
            # rows known to lie before the slice start are dropped
            new_rows = frozenset(r for r in new_rows if _const_form(r) is None or _const_form(r) >= 0)
            return new_rows, new_len
        return None
    if isinstance(op, IncSubtensor):
        x, y = node.inputs[:2]
        base = nonzero_rows(x)
        if base is None:
            return None
        rows, length = base
        idx = get_constant_idx(op.idx_list, [x, *node.inputs[2:]], allow_partial=True)
        first, rest = idx[0], idx[1:]
        if not isinstance(first, slice):
            if _is_zero_constant(y):
                return rows, length
            row = _row_form(first, length)
            return (rows | {row}, length) if row is not None else None
        if any(r != slice(None) for r in rest) or y.type.ndim != x.type.ndim:
            return None
        if not (
            (first.start is None or (isinstance(first.start, int | np.integer) and first.start >= 0))
            and first.stop is None
            and first.step in (None, 1)
        ):
            return None
        sub = nonzero_rows(y)
        if sub is None:
            return None
        y_rows, y_len = sub
        if not y_rows:
            return rows, length
        a = int(first.start or 0)
        # The slice x[a:] has length L - min(a, L); y must fill it row for row
        # (a runtime-broadcast length-1 y would spread its row over the slice).
        a_form = _form(a)
        slice_lens = {_add_forms(length, a_form, -1)}
        slice_lens.add(_add_forms(length, _form(0, {_min_key(a_form, length): 1}), -1))
        if y_len not in slice_lens:
            const_y, const_x = _const_form(y_len), _const_form(length)
            if not (const_y is not None and const_x is not None and const_y == max(const_x - a, 0)):
                return None
        # A row of y only exists when the slice is non-empty (L >= a), and then
        # min(a, L) == a.
        a_min = _min_key(a_form, length)
        return rows | frozenset(_subst(_add_forms(r, a_form), a_min, a) for r in y_rows), length
    return None


def _assume(form, assume):
    for atom, value in assume:
        form = _subst(form, atom, value)
    return form


def _diff(r, s, assume=()):
    return _const_form(_assume(_add_forms(r, s, -1), assume))


def _differs(r, s, assume=()) -> bool:
    d = _diff(r, s, assume)
    return d is not None and d != 0


def _zero_at(rows, r, assume=()) -> bool:
    return all(_differs(r, s, assume) for s in rows)


def row_value(var, r, assume=()):
    """Expression for ``var[r]`` (``r`` a linear form) without computing ``var``.

    Follows the structures :func:`nonzero_rows` understands; returns None when
    it cannot.  ``assume`` holds ``(atom, value)`` substitutions valid where
    the row exists (``min(a, L) == a`` inside a non-empty ``[a:]`` slice).
    Used to start the sit-sot from the seed row alone, so the
    zero-filled tape is never allocated.
    """
    res = nonzero_rows(var)
    if res is None:
        return None
    rows, length = res
    node = var.owner
    if _zero_at(rows, r, assume):
        return pt.zeros(tuple(var.shape)[1:], dtype=var.dtype)
    if isinstance(var, Constant):
        c = _const_form(r)
        return pt.as_tensor_variable(np.asarray(var.data)[c]) if c is not None else None
    op = node.op
    if isinstance(op, SpecifyShape):
        return row_value(node.inputs[0], r, assume)
    if isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Add | ps.Sub | ps.Neg):
        if any(inp.type.shape[0] == 1 and var.type.shape[0] != 1 for inp in node.inputs):
            return None
        vals = [row_value(inp, r, assume) for inp in node.inputs]
        if any(v is None for v in vals):
            return None
        if isinstance(op.scalar_op, ps.Neg):
            return -vals[0]
        if isinstance(op.scalar_op, ps.Sub):
            return vals[0] - vals[1]
        out = vals[0]
        for v in vals[1:]:
            out = out + v
        return out
    if isinstance(op, Subtensor):
        first = get_constant_idx(op.idx_list, node.inputs, allow_partial=True)[0]
        base_len = nonzero_rows(node.inputs[0])[1]
        if first == slice(None, None, -1):
            return row_value(node.inputs[0], _add_forms(_add_forms(base_len, _form(-1)), r, -1), assume)
        return row_value(node.inputs[0], _add_forms(r, _form(int(first.start))), assume)
    if isinstance(op, IncSubtensor):
        x, y = node.inputs[:2]
        x_rows = nonzero_rows(x)[0]
        first = get_constant_idx(op.idx_list, [x, *node.inputs[2:]], allow_partial=True)[0]
        if not isinstance(first, slice):
            i = _row_form(first, length)
            if _differs(r, i, assume):
                return row_value(x, r, assume)
            if _diff(r, i, assume) != 0:
                return None
            y_row = y
        else:
            a_form = _form(int(first.start or 0))
            d = _diff(r, a_form, assume)
            if d is not None and d < 0:
                return row_value(x, r, assume)
            inner = (*assume, (_min_key(a_form, length), int(first.start or 0)))
            y_row = row_value(y, _add_forms(r, a_form, -1), inner)
            if y_row is None:
                return None
        if op.set_instead_of_inc or _zero_at(x_rows, r, assume):
            return pt.zeros(tuple(var.shape)[1:], dtype=var.dtype) + y_row
        x_row = row_value(x, r, assume)
        return None if x_row is None else x_row + y_row
    return None


def _seed_buffer(buffer, n_steps):
    """A sit-sot initial buffer equivalent to the seed-only tape ``buffer``.

    ``len(buffer) == n_steps + 1`` is proven, so Scan writes every row but the
    first: the tape is replaced by the default Scan buffer (``AllocEmpty`` with
    the seed row set), which ``scan_save_mem`` knows how to shrink.  If the seed
    row cannot be expressed without the tape, the tape itself is kept.
    """
    row = row_value(buffer, _form(0))
    if row is None:
        return buffer
    shape = tuple(buffer.shape)
    if row.type.ndim < buffer.type.ndim - 1:
        row = pt.broadcast_to(row, shape[1:])
    if row.type.ndim != buffer.type.ndim - 1:
        return buffer
    row = pt.cast(row, buffer.dtype)
    init = pt.expand_dims(row, 0)
    if init.type.broadcastable[1:] != buffer.type.broadcastable[1:]:
        return buffer
    return expand_empty(init, shape[0] - 1)


def _tape_is_seed_only(buffer, n_steps) -> bool:
    """Whether ``buffer`` is zero except row 0 and has exactly n_steps + 1 rows."""
    res = nonzero_rows(buffer)
    if res is None:
        return False
    rows, length = res
    if any(_const_form(r) != 0 for r in rows):
        return False
    return _proves_len_is_steps_plus_one(length, n_steps)


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------


@node_rewriter([Scan])
def scan_mit_mot_to_sit_sot(fgraph, node):
    """Turn seed-only mit-mot tapes of a (gradient) Scan with a small step into sit-sot states."""
    op = node.op
    info = op.info
    if info.n_mit_mot == 0 or not _small_step(op):
        return None
    n_steps = node.inputs[0]
    outer_mit_mot = op.outer_mitmot(node.inputs)
    candidates = [
        k
        for k in range(info.n_mit_mot)
        if tuple(info.mit_mot_in_slices[k]) == (0, 1)
        and tuple(info.mit_mot_out_slices[k]) == (1,)
        and _tape_is_seed_only(outer_mit_mot[k], n_steps)
    ]
    if not candidates:
        return None

    args = ScanArgs.from_node(node, clone=True)
    taps = [args.inner_in_mit_mot[k] for k in candidates]
    if any(t0.type != t1.type for t0, t1 in taps):
        keep = [(k, t) for k, t in zip(candidates, taps, strict=True) if t[0].type == t[1].type]
        if not keep:
            return None
        candidates, taps = [k for k, _ in keep], [t for _, t in keep]

    # The tap-1 read of a qualifying mit-mot is zero at every step.
    zeros = {t1: pt.zeros_like(t0) for t0, t1 in taps}
    inner_outputs = args.inner_outputs
    new_inner_outputs = clone_replace(inner_outputs, replace=zeros)
    # ``inner_outputs`` may repeat a variable: split it positionally.
    pos = 0
    new_out_mm = []
    for group in args.inner_out_mit_mot:
        new_out_mm.append(list(new_inner_outputs[pos : pos + len(group)]))
        pos += len(group)
    n_mm_outs = pos
    rest = new_inner_outputs[n_mm_outs:]
    n_mit_sot, n_sit_sot, n_nit_sot = info.n_mit_sot, info.n_sit_sot, info.n_nit_sot
    args.inner_out_mit_sot = list(rest[:n_mit_sot])
    args.inner_out_sit_sot = list(rest[n_mit_sot : n_mit_sot + n_sit_sot])
    args.inner_out_nit_sot = list(rest[n_mit_sot + n_sit_sot : n_mit_sot + n_sit_sot + n_nit_sot])
    n_shared = info.n_untraced_sit_sot
    args.inner_out_shared = list(
        rest[n_mit_sot + n_sit_sot + n_nit_sot : n_mit_sot + n_sit_sot + n_nit_sot + n_shared]
    )
    if args.cond:
        args.cond = [rest[-1]]

    keep_mm = [k for k in range(info.n_mit_mot) if k not in candidates]
    for k in candidates:
        args.inner_in_sit_sot.append(args.inner_in_mit_mot[k][0])
        args.outer_in_sit_sot.append(_seed_buffer(args.outer_in_mit_mot[k], n_steps))
        args.inner_out_sit_sot.append(new_out_mm[k][0])
        args.outer_out_sit_sot.append(args.outer_out_mit_mot[k])
    args.inner_in_mit_mot = [args.inner_in_mit_mot[k] for k in keep_mm]
    args.outer_in_mit_mot = [args.outer_in_mit_mot[k] for k in keep_mm]
    args.inner_out_mit_mot = tuple(new_out_mm[k] for k in keep_mm)
    args.outer_out_mit_mot = [args.outer_out_mit_mot[k] for k in keep_mm]
    args.mit_mot_in_slices = tuple(info.mit_mot_in_slices[k] for k in keep_mm)
    args.mit_mot_out_slices = tuple(info.mit_mot_out_slices[k] for k in keep_mm)

    new_op = Scan(
        args.inner_inputs,
        args.inner_outputs,
        args.info,
        mode=op.mode,
        profile=op.profile,
        truncate_gradient=op.truncate_gradient,
        name=op.name,
        allow_gc=op.allow_gc,
    )
    new_outs = new_op(*args.outer_inputs, return_list=True)
    replacements = dict(zip(args.outer_outputs, new_outs, strict=True))
    copy_stack_trace(node.outputs, new_outs)
    return replacements


#: the rewrites here leave a Scan alone whose inner graph has more nodes than this
MAX_INNER_NODES = 64


def _small_step(op) -> bool:
    return len(op.fgraph.apply_nodes) <= MAX_INNER_NODES


@node_rewriter([Subtensor])
def scan_reversed_tail(fgraph, node):
    """``xs[:-(k + 1):-1]`` -> ``xs[-k:][::-1]`` for a sit-sot output ``xs`` of a Scan with a small step.

    Both select rows ``L-1, ..., max(L-k, 0)``.  Gradients of a Scan's initial
    state read the reversed adjoint trace this way (``grad[::-1][:k]`` after
    canonicalization); the forward form ``xs[-k:]`` is what ``scan_save_mem``
    recognises to keep only ``k`` steps.  For ``k == 1`` the reversal is dropped.

    Only for a Scan whose inner graph has at most :data:`MAX_INNER_NODES` nodes
    (``scan_save_mem`` rebuilds the Scan it shrinks).
    """
    x = node.inputs[0]
    if x.owner is None or not isinstance(x.owner.op, Scan):
        return None
    scan = x.owner
    if x not in scan.op.outer_sitsot_outs(scan.outputs) or not _small_step(scan.op):
        return None
    idx = get_constant_idx(node.op.idx_list, node.inputs, allow_partial=True)
    first, rest = idx[0], idx[1:]
    if not (
        isinstance(first, slice)
        and first.start is None
        and first.step == -1
        and isinstance(first.stop, int | np.integer)
        and first.stop < -1
    ):
        return None
    k = -int(first.stop) - 1
    tail = x[-k:]
    if k > 1:
        tail = tail[::-1]
    out = tail[(slice(None), *rest)] if rest else tail
    copy_stack_trace(node.outputs[0], out)
    return [out]
