"""Every pymc-extras state-space model class, with its defaults, is fused (or ``explain`` says why not).

Each model is built as its users build it (priors on every parameter pymc-extras lists, ``P0`` and full
covariance parameters as ``L L^T + I``), then ``iterops.explain`` is asked which Scans of its logp graph
(built with fusion disabled) are replaced.  The default SARIMAX (stationary start from PyTensor's ``solve_discrete_lyapunov``) is also
compiled: its logp and dlogp equal the model's with no pattern registered (oracle: the unrewritten Scan,
run by Python).
"""

import warnings
from unittest import mock

import numpy as np
import pymc as pm
import pytensor.tensor as pt
import pytest
from pytensor.scan.op import Scan

import iterops
from conftest import FAST_PY, SCAN_ORACLE

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning",
                                        "ignore::DeprecationWarning")

import pymc_extras.statespace as ss_models  # noqa: E402  (a development dependency: missing, it is a failure)
from pymc_extras.statespace import structural as st  # noqa: E402
from pymc_extras.statespace.models import BayesianDynamicFactor  # noqa: E402

N = 30

#: pymc-extras' model classes with their defaults (structural components each with a level, as users
#: combine them); every class pymc_extras.statespace ships
MODELS = {
    "BayesianSARIMAX": lambda: ss_models.BayesianSARIMAX(order=(2, 0, 1), seasonal_order=(1, 0, 1, 12),
                                                          verbose=False),
    "BayesianVARMAX": lambda: ss_models.BayesianVARMAX(order=(1, 0), endog_names=["a", "b"], verbose=False),
    "BayesianDynamicFactor": lambda: BayesianDynamicFactor(k_factors=1, factor_order=1, endog_names=["a", "b"],
                                                           verbose=False),
    "BayesianETS": lambda: ss_models.BayesianETS(order=("A", "A", "N"), endog_names=["y"], verbose=False),
    "LevelTrend": lambda: (st.LevelTrend(order=2, innovations_order=[1, 1]) + st.MeasurementError()).build(
        verbose=False),
    "Autoregressive": lambda: (st.Autoregressive(order=2) + st.MeasurementError()).build(verbose=False),
    "TimeSeasonality": lambda: (st.LevelTrend() + st.TimeSeasonality(season_length=4, name="s")
                                + st.MeasurementError()).build(verbose=False),
    "FrequencySeasonality": lambda: (st.LevelTrend() + st.FrequencySeasonality(season_length=12, n=2, name="f")
                                     ).build(verbose=False),
    "Cycle": lambda: (st.LevelTrend() + st.Cycle(name="c", cycle_length=12, dampen=True)).build(verbose=False),
    "Regression": lambda: (st.LevelTrend() + st.Regression(state_names=["x1"], name="r")).build(verbose=False),
}

#: models that stay Scans, and what explain says (none today)
KEPT: dict[str, str] = {}


def model_of(ss, seed=0):
    """A PyMC model of ``ss`` on random data: a prior for every parameter pymc-extras lists."""
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(N, ss.k_endog))
    with pm.Model(coords=ss.coords) as model:
        for name in ss.param_names:
            info, dims = ss.param_info[name], ss.param_dims.get(name)
            shape, constraints = info["shape"], str(info.get("constraints")).lower()
            if name == "P0" or "definite" in constraints:
                k = shape[-1]
                L = pm.Normal(f"{name}_L", 0, 1, shape=(k, k))
                pm.Deterministic(name, L @ L.T + pt.eye(k), dims=dims)
            elif "positive" in constraints:
                pm.HalfNormal(name, 1.0, shape=shape, dims=dims or None)
            else:
                pm.Normal(name, 0.0, 0.3, shape=shape, dims=dims or None)
        for name in ss.data_names:
            info = ss.data_info[name]
            pm.Data(name, rng.normal(size=(N, info["shape"][-1])), dims=info["dims"])
        ss.build_statespace_graph(y)
    return model


def _build(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_of(MODELS[name]())


@pytest.mark.parametrize("name", list(MODELS))
def test_model_is_fused_or_explained(name):
    model = _build(name)
    with iterops.fusion.disabled():  # PyMC's pre-gradient pass would fuse the Scan already
        logp = model.logp()
    report = iterops.explain(logp)
    if name in KEPT:
        assert not report.replaced and KEPT[name] in str(report)
    else:
        assert report.replaced and not report.kept, str(report)


@pytest.mark.slow  # compiles the 14-state SARIMAX Scan and its gradient Scan (about a minute of CPU)
def test_sarimax_with_stationary_start_logp_dlogp_equal_the_scan():
    """P0 = PyTensor's solve_discrete_lyapunov (bilinear) of the SARIMAX system: symmetric for a symmetric
    R Q R^T wherever the solution is unique, so the StandardFilter Scan is fused."""
    model = _build("BayesianSARIMAX")
    logp, dlogp = model.compile_logp(mode=FAST_PY), model.compile_dlogp(mode=FAST_PY)
    for fn in (logp, dlogp):
        assert not any(isinstance(n.op, Scan) for n in fn.f.maker.fgraph.apply_nodes)
    with mock.patch.dict(iterops.fusion.PATTERNS, clear=True):
        ref_logp, ref_dlogp = model.compile_logp(mode=SCAN_ORACLE), model.compile_dlogp(mode=SCAN_ORACLE)
    assert any(isinstance(n.op, Scan) for n in ref_logp.f.maker.fgraph.apply_nodes)
    rng = np.random.default_rng(1)
    ip = model.initial_point()
    point = {k: v + rng.normal(scale=0.2, size=np.shape(v)) for k, v in ip.items()}
    np.testing.assert_allclose(logp(point), ref_logp(point), rtol=1e-9)
    np.testing.assert_allclose(dlogp(point), ref_dlogp(point), rtol=1e-7, atol=1e-9)
