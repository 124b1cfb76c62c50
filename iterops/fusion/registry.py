"""The declarative registry of recognizable Scan loops.

A :class:`Pattern` describes one loop the way a user writes it:

* ``step``: one or more *reference step functions* with ``pytensor.scan``'s
  calling convention ``step(*sequences, *states, *non_sequences)``, returning
  the new states (in ``states`` order) and optionally ``until(condition)``.
  Several functions are *variants* (different stop rules, a sequence instead
  of an indexed non-sequence, ...); a variant that cannot be built in this
  process (it needs a library the user's graph did not import) returns a
  :class:`Rejection` saying so instead of its outputs;
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
* ``needs_ops`` (optional): Op class names, one of which every matching step
  holds (e.g. ``("MatrixInverse", "Solve")`` for a Kalman gain): other loops
  are rejected before the reference steps are built.  Without it, the matcher
  still reads off the reference steps the Op families every variant needs
  (linear algebra, subtensor writes) and whether any holds a nested loop, and
  turns away steps that cannot have them before canonicalizing them;
* ``build``: makes the fused replacement from a :class:`~iterops.fusion.matcher.Match`
  and returns ``{state or output: value}`` (the final value for ``"last"``
  states, the ``(n_steps, ...)`` trace for ``"trace"`` states and outputs); it
  may return only the values in ``match.uses``.

The matcher (:mod:`iterops.fusion.matcher`) knows nothing about specific
algorithms: it canonicalizes the reference step and the user's inner graph with
the same rewrites and unifies them.  Adding a loop means adding a Pattern.

Alternative spellings of one quantity inside a reference step are written
with :func:`one_of` (``K = one_of(P @ Z.T @ inv(F), solve(F, Z @ P).T)``):
the matcher accepts the user's graph when it unifies with any one of them, so
the alternatives of several quantities combine without one step function per
combination.  Every alternative must be the same quantity in exact arithmetic
(given what the rest of the step and the pattern's ``check`` establish); the
replacement then equals the loop to rounding, whichever was written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

__all__ = ["Role", "Pattern", "Rejection", "closest", "register_pattern", "PATTERNS", "one_of", "OneOf"]


@dataclass(frozen=True)
class Rejection:
    """Why a Scan does not match a pattern: a value the matcher returns, never raises.

    ``reason`` is what ``iterops.explain`` prints (``str(rejection)``); ``score``
    how close the loop came, to report the closest pattern: 0-0.5 ruled out by
    the loop's form (states, stop rule, Ops), 1 + 16 stage + min(depth, 15) the
    step differs from the reference at that depth in that stage (0 the stop rule,
    1 the state updates, 2 the per-step outputs: below 50), 50 a static shape
    does not prove a constant,
    100 and more the step matches and the loop's outer uses or the pattern's
    ``check`` rule it out.
    """

    reason: str
    score: float = 0.0

    def __str__(self) -> str:
        return self.reason


def closest(best: Rejection | None, new: Rejection | None) -> Rejection | None:
    """The rejection that came closer to a match (``best`` on a tie; None counts as the farthest)."""
    if best is None or (new is not None and new.score > best.score):
        return new
    return best


@dataclass(frozen=True)
class Role:
    """One argument of a reference step.

    ``constant_ok``: the user may spell this argument as a constant inside the
    step (e.g. a tolerance ``1e-8``) instead of passing it as a non-sequence.
    ``dtype``: of the reference input (e.g. ``"int64"`` for a loop counter);
    ``None`` means the loop's float dtype.
    ``time_varying_ok`` (non-sequences only): the user's loop may read this
    argument as a sequence instead (one row per step, e.g. a time-varying
    system matrix); ``match.time_varying`` names the roles bound so.
    """

    name: str
    ndim: int
    constant_ok: bool = False
    dtype: str | None = None  # None: the loop's float dtype
    time_varying_ok: bool = False


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
    #: a cheap filter before any reference graph is built: names of Op classes (the core Op of a
    #: ``Blockwise``) of which the user's canonical step must hold at least one (empty: no filter)
    needs_ops: tuple = ()

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


class OneOf(Op):
    """A node of a *reference step* standing for any one of its inputs (see :func:`one_of`).

    It only exists in the reference graphs the matcher builds: it is never
    compiled or evaluated (``perform`` raises, constant folding is off).
    """

    __props__ = ()

    def make_node(self, *alternatives):
        alts = [pt.as_tensor_variable(a) for a in alternatives]
        if not alts:
            raise ValueError("one_of needs at least one alternative")
        ndims = {a.type.ndim for a in alts}
        if len(ndims) != 1:
            raise ValueError(f"one_of: alternatives of different ndim {[a.type for a in alts]}")
        dtype = alts[0].type.dtype
        alts = [a if a.type.dtype == dtype else a.astype(dtype) for a in alts]
        out = pt.tensor(dtype=dtype, shape=(None,) * alts[0].type.ndim)
        return Apply(self, alts, [out])

    def perform(self, node, inputs, outputs):
        raise NotImplementedError("one_of is a pattern marker: reference steps are matched, never run")

    def do_constant_folding(self, fgraph, node):
        return False


def one_of(*alternatives):
    """In a reference step: the user's graph may compute this quantity as any one of ``alternatives``.

    The alternatives must all be the same value in exact arithmetic (e.g. the
    Kalman gain as ``P Z^T F^{-1}`` or ``solve(F, Z P)^T``).  A role read only
    by some alternatives is bound only when the user's graph takes one of them
    (``match.outer`` lacks it otherwise); the pattern's ``build`` must handle
    both.  A single alternative is returned as it is.
    """
    if len(alternatives) == 1:
        return pt.as_tensor_variable(alternatives[0])
    return OneOf()(*alternatives)
