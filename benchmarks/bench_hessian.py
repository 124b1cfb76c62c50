"""Hessians of a pymc-extras structural model's log density: fused Kalman filter vs its Scan.

The model: pymc-extras' local linear trend (``LevelTrend(order=2)`` + ``MeasurementError``, five
parameters) on ``n`` observations of a random walk with noise, as :func:`iterops.demo.pymc_extras_local_linear_trend_model`
builds it.  The Hessian is ``model.d2logp()`` (PyMC's: the Jacobian of the gradient, what
``find_MAP(compute_hessian=True)`` and ``fit_laplace`` ask for), compiled in the default (NUMBA) mode:

* fused: iterops imported, the rewrite on (PyMC's pre-gradient pass replaces the filter's Scan by
  ``kalman_filter``); its second derivative is the adjoint Op's pullback (reverse mode twice through the
  filter written as a Scan: exact, not fused);
* Scan: the same model with ``iterops.fusion.disabled()`` and the ``iterops`` rewrites excluded.

Reported: compile time (graph building, rewriting, Numba code generation, first call) and time per
Hessian, side by side in one process, and ratios Scan / fused.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import numpy as np

from benchmarks._harness import Section, best_time, ms


def _model(n, seed=0):
    from iterops import demo

    y = np.random.default_rng(seed).normal(size=n).cumsum() + 0.5 * np.random.default_rng(seed + 1).normal(size=n)
    return demo.pymc_extras_local_linear_trend_model(y[:, None])


def _compile(model, impl):
    import pytensor

    import iterops

    off = impl == "scan"
    mode = pytensor.compile.mode.get_default_mode()
    with iterops.fusion.disabled() if off else contextlib.nullcontext():
        return model.compile_d2logp(mode=mode.excluding("iterops") if off else mode)


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    sizes = [10] if quick else [20]
    sec = Section(
        title="Hessian of a pymc-extras structural model's logp: fused Kalman filter vs Scan",
        columns=["n obs", "parameters", "implementation", "compile (s)", "Hessian (ms)", "max |H - H_scan|",
                 "Hessian ratio scan/fused", "compile ratio scan/fused"],
        notes=("`model.d2logp()` of `LevelTrend(order=2) + MeasurementError` (pymc-extras; "
               "`iterops.demo.pymc_extras_local_linear_trend_model`) on a random walk with noise, "
               "compiled in the default (NUMBA) mode; fused: iterops' rewrite on, the Hessian through the "
               "filter's adjoint Op, whose pullback is reverse mode twice through the filter written as a Scan "
               "(exact, not a fused Hessian kernel); Scan: `iterops.fusion.disabled()` and the `iterops` "
               "rewrites excluded. Compile: graph building, rewriting, Numba code generation and the first "
               "call, with the on-disk caches as earlier runs left them (iterops' kernels cached). Hessian: "
               "best of 3 rounds. max |H - H_scan|: the two Hessians at the same point. Ratios > 1: fused "
               "faster."),
    )
    for n in sizes:
        model = _model(n)
        point = {k: v + 0.1 for k, v in model.initial_point().items()}
        res = {}
        for impl in ("fused", "scan"):
            t0 = time.perf_counter()
            f = _compile(model, impl)
            f(point)
            c_s = time.perf_counter() - t0
            res[impl] = (c_s, best_time(f, point, min_time=0.5, repeat=3), np.asarray(f(point)))
        k = res["fused"][2].shape[0]
        err = float(np.max(np.abs(res["fused"][2] - res["scan"][2])))
        for impl in ("fused", "scan"):
            c_s, t_s, _ = res[impl]
            fused = impl == "fused"
            sec.rows.append([n, k, impl, c_s, ms(t_s), err if fused else 0.0,
                             res["scan"][1] / res["fused"][1] if fused else 1.0,
                             res["scan"][0] / res["fused"][0] if fused else 1.0])
    return [sec]
