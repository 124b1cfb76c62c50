"""Hessian of a pymc-extras structural model's log-density: iterops' fused filter vs its Scan.

The model: pymc-extras' local linear trend + seasonal (period 4) + measurement error on ``n = 100``
observations (:func:`_model`).  ``model.compile_d2logp()`` (what ``find_MAP(compute_hessian=True)`` and
``fit_laplace`` build on) in the default (NUMBA) mode, side by side in one process:

* fused: on ``import iterops`` the filter Scan becomes ``kalman_filter``; its gradient is the fused
  adjoint Op, whose own pullback (second derivatives) is a Scan of the same recursion
  (:mod:`iterops.ts._kalman_second`);
* Scan: the same model with iterops' rewrites off (``iterops.fusion.disabled()`` and
  ``mode.excluding("iterops")``): PyTensor differentiates pymc-extras' Scan twice.

Compile: graph building, rewriting, Numba code generation and the first call, warm on-disk caches for
iterops' kernels, a graph PyTensor has not compiled in this process.  Call: best of 5 rounds.

Regenerate: ``scripts/dev bench --update hessian``.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import numpy as np
from pytensor.compile.mode import get_mode

import iterops
from iterops import demo
from benchmarks._harness import Section, best_time, ms


def _model(n):
    rng = np.random.default_rng(5)
    y = (10.0 + np.cumsum(rng.normal(size=n)) + 2.0 * np.sin(np.arange(n) * np.pi / 2) + 0.7 * rng.normal(size=n))
    return demo.pymc_extras_structural_model(y[:, None], 4)


def _compile(n, impl):
    """(compile seconds, the compiled d2logp, the point it is called at, the Hessian there)."""
    model = _model(n)
    point = {k: v + 0.1 for k, v in model.initial_point().items()}
    mode = get_mode("NUMBA") if impl == "fused" else get_mode("NUMBA").excluding("iterops")
    t0 = time.perf_counter()
    with contextlib.nullcontext() if impl == "fused" else iterops.fusion.disabled():
        f = model.compile_d2logp(mode=mode)
    H = f(point)
    seconds = time.perf_counter() - t0
    fgraph = f.f.maker.fgraph
    # the fused model's filter is the Op (its Hessian's Scans are the adjoint's pullback); the Scan model's
    # d2logp differentiates pymc-extras' filter Scan
    has_filter_op = any("KalmanFilter" in str(getattr(nd.op, "core_op", nd.op)) for nd in fgraph.apply_nodes)
    if has_filter_op != (impl == "fused"):
        raise RuntimeError(f"{impl}: expected {'the' if impl == 'fused' else 'no'} fused filter Op in d2logp")
    return seconds, f, point, H


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    n = 30 if quick else 100
    section = Section(
        title="Hessian: pymc-extras structural model's d2logp, fused vs Scan (NUMBA)",
        columns=["model", "n", "implementation", "d2logp compile + first call (s)", "d2logp call (ms)",
                 "call ratio", "compile ratio"],
        notes="\n".join([
            "- Model: pymc-extras local linear trend + seasonal (period 4, with innovations) + measurement error "
            f"(5 states, 9 parameters), n = {n}, `model.compile_d2logp()` in the default (NUMBA) mode.",
            "- Fused: the filter is `kalman_filter` (the rewrite on `import iterops`); second derivatives are the "
            "adjoint Op's pullback, a Scan of the same recursion (`iterops/ts/_kalman_second.py`): exact, not fused.",
            "- Scan: the same model with iterops' rewrites off; PyTensor differentiates pymc-extras' filter Scan twice.",
            "- Both are a Jacobian Scan (one row per parameter) around Hessian-vector products.",
            "- Ratios: Scan time over fused time; the Hessians agree (max abs difference in the row below).",
        ]),
    )
    res = {impl: _compile(n, impl) for impl in ("fused", "scan")}
    call = {impl: best_time(res[impl][1], res[impl][2], repeat=5) for impl in res}
    diff = float(np.max(np.abs(res["fused"][3] - res["scan"][3])))
    scale = float(np.max(np.abs(res["scan"][3])))
    for impl in ("fused", "scan"):
        section.rows.append(["LLT + seasonal(4) + ME", n, impl, res[impl][0], ms(call[impl]),
                             call["scan"] / call["fused"] if impl == "fused" else 1.0,
                             res["scan"][0] / res["fused"][0] if impl == "fused" else 1.0])
    section.notes += f"\n- Max abs difference of the two Hessians: {diff:.2g} (largest entry {scale:.3g})."
    return [section]
