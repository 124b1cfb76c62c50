"""Recognize iterops' loops inside user Scans and replace them with fused Ops.

``import iterops`` registers the rewrite (tag ``"iterops"``) so that
``pytensor.function`` (NUMBA, FAST_RUN/C, FAST_COMPILE) and PyMC's
pre-gradient pass replace matched Scans; ``mode.excluding("iterops")`` keeps
them, and so does :func:`disabled` (``with iterops.fusion.disabled(): ...``)
where the mode cannot be chosen (PyMC's ``rewrite_pregrad``, nutpie).  For plain PyTensor, :func:`fuse_loops` applies the replacement before
``pytensor.grad``; :func:`explain` says what was (or was not) replaced.

Patterns (see :mod:`iterops.fusion.patterns`): Smith doubling and the
fixed-point Lyapunov iteration (-> ``solve_discrete_lyapunov``), block-diagonal
assembly (-> ``block_diag``), and, when available, Kalman filters and the
Levinson-Durbin recursion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pytensor.compile.rewriting import rewrite_inner_graph
from pytensor.graph.basic import Variable
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.basic import dfs_rewriter
from pytensor.scan.op import Scan
from pytensor.scan.utils import ScanArgs

from iterops.fusion import patterns  # noqa: F401  (registers the patterns)
from iterops.fusion.matcher import _inner_inputs, _inner_outputs, match_scan
from iterops.fusion.registry import PATTERNS, Pattern, Role, register_pattern
from iterops.fusion.rewrite import disabled, fuse_scan, is_enabled, register, replacements_for, set_enabled

__all__ = ["fuse_loops", "explain", "Explanation", "PATTERNS", "Pattern", "Role", "register_pattern",
           "disabled", "set_enabled", "is_enabled"]

register()


def _fuse_fgraph(fgraph: FunctionGraph) -> None:
    dfs_rewriter(fuse_scan, ignore_newtrees=True).rewrite(fgraph)
    rewrite_inner_graph(
        fgraph, lambda op: isinstance(op, Scan), lambda linker, op, node, inner, *, mode: _fuse_fgraph(inner)
    )


def fuse_loops(outputs):
    """Replace the recognized Scans in the graph of ``outputs`` by fused Ops.

    A variable in, a variable out; a list (or tuple) in, a list out.  The input
    graph is not modified.  Use it before ``pytensor.grad`` so the gradient is
    the fused Op's (exact, one kernel) instead of a gradient Scan::

        X = iterops.fuse_loops(gammas[-1])
        g = pytensor.grad(X.sum(), A)

    Inner graphs of Scans are processed too (nested loops).
    """
    single = isinstance(outputs, Variable)
    outs = [outputs] if single else list(outputs)
    fg = FunctionGraph(outputs=outs, clone=True, copy_inputs=False)
    _fuse_fgraph(fg)
    return fg.outputs[0] if single else list(fg.outputs)


@dataclass
class ScanReport:
    scan: str
    replaced_by: str | None
    pattern: str | None
    reasons: list = field(default_factory=list)  # (pattern, reason) for kept Scans, closest first
    nested_in: str | None = None

    def __str__(self):
        where = f" (inside {self.nested_in})" if self.nested_in else ""
        if self.replaced_by:
            return f"{self.scan}{where}: replaced by {self.replaced_by} (pattern {self.pattern})"
        lines = [f"{self.scan}{where}: kept as a Scan"]
        lines += [f"    {name}: {why}" for name, why in self.reasons]
        return "\n".join(lines)


@dataclass
class Explanation:
    """What :func:`explain` found: one :class:`ScanReport` per Scan."""

    scans: list

    @property
    def replaced(self):
        return [s for s in self.scans if s.replaced_by]

    @property
    def kept(self):
        return [s for s in self.scans if not s.replaced_by]

    def __str__(self):
        if not self.scans:
            return "no Scan in the graph"
        return "\n".join(str(s) for s in self.scans)

    __repr__ = __str__


def _scan_name(node):
    name = getattr(node.op, "name", None)
    return f"Scan{{{name}}}" if name else "Scan"


def _explain_fgraph(fg, reports, nested_in=None, near=1.0):
    for node in list(fg.toposort()):
        if node not in fg.apply_nodes or not isinstance(node.op, Scan):
            continue
        match, rejections = match_scan(fg, node, PATTERNS.values())
        name = _scan_name(node)
        if match is not None:
            reports.append(ScanReport(name, match.pattern.replaces_with, match.pattern.name, nested_in=nested_in))
            fg.replace_all(list(replacements_for(match).items()), reason="iterops_explain", import_missing=True)
            continue
        close = [(p, str(err)) for p, err in rejections if err.score >= near] or [(p, str(err)) for p, err in rejections[:1]]
        reports.append(ScanReport(name, None, None, close, nested_in=nested_in))
        args = ScanArgs.from_node(node, clone=True)
        inner = FunctionGraph(_inner_inputs(args), _inner_outputs(args), clone=False)
        _explain_fgraph(inner, reports, nested_in=name, near=near)


def explain(outputs) -> Explanation:
    """List the Scans in the graph of ``outputs``: which are replaced by which fused Op,
    and for those kept, why (for every pattern the loop came close to, the
    first difference from the reference step or the outer condition that
    failed).  ``print(iterops.explain(out))`` for a readable report.

    The same messages are printed while compiling when PyTensor's
    ``config.optimizer_verbose`` is on.
    """
    outs = [outputs] if isinstance(outputs, Variable) else list(outputs)
    fg = FunctionGraph(outputs=outs, clone=True, copy_inputs=False)
    reports: list = []
    _explain_fgraph(fg, reports)
    return Explanation(reports)
