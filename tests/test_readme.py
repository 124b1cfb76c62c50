"""The README's code blocks run as written, and compute what the README says they compute.

Every ```python block of README.md is executed (each in a fresh namespace, in order), so the README
cannot rot.  ``pm.sample`` is shortened to a few draws here (the README calls it with PyMC's defaults).
Oracles: scipy's Lyapunov solver (first example); statsmodels' Kalman filter for the PyMC example's
log-likelihood at a posterior draw.
"""

import functools
import re
from pathlib import Path

import numpy as np
import pymc as pm
import pytest
import scipy.linalg
from statsmodels.tsa.statespace.kalman_filter import KalmanFilter

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def run_block(code, monkeypatch):
    short = functools.partial(pm.sample, draws=40, tune=40, chains=2, progressbar=False, random_seed=1)
    monkeypatch.setattr(pm, "sample", lambda *a, **k: short(*a, **k))
    namespace = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def test_readme_has_the_examples():
    assert len(BLOCKS) >= 2
    assert any("solve_discrete_lyapunov(A, Q)" in b for b in BLOCKS)
    assert any("pm.CustomDist" in b and "kalman_filter" in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, monkeypatch):
    ns = run_block(BLOCKS[index], monkeypatch)
    if "ga" in ns and "f" in ns:  # the first example: X, dX/dA, dX/dQ of sum(X**2)
        A, Q = np.array([[0.9, 0.1], [0.0, 0.5]]), np.eye(2)
        X = scipy.linalg.solve_discrete_lyapunov(A, Q)
        np.testing.assert_allclose(ns["x"], X, rtol=1e-10)
        np.testing.assert_allclose(ns["gq"], scipy.linalg.solve_discrete_lyapunov(A.T, 2 * X), rtol=1e-8)
    if "model" in ns and "idata" in ns:  # the PyMC example
        check_pymc_example(ns)


def check_pymc_example(ns):
    idata, model, y = ns["idata"], ns["model"], ns["y"]
    post = idata.posterior
    chains, draws = post.sizes["chain"], post.sizes["draw"]
    assert chains >= 2
    # log-likelihood group: one finite value per draw, the filter's log-likelihood
    ll = np.asarray(idata.log_likelihood["y"])
    assert ll.shape == (chains, draws) and np.all(np.isfinite(ll))
    pp = np.asarray(idata.posterior_predictive["y"])
    assert pp.shape == (chains, draws, len(y)) and np.all(np.isfinite(pp))
    # at a posterior draw: the CustomDist's logp = statsmodels' Kalman filter with the stationary start
    phi = np.asarray(post["phi"])[0, -1]
    sx, sy = float(np.asarray(post["sigma_x"])[0, -1]), float(np.asarray(post["sigma_y"])[0, -1])
    T = np.array([[phi[0], phi[1]], [1.0, 0.0]])
    R = np.array([[1.0], [0.0]])
    kf = KalmanFilter(k_endog=1, k_states=2, k_posdef=1)
    kf.bind(y[None, :].copy(order="F"))
    kf["transition"], kf["selection"], kf["design"] = T, R, np.array([[1.0, 0.0]])
    kf["state_cov"], kf["obs_cov"] = np.array([[sx**2]]), np.array([[sy**2]])
    kf.initialize_known(np.zeros(2), scipy.linalg.solve_discrete_lyapunov(T, sx**2 * R @ R.T))
    np.testing.assert_allclose(ll[0, -1], kf.loglike(), rtol=1e-9)
    # the sampler found the process the data were simulated from (phi = (0.6, -0.3)), loosely
    phi_mean = np.asarray(post["phi"]).reshape(-1, 2).mean(0)
    np.testing.assert_allclose(phi_mean, [0.6, -0.3], atol=0.25)
