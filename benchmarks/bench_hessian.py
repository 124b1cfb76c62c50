"""Hessian of a pymc-extras structural model's log-density: iterops' fused filter vs its Scan.

The model: issue 30's pymc-extras structural model (level + trend + 12-month seasonal + measurement
error, 13 states, 240 monthly observations with 4 missing; :func:`benchmarks.bench_fusion._structural_model`).
The functions are built the way pymc-extras' ``find_MAP`` builds them for ``method="trust-ncg"``
(``scipy_optimize_funcs_from_loss`` on ``-model.logp(jacobian=False)``): loss + gradient, and a
Hessian-vector product (PyTensor's reverse over reverse).  The Hessian is what
``find_MAP(compute_hessian=True)`` and ``fit_laplace`` then compute: one Hessian-vector product per
parameter, stacked.  Side by side in one process, default (NUMBA) mode:

* fused: on ``import iterops`` the filter Scan becomes ``kalman_filter``; its gradient is the fused
  adjoint Op, whose own pullback (the second-order part of a Hessian-vector product) is one fused kernel,
  forward mode over the adjoint (:mod:`iterops.ts._kalman_second`, :mod:`iterops.ts._kalman_hvp`);
* Scan: the same model with iterops' rewrites off (``iterops.fusion.disabled()`` and
  ``mode.excluding("iterops")``): PyTensor differentiates pymc-extras' Scan twice.

Compile: graph building, rewriting, Numba code generation and the first calls of both functions (the
Hessian's), with warm on-disk caches (each side is built once, untimed, first: what a second run
costs).  Calls: best of 5 rounds.  ``model.compile_d2logp()`` (a Scan over the Hessian's rows around
the same products) is not timed: under NUMBA its compile of the Scan model did not finish in 108 CPU
minutes (2026-12-04), which is why pymc-extras' ``hessp`` route is measured.

A second section (:func:`run_laplace`, left out by ``--quick``): pymc-extras' ``fit_laplace`` on the same model
as a user runs it, each side in a new process (imports, model, optimization, Hessian, draws).

Regenerate: ``scripts/dev bench --update hessian``.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import numpy as np
from pymc.blocking import DictToArrayBijection
from pytensor.compile.mode import get_mode

import iterops
from benchmarks._harness import Section, Target, best_time, ms, child_result
from benchmarks.bench_fusion import _structural_model


#: a new process (``argv[1]``: fused or scan): imports, the structural model, then pymc-extras' ``fit_laplace`` as a
#: user calls it (trust-ncg; the Laplace covariance from one Hessian-vector product per parameter at the MAP);
#: ``vectorize_draws=False``: pymc-extras' vectorized draws leave its state space models' constant ``P0``
#: Deterministic without draw dimensions, and arviz raises on its dims, with or without iterops
_LAPLACE = """
import json, sys, time, warnings
t0 = time.perf_counter()
warnings.simplefilter("ignore")
import contextlib
import iterops
from pytensor.compile.mode import get_mode
from pymc_extras.inference import fit_laplace
from benchmarks.bench_fusion import _structural_model
fused = sys.argv[1] == "fused"
mode = get_mode("NUMBA") if fused else get_mode("NUMBA").excluding("iterops")
t1 = time.perf_counter()
with contextlib.nullcontext() if fused else iterops.fusion.disabled():
    model = _structural_model(240)
    idata = fit_laplace(model=model, optimize_method="trust-ncg", draws=1000, vectorize_draws=False,
                        progressbar=False, random_seed=1, compile_kwargs={"mode": mode})
t2 = time.perf_counter()
print("RESULT " + json.dumps({"imports": t1 - t0, "fit": t2 - t1, "mean": idata.fit["mean_vector"].values.tolist(),
                              "cov": idata.fit["covariance_matrix"].values.tolist()}))
"""


def _laplace_run(impl: str) -> dict:
    """One new process of :data:`_LAPLACE`; wall seconds of its imports and of the model + ``fit_laplace``."""
    t = time.perf_counter()
    out = child_result(_LAPLACE, impl, what="fit_laplace benchmark subprocess")
    out["process"] = time.perf_counter() - t
    return out


def run_laplace() -> Section:
    """``fit_laplace`` on the structural model end to end in a new process, fused vs Scan, caches warm."""
    load = os.getloadavg()[0]
    section = Section(
        title="fit_laplace end to end: pymc-extras structural model, a new process, fused vs Scan (NUMBA)",
        columns=["implementation", "whole process (s)", "imports (s)", "model + fit_laplace (s)", "ratio (whole)"],
    )
    for impl in ("fused", "scan"):  # warm on-disk caches (what a user's second run finds)
        _laplace_run(impl)
    res = {impl: _laplace_run(impl) for impl in ("fused", "scan")}
    for impl, r in res.items():
        section.rows.append([impl, r["process"], r["imports"], r["fit"], res["scan"]["process"] / r["process"]])
    f, s = (np.asarray(res[i]["mean"]) for i in ("fused", "scan"))
    cf, cs = (np.asarray(res[i]["cov"]) for i in ("fused", "scan"))
    section.targets.append(Target("fit_laplace, fused: 120 s / whole process (s)", 120.0 / res["fused"]["process"],
                                  1.0))
    section.notes = "\n".join([
        "- `fit_laplace(model, optimize_method='trust-ncg', draws=1000, vectorize_draws=False)` as a user calls it, "
        "in a new Python process: imports (PyMC, pymc-extras, iterops), the model (13 states, n = 240, 4 missing), "
        "the MAP by trust-ncg from the initial point, the covariance from one Hessian-vector product per parameter, "
        "1000 draws. Numba's and PyTensor's caches warm (each side run once before, untimed). Scan: iterops' "
        "rewrites off (`iterops.fusion.disabled()`, `mode.excluding('iterops')`).",
        f"- The two fits agree: MAP max abs difference {float(np.max(np.abs(f - s))):.2g}, covariance max abs "
        f"difference {float(np.max(np.abs(cf - cs))):.2g} (largest entry {float(np.max(np.abs(cs))):.3g}).",
        f"- 1-minute load average at the start: {load:.1f} on {os.cpu_count()} cores.",
    ])
    return section


def _has_filter_op(fn):
    nodes = fn.maker.fgraph.apply_nodes
    return any("KalmanFilter" in str(getattr(nd.op, "core_op", nd.op)) for nd in nodes)


def _build(n, impl, timed=True):
    """Compile pymc-extras' trust-ncg functions for ``impl``; returns timings and the Hessian."""
    from pymc_extras.inference.laplace_approx.scipy_interface import scipy_optimize_funcs_from_loss  # noqa: PLC0415

    model = _structural_model(n)
    ip = model.initial_point()
    x0 = DictToArrayBijection.map({k: v + 0.1 for k, v in ip.items()}).data
    mode = get_mode("NUMBA") if impl == "fused" else get_mode("NUMBA").excluding("iterops")
    t0 = time.perf_counter()
    with contextlib.nullcontext() if impl == "fused" else iterops.fusion.disabled():
        f_fused, f_hessp = scipy_optimize_funcs_from_loss(
            loss=-model.logp(jacobian=False), inputs=model.continuous_value_vars, initial_point_dict=ip,
            use_grad=True, use_hess=False, use_hessp=True, compile_kwargs={"mode": mode})
    f_fused(x0)
    basis = np.eye(x0.size)
    H = np.stack([f_hessp(x0, basis[:, i]) for i in range(x0.size)], axis=-1)
    seconds = time.perf_counter() - t0
    # the fused model's filter is the Op, the Scan model's is pymc-extras' Scan (both are pytensor Functions)
    for fn in (f_fused, f_hessp):
        if _has_filter_op(fn) != (impl == "fused"):
            raise RuntimeError(f"{impl}: expected {'the' if impl == 'fused' else 'no'} fused filter Op")
    if not timed:
        return None
    return {
        "compile": seconds,
        "grad": best_time(f_fused, x0, repeat=5),
        "hvp": best_time(f_hessp, x0, basis[:, 0], repeat=5),
        "hess": best_time(lambda: [f_hessp(x0, basis[:, i]) for i in range(x0.size)], repeat=5),
        "H": H,
        "k": x0.size,
    }


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    n = 60 if quick else 240
    section = Section(
        title="Hessian: pymc-extras structural model, fused vs Scan (pymc-extras' trust-ncg functions, NUMBA)",
        columns=["implementation", "loss + grad (ms)", "HVP (ms)", "HVP in loss + grads",
                 "Hessian: k HVPs (ms)", "compile + first calls (s)", "Hessian ratio", "compile ratio"],
    )
    for impl in ("fused", "scan"):  # warm on-disk caches for both (their compile is what a second run costs)
        _build(n, impl, timed=False)
    res = {impl: _build(n, impl) for impl in ("fused", "scan")}
    f, s = res["fused"], res["scan"]
    for impl, r in res.items():
        section.rows.append([impl, ms(r["grad"]), ms(r["hvp"]), r["hvp"] / r["grad"], ms(r["hess"]), r["compile"],
                             s["hess"] / r["hess"], s["compile"] / r["compile"]])
    diff = float(np.max(np.abs(f["H"] - s["H"])))
    scale = float(np.max(np.abs(s["H"])))
    section.targets.append(Target("HVP, fused vs Scan", s["hvp"] / f["hvp"], 10.0))
    section.targets.append(Target("Hessian (k HVPs), fused vs Scan", s["hess"] / f["hess"], 10.0))
    section.notes = "\n".join([
        f"- Model: level + trend + seasonal(12) + measurement error, 13 states, k = {f['k']} parameters, n = {n}, "
        "4 missing; `scipy_optimize_funcs_from_loss` (what `find_MAP(method='trust-ncg')` compiles); the Hessian "
        "stacks one HVP per parameter, as `find_MAP(compute_hessian=True)` does.",
        "- Fused: the filter is `kalman_filter` (the rewrite on `import iterops`) and its gradient the fused "
        "adjoint; an HVP adds one `KalmanFilterHVP` call (`iterops/ts/_kalman_hvp.py`): the filter and its adjoint "
        "run once more on `x + i h w` in complex arithmetic (forward mode over the hand-written reverse mode, exact "
        "to rounding), no Scan. Before it (2026-12-04) the pullback was PyTensor's reverse mode twice through a Scan "
        "of the recursion and the fused HVP cost what the Scan model's did (13.3 ms each, 1.05x for the Hessian).",
        "- Where the fused HVP's time goes (n = 240): the `hessp` graph runs the filter (its log-likelihoods feed "
        "PyMC's `-inf` guard, whose mask is the cotangent) and the second-derivative kernel, about 1.6 ms, a third "
        "forward and the rest reverse (it reads a tape of each step's update). The adjoint Op that the "
        "transforms' second-order term reads is gone since 2026-12-08 (`gradient_from_hvp`: the HVP kernel's "
        "real part is that gradient; HVP 2.16 -> 1.85 ms, Hessian 36.8 -> 31.3 ms, same process and load), and "
        "its products skip the zeros of T and Z (1.85 -> 1.70 ms, 31.3 -> 29.2 ms). "
        "Complex arithmetic costs about four real multiply-adds per product and vectorises poorly: the 10x "
        "targets need a real-arithmetic tangent kernel (several directions per pass for a Hessian), not built.",
        "- Scan: the same model with iterops' rewrites off; PyTensor differentiates pymc-extras' filter Scan twice.",
        f"- The two Hessians agree: max abs difference {diff:.2g} (largest entry {scale:.3g}).",
        "- `model.compile_d2logp()` (a Scan over the rows around the same products), fused, kernels cached: "
        "about 40 s on a new PyTensor cache and 6.3 s on a warm one, with imports 53 s and 20 s in a new process "
        "(2026-12-07, load 1-2); before the fused kernel it compiled for about 16 minutes. The Scan model's did not "
        "finish in 108 CPU minutes (2026-12-04).",
    ])
    return [section] if quick else [section, run_laplace()]
