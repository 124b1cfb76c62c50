"""Recognize iterops' loops inside user Scans and replace them with fused Ops.

Entry points: ``import iterops`` registers the rewrite (tag ``"iterops"``) in ``pytensor.function``
(NUMBA, FAST_RUN/C, FAST_COMPILE) and PyMC's pre-gradient pass; :func:`fuse_loops` applies it by hand;
:func:`explain` says what was replaced and why near misses were not.  ``mode.excluding("iterops")`` or
``with iterops.fusion.disabled(): ...`` (where the mode cannot be chosen: PyMC's ``rewrite_pregrad``,
nutpie) keep the Scans.

Patterns (:mod:`iterops.fusion.patterns`) and what replaces them:

* Smith doubling, the fixed-point Lyapunov iteration, plain or damped -> the same iteration fused
  (:mod:`iterops.linalg.lyapunov_iteration`);
* block-diagonal assembly -> ``block_diag``; Kalman filters -> ``kalman_filter``;
* the Levinson-Durbin recursion -> :mod:`iterops.ts.levinson_recursion`.

A loop differentiated with plain ``pytensor.grad`` is replaced together with its gradient Scan, by the
fused Op and the fused Op's gradient (:mod:`iterops.fusion.gradient`).

Code map: :mod:`~iterops.fusion.canonical` (canonical user and reference graphs),
:mod:`~iterops.fusion.unify` (unification against a pattern's reference step), :mod:`~iterops.fusion.uses`
(how the loop's outputs are used), :mod:`~iterops.fusion.matcher` (ties them together),
:mod:`~iterops.fusion.gradient` (gradient Scans), :mod:`~iterops.fusion.proofs` and
:mod:`~iterops.fusion.piecewise` (conditions proved from the graph), :mod:`~iterops.fusion.registry` and
:mod:`~iterops.fusion.rewrite` (registration); this module: :func:`fuse_loops`, :func:`explain`.

The exactness contract
----------------------
The rewrite runs on every graph once iterops is imported, so it promises:

1. **Same values and gradients.**  On every input where the user's loop runs without error, the
   rewritten graph returns the loop's values and gradients, with NaN and infinities where the loop
   has them.

   * Exact recursions (Kalman, Levinson, block-diagonal assembly): to rounding.
   * Lyapunov iterations: the loop's own iteration, stop rule, tolerance and step guard; a stop
     decision taken exactly at the tolerance may move by one step.
   * Gradients equal autodiff of the loop wherever the loop's gradients are finite.
   * "To rounding" is relative to the loop's conditioning: rtol 1e-6, or a few times the loop's own
     spread on ill-conditioned input (e.g. an innovation covariance with cond ~ 1e14, where the loop
     moves under perturbations of a few ulps and between its own compilations).
2. **Proofs, not hopes.**  A condition the replacement needs (a symmetric covariance, a loop index
   counting from 0, a read of the last row only) is proved from the graph
   (:mod:`iterops.fusion.proofs`, :mod:`iterops.fusion.piecewise`, the patterns' ``check``).

   * Without a proof the Scan is kept; :func:`explain` names the declaration that would let it fuse.
   * No replacement exact on only part of the input space: PyTensor's Numba ``ifelse`` evaluates both
     branches, so a run-time fallback would cost the Scan anyway.
   * Matrix facts come from ``pytensor.assumptions``.  Declared facts
     (``assume(P0, symmetric=True, positive_definite=True)``) are trusted, as PyTensor's rewrites trust them.
   * PyTensor's inferred ``symmetric`` is accepted.  Some of its rules hold to rounding only (``inv(S)``,
     ``S @ S``, Lyapunov solutions with a symmetric ``Q``); the fused filter reads the symmetric part,
     the loop the raw entries, so results differ by that asymmetry times the loop's conditioning (item 1).
     Where the Lyapunov solution is not unique, the loop's start covariance is rounding noise and is not
     held to a tolerance.
   * PyTensor's inferred ``positive_definite`` is not used: it counts ``L L^T`` as definite, and every
     Lyapunov solution of a definite ``Q``, stable ``A`` or not.  Positive semi-definiteness is iterops'
     own key (``positive_semidefinite``, rules in :mod:`iterops.fusion.proofs`); a declared
     ``positive_definite`` counts.
   * Facts are inferred on the matrix's own graph: a promise read off a use
     (``solve(S, b, assume_a="pos")``) counts only inside that matrix's construction.
3. **Raise where the loop raises.**

   * A negative ``n_steps``, or a read of the last row of a loop that ran 0 steps, raises
     ``IndexError`` in the rewritten graph too (``CheckAndRaise``).
   * A pattern whose loop would raise on some input checks that input the same way (e.g. Levinson on
     autocovariances shorter than ``order + 1``).  The message may differ.
   * Failed linear algebra is NaN in every linker, never an exception: where the loop's ``inv``,
     ``solve``, ``det`` or ``cholesky`` fails (a singular, indefinite or non-finite matrix), the
     replacement returns NaN (a log-likelihood NaN or -inf, as documented by the fused Op), in every
     linker alike.  That is what the loop returns under NUMBA (the default) and JAX.  Under the Python
     and C linkers (FAST_COMPILE, FAST_RUN) the loop's Ops call NumPy / SciPy, which raise
     ``LinAlgError`` on an exactly singular matrix: there the loop raises and the replacement returns
     NaN.  Example: a textbook Kalman filter with ``P0 = 0`` and ``H = 0`` (``F = 0`` at step 0).  The
     reverse also occurs: with ``p = 1`` and an infinite ``F`` the loop gives -inf under FAST_COMPILE
     and raises under NUMBA; the replacement returns its failure value in both.
   * Why NaN and not the Python linker's raise: the rewrite does not know the linker it compiles for,
     and NumPy's raise follows an exact zero pivot of the routine the user's Op calls (LU for ``inv`` and
     ``solve``, none for ``det``), which a fused kernel factorizing ``F`` its own way does not reproduce:
     it would raise where the loop returns values.  Samplers treat both alike (PyMC's NUTS counts a
     ``LinAlgError`` as a divergence).  Pinned by ``tests/test_fusion_contract.py`` in both linkers.
4. **Never a different computation.**  The matcher looks through spelling only: operand order of
   commutative operations, association of products and sums, ``@`` / ``dot``, transposes, widening
   casts of inputs.  A narrowing cast, ``truncate_gradient``, a different constant or stop rule, an
   intermediate state read outside the loop, or non-tensor state (random generators) keeps the Scan.
5. **Gradient Scans are identified, not guessed.**  A gradient Scan is replaced only when

   * rebuilding ``Scan.pullback`` of the forward Scan, with the cotangents read off the gradient Scan's
     inputs, gives the same Scan (equal inner graph and outer inputs);
   * all its results are used as the loop's gradients (a second derivative keeps both Scans);
   * for loops replaced through their final state, the cotangents are provably zero outside the last row.

Tests: ``tests/test_fusion_fuzz.py`` mutates every pattern's loop (operands, transposes, constants,
casts, stop rules, ``truncate_gradient``, ``go_backwards``, ``n_steps``, start values) and checks that each
mutant is kept or equals its loop on random and adversarial inputs (rtol 1e-6 widened by the loop's
rounding spread, ``_rounding_spread``).  ``tests/test_fusion_contract.py`` holds the regression cases.
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
from iterops.fusion.gradient import fuse_with_gradients
from iterops.fusion.matcher import _inner_inputs, _inner_outputs, match_scan
from iterops.fusion.registry import PATTERNS, Pattern, Role, register_pattern
from iterops.fusion.rewrite import disabled, fuse_scan, is_enabled, replacements_for, set_enabled

__all__ = ["fuse_loops", "explain", "Explanation", "PATTERNS", "Pattern", "Role", "register_pattern",
           "disabled", "set_enabled", "is_enabled"]



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
    #: for a gradient Scan (built by ``pytensor.grad``): the forward Scan it differentiates
    gradient_of: str | None = None

    def __str__(self):
        where = f" (inside {self.nested_in})" if self.nested_in else ""
        if self.gradient_of and self.replaced_by:
            return (f"{self.scan}{where}: gradient of {self.gradient_of}, replaced by the gradient of "
                    f"{self.replaced_by} (pattern {self.pattern})")
        if self.gradient_of:
            lines = [f"{self.scan}{where}: gradient of {self.gradient_of}, kept as a Scan"]
            lines += [f"    {name}: {why}" for name, why in self.reasons]
            return "\n".join(lines)
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
    kept_gradients = {}  # gradient Scan -> (forward Scan's name, reason)
    for node in list(fg.toposort()):
        if node not in fg.apply_nodes or not isinstance(node.op, Scan):
            continue
        name = _scan_name(node)
        if node in kept_gradients:
            forward, why = kept_gradients[node]
            reports.append(ScanReport(name, None, None, [("(gradient)", why)], nested_in=nested_in,
                                      gradient_of=forward))
            continue
        try:
            pair = fuse_with_gradients(fg, node)
        except Exception as err:  # noqa: BLE001  (explain never raises on a valid graph)
            pair = None
        if pair is not None and pair.replacements is not None:
            p = pair.match.pattern
            reports.append(ScanReport(name, p.replaces_with, p.name, nested_in=nested_in))
            reports.extend(ScanReport(_scan_name(g), p.replaces_with, p.name, nested_in=nested_in, gradient_of=name)
                           for g in pair.gradients)
            fg.replace_all(list(pair.replacements.items()), reason="iterops_explain", import_missing=True)
            continue
        if pair is not None:
            why = pair.reason or "kept with its forward loop"
            if pair.rejections:
                why += f" (closest pattern {pair.rejections[0][0]}: {pair.rejections[0][1]})"
            kept_gradients.update((g, (name, why)) for g in pair.gradients)
        try:
            match, rejections = match_scan(fg, node, PATTERNS.values())
        except Exception as err:  # noqa: BLE001  (explain never raises on a valid graph)
            reports.append(ScanReport(name, None, None, [("(all patterns)", f"could not be analysed: {err!r}")],
                                      nested_in=nested_in))
            continue
        if match is not None:
            reports.append(ScanReport(name, match.pattern.replaces_with, match.pattern.name, nested_in=nested_in))
            fg.replace_all(list(replacements_for(match).items()), reason="iterops_explain", import_missing=True)
            continue
        close = [(p, str(err)) for p, err in rejections if err.score >= near] or [(p, str(err)) for p, err in rejections[:1]]
        reports.append(ScanReport(name, None, None, close, nested_in=nested_in))
        try:
            args = ScanArgs.from_node(node, clone=True)
            inner = FunctionGraph(_inner_inputs(args), _inner_outputs(args), clone=False)
        except Exception:  # noqa: BLE001  (an inner graph that cannot be copied: nothing nested to report)
            continue
        _explain_fgraph(inner, reports, nested_in=name, near=near)


def explain(outputs) -> Explanation:
    """List the Scans in the graph of ``outputs``: which are replaced by which fused Op,
    and for those kept, why (for every pattern the loop came close to, the
    first difference from the reference step or the outer condition that
    failed).  ``print(iterops.explain(out))`` for a readable report.

    A gradient Scan that ``pytensor.grad`` built for a loop is reported as
    such: replaced by the fused Op's gradient together with its forward loop
    (:mod:`iterops.fusion.gradient`), or kept, with the reason.

    The same messages are printed while compiling when PyTensor's
    ``config.optimizer_verbose`` is on.
    """
    outs = [outputs] if isinstance(outputs, Variable) else list(outputs)
    fg = FunctionGraph(outputs=outs, clone=True, copy_inputs=False)
    reports: list = []
    _explain_fgraph(fg, reports)
    return Explanation(reports)
