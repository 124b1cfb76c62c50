"""The univariate measurement update of iterops.ts.kalman_filter (``univariate=True`` / ``"auto"``):
one observed component at a time where H is diagonal (Durbin & Koopman 2012, sec. 6.4).

Oracles: statsmodels' KalmanFilter, univariate (``filter_univariate = True``) and conventional
(``forecast_error`` and ``forecast_error_cov`` are the multivariate ones, so only the conventional
filter is their oracle); the dense step-by-step NumPy filter with pymc-extras' arithmetic (jitter);
the dense filter's ``np.linalg.cholesky`` for the failing step; PyTensor autodiff of pymc-extras'
``StandardFilter`` Scan (compiled without iterops' rewrites) and finite differences for the gradient.
"""

import itertools

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pytensor.gradient import verify_grad
from statsmodels.tsa.statespace.kalman_filter import KalmanFilter as SMKalmanFilter
from test_kalman import FIELDS, NAMES, kf, model_args, random_model, symbolic_inputs
from test_kalman_steady import assert_loglik_grads_close, dense_filter, gradient_fns

from iterops.ts.kalman import KalmanFilter, _choose_update, kalman_filter

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

SM_NAMES = dict(c="state_intercept", d="obs_intercept", T="transition", Z="design", R="selection", H="obs_cov",
                Q="state_cov")
#: outputs statsmodels' univariate filter computes as we do (its forecast errors are the sequential ones)
COMMON = FIELDS[:6]


def statsmodels_filter(model, tv=(), univariate=False):
    """statsmodels' filter outputs, in our names and layout (time first)."""
    y = model["y"]
    n, p = y.shape
    kfm = SMKalmanFilter(k_endog=p, k_states=model["a0"].shape[0], k_posdef=model["Q"].shape[-1])
    kfm.bind(np.asfortranarray(y.T))
    for k, name in SM_NAMES.items():
        kfm[name] = np.moveaxis(model[k], 0, -1) if k in tv else model[k]
    kfm.initialize_known(model["a0"], model["P0"])
    kfm.filter_univariate = univariate
    res = kfm.filter()
    cov = lambda x: np.moveaxis(x, -1, 0)  # noqa: E731
    return dict(
        loglik=res.llf, loglik_obs=res.llf_obs, filtered_state=res.filtered_state.T,
        filtered_cov=cov(res.filtered_state_cov), predicted_state=res.predicted_state.T,
        predicted_cov=cov(res.predicted_state_cov), forecast_error=res.forecasts_error.T,
        forecast_error_cov=cov(res.forecasts_error_cov),
    )


def assert_matches_statsmodels(out, model, tv=(), rtol=1e-8, atol=1e-8):
    """Every output (of the ``len(out)`` first) against statsmodels' conventional filter, the first six also
    against its univariate one."""
    for univariate, names in ((False, FIELDS[:len(out)]), (True, COMMON)):
        ref = statsmodels_filter(model, tv, univariate)
        for name in names:
            np.testing.assert_allclose(
                out[FIELDS.index(name)], ref[name], rtol=rtol, atol=atol, equal_nan=True,
                err_msg=f"{name} (statsmodels {'univariate' if univariate else 'conventional'})",
            )


_FNS = {}


def filter_fn(tv=(), univariate=True, jitter=0.0, batch=0, n_out=8):
    """A compiled ``kalman_filter`` of unknown sizes (one per option set), Python linker (``perform``
    runs the same kernel as the Numba linker); outputs: the first ``n_out`` (7: ``forecast_error_cov``
    unused, so the rewrite ``kalman_unused_outputs`` skips it)."""
    key = (tuple(tv), univariate, jitter, batch, n_out)
    if key not in _FNS:
        ins = symbolic_inputs({}, tv, batch)
        outs = list(kf(ins, time_varying=tv, univariate=univariate, cov_jitter=jitter))[:n_out]
        _FNS[key] = pytensor.function(ins, outs, mode="FAST_COMPILE")
    return _FNS[key]


def kalman_ops(fn):
    """The KalmanFilter core Ops of a compiled function."""
    ops = [node.op for node in fn.maker.fgraph.toposort()]
    return [getattr(op, "core_op", op) for op in ops if type(getattr(op, "core_op", op)) is KalmanFilter]


def dfm(rng, m, p, n, missing=True):
    """A dynamic factor model: m factors (a stable VAR(1)), p series loading on all of them, diagonal H."""
    model = random_model(rng, m, p, m, n, missing=missing)
    model["H"] = np.diag(rng.uniform(0.2, 1.0, p))
    return model


def structural(rng, p, n):
    """Several series sharing a local linear trend and a quarterly seasonal, each with its own AR(1):
    a sparse Z (the structured path), diagonal H."""
    m = 2 + 3 + p
    T = np.zeros((m, m))
    T[:2, :2] = [[1.0, 1.0], [0.0, 1.0]]
    T[2, 2:5] = -1.0
    T[3, 2] = T[4, 3] = 1.0
    T[5:, 5:] = np.diag(rng.uniform(0.2, 0.8, p))
    Z = np.zeros((p, m))
    Z[:, 0] = rng.uniform(0.5, 1.5, p)
    Z[:, 2] = 1.0
    Z[np.arange(p), 5 + np.arange(p)] = 1.0
    R = np.eye(m)[:, [0, 1, 2, *range(5, m)]]
    r = R.shape[1]
    y = rng.normal(size=(n, p)).cumsum(axis=0)
    y[3, 1] = np.nan
    y[7, :] = np.nan
    return dict(
        y=y, a0=np.zeros(m), P0=10.0 * np.eye(m), c=np.zeros(m), d=rng.normal(size=p), T=T, Z=Z, R=R,
        H=np.diag(rng.uniform(0.1, 0.5, p)), Q=np.diag(rng.uniform(0.01, 0.2, r)),
    )


# ---------------------------------------------------------------------------
# values against statsmodels
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_out", [8, 7], ids=["F-used", "F-unused"])
@pytest.mark.parametrize("univariate", [True, "auto"])
@pytest.mark.parametrize("m, p", [(2, 8), (4, 16), (3, 12)])
def test_dynamic_factor_model_matches_statsmodels(univariate, m, p, n_out):
    """(a) + (c): partly missing rows (``random_model``: rows 1 and n-2) and a fully missing row; with and
    without ``forecast_error_cov`` among the outputs (the univariate steps skip it when unused)."""
    rng = np.random.default_rng(m * 100 + p)
    model = dfm(rng, m, p, 60)
    model["y"][10, ::3] = np.nan
    fn = filter_fn(univariate=univariate, n_out=n_out)
    assert [op.forecast_cov for op in kalman_ops(fn)] == [n_out == 8]
    assert_matches_statsmodels(fn(*model_args(model)), model)


def test_structural_multiseries_matches_statsmodels():
    """(b): sparse Z and T, diffuse-like P0 = 10 I, missing values."""
    model = structural(np.random.default_rng(1), 5, 50)
    assert_matches_statsmodels(filter_fn()(*model_args(model)), model, rtol=1e-8, atol=1e-7)


def test_time_varying_z_and_h_match_statsmodels():
    """(d): Z and a diagonal H vary over time (H checked every step)."""
    rng = np.random.default_rng(2)
    n, m, p = 40, 3, 6
    model = dfm(rng, m, p, n)
    model["Z"] = model["Z"] + 0.1 * rng.normal(size=(n, p, m))
    model["H"] = np.diag(rng.uniform(0.2, 1.0, p)) * rng.uniform(0.5, 1.5, size=(n, 1, 1))
    tv = ("Z", "H")
    assert_matches_statsmodels(filter_fn(tv)(*model_args(model)), model, tv)


def test_non_diagonal_h_steps_fall_back_to_the_multivariate_update():
    """univariate=True with a symbolic H: the steps where H is not diagonal take the multivariate
    update at run time (a time-varying H diagonal on some steps only; and a static full H)."""
    rng = np.random.default_rng(3)
    n, m, p = 30, 2, 5
    model = dfm(rng, m, p, n)
    H = np.repeat(model["H"][None], n, axis=0)
    H[::3] += 0.05  # every third step a full H
    model["H"] = H
    assert_matches_statsmodels(filter_fn(("H",))(*model_args(model)), model, ("H",))
    model = random_model(rng, m, p, m, n)  # full static H
    assert_matches_statsmodels(filter_fn()(*model_args(model)), model)


@pytest.mark.parametrize("jitter", [1e-8, 1e-3])
def test_jitter_matches_dense_pymc_extras_arithmetic(jitter):
    """(e): the jitter on F and on the filtered covariance (pymc-extras' StandardFilter arithmetic, dense
    NumPy filter), missing components included."""
    rng = np.random.default_rng(4)
    model = dfm(rng, 3, 10, 50)
    model["y"][20, 2:7] = np.nan
    out = filter_fn(jitter=jitter)(*model_args(model))
    for name, ours, ref in zip(FIELDS, out, dense_filter(model, jitter)):
        np.testing.assert_allclose(ours, ref, rtol=1e-8, atol=1e-9, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("n_out", [8, 7], ids=["F-used", "F-unused"])
def test_batched_matches_statsmodels_per_series(n_out):
    """(f): a batch of three models with different (diagonal) H and data (a Blockwise)."""
    rng = np.random.default_rng(5)
    models = [dfm(rng, 2, 9, 30) for _ in range(3)]
    stacked = [np.stack([mod[k] for mod in models]) for k in ("y", "a0", "P0", *NAMES)]
    fn = filter_fn(batch=1, n_out=n_out)
    assert [op.forecast_cov for op in kalman_ops(fn)] == [n_out == 8]
    out = fn(*stacked)
    for b, model in enumerate(models):
        assert_matches_statsmodels([o[b] for o in out], model)


# ---------------------------------------------------------------------------
# failure
# ---------------------------------------------------------------------------


def dense_failing_step(model):
    """The first step at which the dense NumPy filter's Cholesky of F_oo fails (None if none)."""
    a, P = model["a0"], model["P0"]
    Z, H, T, RQR = model["Z"], model["H"], model["T"], model["R"] @ model["Q"] @ model["R"].T
    for t, yt in enumerate(model["y"]):
        o = ~np.isnan(yt)
        F = (Z @ P @ Z.T + H)[np.ix_(o, o)]
        try:
            np.linalg.cholesky(F)
        except np.linalg.LinAlgError:
            return t
        K = P @ Z[o].T @ np.linalg.inv(F)
        a, P = T @ (a + K @ (yt[o] - Z[o] @ a)), T @ (P - K @ Z[o] @ P) @ T.T + RQR
    return None


@pytest.mark.parametrize("univariate", [True, False])
def test_non_pd_step_fails_at_the_dense_filters_step(univariate):
    """(g): H_ii = 0 and a singular P: the two observed components measure the same state exactly, so
    F_oo is singular (the univariate second variance is exactly 0) from step 0; with only one of them
    observed on steps 0-1 the failure comes at step 2."""
    model = dict(
        y=np.array([[1.0, np.nan], [0.5, np.nan], [0.2, 0.3], [0.1, 0.1]]), a0=np.zeros(2),
        P0=np.diag([1.0, 0.0]), c=np.zeros(2), d=np.zeros(2), T=np.diag([1.0, 0.5]),
        Z=np.array([[1.0, 0.0], [1.0, 0.0]]), R=np.array([[1.0], [0.0]]), H=np.zeros((2, 2)), Q=np.ones((1, 1)),
    )
    for y, step in ((model["y"], 2), (np.nan_to_num(model["y"], nan=0.7), 0)):
        mod = dict(model, y=y)
        assert dense_failing_step(mod) == step
        out = filter_fn(univariate=univariate)(*model_args(mod))
        llo, af, Pp = out[1], out[2], out[5]
        assert out[0] == -np.inf and llo[step] == -np.inf
        assert np.all(np.isfinite(llo[:step])) and np.all(np.isnan(llo[step + 1:]))
        assert np.all(np.isnan(af[step:])) and np.all(np.isfinite(Pp[:step + 1])) and np.all(np.isnan(Pp[step + 1:]))


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 5), st.integers(1, 9), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.1, 0.4]),
    st.sampled_from([True, "auto"]),
)
def test_random_diagonal_h_models_match_statsmodels(m, p, seed, missing_rate, univariate):
    """(h): random models with a diagonal H (sometimes an entry 0), random missing entries: the univariate
    and automatic paths against statsmodels' two filters (never against iterops' own output)."""
    rng = np.random.default_rng(seed)
    model = random_model(rng, m, p, m, 25, missing=False)
    h = rng.uniform(0.05, 1.0, p)
    if rng.random() < 0.3:  # one exact observation (more than m of them make F_oo singular)
        h[rng.integers(p)] = 0.0
    model["H"] = np.diag(h)
    model["y"][rng.random(model["y"].shape) < missing_rate] = np.nan
    assert_matches_statsmodels(filter_fn(univariate=univariate)(*model_args(model)), model, rtol=1e-7, atol=1e-8)


# ---------------------------------------------------------------------------
# the automatic rule; options
# ---------------------------------------------------------------------------


def test_auto_takes_the_path_choose_update_names():
    """``_choose_update`` (the kernel's rule, in Python) says which update ``"auto"`` takes; the rounding of
    the two updates differs, so the automatic output is bitwise that of the forced path it names."""
    rng = np.random.default_rng(6)
    assert _choose_update(3, 12, np.eye(12)) == "univariate"
    assert _choose_update(14, 4, np.eye(4)) == "multivariate"
    assert _choose_update(3, 12, np.ones((12, 12))) == "multivariate"
    assert _choose_update(14, 4, np.eye(4), True) == "univariate"
    assert _choose_update(3, 12, np.eye(12), False) == "multivariate"
    for (m, p), n_out in itertools.product(((3, 12), (2, 8), (14, 4), (8, 4), (20, 8)), (7, 8)):
        model = dfm(rng, m, p, 30)
        args = model_args(model)
        outs = {u: filter_fn(univariate=u, n_out=n_out)(*args) for u in (True, False, "auto")}
        assert not np.array_equal(outs[True][3], outs[False][3])  # the two paths round differently
        chosen = _choose_update(m, p, model["H"], forecast_cov=n_out == 8) == "univariate"
        for a, b in zip(outs["auto"], outs[chosen]):
            np.testing.assert_array_equal(a, b)


def test_univariate_true_with_constant_non_diagonal_h_is_a_graph_build_error():
    model = random_model(np.random.default_rng(7), 2, 3, 2, 10)
    args = model_args(model)
    with pytest.raises(ValueError, match="univariate=True needs a diagonal H"):
        kf(args, univariate=True)
    with pytest.raises(ValueError, match="univariate must be 'auto', True or False"):
        kf(args, univariate="yes")
    kf(args, univariate="auto")  # a full constant H: auto (and False) take the multivariate update
    args[8] = np.diag(np.diag(model["H"]))
    kf(args, univariate=True)


# ---------------------------------------------------------------------------
# gradient (the adjoint recomputes each step's multivariate update from the stored predictions)
# ---------------------------------------------------------------------------


def test_gradient_matches_autodiff_of_pymc_extras_scan():
    """Loglik and every filtered/predicted output's cotangent, jitter 1e-8, on a model where "auto" takes the
    univariate update (p=8, m=2): gradients against autodiff of pymc-extras' StandardFilter Scan."""
    from test_kalman_steady import WEIGHT_NDIM

    rng = np.random.default_rng(8)
    n, m, p = 40, 2, 8
    model = dfm(rng, m, p, n, missing=False)
    model["y"][5, 1:4] = np.nan
    assert _choose_update(m, p, model["H"]) == "univariate"
    shapes = [(n,), (n, m), (n, m, m), (n, m), (n, m, m)]
    weights = [rng.normal(size=s) / np.sqrt(np.prod(s)) for s in shapes]
    assert len(shapes) == len(WEIGHT_NDIM)
    fn_ours, fn_theirs = gradient_fns(1e-8)  # "auto": the default
    out_ours = fn_ours(*model_args(model), *weights)
    out_ours.pop()
    assert_loglik_grads_close(out_ours, fn_theirs(*model_args(model), *weights))


def test_verify_grad_univariate():
    """Finite differences of every output's weighted sum, univariate=True, a missing component."""
    rng = np.random.default_rng(9)
    n, m, p = 12, 2, 5
    model = dfm(rng, m, p, n, missing=False)
    missing = np.zeros((n, p), dtype=bool)
    missing[4, 1] = True
    shapes = [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]
    weights = [rng.normal(size=s) / np.sqrt(max(1, np.prod(s))) for s in shapes]

    def f(y, a0, P0, Z, H, Q):
        y = pt.where(missing, np.nan, y)
        res = kalman_filter(y, a0, P0, c=model["c"], d=model["d"], T=model["T"], Z=Z, R=model["R"], H=H, Q=Q,
                            univariate=True)
        total = 0.0
        for w, o, name in zip(weights, res, FIELDS):
            total = total + (w * (pt.where(missing, 0.0, o) if name == "forecast_error" else o)).sum()
        return total

    verify_grad(f, [model[k] for k in ("y", "a0", "P0", "Z", "H", "Q")], rng=rng, abs_tol=1e-5, rel_tol=1e-5)
