"""Gradient fusion: a matched loop differentiated with plain ``pytensor.grad``.

``pytensor.grad`` of a cost through a Scan calls ``Scan.pullback``, which
builds a second, reverse *gradient Scan* reading the forward Scan's whole
trace (its buffers, reversed).  That read disqualifies the forward loop from
:func:`iterops.fusion.rewrite.fuse_scan` (an intermediate state is used), so
both would stay Scans.  This module replaces the pair:

1. **Find** the gradient Scans of a forward Scan ``F``: Scans downstream of
   ``F`` named as ``Scan.pullback`` names them (``grad_of_<name>``).
2. **Identify** each one exactly: read candidate cotangents off its inputs
   (the variables the pullback reverses, ``c[::-1]``: the i-th mit-mot input
   for the i-th state, the sequences for per-step outputs), rebuild
   ``F.op.pullback(F.inputs, F.outputs, cotangents)`` with them and require
   the rebuilt gradient Scan to equal the one in the graph (the same Scan op,
   i.e. equal inner graphs, and ``equal_computations`` of the outer inputs).
   A Scan that cannot be identified so (a second derivative, a truncated
   gradient, a gradient Scan a rewrite has changed) is not a pullback of
   ``F``: it stays, and counts as a use of ``F``'s trace.
3. **Match** ``F`` as if the identified gradient Scans were not there (their
   private input graph hidden), with each connected cotangent standing for a
   use of the output it belongs to: for a state whose cotangent is provably
   zero outside its last row (the cotangent of ``out[-1]`` as
   ``pytensor.grad`` builds it: ``inc_subtensor`` of a last-row index into
   zeros, sums of such), a use of the final state; otherwise a use of the
   whole buffer (only patterns providing the trace, the Kalman filters,
   accept that).
4. **Replace** the gradients the pullback returned (located in the graph
   structurally: ``x[::-1]`` / ``x[-1]`` of the gradient Scan's outputs), by
   the fused Op's own gradient fed with the same cotangents
   (``pytensor.grad(None, known_grads={fused value: cotangent})``), and the
   forward uses as :func:`~iterops.fusion.rewrite.replacements_for` does.
   The gradient with respect to an initial-state buffer is replaced only
   where its users read row 0 alone (the row holding the initial value; the
   other rows are the loop's intermediate adjoints, never read by
   ``pytensor.grad``'s graph of ``set_subtensor(empty[:1], x0)``).  A
   sequence that the fused graph reads through its source (``x`` for the
   Scan's slice ``x[:n]`` or ``x[::-1][:n]``) gets the fused gradient of the
   source, sliced alike (:func:`_sliced_source` says why that is exact).
   The pullback's gradients are partial derivatives, one per loop input; ``pytensor.grad`` of the fused
   graph gives total ones.  They differ where one variable feeds two loop inputs (a start value
   ``X0 = Q`` with ``Q`` a non-sequence too): then the fused replacement is built again on stand-ins
   for the loop inputs, and differentiated with respect to them (:func:`_partial_gradients`).

Several costs differentiated through one loop give several gradient Scans:
each is identified and replaced with its own cotangents.  The rewrite runs
at position 0.04 of ``optdb`` (before PyTensor's Scan rewrites change either
Scan), also inside the inner graphs of Scans (nested loops), see
:mod:`iterops.fusion.rewrite`.

When in doubt the Scans are kept: any step that fails keeps both.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import pytensor
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType
from pytensor.graph.basic import Constant, Variable, equal_computations
from pytensor.graph.fg import Output
from pytensor.graph.null_type import NullType
from pytensor.graph.replace import clone_replace
from pytensor.graph.traversal import ancestors
from pytensor.scan.op import Scan
from pytensor.scan.utils import ScanArgs
from pytensor.tensor.basic import Alloc
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Sum
from pytensor.tensor.subtensor import IncSubtensor, Subtensor, indices_from_subtensor

from iterops.fusion.matcher import constant_value, initial_value, inner_reject, match_scan, may_match
from iterops.fusion.uses import _is_last_index
from iterops.fusion.registry import PATTERNS

__all__ = ["GradientPair", "fuse_with_gradients", "gradient_scans"]

_log = logging.getLogger("iterops.fusion")

#: at most this many cotangent assignments are tried per gradient Scan (each rebuilds a pullback)
_MAX_ASSIGNMENTS = 16


class GradientPair:
    """The outcome of :func:`fuse_with_gradients` for one forward Scan.

    ``replacements``: ``{variable: fused replacement}`` (None when kept);
    ``gradients``: the gradient Scan nodes identified as ``F``'s pullbacks;
    ``match``: the forward :class:`~iterops.fusion.matcher.Match` (or None);
    ``reason``: why the pair was kept.
    """

    def __init__(self, replacements=None, gradients=(), match=None, reason=None, rejections=()):
        self.replacements = replacements
        self.gradients = list(gradients)
        self.match = match
        self.reason = reason
        self.rejections = list(rejections)


# ---------------------------------------------------------------------------
# 1. candidates
# ---------------------------------------------------------------------------


def gradient_scans(fgraph, F):
    """Scan nodes downstream of ``F`` that may be its pullback.

    ``Scan.pullback`` names its Scan ``grad_of_<name>`` (unnamed if the forward
    Scan is), and ``Scan.__eq__`` compares names, so other Scans are skipped
    cheaply; :func:`identify` decides.
    """
    name = F.op.name
    want = f"grad_of_{name}" if name else None
    found, seen = [], set()
    stack = list(F.outputs)
    while stack:
        v = stack.pop()
        for client, _i in fgraph.clients.get(v, ()):
            if client in seen or client is F or not hasattr(client, "outputs"):
                continue
            seen.add(client)
            if isinstance(client.op, Scan):
                if client.op.name == want:
                    found.append(client)
                continue  # past a Scan: a second derivative reads the first one's outputs, not F's
            stack.extend(client.outputs)
    return found


# ---------------------------------------------------------------------------
# 2. identification: the gradient Scan is F's pullback for some cotangents
# ---------------------------------------------------------------------------


def _strip_subtensors(v):
    while v.owner is not None and isinstance(v.owner.op, Subtensor):
        v = v.owner.inputs[0]
    return v


def _reversed_base(v):
    """``b`` if ``v`` is ``b[::-1]`` or ``b[k::-1]``, possibly followed by ``[:n]`` slices; else None."""
    while v.owner is not None and isinstance(v.owner.op, Subtensor):
        idx = indices_from_subtensor(v.owner.inputs[1:], v.owner.op.idx_list)
        if len(idx) == 1 and isinstance(idx[0], slice) and idx[0].step is not None \
                and constant_value(idx[0].step) == -1 and idx[0].stop is None:
            return v.owner.inputs[0]
        if len(idx) == 1 and isinstance(idx[0], slice) and idx[0].start is None and idx[0].step is None:
            v = v.owner.inputs[0]
            continue
        return None
    return None


def _cotangent_base(F, inp):
    """The cotangent ``c`` if ``inp`` is ``c[::-1]`` (possibly sliced) and ``c`` is not ``F``'s own input or output."""
    own = {_strip_subtensors(v) for v in (*F.outputs, *F.inputs)}
    b = _reversed_base(inp)
    if b is None or _strip_subtensors(b) in own or not str(getattr(b.type, "dtype", "")).startswith("float"):
        return None
    return b


def _assignments(F, G):
    """Candidate ``dC_douts`` lists for ``F``'s outputs, read off ``G``'s inputs.

    ``Scan.pullback`` passes the cotangent of the i-th traced state as the
    i-th mit-mot input, reversed (zeros when disconnected), and the connected
    cotangents of the per-step outputs, reversed, among its sequences, in
    order.  When pruning changed the counts, the in-order placements are tried
    (at most ``_MAX_ASSIGNMENTS``); :func:`identify` checks each by rebuilding.
    """
    a = ScanArgs.from_node(F)
    sitsot = [F.outputs.index(o) for o in a.outer_out_sit_sot]
    nitsot = [F.outputs.index(o) for o in a.outer_out_nit_sot]
    info = G.op.info
    seqs = G.inputs[1:1 + info.n_seqs]
    mitmots = G.inputs[1 + info.n_seqs:1 + info.n_seqs + info.n_mit_mot]
    mm = [_cotangent_base(F, x) for x in mitmots]
    sq = [b for b in (_cotangent_base(F, x) for x in seqs) if b is not None]
    if len(mm) == len(sitsot):
        state_options = [list(zip(sitsot, mm))]
    else:
        got = [b for b in mm if b is not None]
        state_options = [list(zip(pos, got)) for pos in itertools.combinations(sitsot, len(got))]
    out_options = [list(zip(pos, sq)) for pos in itertools.combinations(nitsot, len(sq))]
    for n, (st, ot) in enumerate(itertools.product(state_options, out_options)):
        if n >= _MAX_ASSIGNMENTS:
            return
        dC = [DisconnectedType()() for _ in F.outputs]
        for k, c in (*st, *ot):
            if c is not None:
                if c.type.ndim != F.outputs[k].type.ndim:
                    break
                dC[k] = c
        else:
            yield dC


def _pullback_scan(gradients, F):
    nodes = [v.owner for v in ancestors([g for g in gradients if isinstance(g, Variable)])
             if v.owner is not None and isinstance(v.owner.op, Scan) and v.owner is not F]
    # the new gradient Scan is the only one built by the pullback: it is not an ancestor of F
    anc_F = {v.owner for v in ancestors(F.inputs) if v.owner is not None}
    nodes = [n for n in dict.fromkeys(nodes) if n not in anc_F]
    return nodes[0] if len(nodes) == 1 else None


_IDENTIFIED: OrderedDict = OrderedDict()


def identify(F, G):
    """``(dC_douts, gradients, rebuilt node)`` if ``G`` is ``F.op.pullback`` for some cotangents, else None.

    Cached on the two nodes and their current inputs (rewrites such as ``canonicalize`` visit a Scan many times).
    """
    key = (F, G, tuple(F.inputs), tuple(G.inputs))
    if key in _IDENTIFIED:
        return _IDENTIFIED[key]
    found = _identify(F, G)
    _IDENTIFIED[key] = found
    while len(_IDENTIFIED) > 64:
        _IDENTIFIED.popitem(last=False)
    return found


def _identify(F, G):
    if G.op.truncate_gradient != -1 or F.op.truncate_gradient != -1:
        return None
    for dC in _assignments(F, G):
        try:
            grads = F.op.pullback(list(F.inputs), list(F.outputs), dC)
        except Exception:  # noqa: BLE001  (not this assignment)
            continue
        G2 = _pullback_scan(grads, F)
        if G2 is None or G2.op != G.op or len(G2.inputs) != len(G.inputs) or len(G2.outputs) != len(G.outputs):
            continue
        if equal_computations(list(G2.inputs), list(G.inputs)):
            return dC, grads, G2
    return None


# ---------------------------------------------------------------------------
# locating the pullback's results in the graph
# ---------------------------------------------------------------------------


def _same_input(a, bs):
    if isinstance(a, Constant):
        return any(isinstance(b, Constant) and a.type == b.type and a.equals(b) for b in bs)
    return a in bs


def _locate(fgraph, expr, memo):
    """The variables of ``fgraph`` computing ``expr`` node for node (a list: duplicates not merged yet).

    ``memo`` maps known variables to lists of graph variables.
    """
    if expr in memo:
        return memo[expr]
    if isinstance(expr, Constant):
        return [expr]
    if expr.owner is None:
        return [expr] if expr in fgraph.variables else []
    ins = [_locate(fgraph, i, memo) for i in expr.owner.inputs]
    res = []
    anchors = [c for c in ins if not (len(c) == 1 and isinstance(c[0], Constant))]
    if all(ins):
        k = expr.owner.outputs.index(expr)
        # a node of constants alone (``2`` broadcast as ``ExpandDims(2)``) has no variable to start from
        candidates = ((c for anchor in anchors[0] for c, _ in fgraph.clients.get(anchor, ())) if anchors
                      else fgraph.apply_nodes)
        for client in candidates:
            if client.op == expr.owner.op and len(client.inputs) == len(ins) \
                    and all(_same_input(a, bs) for a, bs in zip(client.inputs, ins)) \
                    and client.outputs[k] not in res:
                res.append(client.outputs[k])
    memo[expr] = res
    return res


def _is_zero(v):
    """``v`` is all zeros (a zero constant, ``alloc(0, ...)``, ``zeros_like`` as ``second(x, 0)``)."""
    if isinstance(v, Constant):
        return bool(np.all(np.asarray(v.data) == 0))
    node = v.owner
    if node is None:
        return False
    if isinstance(node.op, Alloc):
        return constant_value(node.inputs[0]) == 0
    if isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, ps.Second):
        c = constant_value(node.inputs[1])
        return c is not None and c == 0
    if isinstance(node.op, DimShuffle):
        return _is_zero(node.inputs[0])
    return False


class LastRow(NamedTuple):
    """The last row of a cotangent whose other rows are provably zero: the ``terms`` summing to it, and the
    fewest ``steps`` the loop must run for the cotangent's own graph not to raise (an index ``-1`` into the
    trace ``buffer[1:]``, empty after 0 steps, raises ``IndexError``)."""

    terms: list
    steps: int = 0


def _last_row_terms(c, buffer, start=0) -> LastRow | None:
    """The last row of ``c`` (shaped like ``buffer[start:]``) if every other row is provably zero (:class:`LastRow`).

    Accepted: zeros, ``inc_subtensor`` / ``set_subtensor`` at a provably last
    row index (no trailing index) or on a suffix ``[s:]`` of such a value, and
    sums of them: what ``pytensor.grad`` builds for ``out[-1]``.  None otherwise.
    A row index into ``buffer[s:]`` reads a row only after ``s`` steps (``buffer``
    holds the initial value first), and one out of bounds after 0 steps
    (``"nonempty"``, see :func:`~iterops.fusion.uses._is_last_index`) after 1.
    """
    if _is_zero(c):
        return LastRow([])
    node = c.owner
    if node is None:
        return None
    if isinstance(node.op, IncSubtensor):
        x, y = node.inputs[0], node.inputs[1]
        idx = indices_from_subtensor(node.inputs[2:], node.op.idx_list)
        base = _last_row_terms(x, buffer, start)
        if base is None or len(idx) != 1:
            return None
        first = idx[0]
        if not isinstance(first, slice):
            last = _is_last_index(first, x, buffer, start)
            if not last or y.type.ndim != c.type.ndim - 1:
                return None
            steps = max(base.steps, start, 0 if last is True else 1)
            return LastRow([y] if node.op.set_instead_of_inc else [*base.terms, y], steps)
        s = 0 if first.start is None else constant_value(first.start)
        if s is None or s < 0 or first.stop is not None or (first.step is not None and constant_value(first.step) != 1):
            return None
        if y.type.ndim != c.type.ndim:
            return None
        inner = _last_row_terms(y, buffer, start + s)
        if inner is None:
            return None
        terms = inner.terms if node.op.set_instead_of_inc else [*base.terms, *inner.terms]
        return LastRow(terms, max(base.steps, inner.steps))
    if isinstance(node.op, Elemwise) and isinstance(node.op.scalar_op, ps.Add):
        terms, steps = [], 0
        for i in node.inputs:
            if i.type.ndim != c.type.ndim or i.type.broadcastable[0] != c.type.broadcastable[0]:
                return None
            t = _last_row_terms(i, buffer, start)
            if t is None:
                return None
            terms += t.terms
            steps = max(steps, t.steps)
        return LastRow(terms, steps)
    return None


# ---------------------------------------------------------------------------
# 3. the forward match with the gradient Scans hidden
# ---------------------------------------------------------------------------


class _Clients:
    def __init__(self, fgraph, hidden, extra):
        self.fgraph, self.hidden, self.extra = fgraph, hidden, extra

    def get(self, v, default=None):
        real = self.fgraph.clients.get(v)
        if real is None and v not in self.extra:
            return default
        return [(n, i) for n, i in (real or ()) if n not in self.hidden] + list(self.extra.get(v, ()))

    def __getitem__(self, v):
        out = self.get(v)
        if out is None:
            raise KeyError(v)
        return out

    def __contains__(self, v):
        return v in self.fgraph.clients or v in self.extra


class _View:
    """``fgraph`` as the matcher sees it: some nodes hidden, some extra (off-graph) clients added."""

    def __init__(self, fgraph, hidden, extra):
        self._fgraph = fgraph
        self.clients = _Clients(fgraph, hidden, extra)

    def __getattr__(self, name):
        return getattr(self._fgraph, name)


def _exclusive_nodes(fgraph, F, seeds, kept):
    """Nodes feeding only the ``seeds`` (the gradient Scans and the nodes of the gradients replaced) and each
    other, except the owners of ``kept`` variables: what dies with the gradient Scans."""
    hidden = set(seeds)
    outputs = set(fgraph.outputs)
    stack = [i for n in seeds for i in n.inputs]
    while stack:
        v = stack.pop()
        node = v.owner
        if node is None or node in hidden or node is F or v in kept:
            continue
        if any(o in outputs or o in kept for o in node.outputs):
            continue
        if all(c in hidden for o in node.outputs for c, _ in fgraph.clients.get(o, ())):
            hidden.add(node)
            stack.extend(node.inputs)
    return hidden


# ---------------------------------------------------------------------------
# 4. the replacement
# ---------------------------------------------------------------------------


def _reads_row0_only(fgraph, v):
    """Every user of ``v`` reads its row 0 alone (``v[0]``, ``v[:1]``, ``v[0:1]``)."""
    for client, i in fgraph.clients.get(v, ()):
        if not isinstance(client.op, Subtensor) or i != 0:
            return False
        idx = indices_from_subtensor(client.inputs[1:], client.op.idx_list)
        first = idx[0]
        if isinstance(first, slice):
            if first.start is not None and constant_value(first.start) != 0:
                return False
            if first.step is not None and constant_value(first.step) != 1:
                return False
            if first.stop is None or constant_value(first.stop) != 1:
                return False
        elif constant_value(first) != 0:
            return False
    return True


def _flows_only_into_base(fgraph, t, x0, reachable):
    """Everything computed from ``t`` (the gradient of an initial buffer holding ``x0 = base[idx]``) ends in
    ``inc_subtensor(zeros_like(base)[idx], .)`` (``Subtensor``'s pullback into ``base``, which the fused graph
    reads); no other use, no graph output."""
    sub = x0.owner
    if sub is None or not isinstance(sub.op, Subtensor) or sub.inputs[0] not in reachable:
        return False
    if not all(isinstance(i, Constant) for i in sub.inputs[1:]):
        return False
    stack, seen = [t], set()
    while stack:
        v = stack.pop()
        for client, i in fgraph.clients.get(v, ()):
            op = client.op
            if isinstance(op, Output):
                return False
            if client in seen:
                continue
            seen.add(client)
            if isinstance(op, IncSubtensor) and i == 1 and not op.set_instead_of_inc \
                    and op.idx_list == sub.op.idx_list and _is_zero(client.inputs[0]) \
                    and client.inputs[0].type.ndim == sub.inputs[0].type.ndim \
                    and all(_same_input(a, [b]) for a, b in zip(client.inputs[2:], sub.inputs[1:])):
                continue  # the pullback of x0 = base[idx]
            if (isinstance(op, Subtensor | DimShuffle | Sum) and i == 0) or (
                    isinstance(op, Elemwise) and isinstance(op.scalar_op, ps.Add)):
                stack.extend(client.outputs)
                continue
            return False
    return True


def _float_ancestors(variables):
    """Ancestors of ``variables`` through which a gradient can flow: not through integer (or boolean) values
    such as shapes and indices, nor through provable zeros (``zeros_like(x)``), whose gradient is zero."""
    seen, stack = set(), [v for v in variables if _is_float(v)]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v.owner is not None and not _is_zero(v):
            stack.extend(i for i in v.owner.inputs if _is_float(i))
    return seen


def _is_float(v):
    return str(getattr(v.type, "dtype", "")).startswith(("float", "complex"))


def _shared_paths(wrt_of, targets):
    """Two gradients replaced for different loop inputs where one's variable is (or builds) the other's."""
    items = [(targets[var][1], w) for var, (w, _) in wrt_of.items()]
    for j1, w1 in items:
        for j2, w2 in items:
            if j1 != j2 and w1 in _float_ancestors([w2]):
                return True
    return False


def _known_grads(cot, aux, values, fwd, last_terms):
    """``{fused value: cotangent}`` for one gradient Scan's cotangents ``cot``: a state replaced through its final
    value (in ``aux``) gets the sum of its cotangent's last-row ``terms``, another output its whole cotangent.
    None if the forward replacements ``fwd`` do not provide a connected output."""
    known = {}
    for o, c in cot.items():
        if o in aux:
            value = values[o]
            g = sum((pt.cast(y, value.dtype) for y in last_terms[o].terms), start=pt.zeros_like(value))
        else:
            value = fwd.get(o)
            if value is None:
                return None
            g = pt.cast(c, value.dtype)
        known[value] = known[value] + g if value in known else g
    return known


def _role_inputs(match):
    """``{role: F's outer input}`` for the roles bound to an input of the matched Scan (not to a constant)."""
    a = match.args
    outer_of = dict(zip(a.inner_in_seqs, a.outer_in_seqs))
    outer_of.update(zip(a.inner_in_sit_sot, a.outer_in_sit_sot))
    outer_of.update(zip(a.inner_in_non_seqs, a.outer_in_non_seqs))
    return {r: outer_of[u] for r, u in match.inner.items() if r in match.outer and u in outer_of}


def _partial_gradients(F, match, targets, wrt_of, cot, aux, values, last_terms, replacements_for):
    """``{gradient variable: fused gradient}`` as partial derivatives: each loop input varied alone, as the loop's
    pullback differentiates (``X0 = Q`` with ``Q`` also a non-sequence: the gradient of the start value and that
    of the non-sequence apart, where ``pytensor.grad`` of the fused graph with respect to ``Q`` sums both).

    The pattern builds its replacement again on a fresh stand-in for each role whose loop input has a gradient;
    ``pytensor.grad`` with respect to the stand-ins gives the partial derivatives, and the stand-ins are then
    replaced by the roles' outer variables.  Exact only if that substitution gives the graph that replaces the
    loop (a pattern whose ``build`` reads the outer graph, not only the roles' variables, may build another):
    checked with ``equal_computations``, else None; None too where the replacement still reads a role's own
    variable (outside ``build``: the start value of a trace read after 0 steps), or an output other than a final
    state has a cotangent.
    """
    if any(o not in aux for o in cot):
        return None
    role_of = {}  # gradient variable -> role
    inputs = _role_inputs(match)
    for var in wrt_of:
        x = F.inputs[targets[var][1]]
        roles = [r for r, o in inputs.items() if o is x]
        if len(roles) != 1:
            return None
        role_of[var] = roles[0]
    stand_in = {r: match.outer[r].type() for r in set(role_of.values())}
    match_s = dataclasses.replace(match, outer={**match.outer, **stand_in})
    fwd_s = replacements_for(match_s)
    values_s = {o: fwd_s[v] for o, v in aux.items()}
    back = {s: match.outer[r] for r, s in stand_in.items()}
    outs = list(values)
    if set(back.values()) & set(ancestors([values_s[o] for o in outs])):
        return None  # a role's variable read outside ``build`` (the start value of a trace read after 0 steps)
    if not equal_computations(clone_replace([values_s[o] for o in outs], replace=back), [values[o] for o in outs]):
        return None
    known = _known_grads(cot, aux, values_s, fwd_s, last_terms)
    wrt = list(stand_in.values())
    grads = pytensor.grad(None, wrt=wrt, known_grads=known, disconnected_inputs="ignore", return_disconnected="zero")
    grads = clone_replace(grads, replace=back)
    by_role = dict(zip(stand_in, grads))
    return {var: by_role[r] for var, r in role_of.items()}


def _sliced_source(F, w, reachable):
    """``(source, slice nodes)`` if ``F``'s input ``w`` is ``source[s0][s1]...`` (slices only, e.g. the rows a
    Scan sequence reads, ``x[:n]`` or ``x[::-1][:n]``) and the fused graph reads ``source`` instead of ``w``;
    else None.

    The fused gradient of ``source`` then gives the loop's gradient of ``w``: the fused graph computes
    ``f(source) = loop(S source)`` with ``S`` the selection of rows the slices make (the pattern's ``check``
    proved it), so ``grad_source = S^T grad_w``, and a slice selects distinct rows (``S S^T = I``), hence
    ``grad_w = S grad_source`` -- the same slices applied to the gradient.  This needs ``source`` to reach
    the fused graph only that way: not through another of ``F``'s inputs (an initial value ``source[0]``, a
    non-sequence ``source``), which would add its own term to ``grad_source``.
    """
    chain, v = [], w
    while v.owner is not None and isinstance(v.owner.op, Subtensor):
        idx = indices_from_subtensor(v.owner.inputs[1:], v.owner.op.idx_list)
        if len(idx) != 1 or not isinstance(idx[0], slice):
            return None
        chain.append(v.owner)
        v = v.owner.inputs[0]
    if not chain or v not in reachable or not _is_float(v):
        return None
    others = [x for x in F.inputs if x is not w]
    if v in _float_ancestors(others):
        return None
    return v, chain[::-1]


def _slice_like(g, chain):
    """``g`` sliced as the ``chain`` of Subtensor nodes (innermost first) slices its source."""
    for node in chain:
        g = node.op(g, *node.inputs[1:])
    return g


def fuse_with_gradients(fgraph, F, patterns=None) -> GradientPair | None:
    """Replace ``F`` and the gradient Scans identified as its pullbacks by a fused Op and its gradient.

    Returns None when ``F`` has no gradient Scan, else a :class:`GradientPair`
    (``replacements`` None when kept, with ``reason``).
    """
    from iterops.fusion.rewrite import replacements_for  # noqa: PLC0415  (rewrite imports this module)

    patterns = list(PATTERNS.values() if patterns is None else patterns)
    candidates = gradient_scans(fgraph, F)
    if not candidates:
        return None
    if not may_match(F, patterns):  # before rebuilding any pullback: no use of F can make it match
        rejections = sorted(((p.name, inner_reject(F, p)) for p in patterns), key=lambda pr: -pr[1].score)
        return GradientPair(gradients=candidates, reason="its forward loop matches no pattern", rejections=rejections)
    pairs = []
    for G in candidates:
        found = identify(F, G)
        if found is not None:
            pairs.append((G, *found))
    if not pairs:
        if F.op.truncate_gradient != -1:
            why = f"the loop truncates its gradient (truncate_gradient={F.op.truncate_gradient})"
        else:
            why = "not identified as the loop's pullback (rebuilding Scan.pullback gives another Scan)"
        return GradientPair(gradients=candidates, reason=why)
    Gs = [p[0] for p in pairs]
    targets = _locate_gradients(fgraph, pairs)
    if targets is None:
        return GradientPair(gradients=Gs, reason="the gradient Scan's results are used other than as the "
                                                 "loop's gradients (e.g. differentiated again)")
    if not targets:
        return GradientPair(gradients=Gs, reason="none of the gradient Scan's results is used")
    a = ScanArgs.from_node(F)
    sitsot = list(a.outer_out_sit_sot)

    # per gradient Scan, its connected cotangent of each forward output
    cots = [{o: c for o, c in zip(F.outputs, dC) if not isinstance(c.type, DisconnectedType)}
            for _G, dC, _grads, _G2 in pairs]
    # per gradient Scan and state: the terms of the cotangent's last row, if its other rows are provably zero
    last_terms = [{o: _last_row_terms(c, o) for o, c in cot.items() if o in sitsot} for cot in cots]
    used = {o for cot in cots for o in cot}

    result = None
    for mode in ("last", "trace"):
        provable = all(t is not None for lt in last_terms for t in lt.values())
        if mode == "last" and not provable:
            continue
        if mode == "trace" and not any(lt for lt in last_terms):
            continue  # the same as "last"
        kept, extra, aux = set(), {}, {}
        for o in used:
            if o in sitsot and mode == "last":
                kept.update(y for lt in last_terms if o in lt for y in lt[o].terms)
                v = o[-1]
                aux[o] = v
                extra[o] = [(v.owner, 0)]
            else:
                kept.update(cot[o] for cot in cots if o in cot)
                extra[o] = [(pt.neg(o).owner, 0)]  # a use of the whole buffer / trace
        hidden = _exclusive_nodes(fgraph, F, [*Gs, *(v.owner for v in targets)], kept)
        view = _View(fgraph, hidden, extra)
        try:
            match, rejections = match_scan(view, F, patterns)
        except Exception as err:  # noqa: BLE001
            _log.debug("gradient fusion: matching failed", exc_info=True)
            return GradientPair(gradients=Gs, reason=f"could not be analysed: {err!r}")
        if match is None:
            _log.debug("gradient fusion (%s): %s", mode, rejections[:1])
            result = GradientPair(gradients=Gs, reason="its forward loop matches no pattern", rejections=rejections)
            continue
        try:
            repl = _replacements(fgraph, F, match, targets, cots, last_terms, aux, replacements_for)
        except Exception as err:  # noqa: BLE001  (a gradient the fused Op does not provide, ...)
            _log.debug("gradient fusion: building the gradient failed", exc_info=True)
            result = GradientPair(gradients=Gs, match=match, reason=f"the fused gradient could not be built: {err}")
            continue
        if repl is None:
            result = GradientPair(gradients=Gs, match=match,
                                  reason="the gradient Scan's results are used other than as the loop's gradients")
            continue
        return GradientPair(repl, gradients=Gs, match=match)
    return result


def _locate_gradients(fgraph, pairs):
    """``{graph variable: (pair index, F input index)}``: the gradients the pullbacks returned, found in the graph.

    None if a gradient Scan's outputs have another use (a second derivative, ...).
    """
    targets = {}
    for p, (G, _dC, grads, G2) in enumerate(pairs):
        memo = {o2: [o] for o2, o in zip(G2.outputs, G.outputs)}
        g2_outs = set(G2.outputs)
        for j, g in enumerate(grads):
            if not isinstance(g, Variable) or isinstance(g.type, (DisconnectedType, NullType)):
                continue
            for var in _locate(fgraph, g, memo):
                if var not in G.outputs:
                    targets[var] = (p, j)
        # the located nodes computing the gradients from G's outputs
        located = {v.owner for e, vs in memo.items() if e not in g2_outs and any(a in g2_outs for a in ancestors([e]))
                   for v in vs if v.owner is not None and v.owner is not G}
        # every use of the gradient Scan is one of the located gradients (not a second derivative, ...)
        for v in [*G.outputs, *(o for n in located for o in n.outputs)]:
            if v in targets:
                continue
            for client, _ in fgraph.clients.get(v, ()):
                if client not in located:
                    return None
    return targets


def _replacements(fgraph, F, match, targets, cots, last_terms, aux, replacements_for):
    """The forward replacements and, per gradient Scan, its gradients from the fused graph and its cotangents."""
    fwd = replacements_for(match)
    values = {o: fwd.pop(v) for o, v in aux.items()}  # the final states, read off the graph's "last" uses
    init_buffers = set(ScanArgs.from_node(F).outer_in_sit_sot)
    repl = {}  # gradients first: their graph reads the forward uses, which the forward replacements then rewire
    for p, cot in enumerate(cots):
        # the loop's gradient graph raises where its cotangents do (an index -1 into the trace of a loop of 0 steps)
        # and where the forward Scan does (a negative n_steps): so must the replaced gradients
        steps = max((t.steps for o, t in last_terms[p].items() if o in aux), default=0)
        if steps > 1 and match.as_while:
            _log.debug("gradient fusion kept: a cotangent needs %d steps, a loop with a stop rule may run fewer", steps)
            return None
        first = len(repl)
        known = _known_grads(cot, aux, values, fwd, last_terms[p])
        if known is None:
            _log.debug("gradient fusion kept: the fused replacement does not provide an output whose "
                       "cotangent is connected")
            return None
        wrt_of = {}
        for var, (q, j) in targets.items():
            if q != p:
                continue
            x = F.inputs[j]
            if x in init_buffers:
                if not _reads_row0_only(fgraph, var):
                    _log.debug("gradient fusion kept: a gradient of an initial buffer is read beyond its first row")
                    return None
                wrt_of[var] = (initial_value(x), x)
            else:
                wrt_of[var] = (x, None)
        reachable = set(ancestors(list(known)))
        via_source = {}  # var -> (source, slices): a sequence the fused graph reads through its source
        for var, (w, buffer) in list(wrt_of.items()):
            if w in reachable:
                continue
            source = _sliced_source(F, w, reachable) if buffer is None else None
            if source is not None:
                via_source[var] = source
                wrt_of[var] = (source[0], None)
                continue
            # the replacement reads an initial value x0 = base[i] through ``base`` (e.g. Levinson's v0 = gamma[0]):
            # the fused gradient of ``base`` holds this path; exact where the loop's gradient of x0 only flows into
            # base's gradient
            if buffer is None or not _flows_only_into_base(fgraph, var, w, reachable):
                _log.debug("gradient fusion kept: the fused graph does not read an input the loop's gradient flows to")
                return None
            repl[var] = var.type.filter_variable(pt.zeros_like(buffer, dtype=var.type.dtype), allow_convert=True)
            del wrt_of[var]
        if not wrt_of:
            continue
        if _shared_paths(wrt_of, targets):
            # the fused gradient of a variable is a total derivative: if it also builds another loop input the
            # fused graph reads (X0 = Q with Q a non-sequence too), the loop's gradient graph adds that path to
            # it by itself.  The loop's pullback gives partial derivatives: take them from the fused graph
            # built on independent stand-ins for the loop's inputs
            gvar = None if via_source else _partial_gradients(F, match, targets, wrt_of, cot, aux, values,
                                                              last_terms[p], replacements_for)
            if gvar is None:
                _log.debug("gradient fusion kept: one variable feeds two loop inputs, and the fused graph built "
                           "on stand-ins for them is not the one replacing the loop")
                return None
        else:
            wrt = list(dict.fromkeys(w for w, _ in wrt_of.values()))
            grads = pytensor.grad(None, wrt=wrt, known_grads=known, disconnected_inputs="ignore",
                                  return_disconnected="zero")
            gmap = dict(zip(wrt, grads))
            gvar = {var: gmap[w] for var, (w, _) in wrt_of.items()}
        for var, (w, buffer) in wrt_of.items():
            g = gvar[var]
            if var in via_source:
                g = _slice_like(g, via_source[var][1])
            if buffer is not None:
                g = pt.set_subtensor(pt.zeros_like(buffer)[0], pt.cast(g, buffer.dtype))
            if g.type.dtype != var.type.dtype:
                g = pt.cast(g, var.type.dtype)
            repl[var] = var.type.filter_variable(g, allow_convert=True)
        for var in list(repl)[first:]:
            repl[var] = var.type.filter_variable(match.require_steps(repl[var], steps), allow_convert=True)
    repl.update(fwd)
    return repl
