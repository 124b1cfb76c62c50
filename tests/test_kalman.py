"""Tests of iterops.ts.kalman_filter / kalman_smoother / stationary_cov.

Oracles: statsmodels' KalmanSmoother (filter + smoother outputs), pymc-extras'
StandardFilter (jitter / missing-value conventions), finite differences
(verify_grad, and central differences of statsmodels' log-likelihood), PyTensor
autodiff of a plain Scan Kalman filter written below, scipy's Lyapunov solver.
"""

import inspect

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg
from pytensor.gradient import NullTypeGradError, verify_grad
from statsmodels.tsa.statespace.kalman_smoother import KalmanSmoother as SMKalmanSmoother

from iterops.ts import kalman_filter, kalman_smoother, stationary_cov
from conftest import SCAN_ORACLE

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

NAMES = ("c", "d", "T", "Z", "R", "H", "Q")
FIELDS = (
    "loglik", "loglik_obs", "filtered_state", "filtered_cov",
    "predicted_state", "predicted_cov", "forecast_error", "forecast_error_cov",
)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def random_model(rng, m, p, r, n, tv=(), missing=True):
    """A random stable model; time-varying matrices get a leading time axis."""
    def spd(k, scale=1.0):
        X = rng.normal(size=(k, k))
        return scale * (X @ X.T / k + 0.5 * np.eye(k))

    base = dict(
        c=0.1 * rng.normal(size=m),
        d=0.3 * rng.normal(size=p),
        T=0.6 * np.eye(m) + 0.25 * rng.normal(size=(m, m)) / np.sqrt(m),
        Z=rng.normal(size=(p, m)),
        R=rng.normal(size=(m, r)),
        H=spd(p, 0.5),
        Q=spd(r),
    )
    mats = {}
    for k, v in base.items():
        if k in tv:
            noise = 0.05 * rng.normal(size=(n, *v.shape))
            if k in ("H", "Q"):
                noise = noise @ np.swapaxes(noise, -1, -2)  # stays SPD
            mats[k] = v + noise
        else:
            mats[k] = v
    y = rng.normal(size=(n, p))
    if missing and n >= 4:
        y[1, 0] = np.nan  # partial row
        y[n // 2, :] = np.nan  # full row
        y[-2, -1] = np.nan
    a0 = rng.normal(size=m)
    P0 = spd(m)
    return dict(y=y, a0=a0, P0=P0, **mats)


def statsmodels_results(model, tv=()):
    y = model["y"]
    n, p = y.shape
    m = model["a0"].shape[0]
    r = model["Q"].shape[-1]
    ks = SMKalmanSmoother(k_endog=p, k_states=m, k_posdef=r)
    ks.bind(np.asfortranarray(y.T))
    sm_names = dict(c="state_intercept", d="obs_intercept", T="transition", Z="design",
                    R="selection", H="obs_cov", Q="state_cov")
    for k, name in sm_names.items():
        v = model[k]
        ks[name] = np.moveaxis(v, 0, -1) if k in tv else v  # statsmodels puts time last
    ks.initialize_known(model["a0"], model["P0"])
    return ks.smooth()


def sm_outputs(res):
    cov = lambda x: np.moveaxis(x, -1, 0)  # noqa: E731
    return dict(
        loglik=res.llf,
        loglik_obs=res.llf_obs,
        filtered_state=res.filtered_state.T,
        filtered_cov=cov(res.filtered_state_cov),
        predicted_state=res.predicted_state.T,
        predicted_cov=cov(res.predicted_state_cov),
        forecast_error=res.forecasts_error.T,
        forecast_error_cov=cov(res.forecasts_error_cov),
        smoothed_state=res.smoothed_state.T,
        smoothed_cov=cov(res.smoothed_state_cov),
    )


def symbolic_inputs(model, tv=(), batch=0):
    """Symbolic inputs with unknown sizes (one compiled function serves many models)."""
    nd = dict(y=2, a0=1, P0=2, c=1, d=1, T=2, Z=2, R=2, H=2, Q=2)
    out = []
    for k in ("y", "a0", "P0", *NAMES):
        out.append(pt.tensor(name=k, dtype="float64", shape=(None,) * (batch + nd[k] + (k in tv))))
    return out


def assert_close(actual, expected, name, rtol=1e-8, atol=1e-10):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True, err_msg=name)


def model_args(model):
    return [model[k] for k in ("y", "a0", "P0", *NAMES)]


def kf(args, **kwargs):
    """``kalman_filter`` on a list ``[y, a0, P0, c, d, T, Z, R, H, Q]`` (system matrices by keyword)."""
    return kalman_filter(*args[:3], **dict(zip(NAMES, args[3:])), **kwargs)


def ks(args, **kwargs):
    """``kalman_smoother`` on a list ``[y, a0, P0, c, d, T, Z, R, H, Q]`` (system matrices by keyword)."""
    return kalman_smoother(*args[:3], **dict(zip(NAMES, args[3:])), **kwargs)


# ---------------------------------------------------------------------------
# statsmodels
# ---------------------------------------------------------------------------

TV_CASES = {"static": (), "all_time_varying": NAMES, "T_Z_H": ("T", "Z", "H")}


@pytest.fixture(scope="module", params=list(TV_CASES))
def filter_and_smoother_fn(request):
    tv = TV_CASES[request.param]
    ins = symbolic_inputs({}, tv)
    res = kf(ins, time_varying=tv)
    sm = ks(ins, time_varying=tv)
    fn = pytensor.function(ins, [*res, *sm])
    return tv, fn


@pytest.mark.parametrize("seed", range(4))
def test_matches_statsmodels(filter_and_smoother_fn, seed):
    tv, fn = filter_and_smoother_fn
    rng = np.random.default_rng(seed)
    m, p, r, n = [(3, 2, 2, 12), (4, 3, 2, 9), (1, 1, 1, 15), (5, 2, 3, 7)][seed]
    model = random_model(rng, m, p, r, n, tv=tv, missing=seed != 3)
    out = fn(*model_args(model))
    expected = sm_outputs(statsmodels_results(model, tv))
    for name, value in zip([*FIELDS, "smoothed_state", "smoothed_cov"], out):
        assert value.shape == np.shape(expected[name]), name
        assert_close(value, expected[name], name)
    # NaN forecast errors exactly where y is missing, as statsmodels
    np.testing.assert_array_equal(np.isnan(out[6]), np.isnan(model["y"]))


def test_steady_state_long_series_matches_statsmodels():
    """A long static series: exercises the frozen-covariance path (and statsmodels' own)."""
    rng = np.random.default_rng(5)
    model = random_model(rng, 3, 2, 3, 400, missing=False)
    model["y"][300, 1] = np.nan  # leave and re-enter the steady state
    ins = symbolic_inputs(model)
    res = kf(ins)
    out = pytensor.function(ins, list(res))(*model_args(model))
    expected = sm_outputs(statsmodels_results(model))
    for name, value in zip(FIELDS, out):
        assert_close(value, expected[name], name, rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------
# pymc-extras StandardFilter
# ---------------------------------------------------------------------------


def test_matches_pymc_extras_standard_filter():
    from pymc_extras.statespace.filters.kalman_filter import StandardFilter

    rng = np.random.default_rng(11)
    tv = ("Z",)
    model = random_model(rng, 3, 2, 2, 10, tv=tv)
    y = model["y"].copy()
    y[3, 1] = -9999.0  # pymc-extras' missing sentinel, next to NaNs
    model["y"] = y
    ins = symbolic_inputs(model, tv)
    # theirs: data, a0, P0, c, d, T, Z, R, H, Q; time-varying matrices as scan sequences
    filt = StandardFilter(time_varying_names=("design",))
    theirs = filt.build_graph(*ins)
    names = [v.name for v in theirs]
    ours = kf(ins, time_varying=tv, cov_jitter=filt.cov_jitter, missing_value=filt.missing_fill_value)
    # theirs: their Scan, iterops' rewrites off and run by ``perform`` (a Numba compile of the Scan took ~40 CPU s);
    # ours: the fused Op compiled by Numba
    args = model_args(model)
    vals = [*pytensor.function(ins, theirs, mode=SCAN_ORACLE)(*args),
            *pytensor.function(ins, ours, mode="FAST_RUN")(*args)]
    th = dict(zip(names, vals[: len(theirs)]))
    us = KF = type(ours)(*vals[len(theirs):])
    assert filt.cov_jitter == 1e-8
    assert_close(us.filtered_state, th["filtered_states"], "filtered_state")
    assert_close(us.filtered_cov, th["filtered_covariances"], "filtered_cov")
    assert_close(us.predicted_state[:-1], th["predicted_states"], "predicted_state")
    assert_close(us.predicted_cov[:-1], th["predicted_covariances"], "predicted_cov")
    assert_close(us.loglik_obs, th["loglike_obs"], "loglik_obs")
    # their observed_states / observed_covariances, from ours as the module docstring says
    missing = np.isnan(y) | (y == -9999.0)
    Z = model["Z"]
    y_hat = np.where(missing, 0.0, model["d"] + np.einsum("tpm,tm->tp", Z, KF.predicted_state[:-1]))
    assert_close(y_hat, th["predicted_observed_states"], "observed_states")
    obs = ~missing
    F = np.where(obs[:, :, None] & obs[:, None, :], KF.forecast_error_cov, 0.0)
    F = F + filt.cov_jitter * np.einsum("tp,pq->tpq", missing, np.eye(2))
    assert_close(F, th["predicted_observed_covariances"], "observed_covariances")


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


def _weighted_loss(res, weights, missing):
    total = 0.0
    for w, o, name in zip(weights, res, FIELDS):
        if name == "forecast_error":
            o = pt.where(missing, 0.0, o)  # NaN (constant) where y is missing
        total = total + (w * o).sum()
    return total


def _weights(rng, n, m, p):
    shapes = [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]
    return [rng.normal(size=s) for s in shapes]


@pytest.mark.parametrize("m, p", [(2, 2), (3, 1)], ids=["p2", "p1"])
@pytest.mark.parametrize("tv", [(), ("T", "Q", "d")], ids=["static", "time_varying"])
def test_verify_grad_all_outputs(tv, m, p):
    """Cotangents on all eight outputs, missing values, jitter; p = 1 takes the rank-one update and its
    merged reverse."""
    rng = np.random.default_rng(3)
    r, n = 2, (5 if p == 2 else 8)  # p = 1: steps 1, 4, 6 missing
    model = random_model(rng, m, p, r, n, tv=tv)
    missing = np.isnan(model["y"])
    weights = _weights(rng, n, m, p)

    def f(y, *rest):
        y = pt.where(missing, np.nan, y)
        res = kf([y, *rest], time_varying=tv, cov_jitter=1e-3)
        return _weighted_loss(res, weights, missing)

    args = model_args(model)
    args[0] = np.nan_to_num(args[0])
    verify_grad(f, args, rng=rng, abs_tol=2e-5, rel_tol=2e-5)


def scan_kalman_filter(y, a0, P0, c, d, T, Z, R, H, Q):
    """Plain pytensor.scan Kalman filter with every output of ours (no missing data, no jitter),
    Joseph form.  Not :func:`iterops.reference_loops.kalman_textbook_loop`: that loop has no
    intercepts ``c``, ``d`` and no filtered outputs, which this one differentiates."""
    m = a0.shape[0]

    def step(y_t, a, P, c, d, T, Z, R, H, Q):
        v = y_t - d - Z @ a
        F = Z @ P @ Z.T + H
        F = 0.5 * (F + F.T)
        Finv = pt.linalg.inv(F)
        K = P @ Z.T @ Finv
        A = pt.eye(m) - K @ Z
        ll = -0.5 * (v.shape[0] * np.log(2 * np.pi) + pt.log(pt.linalg.det(F)) + v @ Finv @ v)
        a_f = a + K @ v
        P_f = A @ P @ A.T + K @ H @ K.T
        P_f = 0.5 * (P_f + P_f.T)
        a_n = T @ a_f + c
        P_n = T @ P_f @ T.T + R @ Q @ R.T
        P_n = 0.5 * (P_n + P_n.T)
        return a_n, P_n, ll, a_f, P_f, v, F

    (a_n, P_n, ll, a_f, P_f, v, F) = pytensor.scan(
        step, sequences=[y], outputs_info=[a0, P0, None, None, None, None, None],
        non_sequences=[c, d, T, Z, R, H, Q], return_updates=False,
    )
    a_pred = pt.concatenate([a0[None], a_n], axis=0)
    P_pred = pt.concatenate([P0[None], P_n], axis=0)
    return (ll.sum(), ll, a_f, P_f, a_pred, P_pred, v, F)


NO_ITEROPS = pytensor.compile.mode.get_default_mode().excluding("iterops")  # the loops stay Scans
# The reference Scans and their autodiff gradients on PyTensor's Python linker: the same graph, evaluated
# Op by Op, so the oracle costs no Numba compile of a Scan and its gradient Scan (minutes in a fresh
# checkout, the largest items of the suite's time)
REFERENCE = SCAN_ORACLE


def _compare_gradients(ins, names, ours, ref, values, *, sym_P0, sym_read=("P0",)):
    g_ours = pytensor.grad(ours, ins)
    g_ref = pytensor.grad(ref, ins)
    out = [*pytensor.function(ins, [ours, *g_ours], mode=NO_ITEROPS)(*values),
           *pytensor.function(ins, [ref, *g_ref], mode=REFERENCE, on_unused_input="ignore")(*values)]
    out = [out[0], out[len(ins) + 1], *out[1:len(ins) + 1], *out[len(ins) + 2:]]
    assert_close(out[0], out[1], "value", rtol=1e-9)
    k = len(ins)
    for i, name in enumerate(names):
        ours_i, ref_i = out[2 + i], out[2 + k + i]
        if name in sym_read:
            # the filter reads P0 (and H, Q) through sym(.) (documented); a Scan that uses their raw
            # entries has another gradient off the symmetric subspace: compare the symmetric parts
            if sym_P0 and name == "P0":
                np.testing.assert_array_equal(ours_i, ours_i.T)
            ours_i, ref_i = 0.5 * (ours_i + ours_i.T), 0.5 * (ref_i + ref_i.T)
        assert_close(ours_i, ref_i, f"d/d{name}", rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("n", [60, 400])
def test_gradient_matches_autodiff_of_reference_loop(n):
    """Loglik, predictions and their gradients against autodiff of the textbook Scan users write
    (:func:`iterops.reference_loops.kalman_textbook_loop`, no intercepts), kept a Scan.  Static
    system, long enough to reach the steady state: n=60 runs the steady backward recursion on
    every step of the stretch, n=400 the Lyapunov-summed far steps."""
    from iterops.reference_loops import kalman_textbook_loop

    rng = np.random.default_rng(7)
    m, p, r = 3, 2, 2
    model = random_model(rng, m, p, r, n, missing=False)
    model["P0"] = model["P0"] + model["P0"].T  # exactly symmetric
    names = ("y", "a0", "P0", "T", "Z", "R", "H", "Q")
    ins = [pt.tensor(name=k, dtype="float64", shape=(None, p) if k == "y" else (None,) * model[k].ndim)
           for k in names]
    w_ll, w_a, w_P = rng.normal(size=n), rng.normal(size=(n, m)), rng.normal(size=(n, m, m))
    y, a0, P0, T, Z, R, H, Q = ins
    res = kalman_filter(y, a0, P0, T=T, Z=Z, R=R, H=H, Q=Q)
    ll_ref, a_ref, P_ref = kalman_textbook_loop(y, a0, P0, T, Z, R, H, Q)
    values = [model[k] for k in names]
    sym = ("P0", "H", "Q")  # the textbook loop reads H and Q raw
    _compare_gradients(ins, names, res.loglik, ll_ref.sum(), values, sym_P0=True, sym_read=sym)
    ours = (w_ll * res.loglik_obs).sum() + (w_a * res.predicted_state[1:]).sum() + (w_P * res.predicted_cov[1:]).sum()
    ref = (w_ll * ll_ref).sum() + (w_a * a_ref).sum() + (w_P * P_ref).sum()
    _compare_gradients(ins, names, ours, ref, values, sym_P0=False, sym_read=sym)


@pytest.mark.parametrize("n", [60, 400])
def test_gradient_of_every_output_matches_autodiff_of_scan(n):
    """Cotangents on all eight outputs, with intercepts, against autodiff of :func:`scan_kalman_filter`."""
    rng = np.random.default_rng(7)
    m, p, r = 3, 2, 2
    model = random_model(rng, m, p, r, n, missing=False)
    model["P0"] = model["P0"] + model["P0"].T  # exactly symmetric
    weights = _weights(rng, n, m, p)
    ins = symbolic_inputs(model)
    no_missing = np.zeros((n, p), dtype=bool)
    ours = _weighted_loss(kf(ins), weights, no_missing)
    ref = _weighted_loss(scan_kalman_filter(*ins), weights, no_missing)
    _compare_gradients(ins, ("y", "a0", "P0", *NAMES), ours, ref, model_args(model), sym_P0=False)


def test_verify_grad_long_series_leaving_the_steady_state():
    """Finite differences through two long steady stretches separated by a missing value,
    with cotangents on every output (the windowed steady backward path and its flush)."""
    rng = np.random.default_rng(21)
    m, p, r, n = 2, 2, 2, 240
    model = random_model(rng, m, p, r, n, missing=False)
    model["y"][120, 0] = np.nan
    missing = np.isnan(model["y"])
    weights = [w / np.sqrt(w.size) for w in _weights(rng, n, m, p)]

    def f(*args):
        y = pt.where(missing, np.nan, args[0])
        return _weighted_loss(kf([y, *args[1:]]), weights, missing)

    args = model_args(model)
    args[0] = np.nan_to_num(args[0])
    verify_grad(f, args, rng=rng, abs_tol=1e-5, rel_tol=1e-5)


def test_gradient_vs_statsmodels_finite_differences(mode):
    """Every linker: loglik vs statsmodels, its gradient vs central differences of statsmodels' llf."""
    rng = np.random.default_rng(13)
    model = random_model(rng, 2, 2, 2, 8)
    ins = [pt.as_tensor(model[k]).type(name=k) for k in ("y", "a0", "P0", *NAMES)]
    res = kf(ins)
    grads = pytensor.grad(res.loglik, ins[1:])
    fn = pytensor.function(ins, [res.loglik, *grads], mode=mode)
    out = fn(*model_args(model))
    assert_close(out[0], statsmodels_results(model).llf, "loglik")
    eps = 1e-6
    for name, g in zip(("a0", "P0", *NAMES), out[1:]):
        num = np.zeros_like(model[name])
        for idx in np.ndindex(model[name].shape):
            vals = []
            for sgn in (1, -1):
                mod = dict(model)
                mod[name] = model[name].copy()
                mod[name][idx] += sgn * eps
                if name in ("P0", "H", "Q") and idx[0] != idx[1]:
                    mod[name][idx[::-1]] += sgn * eps  # statsmodels reads symmetric covariances
                vals.append(statsmodels_results(mod).llf)
            num[idx] = (vals[0] - vals[1]) / (2 * eps)
        if name in ("P0", "H", "Q"):
            g = g + g.T - np.diag(np.diag(g))  # symmetric perturbation of our gradient
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-6, err_msg=name)


def test_gradient_wrt_y_zero_where_missing():
    rng = np.random.default_rng(2)
    model = random_model(rng, 2, 2, 2, 6)
    y = pt.matrix("y")
    res = kf([y, *model_args(model)[1:]])
    gy = pytensor.grad(res.loglik, y).eval({y: model["y"]})
    missing = np.isnan(model["y"])
    assert np.all(gy[missing] == 0) and np.all(np.isfinite(gy)) and np.all(gy[~missing] != 0)


# ---------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------


def test_strided_inputs_and_cotangents():
    """Fortran-ordered and strided inputs (copied to C order inside the Op) and a strided output
    cotangent: same log-likelihood as statsmodels, same gradient as with C-ordered inputs."""
    rng = np.random.default_rng(17)
    model = random_model(rng, 3, 2, 3, 40)
    ins = symbolic_inputs(model)
    res = kf(ins)
    loss = res.loglik + (res.filtered_state[::2, ::-1] ** 2).sum()
    fn = pytensor.function(ins, [res.loglik, *pytensor.grad(loss, ins)])
    args = model_args(model)
    strided = [np.asfortranarray(x) if x.ndim == 2 else x for x in args]
    strided[0] = np.repeat(args[0], 2, axis=0)[::2]  # a strided view of y
    expected = fn(*args)
    out = fn(*strided)
    assert_close(out[0], statsmodels_results(model).llf, "loglik")
    for name, a, b in zip(("loglik", "y", "a0", "P0", *NAMES), out, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_batched_matches_looped():
    rng = np.random.default_rng(21)
    tv = ("T",)
    models = [random_model(rng, 2, 2, 1, 7, tv=tv) for _ in range(3)]
    stack = {k: np.stack([mdl[k] for mdl in models]) for k in models[0]}
    stack["Q"] = models[0]["Q"]  # unbatched input broadcasts
    for mdl in models:
        mdl["Q"] = models[0]["Q"]
    ins_b = symbolic_inputs(stack, tv, batch=1)
    ins_b[-1] = pt.matrix("Q")
    res_b = kf(ins_b, time_varying=tv)
    g_b = pytensor.grad(res_b.loglik.sum(), ins_b[1:])
    fb = pytensor.function(ins_b, [*res_b, ks(ins_b, time_varying=tv).smoothed_state, *g_b])
    ins_1 = symbolic_inputs(models[0], tv)
    res_1 = kf(ins_1, time_varying=tv)
    g_1 = pytensor.grad(res_1.loglik, ins_1[1:])
    f1 = pytensor.function(ins_1, [*res_1, ks(ins_1, time_varying=tv).smoothed_state, *g_1])
    out_b = fb(*model_args(stack))
    looped = [f1(*model_args(mdl)) for mdl in models]
    for j, ob in enumerate(out_b):
        if j == len(out_b) - 1:  # gradient wrt the broadcast Q sums over the batch
            assert_close(ob, sum(lp[j] for lp in looped), "grad Q", rtol=1e-12)
        else:
            assert_close(ob, np.stack([lp[j] for lp in looped]), f"output {j}", rtol=1e-12)


# ---------------------------------------------------------------------------
# failure behaviour and edge cases
# ---------------------------------------------------------------------------


def test_non_pd_innovation_covariance_gives_minus_inf():
    rng = np.random.default_rng(0)
    model = random_model(rng, 2, 2, 2, 5, missing=False)
    model["H"] = -10 * np.eye(2)
    y = pt.matrix("y")
    res = kf([y, *model_args(model)[1:]])
    g = pytensor.grad(res.loglik, y)
    ll, llo, gy = pytensor.function([y], [res.loglik, res.loglik_obs, g])(model["y"])
    assert ll == -np.inf and llo[0] == -np.inf and np.all(np.isnan(gy))


def test_empty_series():
    rng = np.random.default_rng(0)
    model = random_model(rng, 2, 1, 1, 0, missing=False)
    res = kf(model_args(model))
    out = pytensor.function([], list(res))()
    assert out[0] == 0.0
    assert out[2].shape == (0, 2) and out[5].shape == (1, 2, 2)
    np.testing.assert_array_equal(out[4][0], model["a0"])
    a_s, _ = ks(model_args(model))
    assert a_s.eval().shape == (0, 2)


def test_float32_in_float32_out():
    rng = np.random.default_rng(0)
    model = {k: v.astype("float32") for k, v in random_model(rng, 2, 1, 1, 6).items()}
    res = kf(model_args(model))
    assert all(o.dtype == "float32" for o in res)
    expected = statsmodels_results({k: v.astype("float64") for k, v in model.items()}).llf
    np.testing.assert_allclose(res.loglik.eval(), expected, rtol=1e-5)


def test_smoother_gradient_raises():
    rng = np.random.default_rng(0)
    model = random_model(rng, 2, 1, 1, 4)
    T = pt.matrix("T")
    args = model_args(model)
    args[5] = T
    a_s, _ = ks(args)
    with pytest.raises(NullTypeGradError, match="not implemented"):
        pytensor.grad(a_s.sum(), T)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(Z=np.ones((2, 3))), r"Z must be \(p, m\)"),
        (dict(y=np.ones((5, 3))), r"d must have p entries \(y's last dimension\)"),
        (dict(T=np.ones((2, 3))), r"T must be square"),
        (dict(H=np.ones((2, 3))), r"H must be square"),
        (dict(Q=np.ones((1, 2))), r"Q must be square"),
        (dict(P0=np.eye(3)), r"P0 must be \(m, m\)"),
        (dict(c=np.ones(3)), r"c must have m entries"),
        (dict(d=np.ones(3)), r"d must have p entries"),
        (dict(R=np.ones((2, 3))), r"R must be \(m, r\)"),
        (dict(T=np.ones((4, 2, 2)), time_varying=("T",)), r"time-varying T must have length n_time = 5"),
        (dict(time_varying=("X",)), r"time_varying may only name"),
        (dict(time_varying=("Z",)), r"Z must have at least 3 dimensions"),
    ],
)
def test_bad_inputs(change, match):
    rng = np.random.default_rng(0)
    model = random_model(rng, 2, 2, 1, 5, missing=False)
    kwargs = {"time_varying": change.pop("time_varying", ())}
    model.update(change)
    with pytest.raises(ValueError, match=match):
        kf(model_args(model), **kwargs)
    with pytest.raises(ValueError, match=match):
        ks(model_args(model), **kwargs)


@pytest.mark.parametrize("func", [kalman_filter, kalman_smoother])
def test_system_matrices_are_keyword_only(func):
    """Swapping H and Q (or c and d) with matching shapes changes the result without an error,
    so a positional call of the system matrices is refused, with a message saying what to do."""
    model = random_model(np.random.default_rng(0), 2, 2, 2, 5)
    with pytest.raises(TypeError, match=r"takes 3 positional arguments but 10"):
        func(*model_args(model))
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        func(model["y"], model["a0"], model["P0"], model["c"], d=model["d"], T=model["T"], Z=model["Z"],
             R=model["R"], H=model["H"], Q=model["Q"])
    with pytest.raises(TypeError, match="'Q'"):  # the required system matrices have no default
        func(model["y"], model["a0"], model["P0"], T=model["T"], Z=model["Z"], R=model["R"], H=model["H"])
    params = inspect.signature(func).parameters
    assert [k for k, v in params.items() if v.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == ["y", "a0", "P0"]
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in NAMES)


def test_intercepts_default_to_zeros():
    """Omitted c and d are zeros: statsmodels with zero intercepts (it defaults to zeros too)."""
    model = random_model(np.random.default_rng(4), 3, 2, 2, 9)
    model["c"], model["d"] = np.zeros(3), np.zeros(2)
    system = {k: model[k] for k in ("T", "Z", "R", "H", "Q")}
    res = kalman_filter(model["y"], model["a0"], model["P0"], **system)
    sm = kalman_smoother(model["y"], model["a0"], model["P0"], **system)
    expected = sm_outputs(statsmodels_results(model))
    out = pytensor.function([], [*res, sm.smoothed_state])()
    for name, value in zip([*FIELDS, "smoothed_state"], out):
        assert_close(value, expected[name], name)
    with pytest.raises(ValueError, match="time_varying names 'c' but c was not given"):
        kalman_filter(model["y"], model["a0"], model["P0"], time_varying=("c",), **system)


def test_run_time_shape_mismatch_raises():
    rng = np.random.default_rng(0)
    model = random_model(rng, 2, 2, 1, 5, missing=False)
    ins = symbolic_inputs(model, ("T",))
    fn = pytensor.function(ins, kf(ins, time_varying=("T",)).loglik)
    args = model_args(model)
    args[5] = np.stack([model["T"]] * 4)  # 4 != n_time = 5, unknown at build time
    with pytest.raises(ValueError, match=r"kalman_filter: T must have shape \(t, m, m\).* got T with shape \(4, 2, 2\)"):
        fn(*args)


def test_stationary_cov_matches_scipy():
    rng = np.random.default_rng(0)
    model = random_model(rng, 3, 1, 2, 1)
    T, R, Q = model["T"], model["R"], model["Q"]
    expected = scipy.linalg.solve_discrete_lyapunov(T, R @ Q @ R.T)
    np.testing.assert_allclose(stationary_cov(T, R, Q).eval(), expected, rtol=1e-10)
    with pytest.raises(ValueError, match="R must have m = 3 rows"):
        stationary_cov(T, np.ones((2, 2)), Q)
