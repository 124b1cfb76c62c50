"""The steady-state shortcut of iterops.ts.kalman_filter, forward and adjoint, with and without
covariance jitter (pymc-extras' ``cov_jitter``).

Also: the steady-state test is scale-free (states of very different scales, a rescaling of the states
changes nothing), and ``P0`` enters through ``sym(P0)`` on every path.

Oracles: a dense step-by-step NumPy filter written below (no steady state, pymc-extras' Joseph
arithmetic), statsmodels' KalmanFilter (jitter 0; ``tolerance=0``: without its own shortcut) and
KalmanSmoother, PyTensor autodiff of pymc-extras' ``StandardFilter`` Scan and of a textbook Scan
(compiled without iterops' rewrites), finite differences (verify_grad, central differences).
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pytensor.gradient import verify_grad
from statsmodels.tsa.statespace.kalman_filter import KalmanFilter as SMKalmanFilter
from statsmodels.tsa.statespace.kalman_smoother import KalmanSmoother as SMKalmanSmoother

from iterops.ts import kalman_filter
from conftest import SCAN_ORACLE

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

NAMES = ("c", "d", "T", "Z", "R", "H", "Q")
INPUTS = ("y", "a0", "P0", *NAMES)
FIELDS = (
    "loglik", "loglik_obs", "filtered_state", "filtered_cov",
    "predicted_state", "predicted_cov", "forecast_error", "forecast_error_cov",
)


def steady_model(seed, m, p, r, n, h_scale=0.5):
    """A random stable static model whose covariance recursion converges within ~40 steps."""
    rng = np.random.default_rng(seed)

    def spd(k, scale=1.0):
        X = rng.normal(size=(k, k))
        return scale * (X @ X.T / k + 0.5 * np.eye(k))

    P0 = spd(m)
    return dict(
        y=rng.normal(size=(n, p)), a0=rng.normal(size=m), P0=P0 + P0.T,
        c=0.1 * rng.normal(size=m), d=0.3 * rng.normal(size=p),
        T=0.5 * np.eye(m) + 0.2 * rng.normal(size=(m, m)) / np.sqrt(m),
        Z=rng.normal(size=(p, m)), R=rng.normal(size=(m, r)), H=spd(p, h_scale), Q=spd(r),
    )


def dense_filter(model, jitter=0.0):
    """Step-by-step Kalman filter in NumPy, no steady state: pymc-extras' StandardFilter arithmetic
    (jitter on F and on the filtered covariance, Joseph update with the un-jittered H), missing = NaN
    components dropped.  Returns the 8 outputs of ``kalman_filter``."""
    y = model["y"]
    n, p = y.shape
    m = model["a0"].shape[0]
    T, Z, R, H, Q, c, d = (model[k] for k in ("T", "Z", "R", "H", "Q", "c", "d"))
    a, P = model["a0"].copy(), model["P0"].copy()
    out = dict(
        loglik_obs=np.zeros(n), filtered_state=np.zeros((n, m)), filtered_cov=np.zeros((n, m, m)),
        predicted_state=np.zeros((n + 1, m)), predicted_cov=np.zeros((n + 1, m, m)),
        forecast_error=np.full((n, p), np.nan), forecast_error_cov=np.zeros((n, p, p)),
    )
    out["predicted_state"][0], out["predicted_cov"][0] = a, P
    for t in range(n):
        o = ~np.isnan(y[t])
        F = Z @ P @ Z.T + H + jitter * np.eye(p)
        out["forecast_error_cov"][t] = F
        if o.any():
            Zo, Fo, Ho = Z[o], F[np.ix_(o, o)], H[np.ix_(o, o)]
            v = y[t, o] - d[o] - Zo @ a
            out["forecast_error"][t, o] = v
            K = P @ Zo.T @ np.linalg.inv(Fo)
            A = np.eye(m) - K @ Zo
            _, logdet = np.linalg.slogdet(Fo)
            out["loglik_obs"][t] = -0.5 * (o.sum() * np.log(2 * np.pi) + logdet + v @ np.linalg.solve(Fo, v))
            a = a + K @ v
            P = A @ P @ A.T + K @ Ho @ K.T + jitter * np.eye(m)
        else:
            P = P + jitter * np.eye(m)
        out["filtered_state"][t], out["filtered_cov"][t] = a, P
        a = T @ a + c
        P = T @ P @ T.T + R @ Q @ R.T
        out["predicted_state"][t + 1], out["predicted_cov"][t + 1] = a, P
    return [out["loglik_obs"].sum(), *(out[k] for k in FIELDS[1:])]


def statsmodels_bound(cls, model, **options):
    """statsmodels' ``cls`` (KalmanFilter, KalmanSmoother) bound to ``model`` (known initialization)."""
    n, p = model["y"].shape
    m, r = model["R"].shape
    kf = cls(k_endog=p, k_states=m, k_posdef=r, **options)
    kf.bind(np.asfortranarray(model["y"].T))
    for k, name in dict(c="state_intercept", d="obs_intercept", T="transition", Z="design", R="selection",
                        H="obs_cov", Q="state_cov").items():
        kf[name] = model[k]
    kf.initialize_known(model["a0"], model["P0"])
    return kf


def symbolic_inputs():
    nd = dict(y=2, a0=1, P0=2, c=1, d=1, T=2, Z=2, R=2, H=2, Q=2)
    return [pt.tensor(name=k, dtype="float64", shape=(None,) * nd[k]) for k in INPUTS]


def call_filter(ins, **kwargs):
    y, a0, P0, c, d, T, Z, R, H, Q = ins
    return kalman_filter(y, a0, P0, c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q, **kwargs)


def args_of(model):
    return [model[k] for k in INPUTS]


def frozen_steps(Pp):
    """Number of predicted covariances bitwise equal to the previous one (the steady-state shortcut ran)."""
    return int(sum(np.array_equal(Pp[t], Pp[t - 1]) for t in range(1, Pp.shape[0])))


JITTERS = [0.0, 1e-8, 1e-3, 0.5]


@pytest.fixture(scope="module")
def filter_fns():
    """Compiled filters, one per jitter (the jitter is an Op option)."""
    ins = symbolic_inputs()
    return {j: pytensor.function(ins, list(call_filter(ins, cov_jitter=j))) for j in JITTERS}


@pytest.mark.parametrize("jitter", JITTERS)
def test_steady_values_match_dense_stepwise(filter_fns, jitter):
    """Long static series with two gaps (a partly and a fully missing row): the frozen-covariance
    path runs, leaves the steady state at each gap and re-enters it once the covariance has converged
    again (statsmodels' rule); every output equals the step-by-step filter's to rounding."""
    model = steady_model(1, 3, 2, 3, 300)
    model["y"][150, 0] = np.nan
    model["y"][220, :] = np.nan
    out = filter_fns[jitter](*args_of(model))
    # the shortcut is what is tested: it runs before the first gap and re-enters after each gap
    Pp = out[5]
    assert frozen_steps(Pp[:151]) > 80 and frozen_steps(Pp[151:221]) > 20 and frozen_steps(Pp[221:]) > 40
    for name, ours, ref in zip(FIELDS, out, dense_filter(model, jitter)):
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-10, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("read", ["loglik", "loglik+predicted_cov", "loglik+filtered_cov"])
def test_unread_covariances_skip_the_frozen_copies(read):
    """A graph that reads the log-likelihood but neither ``filtered_cov`` nor ``predicted_cov`` (PyMC's logp)
    compiles a filter that leaves their rows of a steady stretch unwritten (``covariances=False``); the next
    full step, after a gap, must still start from the frozen P.  What the graph reads equals the step-by-step
    filter's, over two gaps that each end a steady stretch."""
    model = steady_model(1, 3, 2, 3, 300)
    model["y"][150, 0] = np.nan
    model["y"][220, :] = np.nan
    ins = symbolic_inputs()
    res = call_filter(ins, cov_jitter=1e-8)
    names = read.split("+")
    f = pytensor.function(ins, [getattr(res, k) for k in names])
    (op,) = [nd.op for nd in f.maker.fgraph.apply_nodes if type(nd.op).__name__ == "KalmanFilter"]
    assert op.covariances == (names != ["loglik"])
    ref = dict(zip(FIELDS, dense_filter(model, 1e-8)))
    for name, ours in zip(names, f(*args_of(model))):
        np.testing.assert_allclose(ours, ref[name], rtol=1e-9, atol=1e-10, err_msg=name)


def test_steady_values_match_statsmodels_without_jitter(filter_fns):
    model = steady_model(2, 4, 2, 2, 250)
    model["y"][100, 1] = np.nan
    res = statsmodels_bound(SMKalmanFilter, model).filter()
    out = filter_fns[0.0](*args_of(model))
    # statsmodels freezes its covariance a little earlier than we do (its own convergence test), which
    # moves its states by ~1e-9: the tolerance of this comparison; the dense test above is the tight one
    np.testing.assert_allclose(out[0], res.llf, rtol=1e-9)
    np.testing.assert_allclose(out[1], res.llf_obs, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(out[2], res.filtered_state.T, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(out[5], np.moveaxis(res.predicted_state_cov, -1, 0), rtol=1e-8, atol=1e-9)


def _weighted(parts, weights):
    return sum((w * x).sum() for w, x in zip(weights, parts))


#: cotangent weights of (loglik_obs, filtered_state, filtered_cov, predicted_state[:-1], predicted_cov[:-1])
WEIGHT_NDIM = (1, 2, 3, 2, 3)
_GRAD_FNS = {}


def gradient_fns(jitter):
    """(ours, pymc-extras') compiled ``[weighted sum, its gradient w.r.t. a0, P0, c, ..., Q]``, inputs
    ``(y, a0, ..., Q, *weights)``; ours also returns ``predicted_cov``.  pymc-extras' Scan is compiled
    without iterops' rewrites (else it would be fused into our own Op), on PyTensor's Python linker (the
    same graph, evaluated Op by Op: a Numba compile of the Scan and its gradient Scan took minutes in a
    fresh checkout).  One compile per jitter."""
    if jitter not in _GRAD_FNS:
        from pymc_extras.statespace.filters.kalman_filter import StandardFilter

        ins = symbolic_inputs()
        ws = [pt.tensor(name=f"w{i}", dtype="float64", shape=(None,) * k) for i, k in enumerate(WEIGHT_NDIM)]
        res = call_filter(ins, cov_jitter=jitter, missing_value=-9999.0)
        ours = _weighted(
            [res.loglik_obs, res.filtered_state, res.filtered_cov, res.predicted_state[:-1], res.predicted_cov[:-1]], ws
        )
        got = {v.name: v for v in StandardFilter(cov_jitter=jitter, missing_fill_value=-9999.0).build_graph(*ins)}
        theirs = _weighted(
            [got[k] for k in ("loglike_obs", "filtered_states", "filtered_covariances", "predicted_states",
                              "predicted_covariances")], ws,
        )
        fn_ours = pytensor.function([*ins, *ws], [ours, *pytensor.grad(ours, ins[1:]), res.predicted_cov])
        fn_theirs = pytensor.function(  # the oracle on the Python linker: no Numba compile of the Scan pair
            [*ins, *ws], [theirs, *pytensor.grad(theirs, ins[1:])],
            mode=SCAN_ORACLE,
        )
        _GRAD_FNS[jitter] = fn_ours, fn_theirs
    return _GRAD_FNS[jitter]


def assert_loglik_grads_close(out_ours, out_theirs):
    """``[weighted sum, d/da0, d/dP0, ...]`` of :func:`gradient_fns`' two functions agree (P0, H, Q: symmetric parts)."""
    np.testing.assert_allclose(out_ours[0], out_theirs[0], rtol=1e-9)
    for name, g_ours, g_theirs in zip(INPUTS[1:], out_ours[1:], out_theirs[1:]):
        if name in ("P0", "H", "Q"):  # read through sym() by us, raw by the Scan: compare symmetric parts
            g_ours, g_theirs = 0.5 * (g_ours + g_ours.T), 0.5 * (g_theirs + g_theirs.T)
        scale = np.max(np.abs(g_theirs))
        np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-7, atol=1e-9 * scale, err_msg=f"d/d{name}")


@pytest.mark.parametrize(
    "jitter, n, cotangents, min_frozen",
    [
        (1e-8, 400, "loglik", 300), (1e-8, 400, "all", 300), (1e-8, 70, "all", 15),
        pytest.param(1e-3, 400, "all", 300, marks=pytest.mark.slow),
        pytest.param(0.5, 200, "all", 100, marks=pytest.mark.slow),
    ],
    ids=["1e-8-window-loglik", "1e-8-window-all", "1e-8-short-all", "1e-3-window-all", "0.5-all"],
)
def test_jitter_gradient_matches_autodiff_of_pymc_extras(jitter, n, cotangents, min_frozen):
    """Gradients with jitter through long steady stretches (the Lyapunov-summed far steps; a short
    stretch with the recursion on every step; (slow: one compile of the Scan per jitter) a jitter
    large enough for the j^2 sweeps to matter, and one that forces the recursion), against PyTensor autodiff of pymc-extras' Scan."""
    rng = np.random.default_rng(4)
    m, p, r = 3, 2, 2
    model = steady_model(3, m, p, r, n)
    model["y"][n // 2, 1] = np.nan
    shapes = [(n,), (n, m), (n, m, m), (n, m), (n, m, m)]
    weights = [np.ones(n)] + [np.zeros(s) for s in shapes[1:]]
    if cotangents == "all":
        weights = [rng.normal(size=s) / np.sqrt(np.prod(s)) for s in shapes]
    fn_ours, fn_theirs = gradient_fns(jitter)
    out_ours = fn_ours(*args_of(model), *weights)
    out_theirs = fn_theirs(*args_of(model), *weights)
    assert frozen_steps(out_ours.pop()) >= min_frozen  # the steady-state paths are what is tested
    assert_loglik_grads_close(out_ours, out_theirs)


@pytest.mark.parametrize("jitter", [1e-2, 0.5])
def test_jitter_verify_grad_through_steady_stretches(jitter):
    """Finite differences, jitter on, every output's cotangent, two steady stretches (jitter 0.5:
    its j^2 term is too large for the Lyapunov-summed path, the recursion runs on every step)."""
    rng = np.random.default_rng(8)
    n, m, p = 160, 2, 2
    model = steady_model(5, m, p, 2, n)
    model["y"][80, 0] = np.nan
    missing = np.isnan(model["y"])
    shapes = [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]
    weights = [rng.normal(size=s) / np.sqrt(max(1, np.prod(s))) for s in shapes]

    def f(y, *rest):
        y = pt.where(missing, np.nan, y)
        res = call_filter([y, *rest], cov_jitter=jitter)
        total = 0.0
        for w, o, name in zip(weights, res, FIELDS):
            if name == "forecast_error":
                o = pt.where(missing, 0.0, o)
            total = total + (w * o).sum()
        return total

    args = args_of(model)
    args[0] = np.nan_to_num(args[0])
    verify_grad(f, args, rng=rng, abs_tol=1e-5, rel_tol=1e-5)


# ---------------------------------------------------------------------------
# The steady-state test is scale-free: states of very different scales
# ---------------------------------------------------------------------------


def multiscale_model(p=2, n=200):
    """Two states a hundred million times apart: a fast AR(1) state of variance ~1e8 and a random walk of
    variance ~1e-9 whose covariance converges slowly (gain ~1e-3 per step)."""
    rng = np.random.default_rng(1)
    y = rng.standard_normal((n, 2)) * [1e4, 1e-3]
    model = dict(
        y=y, a0=np.zeros(2), P0=np.diag([1e8, 1e-6]), c=np.zeros(2), d=np.zeros(2),
        T=np.diag([0.5, 1.0]), Z=np.eye(2), R=np.eye(2), H=np.diag([1.0, 1e-6]), Q=np.diag([1e8, 1e-12]),
    )
    if p == 1:
        model.update(y=y[:, :1], d=np.zeros(1), Z=np.ones((1, 2)), H=np.eye(1))
    return model


def statsmodels_loglik(model):
    """statsmodels' conventional filter, steady-state shortcut off (``tolerance=0``)."""
    return statsmodels_bound(SMKalmanFilter, model, tolerance=0.0).loglike()


def assert_cov_close(ours, ref, rtol, name=""):
    """Every covariance entry within ``rtol`` of its own scale, ``sqrt(ref_ii ref_jj)`` (a scale-free
    comparison: a relative-to-the-largest one would not see the small states)."""
    var = np.abs(np.diagonal(ref, axis1=-2, axis2=-1))
    scale = np.sqrt(var[..., :, None] * var[..., None, :])
    err = np.abs(ours - ref) / np.where(scale > 0, scale, 1.0)
    assert np.max(err) <= rtol, f"{name}: {np.max(err):.3g} relative to the entry's scale"


def assert_states_close(ours, ref_states, ref_covs, rtol, name=""):
    """Every state within ``rtol`` of its own standard deviation (and of its size)."""
    sd = np.sqrt(np.abs(np.diagonal(ref_covs, axis1=-2, axis2=-1)))
    err = np.abs(ours - ref_states) / (sd + np.abs(ref_states))
    assert np.max(err) <= rtol, f"{name}: {np.max(err):.3g} relative"


@pytest.mark.parametrize("p", [2, 1])
def test_multiscale_states_are_not_frozen_early(filter_fns, p):
    """A state 1e8 times smaller than another, still converging when the large one has: the filter must not
    freeze it (a test relative to the largest entry did, and changed the log-likelihood from -1026.628 to
    -1045.320 for p = 2; the filtered covariances by 1e-4 of their scale for p = 1, Z = [1, 1]).  Every
    output against the step-by-step NumPy filter, per entry on its own scale; the log-likelihood against
    statsmodels without its own shortcut."""
    model = multiscale_model(p)
    ref = dense_filter(model)
    out = filter_fns[0.0](*args_of(model))
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-10)
    np.testing.assert_allclose(out[0], statsmodels_loglik(model), rtol=1e-10)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-8, atol=1e-10)
    # the filtered variance of the large state is P - P^2 / (P + H) ~ H with P / H ~ 1e8: its cancellation costs
    # ~1e8 eps (the conventional update's, statsmodels' too; the NumPy oracle uses Joseph's form)
    assert_cov_close(out[3], ref[3], 1e-7, "filtered_cov")
    assert_cov_close(out[5], ref[5], 1e-9, "predicted_cov")
    assert_states_close(out[2], ref[2], ref[3], 1e-8, "filtered_state")


def test_multiscale_gradient_matches_finite_differences():
    """d loglik / d log q2 at the multiscale model (a frozen covariance gave -1.13e-4 against -1.76e-3):
    PyTensor's gradient of the filter against central differences of the NumPy filter."""
    model = multiscale_model(2)
    lq = pt.dscalar("lq")
    Q = pt.stack([pt.stack([pt.constant(1e8), pt.constant(0.0)]), pt.stack([pt.constant(0.0), pt.exp(lq)])])
    args = {k: model[k] for k in INPUTS if k != "Q"}
    ll = kalman_filter(args.pop("y"), args.pop("a0"), args.pop("P0"), Q=Q, **args).loglik
    f = pytensor.function([lq], [ll, pytensor.grad(ll, lq)])
    x0, h = np.log(1e-12), 1e-3
    val, grad = f(x0)

    def ref(x):
        return dense_filter(dict(model, Q=np.diag([1e8, np.exp(x)])))[0]

    fd = (ref(x0 + h) - ref(x0 - h)) / (2 * h)
    np.testing.assert_allclose(val, ref(x0), rtol=1e-10)
    np.testing.assert_allclose(grad, fd, rtol=1e-4)


def test_multiscale_user_scan_is_fused_with_its_values():
    """The multiscale model written as a user's textbook Scan (``iterops.reference_loops``): fused, it returns
    the Scan's own log-likelihood and predictions (and gradient w.r.t. the noise scales), not a frozen
    filter's."""
    import iterops
    from iterops.reference_loops import kalman_textbook_loop

    model = multiscale_model(2)
    n = model["y"].shape[0]
    s = dict(y=pt.tensor("y", shape=(n, 2)), a0=pt.tensor("a0", shape=(2,)), L0=pt.tensor("L0", shape=(2, 2)),
             T=pt.tensor("T", shape=(2, 2)), Z=pt.tensor("Z", shape=(2, 2)), R=pt.tensor("R", shape=(2, 2)),
             LH=pt.tensor("LH", shape=(2, 2)), LQ=pt.tensor("LQ", shape=(2, 2)))
    ll, a, P = kalman_textbook_loop(s["y"], s["a0"], s["L0"] @ s["L0"].T, s["T"], s["Z"], s["R"],
                                    s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T)
    total = ll.sum()
    ins = list(s.values())
    fused = iterops.fuse_loops([total, a, P])
    f = pytensor.function(ins, [*fused, *pytensor.grad(fused[0], [s["LQ"], s["LH"]])])
    ref = pytensor.function(ins, [total, a, P, *pytensor.grad(total, [s["LQ"], s["LH"]])], mode=SCAN_ORACLE)
    assert not any(type(nd.op).__name__ == "Scan" for nd in f.maker.fgraph.apply_nodes)
    vals = [model["y"], model["a0"], np.sqrt(model["P0"]), model["T"], model["Z"], model["R"],
            np.sqrt(model["H"]), np.sqrt(model["Q"])]
    got, want = f(*vals), ref(*vals)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    np.testing.assert_allclose(got[0], dense_filter(model)[0], rtol=1e-10)
    assert_cov_close(got[2], want[2], 1e-8, "predicted_cov")
    assert_states_close(got[1], want[1], want[2], 1e-7, "predicted_state")
    for g, w, name in zip(got[3:], want[3:], ("LQ", "LH")):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-9 * np.max(np.abs(w)), err_msg=name)


def rescale_states(model, D):
    """The same model in states rescaled by ``D`` (alpha -> D alpha): ``T -> D T D^-1``, ``Z -> Z D^-1``,
    ``R -> D R``, ``c -> D c``, ``a0 -> D a0``, ``P0 -> D P0 D``; the log-likelihood is unchanged."""
    Di = 1.0 / D
    return dict(model, T=D[:, None] * model["T"] * Di, Z=model["Z"] * Di, R=D[:, None] * model["R"],
                c=D * model["c"], a0=D * model["a0"], P0=D[:, None] * model["P0"] * D)


def property_model(seed, m, p, slow, gaps, n=150):
    """``steady_model``; ``slow``: state 0 a random walk with noise ~1e-6 of H's, whose covariance is still
    converging after n steps while the others' have converged; ``gaps``: a partly and a fully missing row."""
    model = steady_model(seed, m, p, m, n)
    if slow:
        model["T"][0, :], model["T"][:, 0] = 0.0, 0.0
        model["T"][0, 0] = 1.0
        model["R"][0, :] *= 1e-3
        model["Z"][:, 0] = 1.0
    if gaps:
        model["y"][n // 3, 0] = np.nan
        model["y"][n // 2, :] = np.nan
    return model


@pytest.fixture(scope="module")
def loglik_grad_fn():
    """loglik and its gradient w.r.t. a0, T, H, Q."""
    ins = symbolic_inputs()
    ll = call_filter(ins).loglik
    wrt = [ins[INPUTS.index(k)] for k in ("a0", "T", "H", "Q")]
    return pytensor.function(ins, [ll, *pytensor.grad(ll, wrt)])


@settings(max_examples=30)
@given(
    seed=st.integers(0, 10_000), m=st.integers(2, 3), p=st.integers(1, 2), slow=st.booleans(), gaps=st.booleans(),
    log_d=st.lists(st.floats(-8.0, 8.0), min_size=3, max_size=3),
)
def test_rescaling_the_states_changes_nothing(filter_fns, loglik_grad_fn, seed, m, p, slow, gaps, log_d):
    """Rescaling the states by D (over 16 orders of magnitude) leaves the log-likelihood unchanged to rounding
    (against the step-by-step NumPy filter and statsmodels without its shortcut, on the unscaled model),
    freezes the covariance at the same step, and transforms the gradient as it must (``a0_bar -> D^-1 a0_bar``,
    ``T_bar -> D^-1 T_bar D``, ``H_bar``, ``Q_bar`` unchanged): on systems that reach a steady state and
    that do not, with and without missing data."""
    base = property_model(seed, m, p, slow, gaps)
    D = 10.0 ** np.array(log_d[:m])
    scaled = rescale_states(base, D)
    ref = dense_filter(base)[0]
    np.testing.assert_allclose(ref, statsmodels_loglik(base), rtol=1e-10)
    out_base, out_scaled = filter_fns[0.0](*args_of(base)), filter_fns[0.0](*args_of(scaled))
    np.testing.assert_allclose(out_base[0], ref, rtol=1e-10)
    np.testing.assert_allclose(out_scaled[0], ref, rtol=1e-10)
    frozen = frozen_steps(out_base[5])
    if not slow and not gaps:
        assert frozen > 0  # the shortcut is what is tested
    assert abs(frozen_steps(out_scaled[5]) - frozen) <= 1  # the same step, to a rounding flip of the test
    g_base, g_scaled = loglik_grad_fn(*args_of(base)), loglik_grad_fn(*args_of(scaled))
    Di = 1.0 / D
    for name, gb, gs in zip(("a0", "T", "H", "Q"), g_base[1:], [
        D * g_scaled[1], D[:, None] * g_scaled[2] * Di, g_scaled[3], g_scaled[4]
    ]):
        np.testing.assert_allclose(gs, gb, rtol=1e-6, atol=1e-8 * np.max(np.abs(gb)), err_msg=f"d/d{name}")


# ---------------------------------------------------------------------------
# P0 enters through sym(P0) on every path
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paths_fns():
    """The filter with each measurement update forced (multivariate, univariate), and the smoother."""
    from iterops.ts import kalman_smoother

    ins = symbolic_inputs()
    fns = {u: pytensor.function(ins, list(call_filter(ins, univariate=u))) for u in (False, True)}
    y, a0, P0, c, d, T, Z, R, H, Q = ins
    fns["smoother"] = pytensor.function(ins, list(kalman_smoother(y, a0, P0, c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q)))
    return fns


@pytest.mark.parametrize("p", [1, 2])
def test_unsymmetric_P0_is_used_through_its_symmetric_part(paths_fns, p):
    """A non-symmetric ``P0`` is used as ``sym(P0)`` by every path: the one-observable rank-one update (p = 1),
    the multivariate and the univariate update (p = 2), and the smoother (which read ``P0`` itself at t = 0),
    so all agree with the step-by-step NumPy filter and statsmodels' smoother given ``sym(P0)``;
    ``predicted_cov[0]`` is ``P0`` as given."""
    model = steady_model(3, 3, p, 2, 30)
    model["H"] = np.diag(np.diag(model["H"]))  # the univariate update applies
    model["P0"] = model["P0"] + np.array([[0.0, 0.5, 0.0], [-0.3, 0.0, 0.2], [0.1, 0.0, 0.0]])
    sym = dict(model, P0=0.5 * (model["P0"] + model["P0"].T))
    ref = dense_filter(sym)
    ref[5][0] = model["P0"]
    for univariate in (False, True):
        out = paths_fns[univariate](*args_of(model))
        for name, ours, want in zip(FIELDS, out, ref):
            np.testing.assert_allclose(ours, want, rtol=1e-9, atol=1e-12, err_msg=f"{univariate} {name}")
    res = statsmodels_bound(SMKalmanSmoother, sym, tolerance=0.0).smooth()
    a_s, P_s = paths_fns["smoother"](*args_of(model))
    # statsmodels' smoother: its own (conventional) arithmetic, ~1e-8 from the step-by-step filter's late in the series
    np.testing.assert_allclose(a_s, res.smoothed_state.T, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(P_s, np.moveaxis(res.smoothed_state_cov, -1, 0), rtol=1e-7, atol=1e-9)
