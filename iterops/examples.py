"""The demo's models and data, for the demo (``scripts/dev demo``), tests, benchmarks and notebooks.

Import them from here (``from iterops.examples import load_nile, local_level_model``): this module
builds models and loads data only; :mod:`iterops.demo` is the command that fits them, prints and
writes figures.  The models need the ``demo`` extra (PyMC; pymc-extras for the ``pymc_extras_*`` ones);
the data ship with statsmodels (no downloads).

Data:

* :func:`load_nile`: the Nile river flow at Aswan (annual, 1871-1970);
* :func:`load_inflation`: US quarterly CPI inflation (statsmodels' macrodata, 1959-2009).

Models (:data:`MODELS` holds the demo's two, with their data and plot labels):

``nile``, :func:`local_level_model`
    The local-level model::

        y_t = mu_t + eps_t,        eps_t ~ N(0, sigma_obs^2)
        mu_t+1 = mu_t + eta_t,     eta_t ~ N(0, sigma_level^2)

    with an approximately diffuse start ``mu_1 ~ N(y_1, 1e6)``.
``inflation``, :func:`ar2_noise_model`
    A mean plus a stationary AR(2) signal plus measurement noise::

        y_t = mean + x_t + eps_t,                        eps_t ~ N(0, sigma_obs^2)
        x_t = phi_1 x_t-1 + phi_2 x_t-2 + eta_t,         eta_t ~ N(0, sigma_state^2)

    Stationarity comes from the parametrisation (partial autocorrelations
    ``pacf`` in (-1, 1): ``phi_1 = pacf_1 (1 - pacf_2)``, ``phi_2 = pacf_2``), and
    the initial state covariance is the stationary one, ``P0 = T P0 T' + R Q R'``,
    from :func:`iterops.solve_discrete_lyapunov`.  Vectors are indexed from 0, as in
    statsmodels: ``pacf[0]`` and ``phi[0]`` belong to lag 1 (``phi[0]`` is ``phi_1``).

Each is written twice (``impl``): with ``iterops.ts.kalman_filter`` (one fused Numba Op and its
hand-written adjoint), and the way PyMC users write it today: a ``pytensor.scan`` Kalman filter
(:func:`scan_loglik`, the textbook loop of :func:`iterops.reference_loops.kalman_textbook_loop`) with
PyTensor's own ``solve_discrete_lyapunov``.  Compile the Scan version with iterops' rewrites off
(:func:`iterops.fusion.disabled`) to keep the Scan.

pymc-extras' structural models as its users write them, whose Kalman filter Scan iterops replaces on
import: :func:`pymc_extras_local_linear_trend_model`, :func:`pymc_extras_structural_model`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytensor.tensor as pt

import iterops

__all__ = [
    "load_nile",
    "load_inflation",
    "scan_loglik",
    "local_level_system",
    "local_level_model",
    "pymc_extras_local_linear_trend_model",
    "pymc_extras_structural_model",
    "ar2_noise_system",
    "ar2_noise_model",
    "ExampleModel",
    "MODELS",
    "KERNELS",
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


def _loglik(impl, y, a0, P0, system):
    """The log-likelihood with ``impl="iterops"`` (:func:`iterops.ts.kalman_filter`) or ``"scan"``
    (:func:`scan_loglik`)."""
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
        pm.Potential("loglik", _loglik(impl, y[:, None], a0, P0, system))
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
        pm.Potential("loglik", _loglik(impl, y[:, None], a0, P0, system))
    return model


@dataclass
class ExampleModel:
    """One model of :data:`MODELS`, with its data and what the demo reports and plots about it."""

    name: str
    title: str  #: plot title
    load: object  #: ``load() -> (time, y)``, ``y`` (n,)
    build: object  #: ``build(y, impl="iterops" | "scan") -> pm.Model``
    params: tuple  #: the free parameters (posterior plots, minimum ESS)
    units: str  #: units of the data (matplotlib mathtext)
    quantity: str = "data"  #: what the data measure (axis label)
    unitless: tuple = ()  #: parameters without units (the others are in ``units``)


MODELS = {
    "nile": ExampleModel("nile", "Nile flow: local level", load_nile, local_level_model,
                         ("sigma_obs", "sigma_level"), r"$10^8$ m$^3$", "annual flow"),
    "inflation": ExampleModel("inflation", "US inflation: AR(2) + noise, stationary start", load_inflation,
                              ar2_noise_model, ("mean", "pacf", "sigma_state", "sigma_obs"), "% p.a.",
                              "CPI inflation", unitless=("pacf",)),
}


#: The C-ABI kernels the iterops versions of :data:`MODELS` use (``module.function``, as ``python -m iterops.warmup
#: --kernels`` takes them): the Kalman filter, its adjoint and smoother, the Lyapunov solver and its Schur
#: fallback (compiled when an input first needs it; near a unit root the sampler's draws do).
KERNELS = (
    "iterops.ts.kalman._filter_abi", "iterops.ts.kalman._adjoint_abi", "iterops.ts.kalman_smoother._smoother_abi",
    "iterops.linalg.lyapunov._lyapunov_abi", "iterops.linalg.lyapunov._schur_abi",
)
