"""``kalman_filter(..., diffuse=...)``: the exact initial Kalman filter (Durbin & Koopman 2012, sec. 5.2-5.3).

* Every output against statsmodels' exact diffuse filter (``Initialization(k_states, 'diffuse')`` and mixed
  ``Initialization`` with ``.set``) to 1e-8: local level, local linear trend, level + trend + 12-seasonal
  with measurement noise, AR(1) + diffuse level (mixed), a two-observable model (univariate treatment),
  with missing values during the diffuse period.
* Gradients with respect to every differentiable input (``P_inf`` as a matrix included) by
  ``verify_grad``; an all-False mask against the ordinary filter (values and gradients).
* Failure values, graph-build errors, the JAX implementation against the Numba Op.
"""

from __future__ import annotations

import jax
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.gradient import verify_grad
from statsmodels.tsa.statespace.initialization import Initialization
from statsmodels.tsa.statespace.kalman_filter import KalmanFilter as SMKalmanFilter

from conftest import first_then_slow
from iterops.ts.kalman import kalman_filter

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

jax.config.update("jax_enable_x64", True)  # as tests/test_jax.py: float64 JAX for the 1e-10 comparison

FIELDS = (
    "loglik", "loglik_obs", "filtered_state", "filtered_cov", "predicted_state", "predicted_cov",
    "forecast_error", "forecast_error_cov",
)


# ---------------------------------------------------------------------------
# models (system matrices as statsmodels' UnobservedComponents builds them)
# ---------------------------------------------------------------------------


def local_level(rng, n=12):
    y = np.cumsum(rng.normal(size=(n, 1)), axis=0)
    y[[0, 3]] = np.nan  # missing in the diffuse period (the first observation)
    sysm = dict(T=[[1.0]], Z=[[1.0]], R=[[1.0]], H=[[0.7]], Q=[[0.4]])
    return y, sysm, [True], np.zeros((1, 1))


def local_linear_trend(rng, n=15):
    y = np.cumsum(np.cumsum(rng.normal(size=(n, 1)), axis=0), axis=0) * 0.3
    y[1] = np.nan
    sysm = dict(T=[[1.0, 1.0], [0.0, 1.0]], Z=[[1.0, 0.0]], R=np.eye(2), H=[[0.5]], Q=np.diag([0.3, 0.05]))
    return y, sysm, [True, True], np.zeros((2, 2))


def seasonal(rng, n=40, s=12):
    """Level + trend + dummy seasonal of period s (m = 2 + s - 1 = 13) + measurement noise."""
    m = 2 + s - 1
    T = np.zeros((m, m))
    T[:2, :2] = [[1.0, 1.0], [0.0, 1.0]]
    T[2, 2:] = -1.0
    T[3:, 2:-1] = np.eye(s - 2)
    Z = np.zeros((1, m))
    Z[0, [0, 2]] = 1.0
    R = np.zeros((m, 3))
    R[0, 0] = R[1, 1] = R[2, 2] = 1.0
    t = np.arange(n)
    y = (0.1 * t + np.sin(2 * np.pi * t / s) + 0.3 * rng.normal(size=n))[:, None]
    y[[2, 5, 20]] = np.nan
    sysm = dict(T=T, Z=Z, R=R, H=[[0.2]], Q=np.diag([0.1, 0.01, 0.05]))
    return y, sysm, [True] * m, np.zeros((m, m))


def ar1_plus_level(rng, n=20):
    """Mixed: a diffuse random-walk level (state 0) and a stationary AR(1) (state 1), y = level + ar."""
    phi, q_ar = 0.6, 0.5
    y = np.cumsum(rng.normal(size=(n, 1)), axis=0) + rng.normal(size=(n, 1))
    y[[1, 2]] = np.nan
    sysm = dict(T=[[1.0, 0.0], [0.0, phi]], Z=[[1.0, 1.0]], R=np.eye(2), H=[[0.3]], Q=np.diag([0.2, q_ar]))
    P0 = np.zeros((2, 2))
    P0[1, 1] = q_ar / (1 - phi**2)
    return y, sysm, [True, False], P0


def two_series(rng, n=12):
    """p = 2: local linear trend observed twice (diagonal H), a missing component in a diffuse step."""
    y = np.cumsum(rng.normal(size=(n, 2)), axis=0)
    y[0, 0] = np.nan
    y[4, 1] = np.nan
    sysm = dict(T=[[1.0, 1.0], [0.0, 1.0]], Z=[[1.0, 0.0], [1.0, 1.0]], R=np.eye(2), H=np.diag([0.5, 0.7]),
                Q=np.diag([0.3, 0.1]))
    return y, sysm, [True, True], np.zeros((2, 2))


MODELS = {
    "local_level": local_level, "local_linear_trend": local_linear_trend, "seasonal": seasonal,
    "ar1_plus_level": ar1_plus_level, "two_series": two_series,
}


def statsmodels_filter(y, sysm, mask, P0):
    n, p = y.shape
    T = np.asarray(sysm["T"], float)
    m = T.shape[0]
    R = np.asarray(sysm["R"], float)
    kf = SMKalmanFilter(k_endog=p, k_states=m, k_posdef=R.shape[1])
    kf.bind(np.array(y))
    for key, name in (("Z", "design"), ("H", "obs_cov"), ("T", "transition"), ("R", "selection"),
                      ("Q", "state_cov")):
        kf[name] = np.asarray(sysm[key], float)
    mask = np.asarray(mask)
    if mask.all():
        kf.initialize(Initialization(m, "diffuse"))
    else:
        init = Initialization(m, initialization_type=None)
        for i in np.flatnonzero(mask):
            init.set((i, i + 1), "diffuse")
        for i in np.flatnonzero(~mask):
            init.set((i, i + 1), "known", constant=[0.0], stationary_cov=P0[i:i + 1, i:i + 1])
        kf.initialize(init)
    return kf.filter()


def assert_close(actual, expected, what, tol=1e-8):
    actual, expected = np.asarray(actual, float), np.asarray(expected, float)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"{what}: NaN pattern")
    ok = ~np.isnan(expected)
    np.testing.assert_allclose(actual[ok], expected[ok], rtol=tol, atol=tol, err_msg=what)


# ---------------------------------------------------------------------------
# statsmodels
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_equals_statsmodels_exact_diffuse(model, rng):
    y, sysm, mask, P0 = MODELS[model](rng)
    m = len(mask)
    res = kalman_filter(y, np.zeros(m), P0, **sysm, diffuse=mask)
    ours = pytensor.function([], list(res), mode="NUMBA")()  # Numba-linked: the diffuse Op's native run
    sm = statsmodels_filter(y, sysm, mask, P0)
    assert sm.nobs_diffuse > 0
    assert_close(ours[0], sm.llf, "loglik")
    assert_close(ours[1], sm.llf_obs, "loglik_obs")
    assert_close(ours[2], sm.filtered_state.T, "filtered_state")
    assert_close(ours[3], sm.filtered_state_cov.transpose(2, 0, 1), "filtered_cov")
    assert_close(ours[4], sm.predicted_state.T, "predicted_state")
    assert_close(ours[5], sm.predicted_state_cov.transpose(2, 0, 1), "predicted_cov")
    assert_close(ours[6], sm.forecasts_error.T, "forecast_error")
    assert_close(ours[7], sm.forecasts_error_cov.transpose(2, 0, 1), "forecast_error_cov")


def test_p_inf_matrix_equals_mask_and_statsmodels_scaled(rng):
    """P_inf given as a matrix: diag(mask) gives the mask's results; 4 diag(mask) shifts the log-likelihood by
    -(number of diffuse components)/2 log 4 (each F_inf scales by 4), as statsmodels with that P_inf."""
    y, sysm, mask, P0 = local_linear_trend(rng)
    Pinf = np.diag(np.asarray(mask, float))
    r_mask = kalman_filter(y, np.zeros(2), P0, **sysm, diffuse=mask)
    r_mat = kalman_filter(y, np.zeros(2), P0, **sysm, diffuse=4.0 * Pinf)
    f = pytensor.function([], [r_mask.loglik, r_mat.loglik, r_mask.filtered_state, r_mat.filtered_state])
    ll1, ll4, a1, a4 = f()
    assert_close(a4, a1, "filtered_state", tol=1e-10)
    sm = statsmodels_filter(y, sysm, mask, P0)
    n_diffuse_components = 2  # two observations (steps 0 and 2; step 1 is missing) use F_inf
    assert_close(ll4, sm.llf - 0.5 * n_diffuse_components * np.log(4.0), "loglik with 4 P_inf")
    assert_close(ll1, sm.llf, "loglik")


def test_all_false_mask_is_the_ordinary_filter(rng):
    y, sysm, _, _ = ar1_plus_level(rng)
    a0 = np.array([0.3, -0.2])
    P0 = np.array([[2.0, 0.3], [0.3, 1.0]])
    T = pt.matrix("T")
    s2 = dict(sysm, T=T)
    d = kalman_filter(y, a0, P0, **s2, diffuse=[False, False])
    o = kalman_filter(y, a0, P0, **s2)
    cost = lambda r: r.loglik + (r.filtered_state ** 2).sum() + r.predicted_cov.sum()  # noqa: E731
    f = pytensor.function([T], [*d, *o, pytensor.grad(cost(d), T), pytensor.grad(cost(o), T)])
    out = f(np.asarray(sysm["T"]))
    for i in range(8):
        assert_close(out[i], out[8 + i], FIELDS[i], tol=1e-13)
    assert_close(out[16], out[17], "grad T", tol=1e-13)


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


def _weights(rng, n, m, p):
    shapes = [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]
    return [rng.normal(size=s) for s in shapes]


def _weighted(res, weights):
    total = 0.0
    for w, o in zip(weights, res):
        total = total + pt.where(pt.isnan(o), 0.0, w * o).sum()
    return total


@pytest.mark.parametrize("model", first_then_slow(["two_series", "local_linear_trend", "ar1_plus_level"]))
def test_verify_grad_every_input_and_output(model):
    """Cotangents of all 8 outputs, gradients with respect to y (observed entries), a0, P0, P_inf (matrix),
    c, d, T, Z, R, H, Q."""
    rng = np.random.default_rng(7)
    y, sysm, mask, P0 = MODELS[model](rng, n=7)
    n, p = y.shape
    m = len(mask)
    missing = np.isnan(y)
    weights = _weights(rng, n, m, p)
    P0 = P0 + 0.1 * np.eye(m)  # a nonzero P_star everywhere
    Pinf = np.diag(np.asarray(mask, float)) + 0.05 * (1 - np.eye(m)) * np.outer(mask, mask)

    def f(y_, a0, P0_, Pinf_, c, d, T, Z, R, h, Q):
        y_ = pt.where(missing, np.nan, y_)
        # H diagonal (a nonzero off-diagonal entry in a diffuse step is a failure): its diagonal is differentiated
        res = kalman_filter(y_, a0, P0_, c=c, d=d, T=T, Z=Z, R=R, H=pt.diag(h), Q=Q, diffuse=Pinf_)
        return _weighted(res, weights)

    sysm = dict(sysm, H=np.diag(np.asarray(sysm["H"], float)))
    args = [np.nan_to_num(y), 0.1 * rng.normal(size=m), P0, Pinf, 0.1 * rng.normal(size=m),
            0.1 * rng.normal(size=p)] + [np.asarray(sysm[k], float) for k in ("T", "Z", "R", "H", "Q")]
    verify_grad(f, args, rng=rng, abs_tol=2e-5, rel_tol=2e-5)


def test_mask_is_not_differentiable_and_gradient_matches_statsmodels_differences(rng):
    """With a mask only the other inputs are differentiated; d loglik / d Q against central differences of
    statsmodels' exact diffuse log-likelihood (an oracle outside iterops)."""
    y, sysm, mask, P0 = seasonal(rng, n=30)
    Q = pt.matrix("Q")
    res = kalman_filter(y, np.zeros(len(mask)), P0, **dict(sysm, Q=Q), diffuse=mask)
    g = pytensor.function([Q], pytensor.grad(res.loglik, Q))(np.asarray(sysm["Q"]))
    h = 1e-6
    for i in range(3):
        qp, qm = np.array(sysm["Q"], float), np.array(sysm["Q"], float)
        qp[i, i] += h
        qm[i, i] -= h
        fd = (statsmodels_filter(y, dict(sysm, Q=qp), mask, P0).llf
              - statsmodels_filter(y, dict(sysm, Q=qm), mask, P0).llf) / (2 * h)
        np.testing.assert_allclose(g[i, i], fd, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# failure values, graph-build errors
# ---------------------------------------------------------------------------


def _unobserved_diffuse(H):
    """State 1 is diffuse but never observed (Z = [1, 0]): P_inf never vanishes."""
    y = np.array([[0.3], [0.1], [-0.2], [0.4]])
    return y, dict(T=np.eye(2), Z=[[1.0, 0.0]], R=np.eye(2), H=H, Q=np.eye(2) * 0.1)


def test_diffuse_period_not_ending_is_minus_inf_nan_gradient():
    y, sysm = _unobserved_diffuse([[0.5]])
    Q = pt.matrix("Q")
    res = kalman_filter(y, np.zeros(2), np.eye(2), **dict(sysm, Q=Q), diffuse=[False, True])
    f = pytensor.function([Q], [res.loglik, res.loglik_obs, pytensor.grad(res.loglik, Q)])
    ll, llo, g = f(sysm["Q"])
    assert ll == -np.inf
    assert np.all(np.isfinite(llo))  # per-step values are reported
    assert np.all(np.isnan(g))


def test_zero_f_star_and_f_inf_is_minus_inf_and_nan_from_there():
    # state 1 diffuse and unobserved, state 0 known exactly (P0 = 0), no noise: F_inf = F_star = 0
    y, sysm = _unobserved_diffuse([[0.0]])
    sysm["Q"] = np.zeros((2, 2))
    res = kalman_filter(y, np.zeros(2), np.zeros((2, 2)), **sysm, diffuse=[False, True])
    ll, llo, af, ap = pytensor.function([], [res.loglik, res.loglik_obs, res.filtered_state, res.predicted_state])()
    assert ll == -np.inf
    assert llo[0] == -np.inf and np.all(np.isnan(llo[1:]))
    assert np.all(np.isnan(af)) and np.all(np.isnan(ap[1:])) and np.all(ap[0] == 0)


def test_non_diagonal_h_in_a_diffuse_step_is_minus_inf(rng):
    y, sysm, mask, P0 = two_series(rng)
    sysm["H"] = np.array([[0.5, 0.1], [0.1, 0.7]])
    res = kalman_filter(y, np.zeros(2), P0, **sysm, diffuse=mask)
    assert pytensor.function([], res.loglik)() == -np.inf


def test_graph_build_errors():
    y = np.zeros((5, 1))
    sysm = dict(T=np.eye(2), Z=[[1.0, 0.0]], R=np.eye(2), H=[[1.0]], Q=np.eye(2))
    with pytest.raises(ValueError, match=r"diffuse mask must be a sequence of m = 2 bools.*got shape \(3,\)"):
        kalman_filter(y, np.zeros(2), np.eye(2), **sysm, diffuse=[True, False, True])
    with pytest.raises(ValueError, match=r"P_inf of shape \(\.\.\., m, m\) with m = len\(a0\) = 2.*\(3, 3\)"):
        kalman_filter(y, np.zeros(2), np.eye(2), **sysm, diffuse=np.eye(3))
    with pytest.raises(ValueError, match="not supported together with cov_jitter"):
        kalman_filter(y, np.zeros(2), np.eye(2), **sysm, diffuse=[True, True], cov_jitter=1e-8)


def test_batched_inputs_equal_one_by_one(rng):
    y, sysm, mask, P0 = local_linear_trend(rng)
    ys = np.stack([y, y[::-1]])
    Hs = np.array([[[0.5]], [[0.9]]])
    res = kalman_filter(ys, np.zeros(2), P0, **dict(sysm, H=Hs), diffuse=mask)
    ll = pytensor.function([], res.loglik)()
    for b in range(2):
        one = kalman_filter(ys[b], np.zeros(2), P0, **dict(sysm, H=Hs[b]), diffuse=mask)
        assert_close(ll[b], pytensor.function([], one.loglik)(), "batched loglik", tol=1e-12)


# ---------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", first_then_slow(["ar1_plus_level", "two_series"]))
def test_jax_equals_numba_values_and_gradients(model):
    rng = np.random.default_rng(11)
    y, sysm, mask, P0 = MODELS[model](rng, n=9)
    m = len(mask)
    names = ("T", "Z", "R", "H", "Q")
    syms = [pt.tensor(k, shape=np.shape(sysm[k]), dtype="float64") for k in names]
    Pinf = pt.matrix("Pinf", shape=(m, m))
    P0s = pt.matrix("P0", shape=(m, m))
    res = kalman_filter(y, np.zeros(m), P0s, **dict(zip(names, syms)), diffuse=Pinf)
    weights = _weights(rng, *y.shape[:1], m, y.shape[1])
    cost = _weighted(res, weights)
    wrt = [P0s, Pinf, *syms]
    outs = [*res, *pytensor.grad(cost, wrt)]
    vals = [P0 + 0.1 * np.eye(m), np.diag(np.asarray(mask, float)), *(np.asarray(sysm[k], float) for k in names)]
    f_numba = pytensor.function([P0s, Pinf, *syms], outs)
    f_jax = pytensor.function([P0s, Pinf, *syms], outs, mode="JAX")
    for i, (a, e) in enumerate(zip(f_jax(*vals), f_numba(*vals))):
        a, e = np.asarray(a, float), np.asarray(e, float)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"output {i}: NaN pattern")
        ok = ~np.isnan(e)
        err = np.abs(a[ok] - e[ok]) / (1.0 + np.abs(e[ok]))
        assert err.size == 0 or err.max() <= 1e-10, (i, err.max())


def _numba_values_and_gradients(y, a0, P0, Pinf, sysm, weights):
    """The Numba Op's 8 outputs and the gradients of ``sum(weights * outputs)`` (NaN outputs weightless)
    with respect to all 11 inputs (``y``: its observed entries)."""
    names = ("c", "d", "T", "Z", "R", "H", "Q")
    vals = [np.asarray(x, float) for x in (y, a0, P0, Pinf, *(sysm[k] for k in names))]
    syms = [pt.tensor(f"x{i}", shape=v.shape, dtype="float64") for i, v in enumerate(vals)]
    res = kalman_filter(syms[0], syms[1], syms[2], **dict(zip(names, syms[4:])), diffuse=syms[3])
    grads = pytensor.grad(_weighted(res, weights), syms)
    out = pytensor.function(syms, [*res, *grads])(*vals)
    return out[:8], out[8:]


def _jax_cotangents(outs, weights):
    return [np.where(np.isnan(np.asarray(o)), 0.0, w) for o, w in zip(outs, weights)]


def _assert_equal_1e10(actual, expected, what):
    a, e = np.asarray(actual, float), np.asarray(expected, float)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN pattern")
    np.testing.assert_array_equal(np.isinf(a) & (a < 0), np.isinf(e) & (e < 0), err_msg=f"{what}: -inf pattern")
    ok = np.isfinite(e)
    err = np.abs(a[ok] - e[ok]) / (1.0 + np.abs(e[ok]))
    assert err.size == 0 or err.max() <= 1e-10, (what, err.max())


def _jax_case(model, rng):
    """A model with random a0, c, d, a nonzero P_star and a non-diagonal P_inf over the diffuse states."""
    y, sysm, mask, P0 = MODELS[model](rng, n=9 if model != "seasonal" else 30)
    m, p = len(mask), y.shape[1]
    mask = np.asarray(mask, float)
    Pinf = np.diag(mask) + 0.05 * (1 - np.eye(m)) * np.outer(mask, mask)
    sysm = {k: np.asarray(v, float) for k, v in sysm.items()}
    sysm.update(c=0.1 * rng.normal(size=m), d=0.1 * rng.normal(size=p))
    return y, 0.1 * rng.normal(size=m), P0 + 0.1 * np.eye(m), Pinf, sysm


def _jax_inputs(y, a0, P0, Pinf, sysm):
    # the JAX function's core shapes: a static system matrix has a time axis of length 1
    return (y, a0, P0, Pinf, *(np.asarray(sysm[k], float)[None] for k in ("c", "d", "T", "Z", "R", "H", "Q")))


@pytest.mark.parametrize("model", first_then_slow(["two_series", "local_level", "ar1_plus_level", "seasonal"]))
def test_jax_custom_vjp_equals_numba_adjoint_jit(model):
    """The hand-written reverse of the diffuse steps (``jax.custom_vjp``), under ``jax.jit``: values and the
    gradients of every input (P_inf a matrix) from random cotangents of all 8 outputs, equal to the Numba
    Op's to 1e-10; missing values in the diffuse period (local_level, two_series: p = 2, seasonal: m = 13)."""
    from iterops.jax.kalman_diffuse import kalman_filter_diffuse, kalman_filter_diffuse_vjp

    rng = np.random.default_rng(5)
    y, a0, P0, Pinf, sysm = _jax_case(model, rng)
    n, p = y.shape
    weights = _weights(rng, n, len(a0), p)
    outs_e, grads_e = _numba_values_and_gradients(y, a0, P0, Pinf, sysm, weights)
    inputs = _jax_inputs(y, a0, P0, Pinf, sysm)
    outs = jax.jit(kalman_filter_diffuse)(*inputs)
    for i, (a, e) in enumerate(zip(outs, outs_e)):
        _assert_equal_1e10(a, e, f"{model} output {FIELDS[i]}")
    grads = jax.jit(kalman_filter_diffuse_vjp)(inputs, _jax_cotangents(outs_e, weights))
    for i, (g, e) in enumerate(zip(grads, grads_e)):
        g = np.asarray(g)
        _assert_equal_1e10(g if i < 4 else g[0], e, f"{model} gradient of input {i}")


def test_jax_custom_vjp_vmap_equals_numba_one_by_one():
    """``jax.vmap`` over series with different missing patterns and noise levels (different ``d``)."""
    from iterops.jax.kalman_diffuse import kalman_filter_diffuse, kalman_filter_diffuse_vjp

    rng = np.random.default_rng(6)
    y, a0, P0, Pinf, sysm = _jax_case("two_series", rng)
    ys = np.stack([y, y[::-1].copy(), np.where(np.arange(9)[:, None] < 2, np.nan, y)])
    Hs = np.stack([sysm["H"], np.diag([0.9, 0.2]), np.diag([0.3, 1.1])])
    n, p = y.shape
    weights = [_weights(rng, n, len(a0), p) for _ in range(3)]
    expected = [_numba_values_and_gradients(ys[b], a0, P0, Pinf, dict(sysm, H=Hs[b]), weights[b]) for b in range(3)]
    inputs = list(_jax_inputs(ys[0], a0, P0, Pinf, sysm))
    inputs[0], inputs[9] = ys, Hs[:, None]
    axes = (0, None, None, None, None, None, None, None, None, 0, None)
    outs = jax.jit(jax.vmap(kalman_filter_diffuse, in_axes=axes))(*inputs)
    cts = [np.stack([_jax_cotangents(e[0], w)[i] for e, w in zip(expected, weights)]) for i in range(8)]
    grads = jax.jit(jax.vmap(kalman_filter_diffuse_vjp, in_axes=(axes, 0)))(tuple(inputs), cts)
    for b, (outs_e, grads_e) in enumerate(expected):
        for i, (a, e) in enumerate(zip(outs, outs_e)):
            _assert_equal_1e10(np.asarray(a)[b], e, f"series {b} output {FIELDS[i]}")
        for i, (g, e) in enumerate(zip(grads, grads_e)):
            g = np.asarray(g)[b]  # a shared input too: its gradient from this series' cotangents
            if i >= 4:
                g = g[0]
            _assert_equal_1e10(g, e, f"series {b} gradient of input {i}")


@pytest.mark.parametrize("case", ["not_ending", "zero_f", "non_diagonal_h"])
def test_jax_custom_vjp_failure_values_and_nan_gradients_equal_numba(case, rng):
    """Failure cases: -inf log-likelihood, NaN outputs from the failing step, NaN gradients, as the Numba Op."""
    from iterops.jax.kalman_diffuse import kalman_filter_diffuse, kalman_filter_diffuse_vjp

    if case == "non_diagonal_h":
        y, a0, P0, Pinf, sysm = _jax_case("two_series", rng)
        sysm["H"] = np.array([[0.5, 0.1], [0.1, 0.7]])
    else:
        y, sysm = _unobserved_diffuse([[0.5]] if case == "not_ending" else [[0.0]])
        sysm = {k: np.asarray(v, float) for k, v in sysm.items()}
        sysm.update(c=np.zeros(2), d=np.zeros(1))
        a0, P0, Pinf = np.zeros(2), np.eye(2), np.diag([0.0, 1.0])
        if case == "zero_f":
            P0, sysm["Q"] = np.zeros((2, 2)), np.zeros((2, 2))
    n, p = y.shape
    weights = _weights(rng, n, len(a0), p)
    outs_e, grads_e = _numba_values_and_gradients(y, a0, P0, Pinf, sysm, weights)
    assert outs_e[0] == -np.inf
    inputs = _jax_inputs(y, a0, P0, Pinf, sysm)
    outs = jax.jit(kalman_filter_diffuse)(*inputs)
    for i, (a, e) in enumerate(zip(outs, outs_e)):
        _assert_equal_1e10(a, e, f"{case} output {FIELDS[i]}")
    grads = jax.jit(kalman_filter_diffuse_vjp)(inputs, _jax_cotangents(outs_e, weights))
    for i, (g, e) in enumerate(zip(grads, grads_e)):
        g = np.asarray(g)
        assert np.all(np.isnan(g)), (case, i)
        _assert_equal_1e10(g if i < 4 else g[0], e, f"{case} gradient of input {i}")
