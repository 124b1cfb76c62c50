"""Fit two real state-space models in PyMC with iterops, and with Scans, and compare.

    scripts/dev demo                       # defaults: a few minutes on 2 cores
    scripts/dev demo --draws 1000 --tune 1000 --chains 4 --cores 4
    scripts/dev demo --sampler pymc --output my_folder   # PyMC's Python NUTS instead of nutpie

The models and their data are in :mod:`iterops.examples` (import them from there): the local-level
model of the Nile river flow (``nile``) and a stationary AR(2) plus noise of US CPI inflation
(``inflation``), data shipped with statsmodels (no downloads).

Each model is written twice: with ``iterops.ts.kalman_filter`` (one fused
Numba Op and its hand-written adjoint) and the way PyMC users write it today:
a ``pytensor.scan`` Kalman filter (the textbook loop of
:func:`iterops.reference_loops.kalman_textbook_loop`, see :func:`iterops.examples.scan_loglik`)
with PyTensor's own ``solve_discrete_lyapunov``, sampled with iterops' Scan
rewrites off (:func:`iterops.fusion.disabled`), so it stays the Scan users have
without iterops.  Both are sampled in the same run with the same NUTS sampler:
``pm.sample``'s default (nutpie when it is installed, else PyMC's NUTS), or
``--sampler pymc`` / ``--sampler nutpie``, or ``--sampler both`` (side by side).  The summary table reports compile
time (everything ``pm.sample`` does before the first draw; the first run on a
machine includes compiling iterops' Numba kernels, said in the table), sampling
wall time and bulk effective sample size per second (``arviz.ess``, minimum
over the parameters).  Figures go to ``--output`` (default ``demo_output/``):
posteriors (both implementations overlaid: they agree), filtered and smoothed
states with 95% bands over the data, and the timing bar chart.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt

import iterops
from iterops.examples import KERNELS, MODELS, ExampleModel, ar2_noise_system, local_level_system

__all__ = ["state_bands", "fit", "summary_table", "plot_posteriors", "plot_states", "plot_timing", "main"]


# ---------------------------------------------------------------------------
# States at posterior draws (one compiled filter + smoother, called per draw)
# ---------------------------------------------------------------------------


def _state_function(spec: ExampleModel, y):
    """Compiled ``f(*params) -> (filtered_state, filtered_cov, smoothed_state, smoothed_cov, d)``.

    Compiled with PyTensor's Python linker (``FAST_COMPILE``): it runs a few hundred times, once per
    posterior draw, so its compile is what counts, and the Python linker compiles fastest; iterops' filter
    and smoother run their Numba kernels under every linker."""
    Y = y[:, None]
    if spec.name == "nile":
        inputs = [pt.dscalar("sigma_obs"), pt.dscalar("sigma_level")]
        a0, P0, system = local_level_system(*inputs, y[0])
    else:
        inputs = [pt.dscalar("mean"), pt.dvector("pacf"), pt.dscalar("sigma_state"), pt.dscalar("sigma_obs")]
        _, (a0, P0, system) = ar2_noise_system(*inputs)
    filt = iterops.ts.kalman_filter(Y, a0, P0, **system)
    smooth = iterops.ts.kalman_smoother(Y, a0, P0, **system)
    outs = [filt.filtered_state, filt.filtered_cov, smooth.smoothed_state, smooth.smoothed_cov, system["d"]]
    return pytensor.function(inputs, outs, mode="FAST_COMPILE")


def state_bands(spec: ExampleModel, idata, y, n_draws=200, seed=0):
    """Filtered and smoothed signal ``d + Z alpha_t``: mean and sd over posterior draws.

    One compiled filter + smoother, called at ``n_draws`` posterior draws; the
    draws are mixed (mean of means; variance = mean of variances + variance of
    means).  Returns ``{"filtered": (mean, sd), "smoothed": (mean, sd)}``, each (n,).
    """
    post = idata.posterior.to_dataset().stack(sample=("chain", "draw"))
    rng = np.random.default_rng(seed)
    idx = rng.choice(post.sizes["sample"], size=min(n_draws, post.sizes["sample"]), replace=False)
    draws = {p: np.moveaxis(post[p].values, -1, 0)[idx] for p in spec.params}
    fn = _state_function(spec, y)
    mus = {"filtered": [], "smoothed": []}
    vars_ = {"filtered": [], "smoothed": []}
    for k in range(len(idx)):
        a_f, P_f, a_s, P_s, d = fn(*(draws[p][k] for p in spec.params))
        for kind, a, P in (("filtered", a_f, P_f), ("smoothed", a_s, P_s)):
            mus[kind].append(a[:, 0] + d[0])
            vars_[kind].append(P[:, 0, 0])
    out = {}
    for kind in mus:
        mu, var = np.array(mus[kind]), np.array(vars_[kind])
        out[kind] = (mu.mean(0), np.sqrt(var.mean(0) + mu.var(0)))
    return out


# ---------------------------------------------------------------------------
# Sampling and timing
# ---------------------------------------------------------------------------


def default_sampler() -> str:
    """The NUTS implementation ``pm.sample()`` picks for these models: nutpie when installed."""
    return "nutpie" if importlib.util.find_spec("nutpie") is not None else "pymc"


def uncached_kernels() -> set[str]:
    """iterops' float64 kernels that are not in the on-disk cache yet (the first graph using one compiles it), but
    those compiled on demand (second derivatives, which the demo does not take)."""
    from iterops._fused import OPAQUE_KERNELS

    return {k.name for k in OPAQUE_KERNELS if k.float64_only and not k.on_demand and not k.is_cached()}


@dataclass
class Run:
    model: str
    impl: str
    sampler: str
    compile_s: float
    sample_s: float
    ess_bulk_min: float
    idata: object = None
    note: str = ""

    @property
    def ess_per_s(self) -> float:
        return self.ess_bulk_min / self.sample_s if self.sample_s > 0 else float("nan")


def fit(model, *, sampler=None, draws, tune, chains, cores, seed, progressbar=True, params=None, fusion=True):
    """``pm.sample`` with timing: returns ``(idata, compile_s, sample_s, min bulk ESS)``.

    ``sampler=None`` is ``pm.sample``'s default (nutpie when installed); the one used is
    ``idata.posterior.attrs["inference_library"]``.  ``fusion=False`` samples with iterops' Scan
    rewrites off (the Scan baseline).  ``sample_s`` is the sampler's own ``sampling_time``;
    ``compile_s`` is the rest of ``pm.sample``'s wall time (compiling logp and gradient, initial point).
    """
    import contextlib

    import arviz as az
    import pymc as pm

    kwargs = {} if sampler is None else {"nuts_sampler": sampler}
    t0 = time.perf_counter()
    with model, warnings.catch_warnings(), (contextlib.nullcontext() if fusion else iterops.fusion.disabled()):
        warnings.simplefilter("ignore")
        idata = pm.sample(draws=draws, tune=tune, chains=chains, cores=cores, random_seed=seed,
                          progressbar=progressbar, compute_convergence_checks=False, **kwargs)
    total = time.perf_counter() - t0
    post = idata.posterior.to_dataset()
    sample_s = float(post.attrs.get("sampling_time", total))
    ess = az.ess(post[list(params)] if params else post, method="bulk")
    ess_min = float(min(np.min(ess[v].values) for v in ess.data_vars))
    return idata, total - sample_s, sample_s, ess_min


# ---------------------------------------------------------------------------
# Figures and table
# ---------------------------------------------------------------------------


def summary_table(runs: list[Run]) -> str:
    head = f"{'model':<10} {'impl':<8} {'sampler':<7} {'compile s':>9} {'sample s':>9} {'min ESS':>8} {'ESS/s':>8}"
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append(f"{r.model:<10} {r.impl:<8} {r.sampler:<7} {r.compile_s:9.1f} {r.sample_s:9.1f} "
                     f"{r.ess_bulk_min:8.0f} {r.ess_per_s:8.1f}" + (f"  ({r.note})" if r.note else ""))
    by = {(r.model, r.sampler, r.impl): r for r in runs}
    for name, sampler in dict.fromkeys((r.model, r.sampler) for r in runs):
        a, b = by.get((name, sampler, "iterops")), by.get((name, sampler, "scan"))
        if a and b:
            lines.append(f"{name} ({sampler}): iterops vs scan: ESS/s x{a.ess_per_s / b.ess_per_s:.1f}, "
                         f"compile time scan/iterops x{b.compile_s / max(a.compile_s, 1e-9):.2g}, "
                         f"sampling time scan/iterops x{b.sample_s / max(a.sample_s, 1e-9):.2g}")
    return "\n".join(lines)


def _param_panels(spec: ExampleModel, posterior):
    """``[(name, selection, x label)]``: one panel per scalar parameter (vectors split by index)."""
    panels = []
    for p in spec.params:
        unit = "unitless" if p in spec.unitless else spec.units
        extra = posterior[p].dims[2:]
        if extra:
            for i in range(posterior[p].shape[2]):
                panels.append((p, {extra[0]: i}, f"{p}[{i}] ({unit})"))
        else:
            panels.append((p, {}, f"{p} ({unit})"))
    return panels


def plot_posteriors(spec: ExampleModel, runs: list[Run], path: Path):
    """Marginal posteriors, one panel per scalar parameter in a grid, the runs overlaid (filled / outline)."""
    import matplotlib.pyplot as plt

    panels = _param_panels(spec, runs[0].idata.posterior.to_dataset())
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 2.5 * nrows + 0.6), layout="constrained",
                             squeeze=False)
    for ax, (p, sel, label) in zip(axes.flat, panels):
        for r, style in zip(runs, ({"histtype": "stepfilled", "alpha": 0.45, "color": "C0"},
                                   {"histtype": "step", "lw": 1.6, "color": "C1"})):
            v = r.idata.posterior.to_dataset()[p].isel(sel).values.ravel()
            ax.hist(v, bins=30, density=True, label=f"{r.impl} ({r.sampler} NUTS)", **style)
        ax.set_xlabel(label)
        ax.set_ylabel("posterior density")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(runs), frameon=False)
    fig.suptitle(f"{spec.title}: posterior")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_states(spec: ExampleModel, t, y, bands, path: Path):
    """Data with the filtered and the smoothed signal (posterior mean and 95% band)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8), layout="constrained")
    ax.plot(t, y, "k.", ms=3, label="data")
    styles = {"filtered": ("C0", "--", 0.2), "smoothed": ("C3", "-", 0.35)}
    for kind, (m, s) in bands.items():
        color, ls, alpha = styles.get(kind, ("C2", "-", 0.3))
        ax.plot(t, m, color=color, ls=ls, lw=1.3, label=f"{kind} signal (posterior mean)")
        ax.fill_between(t, m - 1.96 * s, m + 1.96 * s, color=color, alpha=alpha, lw=0, label=f"{kind} 95% band")
    ax.set_xlabel("year")
    ax.set_ylabel(f"{spec.quantity} ({spec.units})")
    ax.set_title(f"{spec.title}\nsignal given the data up to t (filtered) and given all data (smoothed)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timing(runs: list[Run], path: Path):
    """Compile time, sampling time and bulk ESS per second, one bar per (model, implementation)."""
    import matplotlib.pyplot as plt

    labels = [f"{r.model}\n{r.impl}" + (f"\n{r.sampler}" if len({x.sampler for x in runs}) > 1 else "") for r in runs]
    colors = ["C0" if r.impl == "iterops" else "C1" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), layout="constrained")
    for ax, (title, unit, vals) in zip(axes, [
            ("compile time", "seconds", [r.compile_s for r in runs]),
            ("sampling wall time", "seconds", [r.sample_s for r in runs]),
            ("bulk ESS per second (higher is better)", "effective draws per second", [r.ess_per_s for r in runs])]):
        ax.bar(labels, vals, color=colors)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_xlabel("model / implementation")
        ax.tick_params(axis="x", labelsize=8)
    samplers = " / ".join(dict.fromkeys(r.sampler for r in runs))
    fig.suptitle(f"iterops vs pytensor.scan ({samplers} NUTS, minimum bulk ESS over the parameters)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterops.demo", description=__doc__.split("\n\n")[0])
    # inflation first: its Scan baseline compiles longest, which leaves a first run's kernel compile (in
    # the background, on the other core) time to finish before any sampler runs
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["inflation", "nile"])
    parser.add_argument("--sampler", choices=["default", "pymc", "nutpie", "both"], default="default",
                        help="NUTS implementation: pm.sample's default (nutpie when installed, else PyMC's NUTS), "
                             "PyMC's Python NUTS, nutpie, or both (nutpie and PyMC's, side by side)")
    parser.add_argument("--draws", type=int, default=500)
    parser.add_argument("--tune", type=int, default=500)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--no-scan", action="store_true", help="skip the pytensor.scan comparison")
    parser.add_argument("--no-progressbar", action="store_true")
    parser.add_argument("--output", default="demo_output", help="folder for the figures and summary")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    samplers = {"default": [None], "both": ["nutpie", "pymc"]}.get(args.sampler, [args.sampler])
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    # the Scan baseline first: on a first run iterops' kernels compile meanwhile, in the background
    impls = ["iterops"] if args.no_scan else ["scan", "iterops"]
    names = ", ".join(s or default_sampler() for s in samplers)
    print(f"iterops {iterops.__version__} demo: models {args.models}, NUTS sampler {names}, "
          f"{args.chains} chains x ({args.tune} tune + {args.draws} draws); output in {out}/", flush=True)
    from iterops.warmup import start_background

    t_warm, warm_done = time.perf_counter(), []
    warm = None if args.no_scan else start_background(KERNELS)  # without Scan runs there is nothing to overlap
    if warm is not None:
        threading.Thread(target=lambda proc=warm: (proc.wait(), warm_done.append(time.perf_counter())),
                         daemon=True).start()
        print("first run on this machine: iterops compiles its Numba kernels once, in a background process "
              "while the Scan baselines compile (cached on disk; `python -m iterops.warmup` does it ahead of time)",
              flush=True)
    uncached = uncached_kernels()

    runs: list[Run] = []
    for name in args.models:
        spec = MODELS[name]
        t, y = spec.load()
        model_runs = []
        for sampler in samplers:
            for impl in impls:
                print(f"\n== {spec.title} [{impl}, {sampler or default_sampler()}] ==", flush=True)
                background = ""
                if warm is not None and impl == "iterops":  # its kernels: wait for the background compile
                    code = warm.wait()
                    took = (warm_done or [time.perf_counter()])[0] - t_warm
                    background = (f"its kernels compiled once per machine, in {took:.0f} s in a background process "
                                  "beside the Scan run" if code == 0 else
                                  f"the background kernel compile failed (exit {code}): compiled here instead")
                    warm, uncached = None, uncached_kernels()
                model = spec.build(y, impl)
                idata, c_s, s_s, ess = fit(model, sampler=sampler, draws=args.draws, tune=args.tune,
                                           chains=args.chains, cores=args.cores, seed=args.seed,
                                           progressbar=not args.no_progressbar, params=spec.params,
                                           fusion=impl == "iterops")  # the Scan baseline stays a Scan
                used = idata.posterior.attrs.get("inference_library", "pymc")
                run = Run(name, impl, used, c_s, s_s, ess, idata, background)
                if uncached and impl == "iterops":
                    now = uncached_kernels()
                    if uncached - now:
                        run.note = "; ".join(filter(None, [run.note, f"includes compiling {len(uncached - now)} "
                                                           "iterops kernel(s), once per machine"]))
                    uncached = now
                print(f"   compile {c_s:.1f} s, sampling {s_s:.1f} s, min bulk ESS {ess:.0f} "
                      f"({run.ess_per_s:.1f}/s)" + (f"; {run.note}" if run.note else ""), flush=True)
                model_runs.append(run)
        runs += model_runs
        plot_posteriors(spec, [r for r in model_runs if r.sampler == model_runs[0].sampler],
                        out / f"{name}_posterior.png")
        bands_from = next((r for r in model_runs if r.impl == "iterops"), model_runs[0])
        plot_states(spec, t, y, state_bands(spec, bands_from.idata, y), out / f"{name}_states.png")
    plot_timing(runs, out / "timing.png")
    table = summary_table(runs)
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    print(f"\nfigures: {', '.join(sorted(p.name for p in out.glob('*.png')))} in {out}/")
    return 0


def exit_now(code: int):
    """End the process after :func:`main`: run the registered exit handlers (``atexit``'s, as a normal
    exit does; iterops' stops its background compiles), flush the output, then skip the interpreter's
    teardown, which frees the compiled models' objects one by one (the OS frees the memory at once)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
