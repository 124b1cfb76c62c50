"""Zero-size and order-0 input of the time-series Ops: each gives the right empty or
trivial result (values and gradients, every linker), or a graph-build-time ValueError that names
the argument and shows its shape.  Lyapunov and block_diag: see their own test modules."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg as sla
from pytensor.gradient import pushforward
from statsmodels.tsa.arima_process import arma_acovf
from statsmodels.tsa.stattools import acovf as sm_acovf

from iterops.ts import acovf, ar_to_acov, ar_to_pacf, levinson_durbin, pacf_to_ar, solve_toeplitz, yule_walker

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

# ---------------------------------------------------------------------------
# solve_toeplitz
# ---------------------------------------------------------------------------


def test_solve_toeplitz_empty_vector(mode):
    c, r, b = pt.vector("c"), pt.vector("r"), pt.vector("b")
    x = solve_toeplitz((c, r), b)
    grads = pytensor.grad(x.sum(), [c, r, b])
    f = pytensor.function([c, r, b], [x, *grads], mode=mode)
    empty = np.zeros(0)
    out = f(empty, empty, empty)
    ref = sla.solve_toeplitz((empty, empty), empty)
    assert out[0].shape == ref.shape == (0,)
    assert [g.shape for g in out[1:]] == [(0,), (0,), (0,)]
    # c alone (symmetric): same
    assert solve_toeplitz(empty, empty).eval().shape == (0,)


@pytest.mark.parametrize("n, k", [(0, 3), (3, 0), (0, 0)])
def test_solve_toeplitz_empty_matrix(mode, n, k, rng):
    c, r, b = pt.vector("c"), pt.vector("r"), pt.matrix("b")
    x = solve_toeplitz((c, r), b)
    grads = pytensor.grad((x * rng.normal(size=(n, k))).sum(), [c, r, b])
    f = pytensor.function([c, r, b], [x, *grads], mode=mode)
    cv = np.r_[3.0, rng.normal(size=max(n - 1, 0))][:n]
    rv = np.r_[3.0, rng.normal(size=max(n - 1, 0))][:n]
    bv = rng.normal(size=(n, k))
    x_v, gc, gr, gb = f(cv, rv, bv)
    # the solution has the shape of b, as np.linalg.solve with the dense matrix
    # (scipy returns (0, 0) for an empty (0, k) b)
    assert x_v.shape == np.linalg.solve(sla.toeplitz(cv, rv), bv).shape == (n, k)
    np.testing.assert_array_equal(gc, np.zeros(n))  # no right-hand side: nothing depends on c, r
    np.testing.assert_array_equal(gr, np.zeros(n))
    assert gb.shape == (n, k)
    if n:
        np.testing.assert_array_equal(x_v, sla.solve_toeplitz((cv, rv), bv))


def test_solve_toeplitz_empty_pushforward():
    c, b = pt.vector("c"), pt.vector("b")
    tc, tb = pt.vector("tc"), pt.vector("tb")
    jvp = pushforward(solve_toeplitz(c, b), [c, b], [tc, tb])
    e = np.zeros(0)
    assert jvp.eval({c: e, b: e, tc: e, tb: e}).shape == (0,)


def test_solve_toeplitz_length_one_gradient_unchanged(rng):
    # the smallest non-empty system, against the dense formula x = b / c0
    c, b = pt.vector("c"), pt.vector("b")
    x = solve_toeplitz(c, b)
    gc, gb = pytensor.grad(x.sum(), [c, b])
    out = pytensor.function([c, b], [x, gc, gb])(np.array([2.0]), np.array([3.0]))
    np.testing.assert_allclose(out, [[1.5], [-3.0 / 4.0], [0.5]])


# ---------------------------------------------------------------------------
# AR lattice maps: order 0 is white noise
# ---------------------------------------------------------------------------


def test_order_zero_lattice_maps(mode):
    v, s2 = pt.vector("v"), pt.scalar("s2")
    phi, pacf = pacf_to_ar(v), ar_to_pacf(v)
    gamma = ar_to_acov(v, s2, nlags=3)
    outs = [phi, pacf, gamma, *pytensor.grad(gamma.sum() + phi.sum() + pacf.sum(), [v, s2])]
    phi_v, pacf_v, gamma_v, gv, gs2 = pytensor.function([v, s2], outs, mode=mode)(np.zeros(0), 2.0)
    assert phi_v.shape == pacf_v.shape == gv.shape == (0,)
    np.testing.assert_allclose(gamma_v, arma_acovf(np.array([1.0]), np.array([1.0]), nobs=4, sigma2=2.0))
    np.testing.assert_allclose(gs2, 1.0)  # sum(gamma) = sigma2


# ---------------------------------------------------------------------------
# acovf, levinson_durbin, yule_walker
# ---------------------------------------------------------------------------


def test_acovf_nlags_zero_value(mode, rng):
    x = pt.vector("x")
    xv = rng.normal(size=7)
    out = pytensor.function([x], acovf(x, 0), mode=mode)(xv)
    np.testing.assert_allclose(out, sm_acovf(xv, nlag=0, fft=False))


@pytest.mark.parametrize(
    "linker",
    [
        "FAST_COMPILE",
        "NUMBA",
    ],
)
def test_acovf_nlags_zero_gradient(linker, rng):
    x = pt.vector("x")
    xv = rng.normal(size=7)
    g = pytensor.function([x], pytensor.grad(acovf(x, 0)[0], x), mode=linker)(xv)
    np.testing.assert_allclose(g, 2 * (xv - xv.mean()) / xv.size)  # d/dx mean((x - mean)^2)


def test_static_empty_series_is_a_build_time_error():
    with pytest.raises(ValueError, match=r"acovf: nlags must be <= n - 1, got nlags=0 and x with shape \(0,\)"):
        acovf(np.zeros(0), 0)
    for fn in (levinson_durbin, yule_walker):
        with pytest.raises(ValueError, match=r"order must be <= len\(acov\) - 1.*acov with shape \(0,\)"):
            fn(np.zeros(0), 1)
        with pytest.raises(ValueError, match=r"order must be >= 1, got 0"):
            fn(np.ones(3), 0)


def test_levinson_durbin_empty_acov_at_run_time_raises(mode):
    acov = pt.vector("acov")
    res = levinson_durbin(acov, 2)
    fn = pytensor.function([acov], list(res), mode=mode)
    with pytest.raises(ValueError, match=r"acov must have shape .* got acov with shape \(0,\)"):
        fn(np.zeros(0))
