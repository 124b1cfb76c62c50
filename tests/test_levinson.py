"""levinson_durbin, yule_walker, acovf (iterops.ts.levinson) against statsmodels, dense solves and finite differences."""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg as sl
from pytensor.gradient import verify_grad
from statsmodels.regression.linear_model import yule_walker as sm_yule_walker
from statsmodels.tsa.stattools import acovf as sm_acovf
from statsmodels.tsa.stattools import levinson_durbin as sm_levinson_durbin

from conftest import evaluate, jacobian_check, random_ar, sm_acov
import iterops
from iterops.ts import acovf, levinson_durbin, yule_walker

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

ATOL = 1e-10
# Gradient and batching checks compile many small graphs: use the Python linker (whose perform
# runs the same Numba kernels); every linker is covered by the ``mode``-parametrized tests.
FAST = "FAST_COMPILE"


# ---------------------------------------------------------------------------
# levinson_durbin, yule_walker, acovf
# ---------------------------------------------------------------------------


def test_levinson_durbin_matches_statsmodels_every_linker(mode, rng):
    phi = random_ar(rng, 4)
    acov = sm_acov(phi, 1.7, 6) + np.r_[0.05, np.zeros(6)]  # a generic PD sequence, not exactly AR(4)
    a = pt.vector("acov")
    res = levinson_durbin(a, 5)
    fn = pytensor.function([a], list(res) + list(yule_walker(a, 3)), mode=mode)
    ar, sigma2, pacf, phi3, s3 = fn(acov)
    sm = sm_levinson_durbin(acov, nlags=5, isacov=True)
    np.testing.assert_allclose(ar, sm.arcoefs, atol=ATOL)
    np.testing.assert_allclose(sigma2, sm.sigma_v, atol=ATOL)
    np.testing.assert_allclose(pacf, sm.pacf[1:], atol=ATOL)
    sm3 = sm_levinson_durbin(acov, nlags=3, isacov=True)
    np.testing.assert_allclose(phi3, sm3.arcoefs, atol=ATOL)
    np.testing.assert_allclose(s3, sm3.sigma_v, atol=ATOL)
    # the Yule-Walker equations themselves
    np.testing.assert_allclose(sl.toeplitz(acov[:5]) @ ar, acov[1:6], atol=1e-10)


@pytest.mark.parametrize("method", ["mle", "adjusted"])
def test_yule_walker_of_acovf_matches_statsmodels(method, rng):
    x = rng.normal(size=80).cumsum() * 0.2 + rng.normal(size=80)
    xv = pt.vector("x")
    order = 4
    phi, sigma2 = yule_walker(acovf(xv, order, adjusted=method == "adjusted"), order)
    got_phi, got_s2 = pytensor.function([xv], [phi, sigma2], mode=FAST)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rho, sigma = sm_yule_walker(x, order, method=method)
    np.testing.assert_allclose(got_phi, rho, atol=1e-10)
    np.testing.assert_allclose(got_s2, sigma**2, atol=1e-10)


@pytest.mark.parametrize("demean", [True, False])
@pytest.mark.parametrize("adjusted", [True, False])
def test_acovf_matches_statsmodels(demean, adjusted, rng):
    x = rng.normal(size=(2, 30)) + 0.5
    got = evaluate(acovf(x, 7, demean=demean, adjusted=adjusted))
    for i in range(2):
        want = sm_acovf(x[i], nlag=7, demean=demean, adjusted=adjusted, fft=False)
        np.testing.assert_allclose(got[i], want, atol=1e-12)


def test_acovf_grad(rng):
    x = rng.normal(size=12)
    verify_grad(lambda x: acovf(x, 5), [x], rng=rng, mode=FAST)
    verify_grad(lambda x: acovf(x, 11, adjusted=True, demean=False), [x], rng=rng, mode=FAST)
    verify_grad(lambda x: yule_walker(acovf(x, 3), 3)[0], [x], rng=rng, mode=FAST)


@pytest.mark.parametrize("adjusted", [False, True])
def test_acovf_float32_gradient_compiles_in_numba_mode(adjusted, rng):
    """Regression: the gradient of a float32 ``acovf`` divided by an int64 length, upcast its kernel to
    float64 and handed PyTensor's Numba ``convolve1d`` mixed dtypes, which failed to compile (found by
    ``python -m iterops.warmup --all-dtypes``).  Oracle: the closed form, for ``demean=False``,
    ``d sum_k acov_k / dx_m = sum_k (x_{m-k} + x_{m+k}) / d_k``."""
    n, L = 9, 3
    x = pt.vector("x", dtype="float32")
    acov = acovf(x, L, demean=False, adjusted=adjusted)
    fn = pytensor.function([x], [acov, pytensor.grad(acov.sum(), x)])
    xv = rng.normal(size=n).astype("float32")
    got_acov, got_grad = fn(xv)
    assert got_acov.dtype == got_grad.dtype == np.float32
    xd = xv.astype(float)
    want = np.zeros(n)
    for k in range(L + 1):
        dk = n - k if adjusted else n
        want[k:] += xd[: n - k] / dk
        want[: n - k] += xd[k:] / dk
    np.testing.assert_allclose(got_grad, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_acov, sm_acovf(xd, nlag=L, demean=False, adjusted=adjusted, fft=False),
                               rtol=1e-5, atol=1e-6)


def test_levinson_durbin_batched_vs_looped(rng):
    acovs = np.stack([sm_acov(random_ar(rng, 3), s, 5) for s in (0.5, 1.0, 2.0)])
    ar, sigma2, pacf = evaluate(*levinson_durbin(acovs, 4))
    for i in range(3):
        sm = sm_levinson_durbin(acovs[i], nlags=4, isacov=True)
        np.testing.assert_allclose(ar[i], sm.arcoefs, atol=ATOL)
        np.testing.assert_allclose(sigma2[i], sm.sigma_v, atol=ATOL)
        np.testing.assert_allclose(pacf[i], sm.pacf[1:], atol=ATOL)


@pytest.mark.parametrize("output", [0, 1, 2])
def test_levinson_durbin_grad(output, rng):
    acov = sm_acov(random_ar(rng, 3), 1.3, 5) + np.r_[0.1, np.zeros(5)]
    verify_grad(lambda a: levinson_durbin(a, 4)[output], [acov], rng=rng, mode=FAST)


def test_levinson_durbin_grad_all_outputs_batched(rng):
    acovs = np.stack([sm_acov(random_ar(rng, 3), s, 4) for s in (0.7, 1.5)])

    def f(a):
        ar, s2, pacf = levinson_durbin(a, 3)
        return ar.sum(-1) * s2 + pacf[..., 1] ** 2

    verify_grad(f, [acovs], rng=rng, mode=FAST)


def test_levinson_durbin_pushforward(rng):
    acov = sm_acov(random_ar(rng, 3), 1.3, 4)
    a = pt.vector("a")
    for out in levinson_durbin(a, 3):
        jacobian_check(out, a, acov, rng.normal(size=5))


def test_yule_walker_grad_matches_dense_solve(rng):
    """Gradient of (phi, sigma2) equals autodiff of the dense Yule-Walker solve."""
    acov = sm_acov(random_ar(rng, 5), 1.0, 5)
    a = pt.vector("a")
    w = rng.normal(size=5)
    phi, s2 = yule_walker(a, 5)
    T = iterops.ts.toeplitz.toeplitz_matrix(a[:5])
    phi_d = pt.linalg.solve(T, a[1:6], assume_a="pos")
    s2_d = a[0] - pt.dot(a[1:6], phi_d)
    f = pytensor.function([a], [pytensor.grad(pt.dot(w, phi) + 3 * s2, a), pytensor.grad(pt.dot(w, phi_d) + 3 * s2_d, a)], mode=FAST)
    g, g_dense = f(acov)
    np.testing.assert_allclose(g, g_dense, rtol=1e-9, atol=1e-10)


def _plain_dense_yule_walker(a, p):
    """The spelling a user writes: the Toeplitz matrix by indexing, a dense positive-definite solve."""
    i = pt.arange(p)
    phi = pt.linalg.solve(a[pt.abs(i[:, None] - i[None, :])], a[1 : p + 1], assume_a="pos")
    return phi, a[0] - pt.dot(a[1 : p + 1], phi)


@pytest.mark.parametrize("p, bound", [(1, 0.9), (2, 0.95), (7, 0.9), (60, 0.5), (200, 0.3)])
def test_yule_walker_grad_matches_plain_dense_solve_compiled(p, bound, rng):
    """The compiled gradient kernel (acov longer than p + 1, cotangents of phi and sigma2, then also of
    pacf) against autodiff of the plain dense solve."""
    acov = sm_acov(random_ar(rng, p, bound), 1.7, p + 2)
    a = pt.vector("a")
    w, w2 = rng.normal(size=p), rng.normal(size=p)
    phi, s2 = yule_walker(a, p)
    phi_d, s2_d = _plain_dense_yule_walker(a, p)
    pacf = levinson_durbin(a, p).pacf
    pacf_d = iterops.ts.ar_to_pacf(phi_d)
    f = pytensor.function([a], [pytensor.grad(pt.dot(w, phi) - 0.7 * s2, a), pytensor.grad(pt.dot(w, phi_d) - 0.7 * s2_d, a),
                                pytensor.grad(pt.dot(w2, pacf) + s2, a), pytensor.grad(pt.dot(w2, pacf_d) + s2_d, a)])
    g, g_dense, h, h_dense = f(acov)
    cond = np.linalg.cond(sl.toeplitz(acov[:p]))
    np.testing.assert_allclose(g, g_dense, rtol=0, atol=1e-13 * cond * np.abs(g_dense).max())
    np.testing.assert_allclose(h, h_dense, rtol=0, atol=1e-13 * cond * np.abs(h_dense).max())
    assert g[-1] == 0.0 and h[-1] == 0.0  # gamma_{p+1} is not read


def test_levinson_durbin_gradient_failure_is_nan_and_shapes_are_checked(mode):
    a = pt.vector("a")
    res = levinson_durbin(a, 2)
    f = pytensor.function([a], pytensor.grad(res.sigma2 + res.ar.sum(), a), mode=mode)
    for bad in ([1.0, 2.0, 0.1], [1.0, 0.9, -0.9], [1.0, np.nan, 0.1]):
        assert np.all(np.isnan(f(np.array(bad)))), bad
    # the gradient Op checks its run-time shapes before its kernel reads them
    phi, phi_bar = pt.vector("phi"), pt.vector("phi_bar")
    g = iterops.ts.levinson.LevinsonDurbinGrad(2)(a, phi, phi_bar, pt.scalar("s"))
    fg = pytensor.function([a, phi, phi_bar, g.owner.inputs[3]], g, mode=mode)
    with pytest.raises(ValueError, match=r"levinson_durbin gradient: phi must have shape \(order,\) = \(2,\)"):
        fg(np.array([1.0, 0.5, 0.1]), np.zeros(3), np.zeros(2), 1.0)
    with pytest.raises(ValueError, match=r"levinson_durbin gradient: acov must have shape"):
        fg(np.array([1.0, 0.5]), np.zeros(2), np.zeros(2), 1.0)


def test_levinson_durbin_failure_is_nan():
    a = pt.vector("a")
    f = pytensor.function([a], list(levinson_durbin(a, 2)), mode=FAST)
    for bad in ([0.0, 0.0, 0.0], [-1.0, 0.1, 0.0], [1.0, 2.0, 0.1], [1.0, 0.9, -0.9], [1.0, np.nan, 0.1]):
        for out in f(np.array(bad)):
            assert np.all(np.isnan(out)), bad
    with pytest.raises(ValueError, match=r"acov must have shape .* got acov with shape \(2,\)"):  # no AR(2)
        f(np.array([1.0, 0.5]))


def test_levinson_durbin_bad_input():
    with pytest.raises(ValueError, match=r"order must be <= len\(acov\) - 1.*shape \(3,\)"):
        levinson_durbin(np.ones(3), 3)
    with pytest.raises(ValueError, match="order must be a static Python integer"):
        levinson_durbin(np.ones(3), 1.5)
    with pytest.raises(ValueError, match="order must be a static Python integer"):
        yule_walker(np.ones(3), pt.iscalar("p"))
    with pytest.raises(ValueError, match="order must be >= 1"):
        levinson_durbin(np.ones(3), 0)
    with pytest.raises(ValueError, match="nlags must be <= n - 1"):
        acovf(np.ones(3), 3)
    with pytest.raises(ValueError, match="nlags must be a static Python integer"):
        acovf(np.ones(3), 1.0)
    with pytest.raises(TypeError, match="complex"):
        levinson_durbin(np.ones(3) * 1j, 1)
