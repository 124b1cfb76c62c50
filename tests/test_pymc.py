"""iterops Ops inside PyMC models: samplers, backends, PyMC features, compiled graphs.

Models are tiny and sampled briefly with fixed seeds.  Oracles are independent
of iterops: statsmodels' exact ARIMA / state-space likelihoods and maximum
likelihood fits, scipy's Lyapunov solver and densities, and the simulated truth.

* ``ar2``: the exact Gaussian AR(2) likelihood: ``(y_1, y_2)`` from the
  stationary covariance ``iterops.solve_discrete_lyapunov(T, R Q R')`` of the
  companion form, then the conditional normals (statsmodels ARIMA oracle).
* ``local_level``: ``iterops.ts.kalman_filter`` likelihood of the local-level
  model (statsmodels UnobservedComponents oracle).
"""

from __future__ import annotations

import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg
import scipy.special
import scipy.stats
import statsmodels.api as sm
from pytensor.compile.mode import Mode
from pytensor.scan.op import Scan
from pytensor.tensor.blockwise import Blockwise

import iterops
from conftest import SCAN_ORACLE
from iterops import demo, examples
from iterops.linalg.lyapunov import DiscreteLyapunov
from iterops.ts.kalman import KalmanFilterGrad

PHI = (0.55, -0.3)  # true AR(2) coefficients (pacf = (0.423..., -0.3))
SIGMA = 0.7
N_AR = 400

C_MODE = Mode(linker="cvm", optimizer="fast_run")  # the C backend ("FAST_RUN" means Numba in PyTensor 3.3)


def _quiet_sample(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pm.sample(progressbar=False, compute_convergence_checks=False, **kwargs)


def _simulate_ar2(n, seed):
    rng = np.random.default_rng(seed)
    y = np.zeros(n + 200)
    e = rng.normal(scale=SIGMA, size=n + 200)
    for t in range(2, n + 200):
        y[t] = PHI[0] * y[t - 1] + PHI[1] * y[t - 2] + e[t]
    return y[200:]


def ar2_model(y, lyapunov=iterops.solve_discrete_lyapunov):
    with pm.Model() as model:
        pacf = pm.Uniform("pacf", -1.0, 1.0, shape=2)
        sigma = pm.HalfNormal("sigma", 5.0)
        phi1, phi2 = pacf[0] * (1 - pacf[1]), pacf[1]
        pm.Deterministic("phi", pt.stack([phi1, phi2]))
        T = pt.stack([pt.stack([phi1, phi2]), pt.stack([pt.constant(1.0), pt.constant(0.0)])])
        RQR = pt.stack([pt.stack([sigma**2, pt.constant(0.0)]), pt.zeros(2)])
        P0 = lyapunov(T, RQR)  # Cov of (y_t, y_t-1); symmetric Toeplitz, so also of (y_1, y_2)
        pm.MvNormal("y0", mu=pt.zeros(2), cov=P0, observed=y[:2])
        pm.Normal("y_rest", mu=phi1 * y[1:-1] + phi2 * y[:-2], sigma=sigma, observed=y[2:])
    return model


def _stationary_cov_scipy(phi, sigma):
    T = np.array([[phi[0], phi[1]], [1.0, 0.0]])
    return scipy.linalg.solve_discrete_lyapunov(T, np.diag([sigma**2, 0.0]))


@pytest.fixture(scope="module")
def ar_y():
    return _simulate_ar2(N_AR, seed=11)


@pytest.fixture(scope="module")
def ar_mle(ar_y):
    res = sm.tsa.arima.ARIMA(ar_y, order=(2, 0, 0), trend="n").fit()
    se = np.sqrt(np.diag(res.cov_params()))
    return res.params, se  # (ar.L1, ar.L2, sigma2)


@pytest.fixture(scope="module")
def ar_idata(ar_y):
    """Two chains in two processes (Numba backend): everything must pickle."""
    with ar2_model(ar_y):
        return _quiet_sample(draws=300, tune=300, chains=2, cores=2, random_seed=3, nuts_sampler="pymc")


def _core_ops(fn):
    ops = []
    for node in fn.maker.fgraph.toposort():
        op = node.op
        ops.append(op.core_op if isinstance(op, Blockwise) else op)
    return ops


# ---------------------------------------------------------------------------
# Likelihood against statsmodels
# ---------------------------------------------------------------------------


def test_ar2_logp_matches_statsmodels_exact_likelihood(ar_y):
    model = ar2_model(ar_y)
    logp = model.compile_logp(vars=model.observed_RVs, jacobian=False)
    arima = sm.tsa.arima.ARIMA(ar_y, order=(2, 0, 0), trend="n")
    for pacf, sigma in [((0.4, -0.3), 0.7), ((-0.8, 0.6), 1.3), ((0.95, -0.1), 0.2)]:
        phi = (pacf[0] * (1 - pacf[1]), pacf[1])
        point = {"pacf_interval__": scipy.special.logit((np.array(pacf) + 1) / 2), "sigma_log__": np.log(sigma)}
        expected = arima.loglike(np.array([phi[0], phi[1], sigma**2]))
        np.testing.assert_allclose(logp(point), expected, rtol=1e-10)


# ---------------------------------------------------------------------------
# Samplers and backends
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """y_i iid N(0, P), P = a^2 P + 1 (AR(1) stationary variance); posterior of ``a`` by quadrature."""
    y = np.random.default_rng(8).normal(scale=1.0 / np.sqrt(1 - 0.6**2), size=40)
    grid = np.linspace(0.0, 0.95, 4001)[1:-1]
    logpost = np.array([scipy.stats.norm(0, 1 / np.sqrt(1 - g**2)).logpdf(y).sum() for g in grid])
    w = np.exp(logpost - logpost.max())
    mean = np.sum(w * grid) / w.sum()
    return y, mean, np.sqrt(np.sum(w * grid**2) / w.sum() - mean**2)


def tiny_model(y):
    with pm.Model() as model:
        a = pm.Uniform("a", 0.0, 0.95)  # only a^2 matters: keep the posterior unimodal
        P = iterops.solve_discrete_lyapunov(pt.reshape(a, (1, 1)), pt.ones((1, 1)))
        pm.Normal("y", 0.0, pt.sqrt(P[0, 0]), observed=y)
    return model


def _check_tiny_posterior(idata, mean, sd):
    draws = idata.posterior["a"].values.ravel()
    assert abs(draws.mean() - mean) < 0.3 * sd, (draws.mean(), mean, sd)  # MC error ~ sd / sqrt(ESS ~ 150)
    np.testing.assert_allclose(draws.std(), sd, rtol=0.25)


@pytest.mark.parametrize("mode", ["NUMBA", C_MODE], ids=["numba", "c"])
def test_pymc_nuts_in_numba_and_c_backends(tiny, mode):
    y, mean, sd = tiny
    model = tiny_model(y)
    with model:
        idata = _quiet_sample(draws=400, tune=300, chains=1, random_seed=5, nuts_sampler="pymc",
                              compile_kwargs={"mode": mode})
    _check_tiny_posterior(idata, mean, sd)
    # the compiled gradient really runs the fused Op in this backend
    dlogp = model.compile_dlogp(mode=mode)
    assert any(isinstance(op, DiscreteLyapunov) for op in _core_ops(dlogp.f))


def test_nutpie(tiny):
    y, mean, sd = tiny
    with tiny_model(y):
        idata = _quiet_sample(draws=400, tune=300, chains=1, random_seed=7, nuts_sampler="nutpie")
    _check_tiny_posterior(idata, mean, sd)


def test_multiprocess_chains_recover_parameters(ar_idata, ar_mle):
    post = ar_idata.posterior.to_dataset()
    assert post.sizes["chain"] == 2
    phi = post["phi"].values.reshape(-1, 2)
    sigma = post["sigma"].values.ravel()
    sd = phi.std(0)
    # truth within 3.5 posterior sd; posterior mean near the exact MLE (flat priors, n = 400)
    assert np.all(np.abs(phi.mean(0) - np.array(PHI)) < 3.5 * sd), (phi.mean(0), sd)
    assert abs(sigma.mean() - SIGMA) < 3.5 * sigma.std()
    mle, se = ar_mle
    np.testing.assert_allclose(phi.mean(0), mle[:2], atol=0.35 * se[:2].max())
    np.testing.assert_allclose(sd, se[:2], rtol=0.3)
    assert int(ar_idata.sample_stats["diverging"].sum()) == 0


# ---------------------------------------------------------------------------
# PyMC features
# ---------------------------------------------------------------------------


def test_compute_log_likelihood_matches_scipy(ar_y, ar_idata):
    model = ar2_model(ar_y)
    sub = ar_idata.isel(draw=slice(0, 20))
    ll = pm.compute_log_likelihood(sub, model=model, extend_inferencedata=False, progressbar=False)
    post = sub.posterior.to_dataset()
    phi = post["phi"].values.reshape(-1, 2)
    sigma = post["sigma"].values.ravel()
    y0 = ll["y0"].values.reshape(-1)
    y_rest = ll["y_rest"].values.reshape(len(sigma), -1)
    for k in range(len(sigma)):
        P0 = _stationary_cov_scipy(phi[k], sigma[k])
        np.testing.assert_allclose(y0[k], scipy.stats.multivariate_normal(np.zeros(2), P0).logpdf(ar_y[:2]),
                                   rtol=1e-10)
        mu = phi[k, 0] * ar_y[1:-1] + phi[k, 1] * ar_y[:-2]
        np.testing.assert_allclose(y_rest[k], scipy.stats.norm(mu, sigma[k]).logpdf(ar_y[2:]), rtol=1e-10)


def test_posterior_predictive_uses_the_stationary_covariance(ar_y, ar_idata):
    model = ar2_model(ar_y)
    with model:
        pp = pm.sample_posterior_predictive(ar_idata, var_names=["y0"], random_seed=2, progressbar=False)
    y0 = pp.posterior_predictive["y0"].values.reshape(-1, 2)
    post = ar_idata.posterior.to_dataset()
    phi = post["phi"].values.reshape(-1, 2)
    sigma = post["sigma"].values.ravel()
    P0 = np.mean([_stationary_cov_scipy(p, s) for p, s in zip(phi, sigma)], axis=0)
    # 600 draws: the sample covariance has ~6% relative sd
    np.testing.assert_allclose(np.cov(y0.T), P0, rtol=0.25, atol=0.05 * P0[0, 0])


def test_find_map_matches_statsmodels_mle(ar_y, ar_mle):
    with ar2_model(ar_y):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            map_est = pm.find_MAP(progressbar=False, seed=1)
    mle, se = ar_mle
    np.testing.assert_allclose(map_est["phi"], mle[:2], atol=0.02 * se.max() + 1e-3)
    np.testing.assert_allclose(map_est["sigma"] ** 2, mle[2], rtol=5e-3)


# ---------------------------------------------------------------------------
# Compiled graphs: fused Ops, no Scan
# ---------------------------------------------------------------------------


def _assert_fused_no_scan(fn, op_type):
    ops = _core_ops(fn)
    assert any(isinstance(op, op_type) for op in ops), [type(op).__name__ for op in ops]
    assert not any(isinstance(op, Scan) for op in ops)


def test_dlogp_contains_fused_lyapunov_and_no_scan(ar_y):
    _assert_fused_no_scan(ar2_model(ar_y).compile_dlogp().f, DiscreteLyapunov)


# ---------------------------------------------------------------------------
# Kalman-filter models (the demo's)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def level_data():
    rng = np.random.default_rng(21)
    n, s_obs, s_lvl = 150, 1.0, 0.5
    level = 10 + np.cumsum(s_lvl * rng.normal(size=n))
    return level + s_obs * rng.normal(size=n), (s_obs, s_lvl)


def _potential_fn(model):
    """The model's Kalman log-likelihood term as a function of the (transformed) values."""
    (loglik,) = model.replace_rvs_by_values(model.potentials)
    return pytensor.function(model.value_vars, loglik)


def _ucm_loglike(y, s_obs, s_lvl):
    ucm = sm.tsa.UnobservedComponents(y, "llevel")
    ucm.ssm.initialize_known(np.array([y[0]]), np.array([[1e6]]))
    ucm.loglikelihood_burn = 0
    return ucm.loglike([s_obs**2, s_lvl**2])


def test_local_level_loglik_matches_statsmodels(level_data):
    y, _ = level_data
    model = examples.local_level_model(y)
    f = _potential_fn(model)
    for s_obs, s_lvl in [(1.0, 0.5), (0.3, 2.0)]:
        np.testing.assert_allclose(f(np.log(s_obs), np.log(s_lvl)), _ucm_loglike(y, s_obs, s_lvl), rtol=1e-10)


def test_inflation_model_loglik_matches_statsmodels():
    _, y = examples.load_inflation()
    model = examples.ar2_noise_model(y)
    f = _potential_fn(model)
    sarimax = sm.tsa.SARIMAX(y, order=(2, 0, 0), trend="c", measurement_error=True)
    for mean, pacf, s_state, s_obs in [(4.0, (0.8, 0.1), 1.5, 1.0), (3.0, (-0.3, 0.5), 0.5, 2.0)]:
        phi1, phi2 = pacf[0] * (1 - pacf[1]), pacf[1]
        expected = sarimax.loglike([mean * (1 - phi1 - phi2), phi1, phi2, s_obs**2, s_state**2])
        value = f(mean, scipy.special.logit((np.array(pacf) + 1) / 2), np.log(s_state), np.log(s_obs))
        np.testing.assert_allclose(value, expected, rtol=1e-10)


NO_ITEROPS = SCAN_ORACLE


def test_scan_baseline_matches_statsmodels(level_data):
    """The demo's Scan Kalman filter (the baseline of the speed comparison: the reference textbook loop)
    is a correct filter, also with the observation intercept the inflation model moves to the data."""
    y, _ = level_data
    s_obs, s_lvl = pt.dscalars("s_obs", "s_lvl")
    a0, P0, system = examples.local_level_system(s_obs, s_lvl, y[0])
    ll = examples.scan_loglik(y[:, None], a0, P0, **system)
    f = pytensor.function([s_obs, s_lvl], ll, mode=NO_ITEROPS)
    assert any(isinstance(node.op, Scan) for node in f.maker.fgraph.apply_nodes)
    np.testing.assert_allclose(f(0.8, 0.4), _ucm_loglike(y, 0.8, 0.4), rtol=1e-9)

    _, y = examples.load_inflation()
    model = examples.ar2_noise_model(y, impl="scan")
    (loglik,) = model.replace_rvs_by_values(model.potentials)
    f = pytensor.function(model.value_vars, loglik, mode=NO_ITEROPS)
    sarimax = sm.tsa.SARIMAX(y, order=(2, 0, 0), trend="c", measurement_error=True)
    mean, pacf, s_state, s_obs = 3.0, (-0.3, 0.5), 0.5, 2.0
    phi1, phi2 = pacf[0] * (1 - pacf[1]), pacf[1]
    expected = sarimax.loglike([mean * (1 - phi1 - phi2), phi1, phi2, s_obs**2, s_state**2])
    value = f(mean, scipy.special.logit((np.array(pacf) + 1) / 2), np.log(s_state), np.log(s_obs))
    np.testing.assert_allclose(value, expected, rtol=1e-9)


def test_local_level_recovery_and_fused_dlogp(level_data):
    y, truth = level_data
    model = examples.local_level_model(y)
    _assert_fused_no_scan(model.compile_dlogp().f, KalmanFilterGrad)
    with model:
        idata = _quiet_sample(draws=300, tune=300, chains=1, random_seed=4, nuts_sampler="pymc")
    post = idata.posterior.to_dataset()
    for name, value in zip(("sigma_obs", "sigma_level"), truth):
        draws = post[name].values.ravel()
        assert abs(draws.mean() - value) < 3 * draws.std(), (name, draws.mean(), draws.std(), value)


def test_demo_state_function_matches_statsmodels_filter_and_smoother(level_data):
    """The demo's state bands come from one compiled filter + smoother (Python linker: iterops' Ops run
    their Numba kernels under it too); its filtered and smoothed states and variances are statsmodels'."""
    y, _ = level_data
    fn = demo._state_function(examples.MODELS["nile"], y)
    assert fn.maker.mode.linker.__class__.__name__ != "NumbaLinker"
    s_obs, s_lvl = 0.7, 1.3
    a_f, P_f, a_s, P_s, d = fn(s_obs, s_lvl)
    ucm = sm.tsa.UnobservedComponents(y, "llevel")
    ucm.ssm.initialize_known(np.array([y[0]]), np.array([[1e6]]))
    res = ucm.smooth([s_obs**2, s_lvl**2])
    np.testing.assert_allclose(a_f[:, 0] + d[0], res.filtered_state[0], rtol=1e-9)
    np.testing.assert_allclose(P_f[:, 0, 0], res.filtered_state_cov[0, 0], rtol=1e-9)
    np.testing.assert_allclose(a_s[:, 0] + d[0], res.smoothed_state[0], rtol=1e-9)
    np.testing.assert_allclose(P_s[:, 0, 0], res.smoothed_state_cov[0, 0], rtol=1e-9)


def test_demo_command_line_writes_everything_before_it_exits(tmp_path):
    """``python -m iterops.demo`` ends with :func:`iterops.demo.exit_now` (no interpreter teardown): its
    last lines still reach a pipe, its exit handlers still run and its figures and table are on disk."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    marker = tmp_path / "atexit-ran"
    # an exit handler registered before the demo runs, as a library imported by the demo would register one
    code = (f"import atexit, pathlib, runpy, sys; atexit.register(pathlib.Path({str(marker)!r}).touch); "
            "sys.argv = ['iterops.demo', '--models', 'nile', '--no-scan', '--draws', '40', '--tune', '40', "
            f"'--chains', '1', '--cores', '1', '--no-progressbar', '--output', {str(out)!r}]; "
            "runpy.run_module('iterops.demo', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: block-buffered
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("figures: "), proc.stdout[-2000:]
    assert marker.exists()
    summary = (out / "summary.txt").read_text()
    assert "nile" in summary and "iterops" in summary
    assert {"nile_posterior.png", "nile_states.png", "timing.png"} <= {p.name for p in out.iterdir()}
