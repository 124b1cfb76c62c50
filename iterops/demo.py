"""Fit two real state-space models in PyMC with iterops, and with Scans, and compare.

    scripts/dev demo                       # defaults: a few minutes on 2 cores
    scripts/dev demo --draws 1000 --tune 1000 --chains 4 --cores 4
    scripts/dev demo --sampler pymc --output my_folder   # PyMC's Python NUTS instead of nutpie

Two models on data that ships with statsmodels (no downloads):

``nile``
    The local-level model on the Nile river flow (annual, 1871-1970)::

        y_t = mu_t + eps_t,        eps_t ~ N(0, sigma_obs^2)
        mu_t+1 = mu_t + eta_t,     eta_t ~ N(0, sigma_level^2)

    with an approximately diffuse start ``mu_1 ~ N(y_1, 1e6)``.
``inflation``
    US quarterly CPI inflation (statsmodels' macrodata, 1959-2009) as a mean
    plus a stationary AR(2) signal plus measurement noise::

        y_t = mean + x_t + eps_t,                        eps_t ~ N(0, sigma_obs^2)
        x_t = phi_1 x_t-1 + phi_2 x_t-2 + eta_t,         eta_t ~ N(0, sigma_state^2)

    Stationarity comes from the parametrisation (partial autocorrelations
    ``pacf`` in (-1, 1): ``phi_1 = pacf_1 (1 - pacf_2)``, ``phi_2 = pacf_2``), and
    the initial state covariance is the stationary one, ``P0 = T P0 T' + R Q R'``,
    from :func:`iterops.solve_discrete_lyapunov`.  Vectors are indexed from 0, as in
    statsmodels: ``pacf[0]`` and ``phi[0]`` belong to lag 1 (``phi[0]`` is ``phi_1``).

Each model is written twice: with ``iterops.ts.kalman_filter`` (one fused
Numba Op and its hand-written adjoint) and the way PyMC users write it today:
a ``pytensor.scan`` Kalman filter (the textbook loop of
:func:`iterops.reference_loops.kalman_textbook_loop`, see :func:`scan_loglik`)
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

__all__ = [
    "load_nile",
    "load_inflation",
    "local_level_model",
    "pymc_extras_local_linear_trend_model",
    "ar2_noise_model",
    "scan_loglik",
    "MODELS",
    "main",
]

# ---------------------------------------------------------------------------
# Data (shipped with statsmodels)
# ---------------------------------------------------------------------------


def load_nile():
    """Nile flow at Aswan, 1871-1970 (10^8 m^3): ``(years, y)`` with y of shape (100,)."""
    from statsmodels.datasets import nile  # not statsmodels.api: imports the demo does not use

    df = nile.load_pandas().data
    return df["year"].to_numpy(), df["volume"].to_numpy(dtype=float)


def load_inflation():
    """US CPI inflation, quarterly 1959Q1-2009Q3 (annualized %): ``(time, y)``, y (203,)."""
    from statsmodels.datasets import macrodata

    df = macrodata.load_pandas().data
    t = df["year"].to_numpy() + (df["quarter"].to_numpy() - 1) / 4
    return t, df["infl"].to_numpy(dtype=float)


# ---------------------------------------------------------------------------
# The Scan Kalman filter users write today
# ---------------------------------------------------------------------------


def scan_loglik(y, a0, P0, *, d, T, Z, R, H, Q):
    """Log-likelihood from the ``pytensor.scan`` Kalman filter users write (time-invariant system,
    no state intercept, no missing data): :func:`iterops.reference_loops.kalman_textbook_loop` on
    ``y - d``.  Arguments as :func:`iterops.ts.kalman_filter`'s (without ``c``).

    Compile it with iterops' rewrites off (:func:`iterops.fusion.disabled` or
    ``mode.excluding("iterops")``) to keep the Scan: iterops recognises this loop and would
    replace it by :func:`iterops.ts.kalman_filter`.
    """
    from iterops.reference_loops import kalman_textbook_loop

    y, d = pt.as_tensor(y), pt.as_tensor(d)
    ll, _, _ = kalman_textbook_loop(y - d, *map(pt.as_tensor, (a0, P0, T, Z, R, H, Q)))
    return ll.sum()


def _filter(impl, y, a0, P0, system):
    if impl == "iterops":
        return iterops.ts.kalman_filter(y, a0, P0, **system).loglik
    if impl == "scan":
        return scan_loglik(y, a0, P0, **system)
    raise ValueError(f"impl must be 'iterops' or 'scan', got {impl!r}")


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def local_level_system(sigma_obs, sigma_level, y0, diffuse=1e6):
    """``(a0, P0, system)`` of the local-level model (m = p = r = 1); ``system``: the keyword
    arguments ``d, T, Z, R, H, Q`` of :func:`iterops.ts.kalman_filter` (no state intercept)."""
    def one():
        return pt.ones((1, 1))

    system = dict(d=pt.zeros(1), T=one(), Z=one(), R=one(), H=pt.reshape(sigma_obs**2, (1, 1)),
                  Q=pt.reshape(sigma_level**2, (1, 1)))
    return pt.as_tensor([float(y0)]), diffuse * one(), system


def local_level_model(y, impl="iterops"):
    """PyMC local-level model of ``y`` (n,); parameters ``sigma_obs``, ``sigma_level``."""
    import pymc as pm

    y = np.asarray(y, dtype=float)
    scale = float(np.std(np.diff(y)))
    with pm.Model(coords={"time": np.arange(len(y))}) as model:
        sigma_obs = pm.HalfNormal("sigma_obs", 2 * scale)
        sigma_level = pm.HalfNormal("sigma_level", 2 * scale)
        a0, P0, system = local_level_system(sigma_obs, sigma_level, y[0])
        pm.Potential("loglik", _filter(impl, y[:, None], a0, P0, system))
    return model


def pymc_extras_local_linear_trend_model(y, filter_type="standard", observed_state_names=None):
    """pymc-extras' structural local linear trend + measurement error model of ``y`` (n, k), as its
    users write it (``P0 = 10 I``; ``observed_state_names``: one name per column of ``y``, each series its
    own trend and diagonal measurement error).  Unchanged user code: on ``import iterops`` its Kalman
    filter Scan (``filter_type="standard"``) is replaced by :func:`iterops.ts.kalman_filter`; pymc-extras'
    other filters stay Scans (see :mod:`iterops.fusion.patterns.kalman`)."""
    import pymc as pm
    from pymc_extras.statespace import structural as st

    names = {} if observed_state_names is None else dict(observed_state_names=list(observed_state_names))
    ss = (st.LevelTrendComponent(order=2, innovations_order=[1, 1], **names)
          + st.MeasurementError(**names)).build(verbose=False, filter_type=filter_type)
    with pm.Model(coords=ss.coords) as model:
        pm.Deterministic("P0", pt.eye(ss.k_states) * 10, dims=ss.param_dims["P0"])
        pm.Normal("initial_level_trend", dims=ss.param_dims["initial_level_trend"])
        pm.HalfNormal("sigma_level_trend", dims=ss.param_dims["sigma_level_trend"])
        pm.HalfNormal("sigma_MeasurementError", dims=ss.param_dims.get("sigma_MeasurementError"))
        ss.build_statespace_graph(y)
    return model


def pymc_extras_structural_model(y, season_length=12):
    """pymc-extras' level + trend + seasonal (``season_length``, with innovations) + measurement error model of
    ``y`` (n, 1), as its users write it: ``P0 = 10 I``, ``HalfNormal(1)`` priors on the scales, ``Normal(0, 1)``
    on the rest.  On ``import iterops`` its Kalman filter Scan is replaced by :func:`iterops.ts.kalman_filter`."""
    import pymc as pm
    from pymc_extras.statespace import structural as st

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ss = (st.LevelTrendComponent(order=2, innovations_order=[1, 1])
              + st.TimeSeasonality(season_length=season_length, innovations=True, name="seasonal")
              + st.MeasurementError()).build(verbose=False)
        with pm.Model(coords=ss.coords) as model:
            pm.Deterministic("P0", pt.eye(ss.k_states) * 10, dims=ss.param_dims["P0"])
            for name in ss.param_names:
                if name != "P0":
                    dist = pm.HalfNormal if name.startswith("sigma") else pm.Normal
                    dist(name, 1.0, dims=ss.param_dims.get(name))
            ss.build_statespace_graph(y)
    return model


def ar2_noise_system(mean, pacf, sigma_state, sigma_obs, lyapunov=iterops.solve_discrete_lyapunov):
    """``(phi, (a0, P0, system))`` of the AR(2)-plus-noise model (m = 2, p = r = 1); ``system``: the
    keyword arguments ``d, T, Z, R, H, Q`` of :func:`iterops.ts.kalman_filter` (no state intercept)."""
    phi1 = pacf[0] * (1 - pacf[1])
    phi2 = pacf[1]
    T = pt.stack([pt.stack([phi1, phi2]), pt.stack([pt.constant(1.0), pt.constant(0.0)])])
    R = pt.as_tensor([[1.0], [0.0]])
    Q = pt.reshape(sigma_state**2, (1, 1))
    P0 = lyapunov(T, R @ Q @ R.T)
    system = dict(d=pt.reshape(mean, (1,)), T=T, Z=pt.as_tensor([[1.0, 0.0]]), R=R,
                  H=pt.reshape(sigma_obs**2, (1, 1)), Q=Q)
    return pt.stack([phi1, phi2]), (pt.zeros(2), P0, system)


def ar2_noise_model(y, impl="iterops"):
    """PyMC AR(2)-plus-noise model with stationary initialization (see module docstring).

    ``impl="iterops"``: ``iterops.solve_discrete_lyapunov`` + ``iterops.ts.kalman_filter``;
    ``impl="scan"``: PyTensor's ``solve_discrete_lyapunov`` + :func:`scan_loglik`.
    """
    import pymc as pm

    y = np.asarray(y, dtype=float)
    sd = float(np.std(y))
    lyapunov = iterops.solve_discrete_lyapunov if impl == "iterops" else pt.linalg.solve_discrete_lyapunov
    with pm.Model() as model:
        mean = pm.Normal("mean", float(np.mean(y)), sd)
        pacf = pm.Uniform("pacf", -1.0, 1.0, shape=2)
        sigma_state = pm.HalfNormal("sigma_state", sd)
        sigma_obs = pm.HalfNormal("sigma_obs", sd / 2)
        phi, (a0, P0, system) = ar2_noise_system(mean, pacf, sigma_state, sigma_obs, lyapunov)
        pm.Deterministic("phi", phi)
        pm.Potential("loglik", _filter(impl, y[:, None], a0, P0, system))
    return model


@dataclass
class DemoModel:
    name: str
    title: str
    load: object
    build: object
    params: tuple
    units: str  #: units of the data (matplotlib mathtext)
    quantity: str = "data"  #: what the data measure (axis label)
    unitless: tuple = ()  #: parameters without units (the others are in ``units``)


MODELS = {
    "nile": DemoModel("nile", "Nile flow: local level", load_nile, local_level_model,
                      ("sigma_obs", "sigma_level"), r"$10^8$ m$^3$", "annual flow"),
    "inflation": DemoModel("inflation", "US inflation: AR(2) + noise, stationary start", load_inflation,
                           ar2_noise_model, ("mean", "pacf", "sigma_state", "sigma_obs"), "% p.a.",
                           "CPI inflation", unitless=("pacf",)),
}


# ---------------------------------------------------------------------------
# States at posterior draws (batched filter + smoother)
# ---------------------------------------------------------------------------


def _state_function(spec: DemoModel, y):
    """Compiled ``f(*params) -> (filtered_state, filtered_cov, smoothed_state, smoothed_cov, d)``.

    Compiled with PyTensor's Python linker (``FAST_COMPILE``): it runs a few hundred times, once per
    posterior draw, so its compile is what counts, and the Python linker compiles fastest; iterops' filter and smoother run their Numba kernels under every linker."""
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


def state_bands(spec: DemoModel, idata, y, n_draws=200, seed=0):
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


#: The C-ABI kernels the demo's iterops models use (``module.function``, as ``python -m iterops.warmup
#: --kernels`` takes them): the Kalman filter, its adjoint and smoother, the Lyapunov solver and its Schur
#: fallback (compiled when an input first needs it; near a unit root the sampler's draws do).
KERNELS = (
    "iterops.ts.kalman._filter_abi", "iterops.ts.kalman._adjoint_abi", "iterops.ts.kalman_smoother._smoother_abi",
    "iterops.linalg.lyapunov._lyapunov_abi", "iterops.linalg.lyapunov._schur_abi",
)


def uncached_kernels() -> set[str]:
    """iterops' float64 kernels that are not in the on-disk cache yet (the first graph using one compiles it)."""
    from iterops._fused import OPAQUE_KERNELS

    return {k.name for k in OPAQUE_KERNELS if k.float64_only and not k.is_cached()}


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


def _param_panels(spec: DemoModel, posterior):
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


def plot_posteriors(spec: DemoModel, runs: list[Run], path: Path):
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


def plot_states(spec: DemoModel, t, y, bands, path: Path):
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
