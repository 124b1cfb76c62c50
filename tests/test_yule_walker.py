"""Yule-Walker family: solve_toeplitz, levinson_durbin, yule_walker, acovf, pacf <-> AR, ar_to_acov.

Oracles: scipy.linalg.solve_toeplitz, statsmodels (levinson_durbin, yule_walker,
acovf, arma_acovf, arma_pacf, levinson_durbin_pacf), numpy polynomial roots,
pytensor.gradient.verify_grad (finite differences) and autodiff of reference
Scans of the recursions.
"""

import pickle
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg as sl
from hypothesis import given
from hypothesis import strategies as st
from pytensor.gradient import NullTypeGradError, pushforward, verify_grad
from statsmodels.regression.linear_model import yule_walker as sm_yule_walker
from statsmodels.tsa.arima_process import arma_acovf, arma_pacf
from statsmodels.tsa.stattools import acovf as sm_acovf
from statsmodels.tsa.stattools import levinson_durbin as sm_levinson_durbin
from statsmodels.tsa.stattools import levinson_durbin_pacf as sm_levinson_durbin_pacf

import iterops
from iterops.ts import acovf, ar_to_acov, ar_to_pacf, levinson_durbin, pacf_to_ar, solve_toeplitz, yule_walker

ATOL = 1e-10
# Gradient and batching checks compile many small graphs: use the Python linker (whose perform
# runs the same Numba kernels); every linker is covered by the ``mode``-parametrized tests.
FAST = "FAST_COMPILE"


def _ev(*outs):
    """Evaluate constant graphs without Numba-compiling each one."""
    res = pytensor.function([], list(outs), mode=FAST)()
    return res[0] if len(outs) == 1 else res


def _random_pacf(rng, p, bound=0.9):
    return rng.uniform(-bound, bound, size=p)


def _random_ar(rng, p, bound=0.9):
    return sm_levinson_durbin_pacf(np.r_[1.0, _random_pacf(rng, p, bound)]).arcoefs


def _sm_acov(phi, sigma2, nlags):
    return arma_acovf(np.r_[1.0, -np.asarray(phi)], [1.0], nobs=nlags + 1, sigma2=sigma2)


def _is_stationary(phi):
    roots = np.roots(np.r_[1.0, -np.asarray(phi)][::-1])  # 1 - sum phi_k z^k
    return bool(np.all(np.abs(roots) > 1.0))


def _jacobian_check(f_out, x, x_val, t_val, rtol=1e-8):
    """pushforward(f, x, t) equals the reverse-mode Jacobian times t."""
    t = x.type()
    J = pytensor.gradient.jacobian(f_out, x)
    # the Ops' own pushforward and PyTensor's default double-pullback
    jvs = [pushforward(f_out, x, t, use_op_pushforward=use) for use in (True, False)]
    fn = pytensor.function([x, t], [pt.tensordot(J, t, axes=x.ndim), *jvs], mode=FAST)
    a, *bs = fn(x_val, t_val)
    for b in bs:
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-10)


# ---------------------------------------------------------------------------
# Compiled once per module (default NUMBA linker)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lattice_fns():
    x = pt.vector("x")
    s2 = pt.scalar("s2")
    return {
        "pacf_to_ar": pytensor.function([x], pacf_to_ar(x), mode=FAST),
        "ar_to_pacf": pytensor.function([x], ar_to_pacf(x), mode=FAST),
        "ar_to_acov": pytensor.function([x, s2], ar_to_acov(x, s2, 12), mode=FAST),
        "pacf_to_ar_grad": pytensor.function([x], pytensor.grad(pt.sum(pt.sin(pacf_to_ar(x))), x), mode=FAST),
    }


# ---------------------------------------------------------------------------
# solve_toeplitz
# ---------------------------------------------------------------------------


def _toeplitz_case(rng, n, k=None, symmetric=False):
    c = rng.normal(size=n)
    c[0] += 2.0 * n  # diagonally dominant: every leading block non-singular
    r = c.copy() if symmetric else rng.normal(size=n)
    b = rng.normal(size=n if k is None else (n, k))
    return c, r, b


def test_solve_toeplitz_matches_scipy_every_linker(mode, rng):
    c, r, B = _toeplitz_case(rng, 7, 3)
    cv, rv, Bv, bv = pt.vector("c"), pt.vector("r"), pt.matrix("B"), pt.vector("b")
    fn = pytensor.function(
        [cv, rv, Bv, bv],
        [solve_toeplitz((cv, rv), Bv), solve_toeplitz(cv, bv), solve_toeplitz((cv, rv), bv)],
        mode=mode,
    )
    X, x_sym, x_gen = fn(c, r, B, B[:, 0])
    np.testing.assert_allclose(X, sl.solve_toeplitz((c, r), B), atol=ATOL)
    np.testing.assert_allclose(x_sym, sl.solve_toeplitz(c, B[:, 0]), atol=ATOL)
    np.testing.assert_allclose(x_gen, sl.solve_toeplitz((c, r), B[:, 0]), atol=ATOL)
    assert x_sym.shape == (7,) and X.shape == (7, 3)


def test_solve_toeplitz_scipy_docstring_example():
    x = _ev(solve_toeplitz(([1.0, 3, 6, 10], [1.0, -1, -2, -3]), [1.0, 2, 2, 5]))
    np.testing.assert_allclose(x, sl.solve_toeplitz(([1, 3, 6, 10], [1, -1, -2, -3]), [1, 2, 2, 5]), atol=1e-12)


def test_solve_toeplitz_indefinite_but_strongly_regular(rng):
    """Not positive definite, but all leading blocks regular: Levinson solves it like scipy."""
    c = np.array([1.0, 2.0, 0.5, -0.3])
    b = rng.normal(size=4)
    assert np.min(np.linalg.eigvalsh(sl.toeplitz(c))) < 0
    np.testing.assert_allclose(_ev(solve_toeplitz(c, b)), sl.solve_toeplitz(c, b), atol=1e-10)


def test_solve_toeplitz_batched_vs_looped(rng):
    cs = np.stack([_toeplitz_case(rng, 5)[0] for _ in range(3)])
    rs = rng.normal(size=(3, 5))
    B = rng.normal(size=(3, 5, 2))
    b = rng.normal(size=(2, 3, 5))  # (batch, batch, n) vectors broadcast against c (3, n)
    X, xb = _ev(solve_toeplitz((cs, rs), B), solve_toeplitz(cs, b, b_ndim=1))
    for i in range(3):
        np.testing.assert_allclose(X[i], sl.solve_toeplitz((cs[i], rs[i]), B[i]), atol=ATOL)
        for j in range(2):
            np.testing.assert_allclose(xb[j, i], sl.solve_toeplitz(cs[i], b[j, i]), atol=ATOL)


def test_solve_toeplitz_grad(rng):
    c, r, B = _toeplitz_case(rng, 5, 2)
    verify_grad(lambda c, r, B: solve_toeplitz((c, r), B), [c, r, B], rng=rng, mode=FAST)
    verify_grad(lambda c, b: solve_toeplitz(c, b), [c, B[:, 0]], rng=rng, mode=FAST)
    # batched gradient (Blockwise of the pullback)
    cs = np.stack([c, _toeplitz_case(rng, 5)[0]])
    verify_grad(lambda c, b: solve_toeplitz(c, b, b_ndim=1), [cs, rng.normal(size=(2, 5))], rng=rng, mode=FAST)


def test_solve_toeplitz_grad_against_dense_solve(rng):
    """Reverse-mode gradient equals autodiff of a dense solve of the same Toeplitz matrix."""
    c, r, b = _toeplitz_case(rng, 6)
    cv, rv, bv = pt.vector("c"), pt.vector("r"), pt.vector("b")
    w = rng.normal(size=6)
    ours = pt.dot(w, solve_toeplitz((cv, rv), bv))
    dense = pt.dot(w, pt.linalg.solve(iterops.ts.toeplitz.toeplitz_matrix(cv, rv), bv))
    f = pytensor.function([cv, rv, bv], pytensor.grad(ours, [cv, rv, bv]) + pytensor.grad(dense, [cv, rv, bv]), mode=FAST)
    out = f(c, r, b)
    for a, d in zip(out[:3], out[3:]):
        np.testing.assert_allclose(a, d, atol=1e-10)
    assert out[1][0] == 0.0  # r[0] is ignored


def test_solve_toeplitz_second_derivatives(rng):
    """The pullback is written with solve_toeplitz itself, so Hessians compose (vs dense solve)."""
    c, _, b = _toeplitz_case(rng, 4)
    cv = pt.vector("c")
    cost = pt.sum(solve_toeplitz(cv, pt.as_tensor(b)) ** 2)
    dense = pt.sum(pt.linalg.solve(iterops.ts.toeplitz.toeplitz_matrix(cv), pt.as_tensor(b)) ** 2)
    f = pytensor.function([cv], [pytensor.gradient.hessian(cost, cv), pytensor.gradient.hessian(dense, cv)], mode=FAST)
    H, H_dense = f(c)
    np.testing.assert_allclose(H, H_dense, rtol=1e-8, atol=1e-12)


def test_solve_toeplitz_pushforward(rng):
    c, r, B = _toeplitz_case(rng, 5, 2)
    cv = pt.vector("c")
    _jacobian_check(solve_toeplitz((cv, pt.as_tensor(r)), pt.as_tensor(B)), cv, c, rng.normal(size=5))
    Bv = pt.matrix("B")
    _jacobian_check(solve_toeplitz(pt.as_tensor(c), Bv), Bv, B, rng.normal(size=B.shape))
    _jacobian_check(solve_toeplitz(cv, pt.as_tensor(B)), cv, c, rng.normal(size=5))  # c is also r


def test_solve_toeplitz_failure_is_nan():
    cv, bv = pt.vector("c"), pt.vector("b")
    f = pytensor.function([cv, bv], solve_toeplitz(cv, bv), mode=FAST)
    assert np.all(np.isnan(f([0.0, 1.0, 0.2], [1.0, 2.0, 3.0])))  # singular leading 1x1 block
    assert np.all(np.isnan(f([1.0, 1.0, 0.2], [1.0, 2.0, 3.0])))  # singular leading 2x2 block
    assert np.all(np.isnan(f([1.0, np.nan, 0.2], [1.0, 2.0, 3.0])))
    assert np.all(np.isnan(f([1.0, 0.1, 0.2], [1.0, np.inf, 3.0])))


def test_solve_toeplitz_bad_input():
    with pytest.raises(ValueError, match="c and r must have the same length"):
        solve_toeplitz((np.ones(3), np.ones(4)), np.ones(3))
    with pytest.raises(ValueError, match="b must have n rows"):
        solve_toeplitz(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="b_ndim"):
        solve_toeplitz(np.ones(3), np.ones(3), b_ndim=3)
    with pytest.raises(ValueError, match="c must have at least 1 dimensions"):
        solve_toeplitz(pt.scalar("c"), np.ones(3))
    with pytest.raises(TypeError, match="complex"):
        solve_toeplitz(np.ones(3) + 1j, np.ones(3))


# ---------------------------------------------------------------------------
# levinson_durbin, yule_walker, acovf
# ---------------------------------------------------------------------------


def test_levinson_durbin_matches_statsmodels_every_linker(mode, rng):
    phi = _random_ar(rng, 4)
    acov = _sm_acov(phi, 1.7, 6) + np.r_[0.05, np.zeros(6)]  # a generic PD sequence, not exactly AR(4)
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
    got = _ev(acovf(x, 7, demean=demean, adjusted=adjusted))
    for i in range(2):
        want = sm_acovf(x[i], nlag=7, demean=demean, adjusted=adjusted, fft=False)
        np.testing.assert_allclose(got[i], want, atol=1e-12)


def test_acovf_grad(rng):
    x = rng.normal(size=12)
    verify_grad(lambda x: acovf(x, 5), [x], rng=rng, mode=FAST)
    verify_grad(lambda x: acovf(x, 11, adjusted=True, demean=False), [x], rng=rng, mode=FAST)
    verify_grad(lambda x: yule_walker(acovf(x, 3), 3)[0], [x], rng=rng, mode=FAST)


def test_levinson_durbin_batched_vs_looped(rng):
    acovs = np.stack([_sm_acov(_random_ar(rng, 3), s, 5) for s in (0.5, 1.0, 2.0)])
    ar, sigma2, pacf = _ev(*levinson_durbin(acovs, 4))
    for i in range(3):
        sm = sm_levinson_durbin(acovs[i], nlags=4, isacov=True)
        np.testing.assert_allclose(ar[i], sm.arcoefs, atol=ATOL)
        np.testing.assert_allclose(sigma2[i], sm.sigma_v, atol=ATOL)
        np.testing.assert_allclose(pacf[i], sm.pacf[1:], atol=ATOL)


@pytest.mark.parametrize("output", [0, 1, 2])
def test_levinson_durbin_grad(output, rng):
    acov = _sm_acov(_random_ar(rng, 3), 1.3, 5) + np.r_[0.1, np.zeros(5)]
    verify_grad(lambda a: levinson_durbin(a, 4)[output], [acov], rng=rng, mode=FAST)


def test_levinson_durbin_grad_all_outputs_batched(rng):
    acovs = np.stack([_sm_acov(_random_ar(rng, 3), s, 4) for s in (0.7, 1.5)])

    def f(a):
        ar, s2, pacf = levinson_durbin(a, 3)
        return ar.sum(-1) * s2 + pacf[..., 1] ** 2

    verify_grad(f, [acovs], rng=rng, mode=FAST)


def test_levinson_durbin_pushforward(rng):
    acov = _sm_acov(_random_ar(rng, 3), 1.3, 4)
    a = pt.vector("a")
    for out in levinson_durbin(a, 3):
        _jacobian_check(out, a, acov, rng.normal(size=5))


def test_yule_walker_grad_matches_dense_solve(rng):
    """Gradient of (phi, sigma2) equals autodiff of the dense Yule-Walker solve."""
    acov = _sm_acov(_random_ar(rng, 5), 1.0, 5)
    a = pt.vector("a")
    w = rng.normal(size=5)
    phi, s2 = yule_walker(a, 5)
    T = iterops.ts.toeplitz.toeplitz_matrix(a[:5])
    phi_d = pt.linalg.solve(T, a[1:6], assume_a="pos")
    s2_d = a[0] - pt.dot(a[1:6], phi_d)
    f = pytensor.function([a], [pytensor.grad(pt.dot(w, phi) + 3 * s2, a), pytensor.grad(pt.dot(w, phi_d) + 3 * s2_d, a)], mode=FAST)
    g, g_dense = f(acov)
    np.testing.assert_allclose(g, g_dense, rtol=1e-9, atol=1e-10)


def test_levinson_durbin_failure_is_nan():
    a = pt.vector("a")
    f = pytensor.function([a], list(levinson_durbin(a, 2)), mode=FAST)
    for bad in ([0.0, 0.0, 0.0], [-1.0, 0.1, 0.0], [1.0, 2.0, 0.1], [1.0, 0.9, -0.9], [1.0, np.nan, 0.1], [1.0, 0.5]):
        for out in f(np.array(bad)):
            assert np.all(np.isnan(out)), bad


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


# ---------------------------------------------------------------------------
# pacf <-> AR
# ---------------------------------------------------------------------------


@given(st.integers(1, 8), st.integers(0, 2**32 - 1), st.floats(0.5, 0.999))
def test_pacf_to_ar_stationary_and_round_trip(lattice_fns, p, seed, bound):
    rng = np.random.default_rng(seed)
    pacf = _random_pacf(rng, p, bound)
    phi = lattice_fns["pacf_to_ar"](pacf)
    assert _is_stationary(phi)
    np.testing.assert_allclose(phi, sm_levinson_durbin_pacf(np.r_[1.0, pacf]).arcoefs, atol=1e-10)
    np.testing.assert_allclose(lattice_fns["ar_to_pacf"](phi), pacf, atol=1e-7)
    np.testing.assert_allclose(lattice_fns["ar_to_pacf"](phi), arma_pacf(np.r_[1.0, -phi], [1.0], lags=p + 1)[1:], atol=1e-6)


@given(st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_ar_to_pacf_detects_non_stationary(lattice_fns, p, seed):
    rng = np.random.default_rng(seed)
    phi = rng.normal(scale=1.5, size=p)
    pacf = lattice_fns["ar_to_pacf"](phi)
    if _is_stationary(phi):
        assert np.all(np.abs(pacf) < 1)
        np.testing.assert_allclose(lattice_fns["pacf_to_ar"](pacf), phi, atol=1e-8)
    else:
        assert np.all(np.isnan(pacf))
        assert np.all(np.isnan(lattice_fns["ar_to_acov"](phi, 1.0)))


def test_lattice_every_linker(mode, rng):
    x, s2 = pt.vector("x"), pt.scalar("s2")
    phi_v = pacf_to_ar(x)
    fn = pytensor.function([x, s2], [phi_v, ar_to_pacf(x), ar_to_acov(x, s2, 7), ar_to_acov(x, s2, 2), pt.grad(phi_v.sum(), x)], mode=mode)
    pacf = _random_pacf(rng, 4)
    phi = sm_levinson_durbin_pacf(np.r_[1.0, pacf]).arcoefs
    got_phi, _, _, _, _ = fn(pacf, 1.0)
    np.testing.assert_allclose(got_phi, phi, atol=1e-12)
    _, got_pacf, g7, g2, _ = fn(phi, 2.5)
    np.testing.assert_allclose(got_pacf, pacf, atol=1e-10)
    np.testing.assert_allclose(g7, _sm_acov(phi, 2.5, 7), rtol=1e-10)
    np.testing.assert_allclose(g2, _sm_acov(phi, 2.5, 2), rtol=1e-10)


def test_lattice_failure_is_nan(lattice_fns):
    for bad in ([0.5, 1.0], [-1.0], [0.2, np.nan], [1.5, 0.0]):
        assert np.all(np.isnan(lattice_fns["pacf_to_ar"](np.array(bad))))
        assert np.all(np.isnan(lattice_fns["pacf_to_ar_grad"](np.array(bad))))
    for bad in ([1.2, -0.1], [0.5, 0.5], [np.inf, 0.0], [1.0]):  # not stationary / not finite
        assert np.all(np.isnan(lattice_fns["ar_to_pacf"](np.array(bad))))
        assert np.all(np.isnan(lattice_fns["ar_to_acov"](np.array(bad), 1.0)))
    assert np.all(np.isnan(lattice_fns["ar_to_acov"](np.array([0.5]), np.nan)))


def test_lattice_batched_vs_looped(rng):
    pacf = rng.uniform(-0.9, 0.9, size=(2, 3, 4))
    phi = _ev(pacf_to_ar(pacf))
    sigma2 = np.array([0.5, 1.0, 2.0])
    acov, back = _ev(ar_to_acov(phi, sigma2, 6), ar_to_pacf(phi))
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(phi[i, j], sm_levinson_durbin_pacf(np.r_[1.0, pacf[i, j]]).arcoefs, atol=1e-12)
            np.testing.assert_allclose(acov[i, j], _sm_acov(phi[i, j], sigma2[j], 6), rtol=1e-10)
            np.testing.assert_allclose(back[i, j], pacf[i, j], atol=1e-10)


@pytest.mark.parametrize("nlags", [0, 2, 4, 9])
def test_ar_to_acov_matches_statsmodels(nlags, rng):
    phi = _random_ar(rng, 4)
    np.testing.assert_allclose(_ev(ar_to_acov(phi, 1.7, nlags)), _sm_acov(phi, 1.7, nlags), rtol=1e-10)


def test_ar_to_acov_is_inverse_of_yule_walker(rng):
    phi = _random_ar(rng, 5, 0.95)
    ar, s2 = yule_walker(ar_to_acov(phi, 0.8, 5), 5)
    ar, s2 = _ev(ar, s2)
    np.testing.assert_allclose(ar, phi, atol=1e-8)
    np.testing.assert_allclose(s2, 0.8, rtol=1e-8)


def test_lattice_grads(rng):
    pacf = _random_pacf(rng, 5)
    phi = _random_ar(rng, 5)
    verify_grad(pacf_to_ar, [pacf], rng=rng, mode=FAST)
    verify_grad(ar_to_pacf, [phi], rng=rng, mode=FAST)
    verify_grad(lambda p, s: ar_to_acov(p, s, 8), [phi, np.array(1.3)], rng=rng, mode=FAST)
    verify_grad(lambda p, s: ar_to_acov(p, s, 2), [phi, np.array(1.3)], rng=rng, mode=FAST)
    verify_grad(lambda p: pacf_to_ar(p), [rng.uniform(-0.9, 0.9, size=(2, 3))], rng=rng, mode=FAST)  # batched
    # a batch of two stationary AR(5), away from the unit circle so finite differences are accurate
    # (phi * 0.5 need not be stationary: its autocovariances can be NaN)
    batch = np.stack([_random_ar(rng, 5, bound=0.7), _random_ar(rng, 5, bound=0.7)])
    verify_grad(lambda p, s: ar_to_acov(p, s, 4), [batch, np.array([1.0, 2.0])], rng=rng, mode=FAST)


def test_lattice_pushforward(rng):
    x = pt.vector("x")
    pacf = _random_pacf(rng, 4)
    phi = _random_ar(rng, 4)
    t = rng.normal(size=4)
    _jacobian_check(pacf_to_ar(x), x, pacf, t)
    _jacobian_check(ar_to_pacf(x), x, phi, t)
    _jacobian_check(ar_to_acov(x, 1.4, 7), x, phi, t)
    s = pt.scalar("s")
    _jacobian_check(ar_to_acov(pt.as_tensor(phi), s, 3), s, np.array(1.4), np.array(0.3))


def _pacf_to_ar_scan(pacf, p):
    """Reference: the step-up recursion as a pytensor.scan over the order k."""
    j = pt.arange(p)

    def step(k, kap, prev):
        rev = prev[pt.maximum(k - 2 - j, 0)]
        return pt.where(j < k - 1, prev - kap * rev, pt.where(pt.eq(j, k - 1), kap, 0.0))

    phis = pytensor.scan(step, sequences=[pt.arange(1, p + 1), pacf], outputs_info=[pt.zeros(p)], return_updates=False)
    return phis[-1]


@pytest.mark.parametrize("near_one", [False, True])
def test_pacf_to_ar_grad_matches_scan_autodiff(near_one, rng):
    """Exact and stable as |pacf| -> 1: equal to autodiff of the reference Scan."""
    p = 6
    pacf = _random_pacf(rng, p)
    if near_one:
        pacf[::2] = np.sign(pacf[::2]) * (1 - 1e-9)
    x = pt.vector("x")
    w = rng.normal(size=p)
    ours = pt.dot(w, pacf_to_ar(x))
    ref = pt.dot(w, _pacf_to_ar_scan(x, p))
    f = pytensor.function([x], [ours, ref, pytensor.grad(ours, x), pytensor.grad(ref, x)], mode=FAST)
    v, v_ref, g, g_ref = f(pacf)
    np.testing.assert_allclose(v, v_ref, rtol=1e-12)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-12)


def test_second_derivatives_raise_clearly():
    x = pt.vector("x")
    g = pytensor.grad(pacf_to_ar(x).sum(), x)
    with pytest.raises(NullTypeGradError, match="Second derivatives"):
        pytensor.grad(g.sum(), x)


def test_lattice_bad_input():
    with pytest.raises(ValueError, match="nlags must be a static Python integer"):
        ar_to_acov(np.ones(2) * 0.1, 1.0, 2.0)
    with pytest.raises(ValueError, match="nlags must be >= 0"):
        ar_to_acov(np.ones(2) * 0.1, 1.0, -1)
    with pytest.raises(ValueError, match="pacf must have at least 1 dimensions"):
        pacf_to_ar(pt.scalar("p"))
    with pytest.raises(TypeError, match="complex"):
        ar_to_pacf(np.ones(2) * 1j)


def test_float32_and_pickle():
    x32 = pt.vector("x", dtype="float32")
    outs = [pacf_to_ar(x32), ar_to_pacf(x32), ar_to_acov(x32, np.float32(1.0), 3), *levinson_durbin(x32, 1)]
    assert all(o.dtype == "float32" for o in outs)
    assert solve_toeplitz(x32, x32).dtype == "float32"
    f = pytensor.function([x32], outs[0], mode=FAST)
    f2 = pickle.loads(pickle.dumps(f))
    for o in outs:
        op = o.owner.op
        assert pickle.loads(pickle.dumps(op)) == op
    np.testing.assert_allclose(f2(np.array([0.5, 0.2], dtype="float32")), [0.4, 0.2], rtol=1e-6)
