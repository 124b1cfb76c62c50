"""PyMC models on iterops vs the same models on ``pytensor.scan`` (the demo's models).

For each demo model (:mod:`iterops.demo`: local level on the Nile data; AR(2)
plus noise with a stationary start on US inflation):

* compile time of the model's log-density and gradient (graph building,
  rewriting, Numba code generation and the first call), with the Scan model
  compiled under ``excluding("iterops")`` so it stays a Scan;
* NUTS sampling wall time and bulk ESS per second (minimum over the
  parameters, ``arviz.ess``), both implementations sampled in the same process
  with the same sampler, for both samplers (nutpie, ``pm.sample``'s default, and
  PyMC's NUTS).
"""

from __future__ import annotations

import pytensor
from pytensor.compile.mode import get_mode

from benchmarks._harness import Section, Target, compile_time
from iterops import demo


def _compile_logp_dlogp(model, mode):
    def build():
        logp = model.logp()
        grads = pytensor.grad(logp, model.value_vars)
        fn = pytensor.function(model.value_vars, [logp, *grads], mode=mode)
        point = model.initial_point()
        fn(*(point[v.name] for v in model.value_vars))
        return fn

    return compile_time(build)[0]


def run(quick: bool) -> list[Section]:
    draws, tune, chains = (200, 200, 2) if quick else (500, 500, 2)
    modes = {"iterops": get_mode("NUMBA"), "scan": get_mode("NUMBA").excluding("iterops")}
    section = Section(
        title="PyMC: demo models with iterops vs pytensor.scan",
        columns=["model", "sampler", "implementation", "logp+dlogp compile (s)", "sampling (s)", "min bulk ESS",
                 "ESS/s", "ESS/s ratio", "compile ratio"],
        notes=(f"{chains} chains x ({tune} tune + {draws} draws), chains in parallel, both NUTS samplers: nutpie "
               "(`pm.sample()`'s default when installed) and PyMC's Python NUTS. Scan models: the textbook "
               "`pytensor.scan` Kalman filter (`iterops.reference_loops.kalman_textbook_loop`, via "
               "`iterops.demo.scan_loglik`) and PyTensor's `solve_discrete_lyapunov`, compiled and sampled with "
               "iterops' rewrites off. Compile: logp + dlogp in one process with warm kernel caches (cold "
               "compiles: the compile-time section). Sampling: the sampler's own wall time. "
               "Ratios: iterops ESS/s over Scan ESS/s; Scan compile time over iterops'."),
    )
    for name, spec in demo.MODELS.items():
        _, y = spec.load()
        compile_s = {impl: _compile_logp_dlogp(spec.build(y, impl), modes[impl]) for impl in ("iterops", "scan")}
        for sampler in ("nutpie", "pymc"):
            res = {}
            for impl in ("iterops", "scan"):
                _, _, s_s, ess = demo.fit(spec.build(y, impl), sampler=sampler, draws=draws, tune=tune,
                                          chains=chains, cores=chains, seed=1, progressbar=False, params=spec.params,
                                          fusion=impl == "iterops")
                res[impl] = (compile_s[impl], s_s, ess, ess / s_s)
            ess_ratio = res["iterops"][3] / res["scan"][3]
            compile_ratio = res["scan"][0] / res["iterops"][0]
            for impl in ("iterops", "scan"):
                c_s, s_s, ess, eps = res[impl]
                section.rows.append([name, sampler, impl, c_s, s_s, ess, eps,
                                     ess_ratio if impl == "iterops" else 1.0,
                                     compile_ratio if impl == "iterops" else 1.0])
            section.targets.append(Target(f"{name} ({sampler}): bulk ESS/s, iterops / scan", float(ess_ratio), 10.0))
        section.targets.append(Target(f"{name}: logp+dlogp compile time, scan / iterops", float(compile_ratio), 5.0))
    return [section]
