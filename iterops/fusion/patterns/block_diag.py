r"""Block-diagonal assembly loops -> :func:`iterops.block_diag`.

``block_diag_indexed`` (the loop PyMC users write to assemble a block-diagonal matrix)::

    k, n, m = x.shape
    def step(i, out, x):
        return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], x[i])
    outs, _ = pytensor.scan(step, sequences=[pt.arange(k)],
                            outputs_info=[pt.zeros((k * n, k * m))], non_sequences=[x])
    B = outs[-1]

``block_diag_sequence``: the same with the blocks as a second sequence,
``step(i, x_i, out)``.  Variants: ``inc_subtensor`` instead of
``set_subtensor``, ``i * n + n`` for ``(i + 1) * n``, block sizes written as
constants equal to ``x``'s static shape.

Accepted spellings:

==============================  ==============================================================
write                           ``set_subtensor`` or ``inc_subtensor`` (into zeros: the same)
block bounds                    ``(i + 1) * n`` or ``i * n + n``; ``n``, ``m`` as ``x.shape[1:]``,
                                ``x_i.shape`` or constants equal to the static shape
blocks                          indexed ``x[i]`` (non-sequence) or a second sequence ``x_i``
order                           forward, or ``go_backwards=True`` (the blocks written last to
                                first: each block is written once at its own position, so the
                                result is the same)
==============================  ==============================================================

Exact (a copy of each block): outputs are bit-identical.  Conditions checked on
the outer graph (otherwise the Scan stays): the initial matrix is zero and
provably of shape ``(k n, k m)``; the loop index is ``arange`` counting from 0
(or, with ``go_backwards``, counting down from ``k - 1`` over an ``arange`` of
provably ``k`` entries, with the blocks sequence reversed alike); the loop runs
provably ``k = x.shape[0]`` steps; only the final matrix is used.
"""

from __future__ import annotations

import pytensor.tensor as pt

from iterops.fusion.matcher import constant_value
from iterops.fusion.patterns._common import is_counter_sequence, provably_equal, sequence_order
from iterops.fusion.registry import Pattern, Role, register_pattern
from iterops.linalg.block_diag import block_diag

__all__: list[str] = []


def _bounds(i, size, spelling):
    lo = i * size
    hi = (i + 1) * size if spelling == 0 else i * size + size
    return lo, hi


def _indexed_step(write, spelling):
    def step(i, out, x):
        n, m = x.shape[1], x.shape[2]
        r0, r1 = _bounds(i, n, spelling)
        c0, c1 = _bounds(i, m, spelling)
        return write(out[r0:r1, c0:c1], x[i])

    return step


def _sequence_step(write, spelling):
    def step(i, xi, out):
        n, m = xi.shape[0], xi.shape[1]
        r0, r1 = _bounds(i, n, spelling)
        c0, c1 = _bounds(i, m, spelling)
        return write(out[r0:r1, c0:c1], xi)

    return step


_WRITES = (pt.set_subtensor, pt.inc_subtensor)
_SPELLINGS = (0, 1)


def _check_common(m, x):
    init = m.outer["out"]
    if constant_value(init) != 0:
        return "the matrix the blocks are written into does not start as zeros"
    k, n, mm = x.shape[0], x.shape[1], x.shape[2]
    if not (provably_equal(init.shape[0], k * n) and provably_equal(init.shape[1], k * mm)):
        return "the zero matrix is not provably of shape (k*n, k*m) for the blocks x of shape (k, n, m)"
    if not provably_equal(m.n_steps, k):
        return "the loop does not provably run k = x.shape[0] steps (some blocks would stay zero)"
    # every block is written once, at its own position: any order of the steps gives the same matrix
    return is_counter_sequence(m.outer["i"], n_steps=m.n_steps)


def _check_indexed(m):
    return _check_common(m, m.outer["x"])


def _blocks_of_sequence(m):
    """The (k, n, m) blocks the ``xi`` sequence reads, in the direction the loop index counts, else None."""
    base, order = sequence_order(m.outer["xi"])
    if order is None or base.type.ndim != 3 or sequence_order(m.outer["i"])[1] != order:
        return None
    return base


def _check_sequence(m):
    x = _blocks_of_sequence(m)
    if x is None:
        return ("the blocks sequence is not a (k, n, m) tensor iterated from its start (or from its end, with "
                "the loop index counting down alike)")
    return _check_common(m, x)


register_pattern(Pattern(
    name="block_diag_indexed",
    replaces_with="iterops.block_diag",
    step=tuple(_indexed_step(w, s) for w in _WRITES for s in _SPELLINGS),
    sequences=(Role("i", 0, dtype="int64"),),
    states=(Role("out", 2),),
    non_sequences=(Role("x", 3),),
    provides={"out": "last"},
    check=_check_indexed,
    build=lambda m: {"out": block_diag(m.outer["x"])},
    doc="out[i n:(i+1) n, i m:(i+1) m] = x[i] for i in range(k)",
))

register_pattern(Pattern(
    name="block_diag_sequence",
    replaces_with="iterops.block_diag",
    step=tuple(_sequence_step(w, s) for w in _WRITES for s in _SPELLINGS),
    sequences=(Role("i", 0, dtype="int64"), Role("xi", 2)),
    states=(Role("out", 2),),
    provides={"out": "last"},
    check=_check_sequence,
    build=lambda m: {"out": block_diag(_blocks_of_sequence(m))},
    doc="out[i n:(i+1) n, i m:(i+1) m] = x_i for (i, x_i) in zip(range(k), x)",
))
