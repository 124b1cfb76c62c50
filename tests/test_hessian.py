"""Second derivatives through iterops' Ops: ``pytensor.hessian`` (reverse mode twice).

Oracles: central finite differences of the fused (first-order) gradient, itself checked against
statsmodels / Scan autodiff elsewhere; for a user's loop fused by the Scan rewrite, PyTensor's
second derivatives of that Scan (``SCAN_ORACLE``).  Where second derivatives are not implemented,
the error is a ``NotImplementedError`` naming the Op, the inputs and the order.

Graphs are run by ``perform`` (``as_run_by_python``): the same fused kernels, without the minutes a
cold Numba compile of a doubly differentiated Scan costs.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.gradient import jacobian

import iterops
from conftest import SCAN_ORACLE, as_run_by_python, first_then_slow, random_ar, random_pacf
from iterops import reference_loops as ref
from iterops import ts

RUN = as_run_by_python("NUMBA")


def _hessian_and_fd(cost_fn, x0, eps=1e-5, mode=RUN):
    """(Hessian of ``cost_fn`` at ``x0`` by reverse mode twice, central differences of the gradient)."""
    th = pt.vector("th", shape=(len(x0),))
    cost = cost_fn(th)
    g = pytensor.grad(cost, th)
    fg = pytensor.function([th], g, mode=mode)
    H = pytensor.function([th], jacobian(g, th), mode=mode)(x0)
    fd = np.stack([(fg(x0 + eps * e) - fg(x0 - eps * e)) / (2 * eps) for e in np.eye(len(x0))], axis=1)
    return H, fd


def _assert_hessian(cost_fn, x0, rtol=1e-6):
    H, fd = _hessian_and_fd(cost_fn, x0)
    scale = np.max(np.abs(fd))
    np.testing.assert_allclose(H, fd, rtol=0, atol=rtol * max(scale, 1.0))
    np.testing.assert_allclose(H, H.T, rtol=0, atol=1e-9 * max(scale, 1.0))
    return H


# ---------------------------------------------------------------------------
# AR maps, Levinson-Durbin, Toeplitz
# ---------------------------------------------------------------------------


def test_ar_maps_hessians_match_finite_differences(rng):
    pacf = random_pacf(rng, 4)
    phi = random_ar(rng, 3)
    w = rng.normal(size=6)
    _assert_hessian(lambda x: pt.sum(ts.pacf_to_ar(x) ** 3), pacf)
    _assert_hessian(lambda x: pt.sum(pt.tanh(ts.ar_to_pacf(x)) * w[:3]), phi)
    _assert_hessian(lambda x: pt.sum(ts.ar_to_acov(x[:3], x[3], 5) * w), np.r_[phi, 1.3])


def test_ar_map_hessian_batched_and_nan_outside_stationarity(rng):
    pacf = np.stack([random_pacf(rng, 3), random_pacf(rng, 3)])

    def cost(x):
        return pt.sum(ts.pacf_to_ar(x.reshape((2, 3))) ** 3)  # Blockwise over 2 rows

    _assert_hessian(cost, pacf.ravel())
    th = pt.vector("th", shape=(3,))
    g = pytensor.grad(pt.sum(ts.ar_to_pacf(th) ** 2), th)
    H = pytensor.function([th], jacobian(g, th), mode=RUN)(np.array([1.5, -0.2, 0.1]))  # not stationary
    assert np.all(np.isnan(H))


def test_levinson_durbin_hessians_match_finite_differences(rng):
    acov = np.array([4.0, 2.0, 0.5, 0.2])
    w = rng.normal(size=3)
    _assert_hessian(lambda x: pt.sum(ts.levinson_durbin(x, 3).pacf * w) + ts.levinson_durbin(x, 3).sigma2 ** 2, acov)
    _assert_hessian(lambda x: pt.sum(ts.levinson_durbin(x, 3).ar ** 3), acov)


def test_toeplitz_hessian_matches_finite_differences():
    x0 = np.array([3.0, 1.0, 0.5, 3.0, 0.7, -0.2, 1.0, -1.0, 2.0])
    _assert_hessian(lambda x: pt.sum(ts.solve_toeplitz((x[:3], x[3:6]), x[6:]) ** 2), x0)


def test_fused_levinson_loop_hessian_matches_the_scans():
    gamma0 = np.array([4.0, 2.0, 0.5, 0.2])

    def loop(x):
        phi, v, kappa = ref.levinson_loop(x, 3)
        return pt.sum(phi**3) + v**2 + pt.sum(kappa * np.array([0.3, -1.0, 2.0]))

    def fused(x):
        out = iterops.fuse_loops(loop(x))
        assert not any(type(n.op).__name__ == "Scan" for n in pytensor.graph.traversal.applys_between([x], [out]))
        return out

    H_fused = _assert_hessian(fused, gamma0)
    H_scan, _ = _hessian_and_fd(loop, gamma0, mode=SCAN_ORACLE)
    np.testing.assert_allclose(H_fused, H_scan, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------
# Kalman filter
# ---------------------------------------------------------------------------


def _kalman(y, th, **kw):
    """A 2-state, 2-observable model; ``th``: T's first row, sigma_eta, H_11, Z's second row, a0, P0 scale."""
    T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
    R = pt.as_tensor([[1.0], [0.0]])
    Q = pt.reshape(th[2] ** 2, (1, 1))
    H = pt.stack([pt.stack([th[3] ** 2, pt.as_tensor(0.1)]), pt.as_tensor([0.1, 0.7])])
    Z = pt.stack([pt.as_tensor([1.0, 0.0]), th[4:6]])
    return ts.kalman_filter(y, th[6:8], pt.eye(2) * th[8], T=T, Z=Z, R=R, H=H, Q=Q, **kw)


KALMAN_X0 = np.array([0.5, -0.2, 1.0, 0.5, 0.3, 0.8, 0.1, -0.2, 1.5])


@pytest.mark.parametrize("options", first_then_slow([{}, {"cov_jitter": 1e-3, "missing_value": -9999.0, "univariate": True}]))
def test_kalman_hessian_matches_finite_differences(rng, options):
    y = rng.normal(size=(12, 2))
    y[3, 0] = np.nan
    y[7] = np.nan
    y[9, 1] = -9999.0 if options else np.nan
    def cost(th):
        r = _kalman(y, th, **options)
        v = pt.switch(pt.isnan(r.forecast_error), 0.0, r.forecast_error)
        return r.loglik + 0.1 * pt.sum(r.filtered_state**2) + 0.3 * pt.sum(v) + pt.sum(r.predicted_cov[-1])

    _assert_hessian(cost, KALMAN_X0, rtol=2e-6)


def test_kalman_hessian_of_a_fused_loop_matches_the_scans(rng):
    n, m, p = 10, 2, 1
    y = rng.normal(size=(n, p))

    def loop(th):
        T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
        R = pt.as_tensor([[1.0], [0.0]])
        Q = pt.reshape(th[2] ** 2, (1, 1))
        Z = pt.as_tensor([[1.0, 0.0]])
        H = pt.reshape(th[3] ** 2, (1, 1))
        ll, _, _ = ref.kalman_textbook_loop(pt.as_tensor(y), pt.zeros(m), pt.eye(m), T, Z, R, H, Q)
        return ll.sum()

    def fused(th):
        out = iterops.fuse_loops(loop(th))
        assert not any(type(nd.op).__name__ == "Scan" for nd in pytensor.graph.traversal.applys_between([th], [out]))
        return out

    x0 = np.array([0.5, -0.2, 1.0, 0.6])
    H_fused = _assert_hessian(fused, x0)
    H_scan, _ = _hessian_and_fd(loop, x0, mode=SCAN_ORACLE)
    np.testing.assert_allclose(H_fused, H_scan, rtol=1e-8, atol=1e-8)


# ---------------------------------------------------------------------------
# The clear error where second derivatives are not implemented
# ---------------------------------------------------------------------------


def _second_derivative(cost_fn, k):
    th = pt.vector("th", shape=(k,))
    g = pytensor.grad(cost_fn(th), th)
    return pytensor.grad(g.sum(), th)


def test_diffuse_kalman_second_derivative_raises_not_implemented(rng):
    y = rng.normal(size=(8, 2))
    with pytest.raises(NotImplementedError, match=r"order 2.*KalmanFilterDiffuseGrad.*P_inf"):
        _second_derivative(lambda th: _kalman(y, th, diffuse=[True, False]).loglik, 9)


def test_lyapunov_loop_second_derivative_raises_not_implemented():
    def cost(th):
        A = th.reshape((2, 2))
        return pt.sum(iterops.linalg.smith_doubling_loop(A, pt.eye(2), 1e-12, 100)[1] ** 2)

    with pytest.raises(NotImplementedError, match=r"order 2.*smith_doubling_loop.*SmithDoublingLoopGrad.*A, Q"):
        _second_derivative(cost, 4)


# ---------------------------------------------------------------------------
# pymc-extras' Laplace family on a model whose likelihood is kalman_filter
# ---------------------------------------------------------------------------


def _ar2_noise_model(rng, n=30):
    """README's model: a stationary AR(2) observed with noise, the filter's log-likelihood a Potential."""
    import pymc as pm  # noqa: PLC0415

    x = np.zeros(n + 50)
    for t in range(2, n + 50):
        x[t] = 0.6 * x[t - 1] - 0.3 * x[t - 2] + rng.normal()
    y = x[50:] + 0.5 * rng.normal(size=n)

    def logp(y, phi, sigma_x, sigma_y):
        T = pt.stack([phi, pt.as_tensor([1.0, 0.0])])
        R = pt.as_tensor([[1.0], [0.0]])
        Q = pt.reshape(sigma_x**2, (1, 1))
        P0 = iterops.solve_discrete_lyapunov(T, R @ Q @ R.T)
        return ts.kalman_filter(y[:, None], pt.zeros(2), P0, T=T, Z=pt.as_tensor([[1.0, 0.0]]), R=R,
                                H=pt.reshape(sigma_y**2, (1, 1)), Q=Q).loglik

    with pm.Model() as model:
        pacf = pm.Uniform("pacf", -1.0, 1.0, shape=2)
        phi = pm.Deterministic("phi", ts.pacf_to_ar(pacf))
        sigma_x = pm.HalfNormal("sigma_x", 2.0)
        sigma_y = pm.HalfNormal("sigma_y", 2.0)
        pm.Potential("loglik", logp(pt.as_tensor(y), phi, sigma_x, sigma_y))
    return model


@pytest.mark.slow  # minutes: trust-ncg runs many Hessian-vector products through the filter's Scan
def test_pymc_extras_find_map_hessian_and_fit_laplace(rng):
    import pymc as pm  # noqa: PLC0415
    from pymc_extras.inference import find_MAP, fit_laplace  # noqa: PLC0415

    model = _ar2_noise_model(rng)
    kw = dict(model=model, progressbar=False, compile_kwargs={"mode": RUN}, random_seed=1)
    idata = find_MAP(method="trust-ncg", compute_hessian=True, **kw)  # Hessian-vector products, exact
    cov = idata.fit["covariance_matrix"].values
    mean = idata.fit["mean_vector"].values
    # oracle: central differences of the (fused, first-order) gradient of -logp at the MAP point
    [neg_logp], flat = pm.pytensorf.join_nonshared_inputs(
        model.initial_point(), [-model.logp(jacobian=False)], model.continuous_value_vars
    )
    fg = pytensor.function([flat], pytensor.grad(neg_logp, flat), mode=RUN)
    eps = 1e-5
    fd = np.stack([(fg(mean + eps * e) - fg(mean - eps * e)) / (2 * eps) for e in np.eye(len(mean))], axis=1)
    np.testing.assert_allclose(cov, np.linalg.inv(0.5 * (fd + fd.T)), rtol=1e-4, atol=1e-6)

    laplace = fit_laplace(optimize_method="trust-ncg", draws=100, optimizer_kwargs={}, **kw)
    np.testing.assert_allclose(laplace.fit["covariance_matrix"].values, cov, rtol=1e-6)
    phi = laplace.posterior["phi"].values
    assert phi.shape[-1] == 2 and np.all(np.isfinite(phi))
