"""The Scan-to-fused-Op rewrite and its registration with PyTensor.

Registered (tag ``"iterops"``; ``mode.excluding("iterops")`` disables all):

* ``iterops_fuse_loops`` in ``optdb`` at position 0.04 (tags ``fast_run``,
  ``fast_compile``): before the Scan push-outs (0.05) rewrite the user's loop,
  so NUMBA, FAST_RUN/C and FAST_COMPILE all see it as written;
* ``iterops_fuse_loops`` in the ``canonicalize`` database (tags ``fast_run``,
  ``fast_compile``): for PyMC's pre-gradient pass
  (``pymc.pytensorf.rewrite_pregrad`` applies ``canonicalize`` and
  ``stabilize``, also to inner graphs) so that ``dlogp`` differentiates the
  fused Op, and as a second chance after other canonicalizations.

Inner graphs of other Scans are rewritten by PyTensor with the compiling
mode's full optimizer (``scan_inner_graph``, every linker), so a matched loop
nested inside another Scan is replaced there too.
"""

from __future__ import annotations

import logging

import pytensor.tensor as pt
from pytensor.compile import optdb
from pytensor.configdefaults import config
from pytensor.graph.rewriting.basic import NodeRewriter, copy_stack_trace, dfs_rewriter
from pytensor.scan.op import Scan

from iterops.fusion.matcher import initial_value, match_scan
from iterops.fusion.registry import PATTERNS

__all__ = ["fuse_scan", "replacements_for"]

_log = logging.getLogger("iterops.fusion")


def _describe_scan(node) -> str:
    name = getattr(node.op, "name", None)
    return f"Scan{{{name}}}" if name else "Scan"


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
            if kind == "last":
                new = value[-1] if provides == "trace" else value
            elif kind == "trace":
                new = value
            elif kind == "buffer":
                init = initial_value(match.args.outer_in_sit_sot[_sitsot_index(match, state)])
                new = pt.concatenate([pt.shape_padleft(pt.cast(init, value.dtype)), value], axis=0)
            else:  # pragma: no cover  (the matcher rejects other uses)
                raise AssertionError(kind)
            if new.type.dtype != var.type.dtype:
                new = pt.cast(new, var.type.dtype)
            new = var.type.filter_variable(new, allow_convert=True)
            copy_stack_trace(var, new)
            repl[var] = new
    return repl


def _sitsot_index(match, state):
    inner = match.inner[state]
    return match.args.inner_in_sit_sot.index(inner)


class FuseScan(NodeRewriter):
    """Replace a Scan matching a registered pattern by the fused Op."""

    def tracks(self):
        return [Scan]

    def transform(self, fgraph, node, enforce_tracks=True):
        if not isinstance(node.op, Scan):
            return None
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

_TAGS = ("fast_run", "fast_compile", "iterops")


def register():
    """Register the rewrites with PyTensor's optimizer database (idempotent)."""
    if "iterops_fuse_loops" in optdb.__db__:
        return
    optdb.register("iterops_fuse_loops", dfs_rewriter(fuse_scan, ignore_newtrees=True), *_TAGS, position=0.04)
    optdb["canonicalize"].register("iterops_fuse_loops", fuse_scan, *_TAGS)
