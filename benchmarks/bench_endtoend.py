"""The fit as a user runs it: a new process that imports, builds a model and calls ``pm.sample()``.

    scripts/dev bench endtoend                   # prints the section
    scripts/dev bench --update endtoend          # ... and replaces it in RESULTS.md
    scripts/dev bench --update endtoend --quick  # the structural model under nutpie only

Each cell is one new Python process (what a user's script or a notebook kernel restart pays): imports (PyMC,
pymc-extras, the sampler's library), the model, then ``pm.sample(draws, tune, chains=2)`` with ``nuts_sampler``
nutpie (``pm.sample()``'s default when installed) or numpyro. "iterops": the model as written, iterops imported
(the demo's iterops models; pymc-extras' structural model, whose filter Scan the rewrite replaces). "scan": the same
model's Scan, iterops' rewrites off (:func:`iterops.fusion.disabled`); the demo's Scan models are built by
:mod:`iterops.examples`, so that process imports iterops too, and its import time, measured in that process, is
taken off its total (a user of the Scan model does not import iterops).

Caches warm: before the measured runs every (model, implementation) pair is fitted once under nutpie in its own
process, which fills Numba's and PyTensor's on-disk caches (iterops' kernels, the graph functions). JAX keeps no
compiled code on disk by default, so the numpyro route compiles in every process.
"""

from __future__ import annotations

import os
import textwrap

from benchmarks._harness import Section, Target, child_result


_CODE = """
import time, warnings
w0 = time.perf_counter()
warnings.simplefilter("ignore")
import json, contextlib
import numpy as np, pymc as pm, pymc_extras
w1 = time.perf_counter()
import iterops
iterops_import = time.perf_counter() - w1
{build}
fit0 = time.perf_counter()
with model, iterops.fusion.disabled() if {impl!r} == "scan" else contextlib.nullcontext():
    idata = pm.sample(draws={draws}, tune={tune}, chains=2, cores=2, nuts_sampler={sampler!r}, random_seed=1,
                      progressbar=False, compute_convergence_checks=False)
end = time.perf_counter()
import arviz as az
post = idata.posterior
ess = az.ess(post, method="bulk")
print("RESULT " + json.dumps({{
    "total": end - w0 - (iterops_import if {impl!r} == "scan" else 0.0), "iterops_import": iterops_import,
    "fit": end - fit0, "sampling": float(post.attrs.get("sampling_time", float("nan"))),
    "min_ess": float(min(np.min(ess[v].values) for v in ess.data_vars)),
}}))
"""

_DEMO = """
from iterops import examples
spec = examples.MODELS[{name!r}]
_, y = spec.load()
model = spec.build(y, {impl!r})
"""

_STRUCTURAL = """
from benchmarks.bench_fusion import _structural_model
model = _structural_model(240)
"""

#: model -> code that builds ``model`` (``impl``: "iterops" or "scan")
MODELS = {
    "pymc-extras structural (13 states, n = 240)": lambda impl: _STRUCTURAL,
    "demo nile (local level)": lambda impl: _DEMO.format(name="nile", impl=impl),
    "demo inflation (AR(2) + noise, stationary start)": lambda impl: _DEMO.format(name="inflation", impl=impl),
}


def _fit(model: str, impl: str, sampler: str, draws: int, tune: int) -> dict:
    code = _CODE.format(build=textwrap.dedent(MODELS[model](impl)), impl=impl, sampler=sampler, draws=draws,
                        tune=tune)
    return child_result(code, what=f"end-to-end fit ({model}, {impl}, {sampler})")


def run(quick: bool = False) -> list[Section]:
    draws = tune = 1000
    models = list(MODELS)[:1] if quick else list(MODELS)
    samplers = ("nutpie",) if quick else ("nutpie", "numpyro")
    load = os.getloadavg()[0]
    section = Section(
        title="The fit end to end: a new process, imports + model + pm.sample(), with vs without iterops",
        columns=["model", "sampler", "implementation", "whole fit (s)", "pm.sample (s)", "of which sampling (s)",
                 "min bulk ESS", "whole fit: scan / iterops"],
        notes=(f"{__doc__.split(chr(10) + chr(10), 2)[2].strip()}\n\n- 2 chains x ({tune} tune + {draws} draws). "
               f"1-minute load average at the start: {load:.1f} on {os.cpu_count()} cores."),
    )
    for model in models:
        for impl in ("iterops", "scan"):  # fill the on-disk caches (not measured)
            _fit(model, impl, "nutpie", 50, 50)
        for sampler in samplers:
            res = {impl: _fit(model, impl, sampler, draws, tune) for impl in ("iterops", "scan")}
            ratio = res["scan"]["total"] / res["iterops"]["total"]
            for impl, r in res.items():
                section.rows.append([model, sampler, impl, r["total"], r["fit"], r["sampling"], r["min_ess"],
                                     ratio if impl == "iterops" else 1.0])
            if model.startswith("pymc-extras structural"):
                section.targets.append(Target(f"structural, whole fit under {sampler}: scan / iterops", ratio,
                                              4.0 if sampler == "nutpie" else 2.5))
    return [section]
