"""Every graph rewrite iterops registers with PyTensor, in one place (as ``pytensor/scan/rewriting/db.py``).

Each carries the tag ``"iterops"``: ``mode.excluding("iterops")`` turns them all off.

========================================  ===================================  ========  ==========================
name                                      database (position)                  backend   what
========================================  ===================================  ========  ==========================
``iterops_fuse_loops``                    ``optdb`` (0.04)                     all       Scan (and its gradient
                                                                                         Scans) -> fused Op
``iterops_fuse_loops``                    ``canonicalize``                     all       the same, node by node
                                                                                         (PyMC's pre-gradient pass)
``iterops_scan_mit_mot_to_sit_sot``       ``optdb`` (1.59)                     all       seed-only mit-mot tape of a
                                                                                         gradient Scan -> sit-sot
``iterops_scan_reversed_tail``            ``optdb`` (1.591)                    all       ``xs[:-(k+1):-1]`` ->
                                                                                         ``xs[-k:][::-1]``
``iterops_share_fixed_point_trace``       ``specialize``                       numba     a Lyapunov loop and its
                                                                                         gradient share one run
``iterops_builtin_lyapunov``              ``canonicalize``                     all       PyTensor's bilinear
                                                                                         ``solve_discrete_lyapunov``
                                                                                         -> the fused solver
``iterops_kalman_gradient_from_hvp``     ``optdb`` (48.9)                     all       Kalman adjoint Op + its
                                                                                         pullback on the same
                                                                                         inputs -> one HVP kernel
``iterops_kalman_unused_outputs``        ``optdb`` (49.0)                     all       Kalman Ops skip outputs
                                                                                         nobody reads (F; the
                                                                                         cotangents of T, Z)
========================================  ===================================  ========  ==========================

The rewrites themselves live beside what they rewrite (:mod:`iterops.fusion.rewrite`,
:mod:`iterops.scan_grad`, :mod:`iterops.linalg.lyapunov_iteration`, :mod:`iterops.ts.kalman`);
``import iterops`` imports this module, which registers them (idempotent).
"""

from __future__ import annotations

from pytensor.compile import optdb
from pytensor.graph.rewriting.basic import NodeRewriter, dfs_rewriter

from iterops.fusion.rewrite import FuseLoopsEverywhere, fuse_scan, is_enabled
from iterops.linalg.lyapunov import builtin_lyapunov_to_fused
from iterops.linalg.lyapunov_iteration import share_fixed_point_trace
from iterops.scan_grad import scan_mit_mot_to_sit_sot, scan_reversed_tail
from iterops.ts._kalman_second import gradient_from_hvp
from iterops.ts.kalman import kalman_unused_outputs

__all__ = ["register"]

_FUSE = ("fast_run", "fast_compile", "iterops")


class _WhenEnabled(NodeRewriter):
    """``rewriter``, obeying the process-wide switch :func:`iterops.fusion.set_enabled` (which PyMC's
    pre-gradient pass and nutpie cannot be passed a mode to turn off)."""

    def __init__(self, rewriter):
        self.rewriter = rewriter

    def tracks(self):
        return self.rewriter.tracks()

    def transform(self, fgraph, node, **kwargs):
        return self.rewriter.transform(fgraph, node, **kwargs) if is_enabled() else None

    def __str__(self):
        return str(self.rewriter)


def register() -> None:
    """Register every iterops rewrite with PyTensor's optimizer database (idempotent)."""
    if "iterops_fuse_loops" in optdb.__db__:
        return
    optdb.register("iterops_fuse_loops", FuseLoopsEverywhere(), *_FUSE, position=0.04)
    optdb["canonicalize"].register("iterops_fuse_loops", fuse_scan, *_FUSE)
    optdb["canonicalize"].register("iterops_builtin_lyapunov", _WhenEnabled(builtin_lyapunov_to_fused), *_FUSE)
    optdb.register("iterops_scan_mit_mot_to_sit_sot", dfs_rewriter(scan_mit_mot_to_sit_sot, ignore_newtrees=True),
                   "fast_run", "scan", "iterops", position=1.59)
    optdb.register("iterops_scan_reversed_tail", dfs_rewriter(scan_reversed_tail, ignore_newtrees=True),
                   "fast_run", "scan", "iterops", position=1.591)
    optdb["specialize"].register("iterops_share_fixed_point_trace", share_fixed_point_trace, "numba", "iterops")
    optdb.register("iterops_kalman_gradient_from_hvp", dfs_rewriter(gradient_from_hvp, ignore_newtrees=True),
                   "fast_run", "fast_compile", "iterops", position=48.9)
    optdb.register("iterops_kalman_unused_outputs",
                   dfs_rewriter(kalman_unused_outputs, ignore_newtrees=True),
                   "fast_run", "fast_compile", "iterops", position=49.0)


register()
