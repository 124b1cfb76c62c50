"""The Scan-to-fused-Op rewrite and its registration with PyTensor.

Registered by :mod:`iterops.rewrites` (tag ``"iterops"``; ``mode.excluding("iterops")`` disables all):

* ``iterops_fuse_loops`` in ``optdb`` at position 0.04 (tags ``fast_run``,
  ``fast_compile``): before the Scan push-outs (0.05) rewrite the user's loop,
  so NUMBA, FAST_RUN/C and FAST_COMPILE all see it as written;
* ``iterops_fuse_loops`` in the ``canonicalize`` database (tags ``fast_run``,
  ``fast_compile``): for PyMC's pre-gradient pass
  (``pymc.pytensorf.rewrite_pregrad`` applies ``canonicalize`` and
  ``stabilize``, also to inner graphs) so that ``dlogp`` differentiates the
  fused Op, and as a second chance after other canonicalizations.

At position 0.04 the graph is as ``pytensor.grad`` built it (only merged), so
a gradient Scan built by ``Scan.pullback`` is still recognizable there: the
rewrite replaces a matched loop together with its gradient Scans
(:func:`iterops.fusion.gradient.fuse_with_gradients`) before PyTensor's Scan
push-outs, save-mem and merge rewrites change either.

Inner graphs of other Scans are rewritten by PyTensor with the compiling
mode's full optimizer (``scan_inner_graph``, every linker), so a matched loop
nested inside another Scan is replaced there too.

Turning the rewrites off
------------------------
``mode.excluding("iterops")`` works wherever you choose the mode.  PyMC's
pre-gradient pass (``rewrite_pregrad``) and samplers that hard-code their
mode (nutpie compiles with its own NUMBA mode) ignore it; for those, use the
process-wide switch::

    with iterops.fusion.disabled():        # the Scans stay Scans
        dlogp = model.compile_dlogp()
        compiled = nutpie.compile_pymc_model(model)

    iterops.fusion.set_enabled(False)      # the same, until set_enabled(True)

While disabled, every iterops rewrite (``iterops_fuse_loops`` in ``optdb``
and ``canonicalize``, ``iterops_builtin_lyapunov`` and
:func:`iterops.fuse_loops`) leaves graphs unchanged; ``iterops.explain``
still reports what *would* be replaced.  The switch is read when a graph
is rewritten, i.e. while compiling: a function compiled inside the block
keeps its Scans after the block ends, and one compiled before it keeps its
fused Ops.  Explicit calls of the fused Ops
(``iterops.solve_discrete_lyapunov``, ...) are not affected.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytensor.tensor as pt
from pytensor.configdefaults import config
from pytensor.graph.rewriting.basic import GraphRewriter, NodeRewriter, copy_stack_trace, dfs_rewriter
from pytensor.scan.op import Scan

from iterops.fusion.gradient import fuse_with_gradients
from iterops.fusion.matcher import initial_value, match_scan, may_match
from iterops.fusion.registry import PATTERNS

__all__ = ["fuse_scan", "FuseLoopsEverywhere", "replacements_for", "disabled", "set_enabled", "is_enabled"]

_log = logging.getLogger("iterops.fusion")

_ENABLED = True


def is_enabled() -> bool:
    """Whether the iterops Scan rewrites are active (see :func:`set_enabled`)."""
    return _ENABLED


def set_enabled(enabled: bool) -> bool:
    """Turn every iterops Scan rewrite on or off process-wide; returns the previous setting.

    Off, the rewrites registered with PyTensor (and :func:`iterops.fuse_loops`)
    leave graphs unchanged, also where ``mode.excluding("iterops")`` cannot be
    passed (PyMC's ``rewrite_pregrad``, nutpie).  Read while compiling.
    """
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


@contextmanager
def disabled():
    """Context manager: the iterops Scan rewrites are off inside the block (restored after, also on error).

    ::

        with iterops.fusion.disabled():
            f = model.compile_dlogp()   # keeps the user's Scans
    """
    previous = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(previous)


def _describe_scan(node) -> str:
    name = getattr(node.op, "name", None)
    return f"Scan{{{name}}}" if name else "Scan"


def _raise_as_the_loop(match, value, kind):
    """``value`` guarded so that the rewritten graph raises where the user's loop raises.

    Scan raises on ``n_steps < 0``.  A loop of 0 steps raises only where the
    user's index is out of bounds then (``"last_nonempty"`` uses):
    PyTensor reads ``out[-1]`` of an empty trace as the initial value, and so
    do the replacements.
    """
    return match.require_steps(value, 1 if kind == "last_nonempty" else 0)


def replacements_for(match) -> dict:
    """``{outer variable: fused replacement}`` for a :class:`Match`."""
    values = match.pattern.build(match)
    repl = {}
    for state, uses in match.uses.items():
        if not uses:
            continue
        value = values[state]
        provides = match.pattern.provides[state]
        for var, kind in uses:
            if var in repl:
                continue
            use_kind, kind = kind, "last" if kind == "last_nonempty" else kind
            if kind in ("last", "last_row") and provides == "trace":
                # the final state; the initial one after 0 steps, as PyTensor reads the loop's out[-1]
                init = initial_value(match.args.outer_in_sit_sot[_sitsot_index(match, state)])
                rows = pt.concatenate([pt.shape_padleft(pt.cast(init, value.dtype)), value[-1:]], axis=0)[-1]
            elif kind in ("last", "last_row"):
                rows = value  # the final state
            elif kind == "trace":
                rows = value
            elif kind == "buffer":
                init = initial_value(match.args.outer_in_sit_sot[_sitsot_index(match, state)])
                rows = pt.concatenate([pt.shape_padleft(pt.cast(init, value.dtype)), value], axis=0)
            else:  # pragma: no cover  (the matcher rejects other uses)
                raise AssertionError(kind)
            new = _raise_as_the_loop(match, _apply_view(rows, kind, *match.views.get(var, ((), ())),
                                                        n_steps=match.n_steps), use_kind)
            if new.type.dtype != var.type.dtype:
                new = pt.cast(new, var.type.dtype)
            new = var.type.filter_variable(new, allow_convert=True)
            copy_stack_trace(var, new)
            repl[var] = new
    return repl


def _apply_view(rows, kind, wrappers, rest, n_steps):
    """Read ``rows`` as the user's use did: row-wise wrappers, then the row selection and trailing indices.

    For ``"last"`` / ``"last_row"``, ``rows`` is the final state itself.
    ``out[-1:]`` of a loop of 0 steps is empty in PyTensor (and
    ``out[-1:][0]`` raises), so ``"last_row"`` keeps ``min(n_steps, 1)`` rows.
    """
    if kind == "last" and not wrappers:
        return rows[rest] if rest else rows
    if kind == "last_row":
        rows = pt.shape_padleft(rows)[: pt.clip(n_steps, 0, 1)]
    elif kind == "last":
        rows = pt.shape_padleft(rows)  # the final state as the only row
    for op in wrappers:
        rows = op(rows)
    if kind == "last":
        return rows[(0, *rest)]
    return rows[(slice(None), *rest)] if rest else rows


def _sitsot_index(match, state):
    inner = match.inner[state]
    return match.args.inner_in_sit_sot.index(inner)


class FuseScan(NodeRewriter):
    """Replace a Scan matching a registered pattern by the fused Op."""

    def tracks(self):
        return [Scan]

    def transform(self, fgraph, node, enforce_tracks=True):
        if not _ENABLED or not isinstance(node.op, Scan):
            return None
        try:
            if not may_match(node, PATTERNS.values()):  # cached per Scan op: the usual answer, at no cost
                return None
        except Exception:  # a failed analysis must never break compilation
            _log.debug("iterops fusion failed on %s", node, exc_info=True)
            return None
        try:
            pair = fuse_with_gradients(fgraph, node)
        except Exception as err:  # a failed match must never break compilation
            _log.debug("iterops gradient fusion failed on %s", node, exc_info=True)
            pair = None
        if pair is not None and pair.replacements is not None:
            if config.optimizer_verbose:
                print(f"iterops: replaced {_describe_scan(node)} and its gradient Scan(s) "  # noqa: T201
                      f"{', '.join(_describe_scan(g) for g in pair.gradients)} by "
                      f"{pair.match.pattern.replaces_with} and its gradient (pattern {pair.match.pattern.name})")
            return pair.replacements
        try:
            match, rejections = match_scan(fgraph, node, PATTERNS.values())
            if match is None:
                if config.optimizer_verbose and rejections and rejections[0][1].score >= 1:
                    name, err = rejections[0]
                    print(f"iterops: kept {_describe_scan(node)}: closest pattern {name}: {err}")  # noqa: T201
                return None
            repl = replacements_for(match)
        except Exception as err:  # a failed match must never break compilation
            _log.debug("iterops fusion failed on %s", node, exc_info=True)
            if config.optimizer_verbose:
                print(f"iterops: error while matching {_describe_scan(node)}: {err!r}")  # noqa: T201
            return None
        if config.optimizer_verbose:
            print(f"iterops: replaced {_describe_scan(node)} by {match.pattern.replaces_with} "  # noqa: T201
                  f"(pattern {match.pattern.name})")
        _log.debug("replaced %s by %s (pattern %s)", node, match.pattern.replaces_with, match.pattern.name)
        return repl

    def __str__(self):
        return "iterops_fuse_loops"


fuse_scan = FuseScan()


def _has_inner_scan(op) -> bool:
    return isinstance(op, Scan) and any(isinstance(n.op, Scan) for n in op.fgraph.apply_nodes)


class FuseLoopsEverywhere(GraphRewriter):
    """``fuse_scan`` on the graph, then inside the inner graphs of Scans that hold Scans (nested loops).

    At position 0.04 an outer Scan's inner graph still holds a nested loop and
    its gradient Scan as ``pytensor.grad`` built them; PyTensor's Scan
    push-outs (0.05) would change them before the inner graph is compiled.
    """

    def apply(self, fgraph):
        if not _ENABLED:
            return
        dfs_rewriter(fuse_scan, ignore_newtrees=True).rewrite(fgraph)
        if not any(_has_inner_scan(n.op) for n in fgraph.apply_nodes):
            return
        from pytensor.compile.rewriting import rewrite_inner_graph  # noqa: PLC0415

        rewrite_inner_graph(fgraph, _has_inner_scan,
                            lambda linker, op, node, inner, *, mode: self.apply(inner))

    def __str__(self):
        return "iterops_fuse_loops"
