"""Every iterops Op inside nutpie, PyMC's default NUTS sampler when installed, with several chains.

One model uses every fused Op in its log-density (so nutpie compiles each Op and its gradient with
PyTensor's Numba backend) and two in Deterministics (computed by nutpie's expand function):
``solve_discrete_lyapunov``, ``block_diag``, ``kalman_filter`` (+ adjoint), ``kalman_smoother``,
``solve_toeplitz``, ``levinson_durbin`` / ``yule_walker``, the Levinson recursion loop replica,
``acovf``, ``pacf_to_ar`` / ``ar_to_pacf`` / ``ar_to_acov``, and the Smith-doubling and fixed-point
Lyapunov iterations (reached through the Scan rewrite of the reference loops).  Parameters are
unconstrained (Normal priors, no transforms), so nutpie's reported ``logp`` of each draw is the
model's log-density; it is compared, draw by draw over all chains, with the same density computed
by scipy / statsmodels / numpy (independent oracles).  Few draws: this checks that nutpie runs the
Ops correctly, not the posterior.
"""

from __future__ import annotations

import warnings

import numpy as np
import nutpie  # noqa: F401  (a dev dependency: without it pm.sample would fall back to its own NUTS)
import pymc as pm
import pytensor.tensor as pt
import scipy.linalg
import scipy.stats
from statsmodels.tsa.arima_process import arma_acovf
from statsmodels.tsa.statespace.kalman_smoother import KalmanSmoother
from statsmodels.tsa.stattools import acovf as sm_acovf
from statsmodels.tsa.stattools import levinson_durbin as sm_levinson_durbin

import iterops
from iterops import reference_loops as ref
from iterops.ts.levinson_recursion import levinson_recursion


Y = np.array([0.3, -0.5, 0.8, 0.1, np.nan, -0.2, 0.6, 0.4, -0.9, 0.2])
X_DATA = np.array([1.0, -0.4, 0.7, 0.2, -1.1, 0.5])


def _rho(a):
    return 0.5 * np.tanh(a)


def _parts(a, b):
    """The model's pieces as numbers, from the oracles (``a``: (2,), ``b``: scalar)."""
    rho = _rho(a)
    A = np.array([[rho[0], 0.2], [0.0, rho[1]]])
    X = scipy.linalg.solve_discrete_lyapunov(A, np.eye(2))
    blocks = scipy.linalg.block_diag(rho[0] * np.eye(2), rho[1] * np.eye(2))
    # local AR(1) + noise model: statsmodels' Kalman filter and smoother
    ks = KalmanSmoother(k_endog=1, k_states=1, k_posdef=1)
    ks.bind(Y[None, :].copy(order="F"))
    ks["transition"], ks["design"], ks["selection"] = np.array([[rho[0]]]), np.ones((1, 1)), np.ones((1, 1))
    ks["obs_cov"], ks["state_cov"] = np.array([[np.exp(b)]]), np.ones((1, 1))
    ks.initialize_known(np.zeros(1), np.array([[1.0 / (1.0 - rho[0] ** 2)]]))
    sm = ks.smooth()
    x_toep = scipy.linalg.solve_toeplitz(np.array([2.0, rho[0], 0.5 * rho[1]]), np.ones(3))
    # pacf -> phi by Durbin's recursion; autocovariances; Levinson-Durbin back
    phi = np.array([rho[0] * (1 - rho[1]), rho[1]])
    acov = arma_acovf(np.r_[1.0, -phi], [1.0], nobs=4, sigma2=1.0)
    _, ld_phi, ld_pacf, _, _ = sm_levinson_durbin(acov, 2, isacov=True)
    ld_pacf = ld_pacf[1:]  # statsmodels' pacf starts with lag 0 (= 1)
    ld_sigma2 = acov[0] - acov[1:3] @ ld_phi
    acv_x = sm_acovf(X_DATA + a[0], nlag=2, fft=False)
    return dict(X=X, blocks=blocks, llf=sm.llf, smoothed=sm.smoothed_state[0], x_toep=x_toep, phi=phi,
                acov=acov, ld_phi=ld_phi, ld_pacf=ld_pacf, ld_sigma2=ld_sigma2, acv_x=acv_x)


def oracle_logp(a, b):
    p = _parts(a, b)
    lp = scipy.stats.norm.logpdf(a).sum() + scipy.stats.norm.logpdf(b)
    lp += -0.5 * np.trace(p["X"])                    # Lyapunov solver
    lp += -0.5 * np.trace(p["X"]) * 2                # Smith doubling + fixed point iterations (same X)
    lp += -0.5 * (p["blocks"] ** 2).sum()
    lp += p["llf"]
    lp += -0.5 * (p["x_toep"] ** 2).sum()
    lp += -(p["phi"] ** 2).sum() - (_rho(a) ** 2).sum()  # pacf_to_ar, ar_to_pacf (returns the pacf)
    lp += -0.1 * p["acov"].sum()
    lp += -(p["ld_phi"] ** 2).sum() - p["ld_sigma2"] - (p["ld_pacf"] ** 2).sum()  # levinson_durbin
    lp += -(p["ld_phi"] ** 2).sum() - p["ld_sigma2"]  # yule_walker
    lp += -(p["ld_phi"] ** 2).sum() - p["ld_sigma2"] - (p["ld_pacf"] ** 2).sum()  # Levinson recursion
    lp += -0.1 * p["acv_x"].sum()
    return lp


def all_ops_model():
    with pm.Model() as model:
        a = pm.Normal("a", 0.0, 1.0, shape=2)
        b = pm.Normal("b", 0.0, 1.0)
        rho = 0.5 * pt.tanh(a)
        A = pt.stack([pt.stack([rho[0], pt.constant(0.2)]), pt.stack([pt.constant(0.0), rho[1]])])
        X = iterops.solve_discrete_lyapunov(A, pt.eye(2))
        X_doubling = ref.doubling_loop(A, pt.eye(2))  # fused: the Smith-doubling iteration Op
        X_fixed = ref.fixed_point_loop(A, pt.eye(2))  # fused: the fixed-point iteration Op
        blocks = iterops.block_diag(pt.stack([rho[0] * pt.eye(2), rho[1] * pt.eye(2)]))
        T = pt.reshape(rho[0], (1, 1))
        system = dict(T=T, Z=pt.ones((1, 1)), R=pt.ones((1, 1)), H=pt.reshape(pt.exp(b), (1, 1)), Q=pt.ones((1, 1)))
        P0 = pt.reshape(1.0 / (1.0 - rho[0] ** 2), (1, 1))
        ll = iterops.kalman_filter(Y[:, None], pt.zeros(1), P0, **system).loglik
        smoothed = iterops.kalman_smoother(Y[:, None], pt.zeros(1), P0, **system).smoothed_state[:, 0]
        x_toep = iterops.solve_toeplitz(pt.stack([pt.constant(2.0), rho[0], 0.5 * rho[1]]), pt.ones(3))
        phi = iterops.ts.pacf_to_ar(rho)
        pacf_back = iterops.ts.ar_to_pacf(phi)
        acov = iterops.ts.ar_to_acov(phi, 1.0, 3)
        ld = iterops.ts.levinson_durbin(acov, 2)
        yw_phi, yw_sigma2 = iterops.ts.yule_walker(acov, 2)
        lr = levinson_recursion(acov, 2)
        acv_x = iterops.acovf(X_DATA + a[0], 2)
        pm.Potential("terms", pt.sum([
            -0.5 * pt.trace(X), -0.5 * (pt.trace(X_doubling) + pt.trace(X_fixed)), -0.5 * (blocks**2).sum(), ll,
            -0.5 * (x_toep**2).sum(), -(phi**2).sum() - (pacf_back**2).sum(), -0.1 * acov.sum(),
            -(ld.ar**2).sum() - ld.sigma2 - (ld.pacf**2).sum(), -(yw_phi**2).sum() - yw_sigma2,
            -(lr.phi**2).sum() - lr.sigma2 - (lr.kappa**2).sum(), -0.1 * acv_x.sum(),
        ]))
        pm.Deterministic("blocks", blocks)
        pm.Deterministic("smoothed", smoothed)
    return model


def test_model_logp_matches_the_oracles():
    """The model is what the oracle says (so the sampler comparison below checks nutpie, not the model)."""
    model = all_ops_model()
    logp = model.compile_logp()
    rng = np.random.default_rng(0)
    for _ in range(3):
        a, b = rng.normal(size=2), rng.normal()
        np.testing.assert_allclose(logp({"a": a, "b": b}), oracle_logp(a, b), rtol=1e-9)


def test_every_op_in_nutpie_with_several_chains():
    model = all_ops_model()
    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = pm.sample(draws=30, tune=30, chains=3, random_seed=1, progressbar=False,
                          compute_convergence_checks=False)  # pm.sample's default sampler
    post = idata.posterior
    assert post.attrs.get("inference_library") == "nutpie"
    assert post.sizes["chain"] == 3
    a, b = np.asarray(post["a"]), np.asarray(post["b"])
    lp = np.asarray(idata.sample_stats["logp"])
    blocks, smoothed = np.asarray(post["blocks"]), np.asarray(post["smoothed"])
    for c in range(3):
        assert np.unique(a[c, :, 0]).size > 5  # the chain moved
        for d in range(0, 30, 6):
            np.testing.assert_allclose(lp[c, d], oracle_logp(a[c, d], b[c, d]), rtol=1e-8)
            parts = _parts(a[c, d], b[c, d])
            np.testing.assert_allclose(blocks[c, d], parts["blocks"], rtol=1e-12)
            np.testing.assert_allclose(smoothed[c, d], parts["smoothed"], rtol=1e-8, atol=1e-12)
