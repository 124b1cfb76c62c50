"""A generic structural matcher of Scan inner graphs against reference steps.

Nothing here knows a specific algorithm.  For a ``Scan`` node and a
:class:`~iterops.fusion.registry.Pattern`, :func:`match_scan` runs three stages,
after a pre-check that costs nothing on the Scans no pattern can match
(:func:`inner_reject`, cached per Scan op, equal ops alike: what the op alone
says -- multi-tap states, stop rule, state ndims, sequences read, Ops: the Op
families every reference step needs (linear algebra, subtensor writes, which
canonicalization makes only from their own kind) and nested loops no reference
step holds -- then stages 1-2 on the step alone):

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

What stages 1-2 decide is a pure function of the step, memoized per Scan op in
this process and on disk per step (:mod:`iterops.fusion.cache`, keyed on a
hash of the step and of iterops' sources): the verdict of each pattern, the
canonical step, the first unification of each variant, the canonical
reference steps.  A new process compiling the same model reads them instead
of canonicalizing and unifying again; stage 3 runs on every call.

A loop that does not match gives a :class:`~iterops.fusion.registry.Rejection`
value per pattern (no stage raises to say "no match"): for a failed
unification, the deepest point where the graphs differ, which
``iterops.explain`` shows for near misses.  The names other modules use are
importable from here: :func:`match_scan`, :class:`Match`, :class:`Rejection`,
:func:`constant_value`, :func:`provably_equal`, :func:`initial_value`.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.graph.basic import Variable
from pytensor.graph.traversal import ancestors, io_toposort
from pytensor.raise_op import CheckAndRaise
from pytensor.scan.op import Scan
from pytensor.scan.utils import ScanArgs
from pytensor.tensor.shape import Shape, Shape_i

from iterops.fusion.canonical import (  # noqa: F401  (re-exported: the matcher's public names)
    _USER_CACHE,
    _inner_inputs,
    _inner_outputs,
    _user_graph,
    _UserGraph,
    constant_value,
    provably_equal,
    unsupported_loop,
)
from iterops.fusion import cache as _disk
from iterops.fusion.registry import OneOf, Pattern, Rejection, closest
from iterops.fusion.unify import (
    _REF_CACHE,
    _const_equal,
    _Env,
    _describe,
    _is_constant,
    _LoopUnification,
    _parse_step_return,
    _ref_graph,
    _shape_determined,
    _specialize,
)
from iterops.fusion.uses import _has_clients, _uses, initial_value

#: PyTensor's Scan raises on a negative ``n_steps``; the fused Ops would run 0 steps
_NEGATIVE_STEPS = CheckAndRaise(IndexError, "Scan was asked to run for a negative number of steps")
#: an index out of bounds when the loop ran too few steps (``out[-1:][0]`` after 0 steps, ...)
_TOO_FEW_STEPS = CheckAndRaise(IndexError, "index out of bounds: the loop ran too few steps (e.g. 0)")

__all__ = ["Match", "Rejection", "match_scan", "may_match", "inner_reject", "constant_value", "provably_equal", "initial_value"]


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


def match_scan(fgraph, node, patterns) -> tuple[Match | None, list[tuple[str, Rejection]]]:
    """Match ``node`` against ``patterns``; returns (match or None, rejections).

    A step holding non-scalar constants is tried a second time with them
    lifted to inputs (see :func:`_canonical_user_graph`).  Patterns whose
    step cannot match the inner graph at all (:func:`inner_reject`, cached per
    Scan op) are rejected without looking at the outer graph.
    """
    best: dict = {}
    candidates = []
    for pattern in patterns:
        why = inner_reject(node, pattern)
        if why is None:
            candidates.append(pattern)
        else:
            best[pattern.name] = why
    for lift in (False, True):
        if not candidates:
            break
        user = _user(node, lift)
        if lift and not user.liftable:
            break
        for pattern in candidates:
            result = _match_pattern(fgraph, node, user, pattern, _step_trials(node, pattern).get(lift, {}))
            if isinstance(result, Match):
                return result, []
            best[pattern.name] = closest(best.get(pattern.name), result)
    rejections = sorted(best.items(), key=lambda pr: -pr[1].score)
    return None, rejections


def may_match(node, patterns) -> bool:
    """Whether the step of the Scan ``node`` can match one of ``patterns`` (the outer graph aside); cached per op.

    False means no use of the loop's outputs can make it match: callers skip
    every costlier step (rebuilding pullbacks to identify gradient Scans, ...).
    """
    return any(inner_reject(node, p) is None for p in patterns)


#: Scan op -> (its :class:`_Signature`, {pattern name: :class:`_StepVerdict`}).  Keyed by the op itself: Scan ops
#: compare by their (interned) inner graphs, so a step is analysed once per process, also when PyTensor rebuilds
#: an equal op or the user builds and compiles the same graph again (PyMC's pre-gradient pass, logp and dlogp)
_INNER: OrderedDict = OrderedDict()


@dataclass(frozen=True)
class _StepVerdict:
    """What matching a step with a pattern decided, the outer graph aside: a pure function of the step.

    ``why``: None if a variant unifies (states and stop rule), else the closest rejection.  ``trials``:
    ``{lift: {variant: Rejection}}`` of the (lift, variant) pairs tried before the first that unifies, in
    :func:`match_scan`'s order; none of them can match, so :func:`match_scan` takes their rejections
    instead of unifying them again.
    """

    why: Rejection | None
    trials: dict = field(default_factory=dict)
    #: variants this process could not build (:class:`Pattern`), for ``dtype``: the verdict holds while they
    #: still cannot be built (a library imported since may make one match)
    unbuildable: tuple = ()
    dtype: str | None = None

    def holds(self, pattern: Pattern) -> bool:
        """Whether the verdict still holds: each variant it could not use still cannot be built."""
        return _still_unbuildable(pattern, self.unbuildable, self.dtype)


#: (pattern name, variants, dtype) -> ``len(sys.modules)`` when they were last seen unbuildable: a variant
#: becomes buildable only when a library is imported, so the check is redone only after an import
_UNBUILDABLE: dict = {}


def _still_unbuildable(pattern: Pattern, variants: tuple, dtype: str | None) -> bool:
    """Whether none of ``pattern``'s step ``variants`` can be built in this process (for ``dtype``)."""
    if not variants:
        return True
    key, now = (pattern.name, variants, dtype), len(sys.modules)
    if _UNBUILDABLE.get(key) == now:
        return True
    if all(isinstance(pattern.step[v](*_role_inputs(pattern, dtype or "float64")), Rejection) for v in variants):
        _UNBUILDABLE[key] = now
        return True
    return False


def _persistent(pattern: Pattern) -> bool:
    """Whether ``pattern``'s verdicts may be kept on disk: its steps are iterops' own (covered by the
    cache's source digest), not functions a user registered."""
    return all(getattr(step, "__module__", "").startswith("iterops.") for step in pattern.step)


def _verdict(node, pattern: Pattern) -> _StepVerdict:
    op = node.op
    hit = _INNER.get(op)
    if hit is None:
        hit = _INNER[op] = (_signature(op), {})
        while len(_INNER) > 256:
            _INNER.popitem(last=False)
    else:
        _INNER.move_to_end(op)
    sig, cache = hit
    verdict = cache.get(pattern.name)
    if verdict is not None and verdict.holds(pattern):
        return verdict
    why = _static_reject(sig, pattern)
    if why is not None:
        cache[pattern.name] = verdict = _StepVerdict(why)
        return verdict
    key = f"{_disk.step_key(op)}|{pattern.name}" if _persistent(pattern) and _disk.step_key(op) else None
    verdict = _disk.load("verdict", key)
    if verdict is None or not verdict.holds(pattern):
        verdict = _unify_reject(node, pattern)
        _disk.store("verdict", key, verdict)
    cache[pattern.name] = verdict
    return verdict


def inner_reject(node, pattern: Pattern) -> Rejection | None:
    """Why no step of ``pattern`` can match ``node``'s inner graph whatever the outer graph, or None.

    First what the Scan op says at no cost (:func:`_static_reject`); then the
    step is unified with each variant (states and stop rule; per-step outputs
    and outer uses are checked later by :func:`match_scan`).  Cached per
    Scan op (equal ops share the entry): PyTensor visits a Scan node many times
    and rebuilds nodes around an unchanged op; and on disk per step
    (:mod:`iterops.fusion.cache`), so a new process running the same model
    does not unify again.  A verdict that depended on a
    step variant this process cannot build yet (see :class:`Pattern`) is not cached.
    """
    return _verdict(node, pattern).why


def _step_trials(node, pattern: Pattern) -> dict:
    """``{lift: {variant: Rejection}}``: the (lift, variant) pairs known not to unify before the first that does."""
    return _verdict(node, pattern).trials


@dataclass(frozen=True)
class _Signature:
    """What a Scan op says about its loop without canonicalizing its step."""

    unsupported: str | None
    dtype: str | None  # of the first float state, as the canonical graph's
    state_ndims: tuple  # sorted ndims of the states (sit-sot and untraced)
    as_while: bool  # the step returns ``until(...)``
    n_seqs: int
    n_seqs_read: int  # sequences the state updates and the stop rule read
    op_names: frozenset  # class names of the step's Ops (core Ops of Blockwise, OpFromGraph inlined)
    families: frozenset  # the step's Op families (:func:`_family`); every family when an Op may become others
    reads_loop: bool  # the state updates or the stop rule read a nested loop (a Scan in the step)


def _signature(op) -> _Signature:
    info = op.info
    inputs = op.inner_inputs
    start = info.n_seqs + sum(len(s) for s in info.mit_mot_in_slices) + sum(len(s) for s in info.mit_sot_in_slices)
    states = inputs[start:start + info.n_sit_sot + info.n_untraced_sit_sot]
    outs = op.inner_outputs
    n_out_mm = sum(len(s) for s in info.mit_mot_out_slices)
    updates = outs[n_out_mm + info.n_mit_sot:n_out_mm + info.n_mit_sot + info.n_sit_sot]
    updates += outs[len(outs) - info.n_untraced_sit_sot - int(info.as_while):len(outs) - int(info.as_while)]
    read = set(ancestors([*updates, *(outs[-1:] if info.as_while else [])], blockers=inputs))
    n_seqs_read = sum(v in read for v in inputs[:info.n_seqs])
    dtypes = [v.type.dtype for v in states if str(getattr(v.type, "dtype", "")).startswith("float")]
    op_names = _raw_op_names(inputs, outs)
    families = frozenset({*_FAMILIES.values(), _LINALG_FAMILY}) if op_names & _MAY_BECOME else frozenset(
        f for n in io_toposort(inputs, outs) if (f := _family(n.op)) is not None)
    return _Signature(unsupported=unsupported_loop(op), dtype=dtypes[0] if dtypes else None,
                      state_ndims=tuple(sorted(getattr(v.type, "ndim", -1) for v in states)),
                      n_seqs=info.n_seqs, n_seqs_read=n_seqs_read, as_while=info.as_while,
                      op_names=op_names, families=families,
                      reads_loop=any(v.owner is not None and isinstance(v.owner.op, Scan) for v in read))


def _raw_op_names(inputs, outputs) -> frozenset:
    names = set()
    for n in io_toposort(inputs, outputs):
        core = getattr(n.op, "core_op", n.op)
        names.add(type(core).__name__)
        module = type(core).__module__
        if not module.startswith("pytensor.") or module.startswith(_LINALG_MODULES):
            names |= _MAY_BECOME
        if isinstance(core, OpFromGraph):
            names |= _raw_op_names(core.inner_inputs, core.inner_outputs)
    return frozenset(names)


#: Op families (class names of core Ops) that ``canonicalize`` only makes from Ops of the same family: a
#: canonical step holds one only if its raw step holds one (or an Op that may become others, ``_MAY_BECOME``)
_FAMILIES = {"IncSubtensor": "subtensor write", "AdvancedIncSubtensor": "subtensor write",
             "AdvancedIncSubtensor1": "subtensor write"}
_LINALG_FAMILY = "linear algebra"


def _family(op) -> str | None:
    """The family of ``op`` (its core Op's, for a ``Blockwise``): linear algebra, a subtensor write, or None."""
    core = getattr(op, "core_op", op)
    if type(core).__module__.startswith(_LINALG_MODULES):
        return _LINALG_FAMILY
    return _FAMILIES.get(type(core).__name__)


@dataclass(frozen=True)
class _ReferenceFacts:
    """What a pattern's reference steps say before any is canonicalized (built once per pattern)."""

    stops: frozenset  # whether the variants end with ``until``: {True}, {False} or both
    #: Op families every variant's state updates and stop rule need, whichever ``one_of`` alternative a user
    #: takes (empty when a variant cannot be built in this process)
    needs: frozenset
    has_loop: bool  # a variant holds a nested Scan (True when a variant cannot be built)
    unbuildable: tuple = ()  # the variants that could not be built: the facts hold while they still cannot


_FACTS: dict = {}


def _reference_facts(pattern: Pattern) -> _ReferenceFacts:
    """The :class:`_ReferenceFacts` of ``pattern``'s raw reference steps (cached per pattern)."""
    if pattern.name in _FACTS:
        return _FACTS[pattern.name]
    if _persistent(pattern) and (facts := _disk.load("facts", pattern.name)) is not None and \
            _still_unbuildable(pattern, facts.unbuildable, None):
        _FACTS[pattern.name] = facts
        return facts
    stops, needs, has_loop, built = set(), None, False, []
    for step in pattern.step:
        roles = (*pattern.sequences, *pattern.states, *pattern.non_sequences)
        ins = _role_inputs(pattern)
        ret = step(*ins)
        built.append(ret)
        if isinstance(ret, Rejection):  # the variant cannot be built here (e.g. needs a library not imported)
            stops |= {True, False}
            needs, has_loop = frozenset(), True
            continue
        outs, cond = _parse_step_return(ret)
        stops.add(cond is not None)
        outs = [pt.as_tensor_variable(o) for o in outs]
        read = [*outs[:len(pattern.states)], *([cond] if cond is not None else [])]
        role_of = {v: (r, None) for v, r in zip(ins, roles)}
        need = _needed_families(read, role_of)
        needs = need if needs is None else needs & need
        has_loop |= any(isinstance(n.op, Scan) for n in io_toposort(ins, [*outs, *read]))
    facts = _ReferenceFacts(stops=frozenset(stops), needs=needs or frozenset(), has_loop=has_loop,
                            unbuildable=tuple(v for v, ret in enumerate(built) if isinstance(ret, Rejection)))
    _FACTS[pattern.name] = facts
    if _persistent(pattern):
        _disk.store("facts", pattern.name, facts)
    return facts


def _role_inputs(pattern: Pattern, dtype: str = "float64") -> list:
    """Fresh symbolic inputs of ``pattern``'s roles (sequences, states, non-sequences), of ``dtype`` by default."""
    roles = (*pattern.sequences, *pattern.states, *pattern.non_sequences)
    return [pt.tensor(dtype=r.dtype or dtype, shape=(None,) * r.ndim, name=r.name) for r in roles]


def _needed_families(outputs, role_of) -> frozenset:
    """The Op families every unification of the reference ``outputs`` finds in the user's step.

    The unifier matches a reference node with a user node of the same Op, except where the reference has
    alternatives (:func:`~iterops.fusion.registry.one_of`: only the families all of them need) and where a
    subgraph computed from shapes and constant scalars may be a folded constant in the user's step.
    """
    memo: dict = {}

    def need(v):
        if v in memo:
            return memo[v]
        memo[v] = frozenset()  # (graphs are acyclic: a placeholder only)
        node = v.owner
        if node is None or isinstance(node.op, Shape | Shape_i):
            out = frozenset()
        elif isinstance(node.op, OneOf):
            out = frozenset.intersection(*(need(a) for a in node.inputs))
        else:
            out = frozenset().union(*(need(i) for i in node.inputs))
            if (f := _family(node.op)) is not None and _shape_determined(v, role_of) is None:
                out |= {f}
        memo[v] = out
        return out

    return frozenset().union(*(need(o) for o in outputs))


_LINALG_MODULES = ("pytensor.tensor.linalg", "pytensor.tensor.nlinalg", "pytensor.tensor.slinalg")


def _static_reject(sig: _Signature, pattern: Pattern) -> Rejection | None:
    """The checks of :func:`_match_pattern` that the Scan op alone decides (the same messages)."""
    if sig.unsupported:
        return Rejection(sig.unsupported, 0.0)
    if sig.dtype not in ("float32", "float64"):
        return Rejection("the loop has no float32/float64 state", 0.0)
    if len(sig.state_ndims) < len(pattern.states) or sig.n_seqs < len(pattern.sequences):
        return Rejection(f"needs {len(pattern.states)} state(s) and {len(pattern.sequences)} sequence(s), the loop "
                         f"has {len(sig.state_ndims)} and {sig.n_seqs}", 0.0)
    # every input the step's updates read is bound to a role of the same kind (a time-varying matrix may be a
    # sequence): more sequences read than the pattern can bind cannot unify
    seq_roles = len(pattern.sequences) + sum(r.time_varying_ok for r in pattern.non_sequences)
    if sig.n_seqs_read > seq_roles:
        return Rejection(f"the step's states read {sig.n_seqs_read} sequence(s), the pattern at most {seq_roles}", 0.0)
    have = Counter(sig.state_ndims)
    for ndim, k in Counter(r.ndim for r in pattern.states).items():
        if have[ndim] < k:
            return Rejection(f"needs {k} state(s) of ndim {ndim}, the loop has {have[ndim]}", 0.0)
    if pattern.needs_ops and not set(pattern.needs_ops) & sig.op_names and not sig.op_names & _MAY_BECOME:
        return Rejection(f"the step has none of the operations {', '.join(pattern.needs_ops)}", 0.0)
    # the checks above cost nothing; those below read the pattern's reference steps (built once per process)
    facts = _reference_facts(pattern)
    if sig.as_while not in facts.stops:
        return (Rejection("the loop has an until stop the pattern does not have", 0.5) if sig.as_while else
                Rejection("the loop has no convergence stop (until) where the pattern needs one", 0.5))
    if facts.needs - sig.families:
        return Rejection(f"the step has no {' or '.join(sorted(facts.needs - sig.families))} operation, which "
                         "every step of the pattern holds", 0.0)
    if sig.reads_loop and not facts.has_loop:
        return Rejection("the step's states read a nested loop (a Scan), which the pattern's step does not hold", 0.0)
    return None


#: stands for an Op that ``canonicalize`` may turn into another linear-algebra Op (PyTensor's linalg rewrites
#: only rewrite linalg Ops into one another) or that a user's rewrite may change: ``needs_ops`` is then checked on
#: the canonical step
_MAY_BECOME = frozenset({"<linalg or foreign Op>"})


def _unify_reject(node, pattern: Pattern) -> _StepVerdict:
    """Unification of the step alone (states, stop rule), unlifted and lifted constants: the
    :class:`_StepVerdict`."""
    worst, unbuildable, trials, dtype = None, {}, {}, None
    for lift in (False, True):
        user = _user(node, lift)
        if lift and not user.liftable:
            break
        if user.unsupported:
            return _StepVerdict(Rejection(user.unsupported, 0.0))
        if pattern.needs_ops and not set(pattern.needs_ops) & _op_names(user):
            worst = closest(worst, Rejection(f"the step has none of the operations {', '.join(pattern.needs_ops)}"))
            continue
        dtype = user.dtype
        for variant in range(len(pattern.step)):
            ref = _reference_graph(pattern, variant, user.dtype)
            if isinstance(ref, Rejection):
                worst = closest(worst, ref)
                unbuildable[variant] = None
                continue
            envs = _LoopUnification(pattern, ref, user)
            if next(iter(envs), None) is not None:
                return _StepVerdict(None, trials)  # (a variant built later cannot change a match)
            worst = closest(worst, envs.rejection)
            trials.setdefault(lift, {})[variant] = envs.rejection
    return _StepVerdict(worst, unbuildable=tuple(unbuildable), dtype=dtype)


def _reference_graph(pattern: Pattern, variant: int, dtype: str):
    """:func:`~iterops.fusion.unify._ref_graph`, read from the disk cache (:mod:`iterops.fusion.cache`) when
    this process has not built it: reference steps are canonicalized once per installation."""
    key = (pattern.name, variant, dtype)
    if key not in _REF_CACHE and _persistent(pattern):
        ref = _disk.load("reference", repr(key))
        if ref is not None:
            _REF_CACHE[key] = ref
        elif not isinstance(ref := _ref_graph(pattern, variant, dtype), Rejection):
            _disk.store("reference", repr(key), ref)
    return _ref_graph(pattern, variant, dtype)


def _match_pattern(fgraph, node, user: _UserGraph, pattern: Pattern, known=None) -> Match | Rejection:
    """The match of ``node`` with ``pattern`` (the first environment of the first variant that unifies, checked
    against the outer graph), or the closest :class:`Rejection` over the variants.  ``known``: {variant:
    Rejection} of variants whose step is known not to unify (:func:`_step_trials`), not unified again."""
    known = known or {}
    # the checks the Scan op and its step decide alone were made by :func:`inner_reject`
    used_outputs = [j for j, o in enumerate(user.outer_outputs) if _has_clients(fgraph, o)]
    if pattern.outputs and len(used_outputs) > len(pattern.outputs):
        return Rejection(f"the loop has {len(used_outputs)} used per-step outputs, the pattern at most "
                         f"{len(pattern.outputs)}", 0.0)
    if pattern.needs_ops and not set(pattern.needs_ops) & _op_names(user):
        return Rejection(f"the step has none of the operations {', '.join(pattern.needs_ops)}", 0.0)
    best = None
    for variant in range(len(pattern.step)):
        if variant in known:  # its states or stop rule differ: whatever the outputs and outer graph, no match
            best = closest(best, known[variant])
            continue
        ref = _reference_graph(pattern, variant, user.dtype)
        if isinstance(ref, Rejection):  # the variant cannot be built here (e.g. needs a library not imported)
            best = closest(best, ref)
            continue
        env = _first_env(node, user, pattern, variant, ref, tuple(used_outputs) if pattern.outputs else ())
        if isinstance(env, Rejection):
            best = closest(best, env)
            continue
        result = _check_outer(fgraph, node, user, pattern, env, variant, ref)
        if isinstance(result, Match):
            return result
        best = closest(best, result)
    return best


def _user(node, lift: bool) -> _UserGraph:
    """:func:`~iterops.fusion.canonical._user_graph`, its canonical step read from the disk cache
    (:mod:`iterops.fusion.cache`) when this process has not canonicalized an equal step."""
    op = node.op
    if (op, lift) not in _USER_CACHE and (key := _disk.step_key(op)) is not None:
        core = _disk.load("user", f"{key}|{lift}")
        if core is not None:
            _USER_CACHE[(op, lift)] = core
        else:
            user = _user_graph(node, lift=lift)
            _disk.store("user", f"{key}|{lift}", _USER_CACHE.get((op, lift)))
            return user
    return _user_graph(node, lift=lift)


#: (Scan op, pattern name, lift, variant, used outputs) -> the first unification of the step with the
#: variant, as :func:`_portable_env` (or the Rejection when none unifies)
_UNIFIED: OrderedDict = OrderedDict()


def _first_env(node, user, pattern, variant, ref, used_outputs):
    """The first environment unifying ``user``'s step with ``pattern``'s ``variant`` (states, stop rule and the
    ``used_outputs``), else the Rejection; memoized per step in this process and on disk (a pure function of
    the step: what the outer graph decides is :func:`_check_outer`'s, run per call)."""
    lift = bool(user.lifted)
    mem = (node.op, pattern.name, lift, variant, used_outputs)
    rec, key = _UNIFIED.get(mem), None
    if rec is None and _persistent(pattern) and (step := _disk.step_key(node.op)) is not None:
        key = f"{step}|{pattern.name}|{lift}|{variant}|{used_outputs}"
        rec = _disk.load("unified", key)
    if rec is None:
        envs = _LoopUnification(pattern, ref, user, used_outputs)
        env = next(iter(envs), None)
        rec = envs.rejection if env is None else _portable_env(env, user, ref)
        if rec is None:  # bindings that only this process's objects can say: not memoized
            return env
        _disk.store("unified", key, rec)
        _UNIFIED[mem] = rec
        while len(_UNIFIED) > 256:
            _UNIFIED.popitem(last=False)
        if env is not None:
            return env
    if isinstance(rec, Rejection):
        return rec
    ref_vars, ref_digest = _ref_index(ref)
    roles, users, pending, digest = rec
    if digest != ref_digest:  # another build of the reference step: unify again
        _UNIFIED.pop(mem, None)
        envs = _LoopUnification(pattern, ref, user, used_outputs)
        return next(iter(envs), None) or envs.rejection
    inputs = [*user.inner_inputs, *user.lifted]
    dec = {"in": inputs.__getitem__, "out": int, "const": lambda c: c, "ref": ref_vars.__getitem__}
    pending = tuple(item if item[0] == "dim" else
                    (item[0], dec["ref"](item[1]), item[2], frozenset(map(dec["ref"], item[3]))) for item in pending)
    return _Env({name: dec[kind](x) for name, (kind, x) in roles.items()},
                {dec[kind](x): name for (kind, x), name in users}, pending)


#: id of a reference graph -> (the graph, its variables in a fixed order, a digest of its text)
_REF_INDEX: dict = {}


def _ref_index(ref):
    """The variables of the reference graph ``ref`` in topological order, and a digest of its structure
    (a memoized unification names reference variables by their position: valid for an equal graph only)."""
    hit = _REF_INDEX.get(id(ref))
    if hit is None or hit[0] is not ref:
        inputs = list(ref.role_of)
        outputs = [*ref.updates, *ref.outputs, *([ref.cond] if ref.cond is not None else [])]
        order = [*inputs, *(o for n in io_toposort(inputs, outputs) for o in n.outputs)]
        try:
            text = _disk._graph_text(inputs, outputs)
        except Exception:  # noqa: BLE001  (no deterministic text: never equal to a stored digest)
            text = repr(id(ref))
        hit = _REF_INDEX[id(ref)] = (ref, order, hashlib.sha256(text.encode()).hexdigest())
    return hit[1], hit[2]


def _portable_env(env, user, ref):
    """``env`` with each bound user variable as its position in ``user``'s inputs (``("in", i)``), a per-step
    output index (``("out", j)``) or a constant (``("const", c)``), and the reference variables of pending
    constraints as their positions in :func:`_ref_index`; None if some variable is none of these (a node the
    unifier made on the fly)."""
    index = {v: i for i, v in enumerate([*user.inner_inputs, *user.lifted])}
    ref_vars, ref_digest = _ref_index(ref)
    ref_pos = {v: i for i, v in enumerate(ref_vars)}

    def enc(u):
        if isinstance(u, int):
            return "out", u
        if u in index:
            return "in", index[u]
        if _is_constant(u):
            return "const", u
        return None

    roles = {name: enc(u) for name, u in env.roles.items()}
    users = [(enc(u), name) for u, name in env.users.items()]
    pending = []
    for item in env.pending:
        if item[0] == "dim":
            pending.append(item)
        elif item[1] in ref_pos and all(x in ref_pos for x in item[3]):
            pending.append((item[0], ref_pos[item[1]], item[2], tuple(ref_pos[x] for x in item[3])))
        else:
            return None
    if any(e is None for e in roles.values()) or any(e is None for e, _ in users):
        return None
    return roles, users, tuple(pending), ref_digest


def _op_names(user) -> set:
    """Class names of the Ops (core Ops of ``Blockwise``) in the user's canonical step."""
    names = getattr(user, "_op_names", None)
    if names is None:
        names = {type(getattr(n.op, "core_op", n.op)).__name__
                 for n in io_toposort(user.inner_inputs, user.inner_outputs)}
        user._op_names = names
    return names


def _check_outer(fgraph, node, user, pattern, env, variant, ref) -> Match | Rejection:
    """The :class:`Match` of the unified ``env`` if the outer graph allows the replacement (static-shape
    constraints, the uses of every output, the pattern's ``check``), else the :class:`Rejection` saying why."""
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
                return Rejection(f"the step uses the constant {c} where the reference uses {role}.shape[{d}], "
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
                return Rejection(f"the step uses the constant {_describe(u)} where the reference computes it from "
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
                return Rejection("the loop carries an extra state whose values are used outside", score)
            continue
        kinds = {k for _, k in use}
        provides = pattern.provides[name]
        if use and provides is None:
            return Rejection(f"the state {name} is used outside the loop (the replacement only computes the others)", score)
        if "other" in kinds:
            return Rejection(f"{name} is used through an index, slice or shape that is not provably its final "
                             "value (intermediate states, or the number of steps run)", score)
        if provides == "last" and kinds - {"last", "last_nonempty", "last_row"}:
            return Rejection(f"intermediate values of {name} (or the number of steps run) are used "
                             "(only its final value can be replaced)", score)
        uses[name] = use
    bound_outputs = {user.outer_outputs[env.roles[name]]: name for name in out_roles if name in env.roles}
    for o in user.extra_outputs:
        if o in bound_outputs:
            uses[bound_outputs[o]] = [(o, "trace")]
        elif _has_clients(fgraph, o):
            return Rejection("the loop has extra outputs that are used outside", score)
    if not any(uses.values()):
        return Rejection("no output of the loop is used", score)
    nonseq = {r.name for r in pattern.non_sequences}
    time_varying = frozenset(name for name, u in env.roles.items()
                             if name in nonseq and not _is_constant(u) and user.kind.get(u) == "seq")
    m = Match(pattern=pattern, node=node, args=a, inner=dict(env.roles), outer=outer, n_steps=a.n_steps,
              as_while=a.as_while, dtype=user.dtype, uses=uses, variant=variant, views=views,
              time_varying=time_varying)
    if pattern.check is not None:
        reason = pattern.check(m)
        if reason:
            return Rejection(reason, score + 1)
    return m


def forget() -> None:
    """Forget what this process learnt about steps and reference graphs (the in-process memos of the matcher,
    the unifier and the canonicalizer); the disk cache (:mod:`iterops.fusion.cache`) is kept.  For tests and
    benchmarks that measure a new process's work without starting one."""
    for memo in (_INNER, _FACTS, _UNIFIED, _REF_INDEX, _UNBUILDABLE, _REF_CACHE, _USER_CACHE, _disk._STEP_KEYS):
        memo.clear()
