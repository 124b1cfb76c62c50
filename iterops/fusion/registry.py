"""The declarative registry of recognizable Scan loops.

A :class:`Pattern` describes one loop the way a user writes it:

* ``step``: one or more *reference step functions* with ``pytensor.scan``'s
  calling convention ``step(*sequences, *states, *non_sequences)``, returning
  the new states (in ``states`` order) and optionally ``until(condition)``.
  Several functions are *variants* (different stop rules, a sequence instead
  of an indexed non-sequence, ...);
* the *roles* of the step's arguments (names and ndims), grouped as Scan
  groups its inputs;
* ``outputs`` (optional): per-step outputs the step returns after the states
  (Scan's ``outputs_info=None`` outputs, e.g. a per-step log-likelihood).  A
  user loop may return any subset of them, in any order; its per-step outputs
  that are used outside the loop must each match one of them;
* ``provides``: per state, what the fused replacement computes: ``"last"``
  (only the final state, e.g. a converged solution) or ``"trace"`` (every
  step's state, e.g. filtered means); per-step outputs are always ``"trace"``;
* ``check`` (optional): conditions on the *outer* graph (initial values,
  ``n_steps``, static shapes) that the inner graph cannot express; returns a
  reason string to reject, ``None`` to accept;
* ``build``: makes the fused replacement from a :class:`~iterops.fusion.matcher.Match`
  and returns ``{state or output: value}`` (the final value for ``"last"``
  states, the ``(n_steps, ...)`` trace for ``"trace"`` states and outputs); it
  may return only the values in ``match.uses``.

The matcher (:mod:`iterops.fusion.matcher`) knows nothing about specific
algorithms: it canonicalizes the reference step and the user's inner graph with
the same rewrites and unifies them.  Adding a loop means adding a Pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Role", "Pattern", "register_pattern", "PATTERNS"]


@dataclass(frozen=True)
class Role:
    """One argument of a reference step.

    ``constant_ok``: the user may spell this argument as a constant inside the
    step (e.g. a tolerance ``1e-8``) instead of passing it as a non-sequence.
    ``dtype``: of the reference input (e.g. ``"int64"`` for a loop counter);
    ``None`` means the loop's float dtype.
    """

    name: str
    ndim: int
    constant_ok: bool = False
    dtype: str | None = None  # None: the loop's float dtype


@dataclass(frozen=True)
class Pattern:
    name: str
    replaces_with: str
    step: Sequence[Callable]
    sequences: Sequence[Role] = ()
    states: Sequence[Role] = ()
    non_sequences: Sequence[Role] = ()
    outputs: Sequence[Role] = ()
    provides: dict = field(default_factory=dict)
    build: Callable | None = None
    check: Callable | None = None
    doc: str = ""

    def role(self, name: str) -> Role:
        for r in (*self.sequences, *self.states, *self.non_sequences):
            if r.name == name:
                return r
        raise KeyError(name)


PATTERNS: dict[str, Pattern] = {}


def register_pattern(pattern: Pattern) -> Pattern:
    """Add ``pattern`` to the registry (replacing one of the same name)."""
    missing = [r.name for r in pattern.states if r.name not in pattern.provides]
    if missing:
        raise ValueError(f"pattern {pattern.name}: provides must say 'last', 'trace' or None for states {missing}")
    for r in pattern.outputs:
        if pattern.provides.setdefault(r.name, "trace") != "trace":
            raise ValueError(f"pattern {pattern.name}: per-step output {r.name} can only be provided as 'trace'")
    PATTERNS[pattern.name] = pattern
    return pattern
