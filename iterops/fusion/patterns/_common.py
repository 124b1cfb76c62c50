"""Helpers shared by pattern entries: stop rules and outer-graph proofs."""

from __future__ import annotations

import pytensor.tensor as pt
from pytensor.tensor.basic import ARange
from pytensor.tensor.subtensor import Subtensor, indices_from_subtensor

from iterops.fusion.matcher import constant_value, provably_equal

__all__ = ["CONVERGENCE_STOPS", "CONVERGENCE_STOP_KINDS", "STOP_RULES", "STOP_KINDS", "provably_equal",
           "is_counter_sequence", "strip_leading_slices", "sequence_order", "static_square"]


def _max_abs(d):
    return pt.max(pt.abs(d))


_STOP_RULES = (
    ("max_lt", lambda d, tol: _max_abs(d) < tol),
    ("max_le", lambda d, tol: _max_abs(d) <= tol),
    ("max_lt", lambda d, tol: pt.all(pt.abs(d) < tol)),  # the same test, NaN included (false)
    ("fro_lt", lambda d, tol: pt.linalg.norm(d) < tol),
)

#: The convergence stops users write, as ``stop(new, old, tol) -> condition``:
#: the max-abs or Frobenius norm of the change below ``tol`` (strict or not),
#: with either sign of the difference; ``CONVERGENCE_STOP_KINDS[i]`` names
#: rule ``i`` as the fused loop Ops spell it (``stop=``).
CONVERGENCE_STOPS = tuple(
    (lambda new, old, tol, diff=diff, rule=rule: rule(diff(new, old), tol))
    for diff in (lambda new, old: new - old, lambda new, old: old - new)
    for _, rule in _STOP_RULES
)
CONVERGENCE_STOP_KINDS = tuple(kind for _ in range(2) for kind, _ in _STOP_RULES)
#: The stop rules of a loop pattern's reference variants, in the order of its step functions: each
#: convergence stop, then None (no stop: ``n_steps`` steps); ``STOP_KINDS[i]`` is rule ``i``'s ``stop=``.
STOP_RULES = (*CONVERGENCE_STOPS, None)
STOP_KINDS = (*CONVERGENCE_STOP_KINDS, None)


def strip_leading_slices(v):
    """``x[s0:][:s1]...`` -> (x, [slices]): look through the slicing Scan adds to sequences."""
    slices = []
    while v.owner is not None and isinstance(v.owner.op, Subtensor):
        idx = indices_from_subtensor(v.owner.inputs[1:], v.owner.op.idx_list)
        if len(idx) != 1 or not isinstance(idx[0], slice):
            break
        slices.append(idx[0])
        v = v.owner.inputs[0]
    return v, slices


def starts_at_zero(slices) -> bool:
    return all(
        (s.start is None or constant_value(s.start) == 0) and (s.step is None or constant_value(s.step) == 1)
        for s in slices
    )


def _is_none_or(v, value) -> bool:
    return v is None or constant_value(v) == value


def sequence_order(seq):
    """How a Scan sequence reads its source: ``(source, "forward" | "reversed" | None)``.

    ``"forward"``: rows 0, 1, 2, ... of ``source`` (slices starting at 0 with step 1);
    ``"reversed"``: ``source[start:][::-1][:stop]`` with ``start`` 0, i.e. the last row first, as
    ``pytensor.scan(..., go_backwards=True)`` reads its sequences (``None``: anything else).  A
    reversed sequence visits every row of ``source`` only if the loop runs ``len(source)`` steps:
    the caller must prove that.
    """
    base, slices = strip_leading_slices(seq)
    if starts_at_zero(slices):
        return base, "forward"
    # slices are listed outermost first: [outer..., reversal, inner...]
    rev = [j for j, s in enumerate(slices) if not _is_none_or(s.step, 1)]
    if len(rev) != 1:
        return base, None
    j = rev[0]
    r = slices[j]
    outer, inner = slices[:j], slices[j + 1:]
    whole_reversal = r.start is None and r.stop is None and constant_value(r.step) == -1
    if whole_reversal and starts_at_zero(outer) and all(s.stop is None for s in inner) and starts_at_zero(inner):
        return base, "reversed"
    return base, None


def is_counter_sequence(seq, n_steps=None) -> str | None:
    """``seq`` gives 0, 1, 2, ... at steps 0, 1, 2, ... (``arange(k)`` as a Scan sequence)?

    With ``n_steps`` (for loops whose result does not depend on the order of the steps), the
    reversed count ``k - 1, ..., 0`` of ``go_backwards=True`` is accepted too when the loop provably
    runs ``k`` steps.  Returns None if so, else a reason.
    """
    base, order = sequence_order(seq)
    if base.owner is None or not isinstance(base.owner.op, ARange):
        return "the loop index is not a sequence pt.arange(k)"
    start, stop, step = base.owner.inputs
    if constant_value(start) != 0 or constant_value(step) != 1 or order is None:
        return "the loop index sequence does not count 0, 1, 2, ..."
    if order == "reversed":
        if n_steps is None:
            return "the loop index counts backwards (go_backwards): the loop depends on the order of its steps"
        if not provably_equal(stop, n_steps):
            return "the loop index counts backwards from an arange(k) whose length k is not provably n_steps"
    return None


def static_square(name, x) -> str | None:
    r, c = x.type.shape[-2:]
    if r is not None and c is not None and r != c:
        return f"{name} is not square (static shape {x.type.shape})"
    return None
