"""Second derivatives through iterops' Ops: ``pytensor.hessian`` (reverse mode twice), Hessian-vector
products, JAX, and pymc-extras' Laplace family on iterops models.

Oracles: central finite differences of the fused (first-order) gradient, itself checked against
statsmodels / Scan autodiff elsewhere; for a user's loop fused by the Scan rewrite, PyTensor's
second derivatives of that Scan (``SCAN_ORACLE``); for pymc-extras' ``find_MAP`` / ``fit_laplace``,
the same model on its Scan with the rewrite off.  Where second derivatives are not implemented,
the error is a ``NotImplementedError`` naming the Op, the inputs and the order.

Graphs are run by ``perform`` (``as_run_by_python``): the same fused kernels, without the minutes a
cold Numba compile of a doubly differentiated Scan costs.
"""

from collections import Counter

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.gradient import hessian_vector_product, jacobian

import iterops
from conftest import FAST_PY, SCAN_ORACLE, as_run_by_python, first_then_slow, random_ar, random_pacf
from iterops import examples, ts
from iterops import reference_loops as ref

RUN = as_run_by_python("NUMBA")


def _hessian_and_fd(cost_fn, x0, eps=1e-5, mode=RUN, static=True):
    """(Hessian of ``cost_fn`` at ``x0`` by reverse mode twice, central differences of the gradient);
    ``static=False``: the parameter vector's length is symbolic."""
    th = pt.vector("th", shape=(len(x0) if static else None,))
    cost = cost_fn(th)
    g = pytensor.grad(cost, th)
    fg = pytensor.function([th], g, mode=mode)
    H = pytensor.function([th], jacobian(g, th), mode=mode)(x0)
    fd = np.stack([(fg(x0 + eps * e) - fg(x0 - eps * e)) / (2 * eps) for e in np.eye(len(x0))], axis=1)
    return H, fd


def _assert_hessian(cost_fn, x0, rtol=1e-6, static=True):
    H, fd = _hessian_and_fd(cost_fn, x0, static=static)
    scale = np.max(np.abs(fd))
    np.testing.assert_allclose(H, fd, rtol=0, atol=rtol * max(scale, 1.0))
    np.testing.assert_allclose(H, H.T, rtol=0, atol=1e-9 * max(scale, 1.0))
    return H


# ---------------------------------------------------------------------------
# Every public Op: Hessian of a cost of its outputs = finite differences of its gradient
# ---------------------------------------------------------------------------

A0 = np.array([[0.5, 0.1], [-0.2, 0.3]])
Q0 = np.array([[1.0, 0.2], [0.2, 0.5]])
X_LYAP = np.r_[A0.ravel(), Q0.ravel()]


def _mats(x):
    return x[:4].reshape((2, 2)), x[4:8].reshape((2, 2))


def _dare(x):
    A, B = x[:4].reshape((2, 2)), x[4:6].reshape((2, 1))
    return pt.sum(iterops.linalg.solve_discrete_are(A, B, pt.eye(2) * x[6], pt.reshape(x[7] ** 2, (1, 1))) ** 2)


def _lyapunov_batched(x):
    A, Q = _mats(x)
    return pt.sum(iterops.solve_discrete_lyapunov(pt.stack([A, 0.5 * A]), Q) ** 2)  # Blockwise over A's rows


def _stationary_cov(x):
    R = pt.as_tensor([[1.0], [0.5]])
    return pt.sum(ts.stationary_cov(x[:4].reshape((2, 2)), R, pt.reshape(x[4] ** 2, (1, 1))) ** 2)


def _yule_walker(x):
    phi, sigma2 = ts.yule_walker(x, 3)
    return pt.sum(phi**3) + sigma2**2


OPS = {
    "solve_discrete_lyapunov": (lambda x: pt.sum(iterops.solve_discrete_lyapunov(*_mats(x)) ** 2), X_LYAP),
    "solve_discrete_lyapunov schur": (
        lambda x: pt.sum(iterops.solve_discrete_lyapunov(*_mats(x), method="schur") ** 2), X_LYAP),
    "solve_discrete_lyapunov batched": (_lyapunov_batched, X_LYAP),
    "solve_discrete_are": (_dare, np.r_[A0.ravel(), 1.0, 0.5, 1.2, 0.8]),
    "stationary_cov": (_stationary_cov, np.r_[A0.ravel(), 0.7]),
    "block_diag": (lambda x: pt.sum(iterops.block_diag(x[:4].reshape((2, 2)), x[4:6].reshape((1, 2))) ** 3),
                   np.array([0.3, -1.2, 0.5, 2.0, -0.7, 1.1])),
    "acovf": (lambda x: pt.sum(ts.acovf(x, 3) ** 2), np.array([0.3, -1.2, 0.5, 2.0, -0.7, 1.1, 0.2])),
    "yule_walker": (_yule_walker, np.array([4.0, 2.0, 0.5, 0.2])),
    "smith_doubling_loop": (
        lambda x: pt.sum(iterops.linalg.smith_doubling_loop(*_mats(x), 1e-12, 100)[1] ** 2), X_LYAP),
    "lyapunov_fixed_point_loop": (
        lambda x: pt.sum(iterops.linalg.lyapunov_fixed_point_loop(*_mats(x), pt.eye(2), 1e-13, 500) ** 2), X_LYAP),
    "lyapunov_fixed_point_loop damped": (
        lambda x: pt.sum(iterops.linalg.lyapunov_fixed_point_loop(*_mats(x[:8]), pt.eye(2), 1e-13, 500, w=x[8]) ** 2),
        np.r_[X_LYAP, 0.7]),
}


@pytest.mark.parametrize("name", list(OPS))
def test_op_hessian_matches_finite_differences(name):
    cost, x0 = OPS[name]
    _assert_hessian(cost, x0)


# ---------------------------------------------------------------------------
# A user's loop fused by the Scan rewrite: the Hessian of the fused Op = the Scan's own
# ---------------------------------------------------------------------------


def _no_scan(x, out):
    assert not any(type(n.op).__name__ == "Scan" for n in pytensor.graph.traversal.applys_between([x], [out]))
    return out


LOOPS = {
    "doubling_loop": (lambda x: pt.sum(ref.doubling_loop(*_mats(x)) ** 2), X_LYAP),
    "fixed_point_loop": (lambda x: pt.sum(ref.fixed_point_loop(*_mats(x), tol=1e-13, n_steps=500) ** 2), X_LYAP),
    "damped_fixed_point_loop": (
        lambda x: pt.sum(ref.damped_fixed_point_loop(*_mats(x[:8]), x[8], tol=1e-13, n_steps=500) ** 2),
        np.r_[X_LYAP, 0.7]),
    "block_diag_loop": (lambda x: pt.sum(ref.block_diag_loop(x.reshape((2, 2, 2))) ** 3),
                        np.array([0.3, -1.2, 0.5, 2.0, -0.7, 1.1, 0.2, 0.9])),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_fused_loop_hessian_matches_the_scans(name):
    loop, x0 = LOOPS[name]
    H_fused = _assert_hessian(lambda x: _no_scan(x, iterops.fuse_loops(loop(x))), x0)
    H_scan, _ = _hessian_and_fd(loop, x0, mode=SCAN_ORACLE)
    np.testing.assert_allclose(H_fused, H_scan, rtol=1e-9, atol=1e-9)


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


@pytest.mark.parametrize("fn", ["pacf_to_ar", "ar_to_pacf", "ar_to_acov"])
def test_ar_map_hessian_of_a_symbolic_order(rng, fn):
    """``p`` unknown at graph build: second derivatives through the lattice written as Scans."""
    w = rng.normal(size=6)
    cost = {"pacf_to_ar": lambda x: pt.sum(ts.pacf_to_ar(x) ** 3),
            "ar_to_pacf": lambda x: pt.sum(pt.tanh(ts.ar_to_pacf(x)) * w[:3]),
            "ar_to_acov": lambda x: pt.sum(ts.ar_to_acov(x, 1.3, 5) * w)}[fn]
    x0 = random_pacf(rng, 3) if fn == "pacf_to_ar" else random_ar(rng, 3)
    _assert_hessian(cost, x0, static=False)


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


def test_batched_kalman_hessian_matches_finite_differences(rng):
    """Two series with their own T (Blockwise over the leading axis)."""
    y = rng.normal(size=(2, 8, 1))

    def cost(th):
        T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
        Q, H = pt.reshape(th[2] ** 2, (1, 1)), pt.reshape(th[3] ** 2, (1, 1))
        r = ts.kalman_filter(y, pt.zeros(2), pt.eye(2), T=pt.stack([T, 0.9 * T]), Z=pt.as_tensor([[1.0, 0.0]]),
                             R=pt.as_tensor([[1.0], [0.0]]), H=H, Q=Q)
        return pt.sum(r.loglik * np.array([1.0, 0.5]))

    _assert_hessian(cost, np.array([0.5, -0.2, 1.0, 0.6]))


def test_kalman_hessian_vector_product_is_a_few_filter_passes(rng):
    """``hessian_vector_product`` (reverse mode twice): one filter, one adjoint Op and one fused second-derivative
    Op, no Scan, whatever the number of parameters; equal to central differences of the gradient along ``v``."""
    y = rng.normal(size=(12, 2))
    th, v = pt.vector("th", shape=(9,)), pt.vector("v", shape=(9,))
    cost = _kalman(y, th).loglik
    g = pytensor.grad(cost, th)
    f = pytensor.function([th, v], hessian_vector_product(cost, th, v), mode=RUN)
    ops = Counter(type(n.op).__name__ for n in f.maker.fgraph.apply_nodes)
    assert ops["KalmanFilter"] == 1 and ops["KalmanFilterGrad"] == 1 and ops["KalmanFilterHVP"] == 1, ops
    assert ops["Scan"] == 0, ops
    fg = pytensor.function([th], g, mode=RUN)
    v0, eps = rng.normal(size=9), 1e-5
    fd = (fg(KALMAN_X0 + eps * v0) - fg(KALMAN_X0 - eps * v0)) / (2 * eps)
    np.testing.assert_allclose(f(KALMAN_X0, v0), fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


def _one_observable_kalman(y, th):
    """A 2-state model with one observable (F is 1 x 1); ``th``: T's first row, sigma_eta, sigma_eps."""
    T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
    return ts.kalman_filter(y, pt.zeros(2), pt.eye(2), T=T, Z=pt.as_tensor([[1.0, 0.0]]),
                            R=pt.as_tensor([[1.0], [0.0]]), H=pt.reshape(th[3] ** 2, (1, 1)),
                            Q=pt.reshape(th[2] ** 2, (1, 1))).loglik


@pytest.mark.parametrize("options", [{}, {"cov_jitter": 1e-3, "missing_value": -9999.0}])
def test_one_observable_kalman_hessian_with_missing_values(rng, options):
    """One observable (the pullback's scalar branch, no LAPACK): missing values, every output in the cost,
    Hessian = central differences of the gradient; where F is not positive definite, the filter's documented
    ``loglik = -inf`` and a NaN Hessian."""
    y = rng.normal(size=(12, 1))
    y[3], y[7] = np.nan, (-9999.0 if options else np.nan)

    def filt(th, H):
        T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
        return ts.kalman_filter(y, th[4:6], pt.eye(2) * th[6], T=T, Z=pt.as_tensor([[1.0, 0.3]]),
                                R=pt.as_tensor([[1.0], [0.0]]), H=pt.reshape(H, (1, 1)),
                                Q=pt.reshape(th[2] ** 2, (1, 1)), **options)

    def cost(th):
        r = filt(th, th[3] ** 2)
        v = pt.switch(pt.isnan(r.forecast_error), 0.0, r.forecast_error)
        return r.loglik + 0.1 * pt.sum(r.filtered_state**2) + 0.3 * pt.sum(v) + pt.sum(r.predicted_cov[-1])

    _assert_hessian(cost, np.array([0.5, -0.2, 1.0, 0.6, 0.1, -0.3, 1.5]), rtol=2e-6)
    # H = -3 with P0 = I: F = 1 + 0.09 - 3 < 0 at the first step
    th = pt.vector("th", shape=(7,))
    ll = filt(th, th[3]).loglik
    f = pytensor.function([th], [ll, jacobian(pytensor.grad(ll, th), th)], mode=RUN)
    ll_bad, H_bad = f(np.array([0.5, -0.2, 1.0, -3.0, 0.1, -0.3, 1.0]))
    assert ll_bad == -np.inf and np.all(np.isnan(H_bad))


def test_kalman_hessian_vector_product_with_one_observable_compiles_under_numba(rng):
    """The default (Numba) mode, not ``perform``: equal to central differences of the gradient."""
    y = rng.normal(size=(10, 1))
    y[4] = np.nan
    th, v = pt.vector("th", shape=(4,)), pt.vector("v", shape=(4,))
    cost = _one_observable_kalman(y, th)
    f = pytensor.function([th, v], hessian_vector_product(cost, th, v))
    fg = pytensor.function([th], pytensor.grad(cost, th))
    x0, v0, eps = np.array([0.5, -0.2, 1.0, 0.6]), rng.normal(size=4), 1e-5
    fd = (fg(x0 + eps * v0) - fg(x0 - eps * v0)) / (2 * eps)
    np.testing.assert_allclose(f(x0, v0), fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


def _structural_model(n=20):
    """pymc-extras' local linear trend + seasonal (4) + measurement error, its filter Scan fused on ``import
    iterops`` (``P0 = 10 I``)."""
    return examples.pymc_extras_structural_model(_local_level_data(n)[:, None], 4)


@pytest.mark.slow  # a cold Numba compile of d2logp: the Hessian's Jacobian Scan around the filter's Scans (minutes)
def test_structural_model_d2logp_compiles_under_numba():
    """A pymc-extras structural model fused by the rewrite: ``compile_d2logp`` in the default (Numba) mode
    equals central differences of its ``dlogp``."""
    import warnings  # noqa: PLC0415

    warnings.simplefilter("ignore")
    model = _structural_model()
    point = model.initial_point()
    d2logp = model.compile_d2logp()  # the default mode: Numba
    dlogp = model.compile_dlogp(mode=RUN)
    assert not _has_scan(model, fused=True)
    names = [v.name for v in model.continuous_value_vars]
    sizes = [np.size(point[k]) for k in names]
    x0 = np.concatenate([np.ravel(point[k]) + 0.1 for k in names])

    def unravel(x):
        parts = np.split(x, np.cumsum(sizes)[:-1])
        return {k: np.reshape(p, np.shape(point[k])) for k, p in zip(names, parts)}

    H = d2logp(unravel(x0))
    eps = 1e-5
    fd = np.stack([(dlogp(unravel(x0 + eps * e)) - dlogp(unravel(x0 - eps * e))) / (2 * eps)
                   for e in np.eye(len(x0))], axis=1)
    # PyMC's d2logp is the Hessian of -logp
    np.testing.assert_allclose(H, -fd, rtol=0, atol=2e-6 * np.max(np.abs(fd)))


# ---------------------------------------------------------------------------
# JAX: PyTensor's Hessian graph under mode="JAX", and JAX's own reverse-over-reverse
# ---------------------------------------------------------------------------


def _jax_cases():
    def lyapunov(x):
        return pt.sum(iterops.solve_discrete_lyapunov(*_mats(x)) ** 2)

    y = np.random.default_rng(3).normal(size=(10, 2))
    y[4, 1] = np.nan
    return {"solve_discrete_lyapunov": (lyapunov, X_LYAP),
            "kalman_filter": (lambda x: _kalman(y, x).loglik, KALMAN_X0)}


@pytest.mark.parametrize("name", ["solve_discrete_lyapunov", "kalman_filter"])
def test_jax_hessians_match_finite_differences(name):
    import jax  # noqa: PLC0415
    from pytensor.compile import mode as pt_mode  # noqa: PLC0415
    from pytensor.graph.fg import FunctionGraph  # noqa: PLC0415
    from pytensor.link.jax.dispatch import jax_funcify  # noqa: PLC0415

    jax.config.update("jax_enable_x64", True)
    cost, x0 = _jax_cases()[name]
    # PyTensor's Hessian graph, every Op in JAX; oracle: central differences of the JAX gradient (which
    # test_jax checks against the Numba gradient)
    H_pt, fd = _hessian_and_fd(cost, x0, mode="JAX")
    scale = max(np.max(np.abs(fd)), 1.0)
    np.testing.assert_allclose(H_pt, fd, rtol=0, atol=2e-6 * scale)
    th = pt.vector("th", shape=(len(x0),))
    fgraph = FunctionGraph([th], [cost(th)], clone=True)
    pt_mode.JAX.optimizer.rewrite(fgraph)
    f = jax_funcify(fgraph)
    H_jax = jax.jacrev(jax.jacrev(lambda t: f(t)[0]))(x0)  # reverse over the custom_vjp rules
    np.testing.assert_allclose(np.asarray(H_jax), fd, rtol=0, atol=2e-6 * scale)


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


@pytest.mark.slow  # about a minute: Numba compiles the loss, gradient and Hessian-vector product graphs
def test_pymc_extras_find_map_hessian_and_fit_laplace(rng):
    """find_MAP(compute_hessian=True) and fit_laplace as a user calls them: the default (Numba) mode, the Kalman
    filter's second derivatives by its fused kernel; the covariance is the inverse of central differences of the
    gradient at the MAP."""
    import pymc as pm  # noqa: PLC0415
    from pymc_extras.inference import find_MAP, fit_laplace  # noqa: PLC0415

    model = _ar2_noise_model(rng)
    kw = dict(model=model, progressbar=False, random_seed=1)
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


def _local_level_data(n=30, seed=5):
    rng = np.random.default_rng(seed)
    return 10.0 + np.cumsum(rng.normal(size=n)) + 0.7 * rng.normal(size=n)


def _laplace_family_models(name):
    """(model on iterops, the same model on its Scan): ``kalman_filter`` called directly (demo's local level,
    whose Scan twin is the textbook filter Scan and PyTensor's ops), or pymc-extras' structural local linear
    trend (one builder: the rewrite fuses its filter Scan unless fusion is disabled)."""

    y = _local_level_data()
    if name == "kalman_filter":
        return examples.local_level_model(y, "iterops"), examples.local_level_model(y, "scan")
    return (examples.pymc_extras_local_linear_trend_model(y[:, None]),
            examples.pymc_extras_local_linear_trend_model(y[:, None]))


@pytest.mark.parametrize("name", first_then_slow(["structural", "kalman_filter"]))  # ~1.5 CPU min each
def test_pymc_extras_laplace_family_on_iterops_models(name):
    """find_MAP, fit_laplace (find_MAP(compute_hessian=True) inside) and fit(method="pathfinder") run on the fused
    model; the MAP and the Laplace covariance equal find_MAP(compute_hessian=True)'s on the same model's Scan
    (rewrite off).

    trust-ncg starts at the MAP (found by L-BFGS-B on the fused model), so the optimizer takes a step or two and
    the covariance is the inverse of the exact Hessian there, built from Hessian-vector products: through the
    fused filter's second derivatives on one side, through PyTensor's second derivatives of the Scan on the other
    (trust-ncg from the initial point, many Hessian-vector products: the slow
    ``test_pymc_extras_find_map_hessian_and_fit_laplace``).  ``vectorize_draws=False`` and
    ``vectorize_postprocessing=False``: pymc-extras' vectorized draws leave a constant Deterministic (its state
    space models' ``P0 = 10 I``) without the draw dimensions, and arviz then raises on its dims; a plain PyMC
    model with such a Deterministic fails the same way without iterops."""
    import warnings  # noqa: PLC0415

    from pymc_extras.inference import find_MAP, fit, fit_laplace  # noqa: PLC0415

    warnings.simplefilter("ignore")
    fused, scan = _laplace_family_models(name)
    kw = dict(progressbar=False, random_seed=1, method="trust-ncg")
    start = find_MAP(model=fused, method="L-BFGS-B", compile_kwargs={"mode": FAST_PY}, progressbar=False)
    initvals = {v.name: start.posterior[v.name].values[0, 0] for v in fused.free_RVs}
    with iterops.fusion.disabled():
        oracle = find_MAP(model=scan, compute_hessian=True, initvals=initvals, compile_kwargs={"mode": SCAN_ORACLE},
                          **kw).fit
    assert _has_scan(scan, fused=False) and not _has_scan(fused, fused=True)

    laplace = fit_laplace(model=fused, optimize_method=kw.pop("method"), initvals=initvals, draws=50,
                          vectorize_draws=False, compile_kwargs={"mode": FAST_PY}, **kw)
    np.testing.assert_allclose(laplace.fit["mean_vector"].values, oracle["mean_vector"].values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(laplace.fit["covariance_matrix"].values, oracle["covariance_matrix"].values,
                               rtol=1e-4, atol=1e-8)
    assert all(np.all(np.isfinite(v.values)) for v in laplace.posterior.data_vars.values())

    pf = fit(method="pathfinder", model=fused, num_paths=2, num_draws=100, num_draws_per_path=50, parallel=False,
             vectorize_postprocessing=False, compile_kwargs={"mode": FAST_PY}, **kw)
    draws = np.concatenate([np.reshape(pf.posterior[v].values, (-1, int(np.prod(pf.posterior[v].shape[2:]))))
                            for v in pf.posterior.data_vars], axis=1)
    assert np.all(np.isfinite(draws)) and draws.shape[0] == 100


def _has_scan(model, fused):
    """Whether ``model``'s compiled logp-gradient graph holds a Scan (with iterops' rewrites, or without)."""
    import contextlib  # noqa: PLC0415

    from pytensor.scan.op import Scan  # noqa: PLC0415

    with contextlib.nullcontext() if fused else iterops.fusion.disabled():
        f = model.compile_dlogp(mode=RUN if fused else SCAN_ORACLE)
    return any(isinstance(n.op, Scan) for n in f.f.maker.fgraph.apply_nodes)


@pytest.mark.slow  # a few minutes: Numba compiles the loss, gradient, Hessian-vector product and pathfinder graphs
def test_laplace_family_on_the_pymc_extras_structural_model_under_numba():
    """find_MAP(compute_hessian=True), fit_laplace and pathfinder on pymc-extras' structural model (level + trend +
    12-month seasonal + measurement error, 13 states) as a user calls them: the default (Numba) mode, the filter
    fused on ``import iterops``, its second derivatives by the fused kernel.  Oracle: the same model's Scan
    (iterops' rewrites off, run by ``perform``): its gradient vanishes at the MAP, and the inverse of central
    differences of its gradient there is the Laplace covariance."""
    import warnings  # noqa: PLC0415

    import pymc as pm  # noqa: PLC0415
    from pymc_extras.inference import find_MAP, fit, fit_laplace  # noqa: PLC0415

    warnings.simplefilter("ignore")
    rng = np.random.default_rng(4)
    t = np.arange(48)
    y = 300 + 0.1 * t + 3 * np.sin(2 * np.pi * t / 12) + np.cumsum(rng.normal(0, 0.3, 48)) + rng.normal(0, 0.2, 48)
    y[[7, 30]] = np.nan
    model = examples.pymc_extras_structural_model(y[:, None], 12)
    assert not _has_scan(model, fused=True) and _has_scan(model, fused=False)
    kw = dict(model=model, progressbar=False, random_seed=1)
    idata = find_MAP(method="trust-ncg", compute_hessian=True, **kw)
    mean, cov = idata.fit["mean_vector"].values, idata.fit["covariance_matrix"].values

    # find_MAP's vector orders the value variables its own way (its rows name them): the oracle reads it alike
    names = list(dict.fromkeys(str(r).split("[")[0] for r in idata.fit["mean_vector"].coords["rows"].values))
    value_vars = {v.name: v for v in model.continuous_value_vars}
    with iterops.fusion.disabled():
        [neg_logp], flat = pm.pytensorf.join_nonshared_inputs(
            model.initial_point(), [-model.logp(jacobian=False)], [value_vars[n] for n in names])
        scan_grad = pytensor.function([flat], pytensor.grad(neg_logp, flat), mode=SCAN_ORACLE)
    g = scan_grad(mean)
    assert np.max(np.abs(g)) < 1e-4 * max(1.0, np.max(np.abs(scan_grad(mean + 0.1))))
    eps = 1e-5
    fd = np.stack([(scan_grad(mean + eps * e) - scan_grad(mean - eps * e)) / (2 * eps) for e in np.eye(len(mean))],
                  axis=1)
    np.testing.assert_allclose(cov, np.linalg.inv(0.5 * (fd + fd.T)), rtol=1e-4, atol=1e-6 * np.max(np.abs(cov)))

    laplace = fit_laplace(optimize_method="trust-ncg", draws=100, vectorize_draws=False, **kw)
    np.testing.assert_allclose(laplace.fit["covariance_matrix"].values, cov, rtol=1e-6,
                               atol=1e-9 * np.max(np.abs(cov)))
    assert all(np.all(np.isfinite(v.values)) for v in laplace.posterior.data_vars.values())

    pf = fit(method="pathfinder", num_paths=2, num_draws=100, num_draws_per_path=50, parallel=False,
             vectorize_postprocessing=False, **kw)
    assert all(np.all(np.isfinite(v.values)) for v in pf.posterior.data_vars.values())
