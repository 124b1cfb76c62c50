"""pacf_to_ar, ar_to_pacf, ar_to_acov (iterops.ts.ar) against statsmodels, polynomial roots,
finite differences and autodiff of the step-up recursion's Scan (:func:`iterops.reference_loops.step_up_loop`)."""

import pickle

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pytensor.gradient import verify_grad
from statsmodels.tsa.arima_process import arma_pacf
from statsmodels.tsa.stattools import levinson_durbin_pacf as sm_levinson_durbin_pacf

from conftest import FAST_PY, evaluate, jacobian_check, random_ar, random_pacf, sm_acov
from iterops.reference_loops import step_up_loop
from iterops.ts import ar_to_acov, ar_to_pacf, levinson_durbin, pacf_to_ar, solve_toeplitz, yule_walker

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

# Gradient and batching checks compile many small graphs: use the Python linker (whose perform
# runs the same Numba kernels); every linker is covered by the ``mode``-parametrized tests.
FAST = FAST_PY  # FAST_COMPILE, Scans (the reference loops, jacobians) included, run by perform


def _is_stationary(phi):
    roots = np.roots(np.r_[1.0, -np.asarray(phi)][::-1])  # 1 - sum phi_k z^k
    return bool(np.all(np.abs(roots) > 1.0))


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
# pacf <-> AR
# ---------------------------------------------------------------------------


@given(st.integers(1, 8), st.integers(0, 2**32 - 1), st.floats(0.5, 0.999))
def test_pacf_to_ar_stationary_and_round_trip(lattice_fns, p, seed, bound):
    rng = np.random.default_rng(seed)
    pacf = random_pacf(rng, p, bound)
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
    pacf = random_pacf(rng, 4)
    phi = sm_levinson_durbin_pacf(np.r_[1.0, pacf]).arcoefs
    got_phi, _, _, _, _ = fn(pacf, 1.0)
    np.testing.assert_allclose(got_phi, phi, atol=1e-12)
    _, got_pacf, g7, g2, _ = fn(phi, 2.5)
    np.testing.assert_allclose(got_pacf, pacf, atol=1e-10)
    np.testing.assert_allclose(g7, sm_acov(phi, 2.5, 7), rtol=1e-10)
    np.testing.assert_allclose(g2, sm_acov(phi, 2.5, 2), rtol=1e-10)


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
    phi = evaluate(pacf_to_ar(pacf))
    sigma2 = np.array([0.5, 1.0, 2.0])
    acov, back = evaluate(ar_to_acov(phi, sigma2, 6), ar_to_pacf(phi))
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(phi[i, j], sm_levinson_durbin_pacf(np.r_[1.0, pacf[i, j]]).arcoefs, atol=1e-12)
            np.testing.assert_allclose(acov[i, j], sm_acov(phi[i, j], sigma2[j], 6), rtol=1e-10)
            np.testing.assert_allclose(back[i, j], pacf[i, j], atol=1e-10)


@pytest.mark.parametrize("nlags", [0, 2, 4, 9])
def test_ar_to_acov_matches_statsmodels(nlags, rng):
    phi = random_ar(rng, 4)
    np.testing.assert_allclose(evaluate(ar_to_acov(phi, 1.7, nlags)), sm_acov(phi, 1.7, nlags), rtol=1e-10)


def test_ar_to_acov_is_inverse_of_yule_walker(rng):
    phi = random_ar(rng, 5, 0.95)
    ar, s2 = yule_walker(ar_to_acov(phi, 0.8, 5), 5)
    ar, s2 = evaluate(ar, s2)
    np.testing.assert_allclose(ar, phi, atol=1e-8)
    np.testing.assert_allclose(s2, 0.8, rtol=1e-8)


def test_lattice_grads(rng):
    pacf = random_pacf(rng, 5)
    phi = random_ar(rng, 5)
    verify_grad(pacf_to_ar, [pacf], rng=rng, mode=FAST)
    verify_grad(ar_to_pacf, [phi], rng=rng, mode=FAST)
    verify_grad(lambda p, s: ar_to_acov(p, s, 8), [phi, np.array(1.3)], rng=rng, mode=FAST)
    verify_grad(lambda p, s: ar_to_acov(p, s, 2), [phi, np.array(1.3)], rng=rng, mode=FAST)
    verify_grad(lambda p: pacf_to_ar(p), [rng.uniform(-0.9, 0.9, size=(2, 3))], rng=rng, mode=FAST)  # batched
    # a batch of two stationary AR(5), away from the unit circle so finite differences are accurate
    # (phi * 0.5 need not be stationary: its autocovariances can be NaN)
    batch = np.stack([random_ar(rng, 5, bound=0.7), random_ar(rng, 5, bound=0.7)])
    verify_grad(lambda p, s: ar_to_acov(p, s, 4), [batch, np.array([1.0, 2.0])], rng=rng, mode=FAST)


def test_lattice_pushforward(rng):
    x = pt.vector("x")
    pacf = random_pacf(rng, 4)
    phi = random_ar(rng, 4)
    t = rng.normal(size=4)
    jacobian_check(pacf_to_ar(x), x, pacf, t)
    jacobian_check(ar_to_pacf(x), x, phi, t)
    jacobian_check(ar_to_acov(x, 1.4, 7), x, phi, t)
    s = pt.scalar("s")
    jacobian_check(ar_to_acov(pt.as_tensor(phi), s, 3), s, np.array(1.4), np.array(0.3))


@pytest.mark.parametrize("near_one", [False, True])
def test_pacf_to_ar_grad_matches_scan_autodiff(near_one, rng):
    """Exact and stable as |pacf| -> 1: equal to autodiff of the reference Scan."""
    p = 6
    pacf = random_pacf(rng, p)
    if near_one:
        pacf[::2] = np.sign(pacf[::2]) * (1 - 1e-9)
    x = pt.vector("x")
    w = rng.normal(size=p)
    ours = pt.dot(w, pacf_to_ar(x))
    ref = pt.dot(w, step_up_loop(x, p))
    f = pytensor.function([x], [ours, ref, pytensor.grad(ours, x), pytensor.grad(ref, x)], mode=FAST)
    v, v_ref, g, g_ref = f(pacf)
    np.testing.assert_allclose(v, v_ref, rtol=1e-12)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, g_ref, rtol=1e-10, atol=1e-12)


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
