"""A generic structural matcher of Scan inner graphs against reference steps.

Nothing here knows a specific algorithm.  For a ``Scan`` node and a
:class:`~iterops.fusion.registry.Pattern`, :func:`match_scan` runs three stages:

1. canonicalization (:mod:`iterops.fusion.canonical`): the user's inner graph
   and the pattern's reference step are rebuilt without static shapes, with
   ``OpFromGraph`` nodes inlined, and canonicalized with the same PyTensor
   rewrites;
2. unification (:mod:`iterops.fusion.unify`): the two graphs are walked from
   the outputs, binding the pattern's roles to the user's inner inputs up to
   spelling (operand order, association, signs, transposes, widening casts);
3. use analysis (:mod:`iterops.fusion.uses`) and the outer check here
   (:func:`_check_outer`): every used output of the loop is one the
   replacement provides (the last state, the trace, ...), static-shape
   constraints hold, and the pattern's own ``check`` accepts the match.

A failed unification reports the deepest point where the graphs differ, which
``iterops.explain`` shows for near misses.  The names other modules use are
importable from here: :func:`match_scan`, :class:`Match`, :class:`Reject`,
:func:`constant_value`, :func:`provably_equal`, :func:`initial_value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import io_toposort
from pytensor.raise_op import CheckAndRaise
from pytensor.scan.utils import ScanArgs

from iterops.fusion.canonical import (  # noqa: F401  (re-exported: the matcher's public names)
    _inner_inputs,
    _inner_outputs,
    _user_graph,
    _UserGraph,
    constant_value,
    provably_equal,
)
from iterops.fusion.registry import Pattern
from iterops.fusion.unify import Reject, _const_equal, _describe, _is_constant, _ref_graph, _specialize, _unify_loop
from iterops.fusion.uses import _has_clients, _uses, initial_value

#: PyTensor's Scan raises on a negative ``n_steps``; the fused Ops would run 0 steps
_NEGATIVE_STEPS = CheckAndRaise(IndexError, "Scan was asked to run for a negative number of steps")
#: an index out of bounds when the loop ran too few steps (``out[-1:][0]`` after 0 steps, ...)
_TOO_FEW_STEPS = CheckAndRaise(IndexError, "index out of bounds: the loop ran too few steps (e.g. 0)")

__all__ = ["Match", "Reject", "match_scan", "constant_value", "provably_equal", "initial_value"]


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
    #: roles of non-sequences (``Role.time_varying_ok``) the loop reads as sequences, one row per step
    time_varying: frozenset = frozenset()

    def n_steps_value(self):
        """``n_steps`` as a Python int if constant, else None."""
        return constant_value(self.n_steps)

    def require_steps(self, value, at_least=0):
        """``value`` guarded to raise ``IndexError`` where the user's graph raises for its ``n_steps``.

        Scan raises on ``n_steps < 0``; a read that needs ``at_least`` steps (an index out of bounds after
        fewer) raises when ``n_steps < at_least``.  Checks a constant ``n_steps`` proves are left out.  For a
        loop with a stop rule ``n_steps`` is only a bound: ``at_least`` > 1 is the caller's to prove.
        """
        c = self.n_steps_value()
        if c is None or c < 0:  # a constant negative n_steps: the loop raises when it runs, and so must this
            value = _NEGATIVE_STEPS(value, pt.ge(self.n_steps, 0))
        if at_least > 0 and (c is None or c < at_least):
            value = _TOO_FEW_STEPS(value, pt.ge(self.n_steps, at_least))
        return value


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
    if pattern.needs_ops and not set(pattern.needs_ops) & _op_names(user):
        raise Reject(f"the step has none of the operations {', '.join(pattern.needs_ops)}", 0.0)
    best = None
    for variant in range(len(pattern.step)):
        try:
            ref = _ref_graph(pattern, variant, user.dtype)  # a step may Reject (e.g. needs a library not imported)
            for env in _unify_loop(pattern, ref, user, used_outputs if pattern.outputs else ()):
                return _check_outer(fgraph, node, user, pattern, env, variant, ref)
        except Reject as err:
            if best is None or err.score > best.score:
                best = err
    raise best


def _op_names(user) -> set:
    """Class names of the Ops (core Ops of ``Blockwise``) in the user's canonical step."""
    names = getattr(user, "_op_names", None)
    if names is None:
        names = {type(getattr(n.op, "core_op", n.op)).__name__
                 for n in io_toposort(user.inner_inputs, user.inner_outputs)}
        user._op_names = names
    return names


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
    nonseq = {r.name for r in pattern.non_sequences}
    time_varying = frozenset(name for name, u in env.roles.items()
                             if name in nonseq and not _is_constant(u) and user.kind.get(u) == "seq")
    m = Match(pattern=pattern, node=node, args=a, inner=dict(env.roles), outer=outer, n_steps=a.n_steps,
              as_while=a.as_while, dtype=user.dtype, uses=uses, variant=variant, views=views,
              time_varying=time_varying)
    if pattern.check is not None:
        reason = pattern.check(m)
        if reason:
            raise Reject(reason, score + 1)
    return m
