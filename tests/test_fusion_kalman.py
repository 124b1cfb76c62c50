"""Kalman filter Scans -> iterops.ts.kalman_filter (iterops.fusion.patterns.kalman).

Matches: the compiled graph holds the Kalman Op and no Scan; values and
gradients equal the unrewritten Scan (``excluding("iterops")``, FAST_COMPILE,
autodiff of the Scan).  pymc-extras: its ``StandardFilter`` graph (all seven
outputs, NaN and sentinel missing values), with static and with time-varying
system matrices, and a real state-space model's ``compile_logp``/``compile_dlogp``;
its square-root, univariate and convergent filters stay Scans (structural models with each
``filter_type`` compile to what pymc-extras computes), each for a reason shown on its own
outputs (a skipped degenerate observation, a jitter on the Cholesky factor and a less stable
conventional candidate on near-singular inputs, a frozen gain and an averaged pullback).
Near misses stay Scans.
"""

import warnings
from unittest import mock

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.scan.op import Scan

import iterops
from conftest import FAST_PY, SCAN_ORACLE
from iterops.ts.kalman import KalmanFilter

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

_SCAN_MODE = SCAN_ORACLE
N, M, P, R_ = 25, 3, 2, 2


def _ops(f):
    return [n.op for n in f.maker.fgraph.apply_nodes]


def _has_kalman(f):
    return any(isinstance(getattr(op, "core_op", op), KalmanFilter) for op in _ops(f))


def _has_scan(f):
    return any(isinstance(op, Scan) for op in _ops(f))


def _system(rng, n=N, m=M, p=P, r=R_):
    T = 0.6 * np.eye(m) + 0.15 * rng.normal(size=(m, m))
    return dict(
        y=rng.normal(size=(n, p)), a0=rng.normal(size=m), L0=np.tril(rng.normal(size=(m, m))) + 2 * np.eye(m),
        c=0.1 * rng.normal(size=m), d=0.1 * rng.normal(size=p), T=T, Z=rng.normal(size=(p, m)),
        R=rng.normal(size=(m, r)), LH=np.tril(0.3 * rng.normal(size=(p, p))) + np.eye(p),
        LQ=np.tril(0.3 * rng.normal(size=(r, r))) + np.eye(r),
    )


def _symbols(n=N, m=M, p=P, r=R_):
    return dict(
        y=pt.tensor("y", shape=(n, p)), a0=pt.tensor("a0", shape=(m,)), L0=pt.tensor("L0", shape=(m, m)),
        c=pt.tensor("c", shape=(m,)), d=pt.tensor("d", shape=(p,)), T=pt.tensor("T", shape=(m, m)),
        Z=pt.tensor("Z", shape=(p, m)), R=pt.tensor("R", shape=(m, r)), LH=pt.tensor("LH", shape=(p, p)),
        LQ=pt.tensor("LQ", shape=(r, r)),
    )


def _compare(outs, wrt, ins, vals, rtol=1e-8, atol=1e-9):
    """Values and gradients of ``outs`` with the rewrite (fuse_loops + default mode) vs the Scan."""
    # a cost touching every entry of every output with a different weight
    cost = sum((o * pt.cos(0.7 * pt.arange(o.size) + k).reshape(o.shape)).sum() for k, o in enumerate(outs))
    fused_outs = iterops.fuse_loops([*outs, cost])
    f = pytensor.function(ins, [*fused_outs[:-1], *pytensor.grad(fused_outs[-1], wrt)])
    ref = pytensor.function(ins, [*outs, *pytensor.grad(cost, wrt)], mode=_SCAN_MODE)
    assert _has_kalman(f) and not _has_scan(f)
    assert _has_scan(ref)
    got, want = f(*vals), ref(*vals)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return f


# ---------------------------------------------------------------------------
# pymc-extras StandardFilter
# ---------------------------------------------------------------------------

import pymc_extras.statespace as pme  # noqa: E402  (a dev dependency: never skipped)


def _standard_filter_outputs(s, filt=None):
    from pymc_extras.statespace.filters import StandardFilter

    P0 = s["L0"] @ s["L0"].T
    H, Q = s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T
    filt = filt or StandardFilter()
    return filt.build_graph(s["y"], s["a0"], P0, s["c"], s["d"], s["T"], s["Z"], s["R"], H, Q)


@pytest.fixture(scope="module")
def pe_data():
    rng = np.random.default_rng(11)
    vals = _system(rng)
    y = vals["y"]
    y[3, 0] = np.nan  # one component missing
    y[7, 1] = -9999.0  # pymc-extras' sentinel
    y[12] = np.nan  # a fully missing row
    return vals


def test_pymc_extras_standard_filter_all_outputs_values_and_gradients(pe_data):
    s = _symbols()
    outs = _standard_filter_outputs(s)
    assert len(outs) == 7
    report = iterops.explain(outs)
    assert [r.pattern for r in report.replaced] == ["kalman_pymc_extras"], str(report)
    names = list(s)
    wrt = [s[k] for k in names if k != "y"]
    _compare(outs, wrt, [s[k] for k in names], [pe_data[k] for k in names])


def test_pymc_extras_loglik_only_every_linker(pe_data, mode):
    s = _symbols()
    ll = _standard_filter_outputs(s)[-1]
    names = list(s)
    f = pytensor.function([s[k] for k in names], ll.sum(), mode=mode)
    assert _has_kalman(f) and not _has_scan(f)
    ref = pytensor.function([s[k] for k in names], ll.sum(), mode=_SCAN_MODE)
    vals = [pe_data[k] for k in names]
    np.testing.assert_allclose(f(*vals), ref(*vals), rtol=1e-10)


def test_pymc_extras_raw_covariance_gradients_agree_along_symmetric_directions(pe_data):
    """d/dH, d/dP0 of the raw entries: equal g + g^T (documented: the Scan splits off-diagonals unevenly)."""
    s = _symbols()
    P0, H = pt.tensor("P0", shape=(M, M)), pt.tensor("H", shape=(P, P))
    from pymc_extras.statespace.filters import StandardFilter

    ll = StandardFilter().build_graph(s["y"], s["a0"], P0, s["c"], s["d"], s["T"], s["Z"], s["R"], H,
                                      s["LQ"] @ s["LQ"].T)[-1].sum()
    ins = [s["y"], s["a0"], P0, s["c"], s["d"], s["T"], s["Z"], s["R"], H, s["LQ"]]
    vals = [pe_data[k] for k in ("y", "a0")] + [pe_data["L0"] @ pe_data["L0"].T] + [
        pe_data[k] for k in ("c", "d", "T", "Z", "R")] + [pe_data["LH"] @ pe_data["LH"].T, pe_data["LQ"]]
    # by perform (FAST_PY): the values of the fused gradient are the point here; its Numba compile is tested
    # elsewhere (test_pymc_extras_standard_filter_all_outputs_values_and_gradients)
    f = pytensor.function(ins, pytensor.grad(iterops.fuse_loops(ll), [P0, H]), mode=FAST_PY)
    ref = pytensor.function(ins, pytensor.grad(ll, [P0, H]), mode=_SCAN_MODE)
    for g, w in zip(f(*vals), ref(*vals)):
        np.testing.assert_allclose(g + g.T, w + w.T, rtol=1e-8, atol=1e-10)


def _subclass_filter(predict=None, update=None):
    from pymc_extras.statespace.filters import StandardFilter

    attrs = {}
    if predict is not None:
        attrs["predict"] = staticmethod(predict)
    if update is not None:
        attrs["update"] = update
    return type("Variant", (StandardFilter,), attrs)()


def _no_rqr(a, P, c, T, R, Q):
    from pymc_extras.statespace.filters.utilities import quad_form_sym

    return T @ a + c, quad_form_sym(T, P)


def _transposed_T(a, P, c, T, R, Q):
    from pymc_extras.statespace.filters.utilities import quad_form_sym

    return T @ a + c, quad_form_sym(T.T, P) + quad_form_sym(R, Q)


def _no_joseph_h_term(self, a, P, y, d, Z, H, nan_mask):
    from pymc_extras.statespace.filters import StandardFilter
    from pymc_extras.statespace.filters.utilities import quad_form_sym

    a_f, P_f, y_hat, F, ll = StandardFilter.update(self, a, P, y, d, Z, H, nan_mask)
    # a different covariance update: drop K H K^T from the Joseph form
    PZT = P @ Z.mT
    K = pt.linalg.solve(F, PZT.mT, assume_a="pos").mT
    I_KZ = pt.eye(a.shape[0]) - K @ Z
    return a_f, quad_form_sym(I_KZ, P), y_hat, F, ll


PE_NEAR_MISSES = {
    "predict without R Q R^T": dict(predict=_no_rqr),
    "predict with T^T": dict(predict=_transposed_T),
    "Joseph update without K H K^T": dict(update=_no_joseph_h_term),
}


@pytest.mark.parametrize("name", list(PE_NEAR_MISSES))
def test_pymc_extras_near_misses_stay_scans(name):
    s = _symbols()
    ll = _standard_filter_outputs(s, _subclass_filter(**PE_NEAR_MISSES[name]))[-1]
    report = iterops.explain(ll)
    assert not report.replaced, str(report)
    assert any(p == "kalman_pymc_extras" for p, _ in report.kept[0].reasons), str(report)


def _time_varying_case(names, rng):
    """pymc-extras' StandardFilter with the system matrices ``names`` time-varying (Scan sequences)."""
    from pymc_extras.statespace.filters import StandardFilter

    s = _symbols()
    vals = {**_system(rng)}
    vals["y"][4, 1] = np.nan
    vals["y"][9, 0] = -9999.0
    syms = {k: s[k] for k in ("y", "a0", "L0", "c", "d", "T", "Z", "R", "LH", "LQ")}
    mats = dict(c=s["c"], d=s["d"], T=s["T"], Z=s["Z"], R=s["R"], H=s["LH"] @ s["LH"].T, Q=s["LQ"] @ s["LQ"].T)
    # a sequence of matrices per time-varying name (pymc-extras' names -> the filter's argument)
    tv = {"state_intercept": ("c", (N, M)), "obs_intercept": ("d", (N, P)), "transition": ("T", (N, M, M)),
          "design": ("Z", (N, P, M)), "selection": ("R", (N, M, R_)), "obs_cov": ("LH", (N, P, P)),
          "state_cov": ("LQ", (N, R_, R_))}
    for name in names:
        key, shape = tv[name]
        x = pt.tensor(key + "_t", shape=shape)
        syms[key] = x
        vals[key] = (0.5 * np.eye(shape[-1]) + 0.2 * rng.normal(size=shape) if key in ("LH", "LQ", "T")
                     else rng.normal(size=shape))
        if key == "LH":
            mats["H"] = x @ x.mT
        elif key == "LQ":
            mats["Q"] = x @ x.mT
        else:
            mats[key] = x
    outs = StandardFilter(time_varying_names=names).build_graph(
        syms["y"], syms["a0"], syms["L0"] @ syms["L0"].T, mats["c"], mats["d"], mats["T"], mats["Z"], mats["R"],
        mats["H"], mats["Q"])
    keys = list(syms)
    return outs, [syms[k] for k in keys], [vals[k] for k in keys]


TIME_VARYING = [("design",), ("obs_intercept", "design"),
                ("state_intercept", "transition", "selection", "obs_cov", "state_cov")]


@pytest.mark.parametrize("names", TIME_VARYING, ids=lambda n: "+".join(n))
def test_pymc_extras_time_varying_matrices(names):
    """Time-varying system matrices (Scan sequences, e.g. a design of exogenous regressors): fused, and
    all seven outputs and their gradients equal pymc-extras' own Scan."""
    outs, ins, vals = _time_varying_case(names, np.random.default_rng(17))
    report = iterops.explain(outs)
    assert [r.pattern for r in report.replaced] == ["kalman_pymc_extras"], str(report)
    _compare(outs, ins[1:], ins, vals)


def test_pymc_extras_time_varying_unsymmetric_obs_cov_stays_scan():
    """A time-varying H that is not provably symmetric keeps the Scan (as for a static one)."""
    from pymc_extras.statespace.filters import StandardFilter

    s = _symbols()
    Hs = pt.tensor("Hs", shape=(N, P, P))
    outs = StandardFilter(time_varying_names=("obs_cov",)).build_graph(
        s["y"], s["a0"], s["L0"] @ s["L0"].T, s["c"], s["d"], s["T"], s["Z"], s["R"], Hs, s["LQ"] @ s["LQ"].T)
    report = iterops.explain(outs[-1])
    assert not report.replaced and "not provably symmetric" in str(report), str(report)


# ---------------------------------------------------------------------------
# pymc-extras' other filters: kept as Scans, each for a reason shown on pymc-extras' own outputs
# ---------------------------------------------------------------------------

_OTHER_FILTERS = ["SquareRootFilter", "UnivariateFilter", "ConvergentFilter"]


def _filter(name, **kw):
    import pymc_extras.statespace.filters as filters

    return getattr(filters, name)(**kw)


def _outputs_of(filt, y, a0, P0, c, d, T, Z, R, H, Q):
    """pymc-extras' filter outputs on numeric inputs: filtered state, filtered covariance, loglike_obs
    (the univariate filter's observed-state outputs have one row per step, not ``p``: not requested)."""
    outs = filt.build_graph(*(pt.as_tensor(np.asarray(x, dtype="float64")) for x in (y, a0, P0, c, d, T, Z, R, H, Q)))
    return pytensor.function([], [outs[0], outs[3], outs[-1]], mode=_SCAN_MODE)()


@pytest.mark.parametrize("filter_name", _OTHER_FILTERS)
def test_pymc_extras_other_filters_stay_scans(filter_name, pe_data):
    """pymc-extras' square-root, univariate and convergent filters are not replaced (reasons: the tests
    below and the pattern module's docstring), and the compiled graph (rewrite registered) computes what
    pymc-extras computes, values and gradients."""
    s = _symbols()
    vals = dict(pe_data)
    if filter_name == "ConvergentFilter":  # no missing data (it asserts so)
        vals["y"] = np.random.default_rng(2).normal(size=vals["y"].shape)
    outs = _standard_filter_outputs(s, _filter(filter_name))
    report = iterops.explain(outs[-1])
    assert not report.replaced, str(report)
    if filter_name == "UnivariateFilter":  # the nested Scan over the observations is analysed too
        assert len(report.kept) == 2 and "could not be analysed" not in str(report), str(report)
    names = list(s)
    ins, vals = [s[k] for k in names], [vals[k] for k in names]
    ll = outs[-1].sum()
    grads = pytensor.grad(ll, [s["a0"], s["L0"], s["T"], s["LH"]])
    f = pytensor.function(ins, [ll, *grads], mode=FAST_PY)
    assert not _has_kalman(f)
    ref = pytensor.function(ins, [ll, *grads], mode=_SCAN_MODE)
    for g, w in zip(f(*vals), ref(*vals)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_univariate_explain_inner_scan_with_boolean_sequence():
    """Regression: a step summing a boolean (``1 - mask``, the univariate filter's ``1 - F_zero_flag``) is
    analysed (the unifier negated the boolean term and raised), so ``explain`` gives the closest pattern's
    first difference instead of "could not be analysed"."""
    x, m = pt.vector("x"), pt.vector("m", dtype="bool")
    out = pytensor.scan(lambda mi, xi: xi * (1 - mi) + 1.0, sequences=[m], outputs_info=[x], return_updates=False)
    report = iterops.explain(out[-1])
    assert not report.replaced and "could not be analysed" not in str(report), str(report)


def test_univariate_filter_skips_exactly_degenerate_observations():
    """Why ``UnivariateFilter`` is kept: it equals the multivariate filter with ``H = diag(diag(H)) + j I``
    except where an observation's variance ``Z_i P Z_i^T + H_ii`` is exactly 0 (no measurement error, a
    state known exactly: ``P0`` singular in the observed direction, the filter's stated use case), where it
    skips the observation (``K = 0``, no ``log F + v^2 / F`` term, the ``log 2 pi`` still counted).  No
    fused filter does that, and ``H_ii > 0`` cannot be proved (``H = 0`` models; ``sigma**2`` underflows).
    Oracle: the closed form of both steps."""
    j = 1e-8
    y = np.array([[0.7, -0.4], [0.1, 0.2]])
    P0, Z, H = np.diag([0.0, 1.0]), np.eye(2), np.zeros((2, 2))
    sys_ = dict(a0=np.zeros(2), P0=P0, c=np.zeros(2), d=np.zeros(2), T=np.eye(2), Z=Z, R=np.eye(2), H=H,
                Q=np.eye(2))
    _, _, ll = _outputs_of(_filter("UnivariateFilter", cov_jitter=j), y, *sys_.values())
    skipped = -0.5 * (2 * LOG2PI + np.log(1.0 + j) + y[0, 1] ** 2 / (1.0 + j))
    np.testing.assert_allclose(ll[0], skipped, rtol=1e-12)
    # the multivariate filter with the univariate's effective H = diag(diag(H)) + j I scores the first
    # component too: -(log j + y^2 / j) / 2 more, about -2.4e7 here
    fused_candidate = skipped - 0.5 * (np.log(j) + y[0, 0] ** 2 / j)
    assert abs(fused_candidate - ll[0]) > 1e6
    _, _, ll_std = _outputs_of(_filter("StandardFilter", cov_jitter=j), y, *sys_.values())
    assert abs(ll_std[0] - ll[0]) > 1e6


def test_square_root_filter_jitters_the_cholesky_factor():
    """Why ``SquareRootFilter`` is kept (1): its ``stabilize(P_filtered, jitter)`` adds ``j I`` to the
    Cholesky *factor* ``L`` (the recursion carries factors), so the covariance gets ``j (L + L^T) + j^2 I``
    (with the QR's signs on ``diag(L)``), not the ``j I`` of every conventional filter.  Shown on a fully
    missing first row, where the filtered factor is ``chol(P0 + j I) + j I`` (oracle: numpy)."""
    j = 1e-3
    rng = np.random.default_rng(8)
    s = _system(rng)
    y = s["y"].copy()
    y[0] = np.nan
    P0 = s["L0"] @ s["L0"].T
    H, Q = s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T
    _, P_f, _ = _outputs_of(_filter("SquareRootFilter", cov_jitter=j), y, s["a0"], P0, s["c"], s["d"], s["T"],
                            s["Z"], s["R"], H, Q)
    L = np.linalg.cholesky(P0 + j * np.eye(M)) + j * np.eye(M)
    np.testing.assert_allclose(P_f[0], L @ L.T, rtol=1e-12)
    conventional = P0 + 2 * j * np.eye(M)  # P0 + j I (start) + j I (stabilize), nothing observed
    # off by j (L + L^T - I) + j^2 I, about 5e-4 relative here: far beyond rounding
    assert np.abs(P_f[0] - conventional).max() > 1e-4 * np.abs(conventional).max()


def test_square_root_filter_on_near_singular_inputs_a_fused_filter_breaks_the_contract():
    """Why ``SquareRootFilter`` is kept (2), even with ``cov_jitter=0`` (where the factor jitter vanishes):
    the fused conventional filter is the candidate, and on a near-singular start (``P0 = diag(1, 1e-14,
    1e-14)``) with tiny measurement error (``H = 1e-14 I``) the square-root loop is well conditioned (its
    outputs move by ~1e-10 relative under ulp perturbations of its inputs) while the conventional filter's
    states and log-likelihood are off by ~4e-5 relative: beyond the fuzzer's tolerance (rtol 1e-6 plus 8
    times the loop's own rounding spread).  Measured with the fuzzer's own checker."""
    from test_fusion_fuzz import _close, _kalman_symbols, _kalman_values, _rounding_spread

    s = _kalman_symbols()
    ins = list(s.values())
    P0, H, Q = s["L0"] @ s["L0"].T, s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T
    m, p = 3, 2
    c, d = pt.zeros(m), pt.zeros(p)
    outs = _filter("SquareRootFilter", cov_jitter=0.0).build_graph(s["y"], s["a0"], P0, c, d, s["T"], s["Z"],
                                                                   s["R"], H, Q)
    loop = pytensor.function(ins, [outs[0], outs[-1]], mode=_SCAN_MODE)
    res = iterops.ts.kalman_filter(s["y"], s["a0"], P0, c=c, d=d, T=s["T"], Z=s["Z"], R=s["R"], H=H, Q=Q)
    fused = pytensor.function(ins, [res.filtered_state, res.loglik_obs], mode=FAST_PY)
    vals = dict(zip(s, _kalman_values()[0]))
    base = [np.asarray(v, dtype="float64") for v in vals.values()]
    want = loop(*base)
    for g, w in zip(fused(*base), want):  # well-conditioned inputs: equal to rounding
        _close(g, w, "well conditioned")
    vals.update(LH=1e-7 * np.eye(p), L0=np.diag([1.0, 1e-7, 1e-7]))
    hard = [np.asarray(v, dtype="float64") for v in vals.values()]
    want = loop(*hard)
    spread = _rounding_spread(loop, hard, ins, want)
    assert all(float((sp / np.maximum(1.0, np.abs(w))).max()) < 1e-8 for sp, w in zip(spread, want))
    got = fused(*hard)
    for what, g, w, sp in zip(("filtered_state", "loglike_obs"), got, want, spread):
        with pytest.raises(AssertionError, match="differ beyond rounding"):
            _close(g, w, what, sp)


def test_convergent_filter_is_not_the_full_filter():
    """Why ``ConvergentFilter`` is kept: it stops the Riccati recursion at a user tolerance and continues
    with the frozen gain (values differ from the full filter by the tolerance's effect, far beyond rounding
    for a loose ``tol``), and its gradient is pymc-extras' own pullback, which averages the per-step
    cotangents (its gradient of a weighted sum of ``loglike_obs`` is not the filter's).  Its Scans also sit
    inside a ``SymbolicOp`` inlined only at ``specialize``, after the fusion passes.  Oracle: autodiff of
    pymc-extras' ``StandardFilter`` Scan (the full filter)."""
    rng = np.random.default_rng(1)
    n = 200
    y = pt.as_tensor((np.cumsum(rng.normal(scale=0.1, size=n)) + rng.normal(size=n))[:, None])
    q = pt.dscalar("q")
    T, Z, R, H = (pt.eye(1) for _ in range(4))  # distinct variables: the SymbolicOp takes each as an input
    args = (y, pt.zeros(1), 10.0 * pt.eye(1), pt.zeros(1), pt.zeros(1), T, Z, R, H, q[None, None])
    full = _filter("StandardFilter").build_graph(*args)[-1]
    w = pt.cos(pt.arange(n))
    for tol in (1e-10, 1e-3):
        conv = _filter("ConvergentFilter", tol=tol).build_graph(*args)[-1]
        assert not iterops.explain(conv).scans  # inside the SymbolicOp: the rewrite never sees them
        f = pytensor.function([q], [conv.sum(), full.sum(), pytensor.grad((conv * w).sum(), q),
                                    pytensor.grad((full * w).sum(), q)], mode=_SCAN_MODE)
        ll_conv, ll_full, g_conv, g_full = f(0.5)
        if tol == 1e-3:
            assert abs(ll_conv - ll_full) > 1e-6 * abs(ll_full)
        else:
            np.testing.assert_allclose(ll_conv, ll_full, rtol=1e-9)
        assert abs(g_conv - g_full) > 0.1 * abs(g_full)


_KEPT_MODELS = {  # filter_type -> observed series of pymc-extras' structural local linear trend + noise
    "univariate": ["a", "b"],
    "cholesky": ["a", "b"],
    "convergent": None,  # one series, no missing data (it asserts so)
}


# slow: each compiles a kept pymc-extras Scan model twice in the default (Numba) mode (minutes); the
# filter-level test above checks the same three filters in the default run
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) for k in _KEPT_MODELS])
def kept_filter_model(request):
    from iterops.examples import pymc_extras_local_linear_trend_model

    rng = np.random.default_rng(3)
    names = _KEPT_MODELS[request.param]
    y = np.cumsum(rng.normal(size=(40, len(names or [0]))), axis=0)
    if names:  # 2 series, diagonal measurement error, a missing component and a fully missing row
        y[5, 0] = np.nan
        y[17] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pymc_extras_local_linear_trend_model(y, filter_type=request.param, observed_state_names=names)


def test_pymc_extras_models_with_other_filters_logp_dlogp(kept_filter_model):
    """Structural models with ``filter_type`` univariate / cholesky / convergent: ``compile_logp`` and
    ``compile_dlogp`` with iterops (rewrite registered, PyMC's pre-gradient pass included) equal the same
    model compiled with no pattern; no Kalman Op appears (the filters are kept)."""
    model = kept_filter_model
    logp, dlogp = model.compile_logp(mode=FAST_PY), model.compile_dlogp(mode=FAST_PY)
    for fn in (logp, dlogp):
        assert not _has_kalman(fn.f)
    _compare_with_unfused(model, logp, dlogp, n_points=2, scale=0.3)


def _compare_with_unfused(model, logp, dlogp, n_points, scale):
    """``logp``/``dlogp`` equal the model's compiled with no pattern registered, at ``n_points`` random points
    around the initial point; returns the reference functions.  PyMC canonicalizes the logp graph itself
    (pre-gradient pass), whatever the mode: the reference is built with the registry emptied."""
    with mock.patch.dict(iterops.fusion.PATTERNS, clear=True):
        ref_logp = model.compile_logp(mode=_SCAN_MODE)
        ref_dlogp = model.compile_dlogp(mode=_SCAN_MODE)
    rng = np.random.default_rng(0)
    ip = model.initial_point()
    for _ in range(n_points):
        point = {k: v + rng.normal(scale=scale, size=np.shape(v)) for k, v in ip.items()}
        np.testing.assert_allclose(logp(point), ref_logp(point), rtol=1e-10)
        np.testing.assert_allclose(dlogp(point), ref_dlogp(point), rtol=1e-8, atol=1e-10)
    return ref_logp, ref_dlogp


@pytest.fixture(scope="module")
def local_level_model():
    from iterops.examples import pymc_extras_local_linear_trend_model

    rng = np.random.default_rng(3)
    y = np.cumsum(rng.normal(size=40))[:, None]
    y[5] = np.nan
    y[17] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pymc_extras_local_linear_trend_model(y)


def test_pymc_extras_model_logp_dlogp_use_kalman_op(local_level_model):
    model = local_level_model
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for fn in (logp, dlogp):
        assert _has_kalman(fn.f) and not _has_scan(fn.f)
    ref_logp, ref_dlogp = _compare_with_unfused(model, logp, dlogp, n_points=3, scale=0.5)
    assert _has_scan(ref_logp.f) and _has_scan(ref_dlogp.f)


# ---------------------------------------------------------------------------
# textbook covariance form
# ---------------------------------------------------------------------------

LOG2PI = np.log(2 * np.pi)


def textbook_inv(y, a0, P0, T, Z, R, H, Q):
    def step(y, a, P, T, Z, R, H, Q):
        v = y - Z @ a
        F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F)
        a_f = a + K @ v
        P_f = P - K @ Z @ P
        ll = -0.5 * (2 * LOG2PI + pt.log(pt.linalg.det(F)) + v @ pt.linalg.inv(F) @ v)
        return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll

    a, Ps, ll = pytensor.scan(step, sequences=[y], outputs_info=[a0, P0, None], non_sequences=[T, Z, R, H, Q],
                              return_updates=False)
    return ll, a, Ps


def textbook_solve_intercepts(y, a0, P0, c, d, T, Z, R, H, Q):
    """solve() gain, (I - K Z) P, intercepts, other argument and output order, .mT / matrix_dot."""

    def step(y, P, a, Q, H, R, Z, T, d, c):
        v = y - d - pt.dot(Z, a)
        F = pt.linalg.matrix_dot(Z, P, Z.mT) + H
        K = pt.linalg.solve(F, Z @ P).T
        P_f = (pt.eye(3) - K @ Z) @ P
        ll = -0.5 * (2 * LOG2PI + pt.log(pt.linalg.det(F)) + v @ pt.linalg.solve(F, v))
        return ll, R @ Q @ R.mT + T @ P_f @ T.mT, c + T @ (a + K @ v)

    ll, Ps, a = pytensor.scan(step, sequences=[y], outputs_info=[None, P0, a0],
                              non_sequences=[Q, H, R, Z, T, d, c], return_updates=False)
    return ll, a, Ps


@pytest.fixture(scope="module")
def tb_data():
    return _system(np.random.default_rng(5))


def _tb_inputs(s, intercepts):
    P0 = s["L0"] @ s["L0"].T
    H, Q = s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T
    if intercepts:
        return textbook_solve_intercepts(s["y"], s["a0"], P0, s["c"], s["d"], s["T"], s["Z"], s["R"], H, Q)
    return textbook_inv(s["y"], s["a0"], P0, s["T"], s["Z"], s["R"], H, Q)


@pytest.mark.parametrize("intercepts", [False, True])
def test_textbook_values_and_gradients(tb_data, intercepts):
    s = _symbols()
    outs = _tb_inputs(s, intercepts)
    assert [r.pattern for r in iterops.explain(list(outs)).replaced] == ["kalman_textbook"]
    names = [k for k in s if intercepts or k not in ("c", "d")]
    wrt = [s[k] for k in names if k != "y"]
    _compare(list(outs), wrt, [s[k] for k in names], [tb_data[k] for k in names], rtol=1e-7, atol=1e-8)


def test_textbook_nan_observation_poisons_like_the_loop(tb_data):
    s = _symbols()
    ll, a, _ = _tb_inputs(s, False)
    names = [k for k in s if k not in ("c", "d")]
    ins = [s[k] for k in names]
    f = pytensor.function(ins, [ll, a])
    ref = pytensor.function(ins, [ll, a], mode=_SCAN_MODE)
    assert _has_kalman(f)
    vals = {**tb_data, "y": tb_data["y"].copy()}
    vals["y"][10, 1] = np.nan
    got, want = f(*[vals[k] for k in names]), ref(*[vals[k] for k in names])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g[~np.isnan(g)], w[~np.isnan(w)], rtol=1e-8)


def _tb_near(variant):
    """A textbook loop with one change; returns ll.sum()."""

    def step(y, a, P, T, Z, R, H, Q):
        v = Z @ a - y if variant == "innovation sign" else y - Z @ a
        F = Z @ P @ Z.T + (0 if variant == "F without H" else H)
        K = (Z.T @ pt.linalg.inv(F) if variant == "gain without P" else
             P @ Z.T @ pt.linalg.inv(F + H) if variant == "gain with extra H" else P @ Z.T @ pt.linalg.inv(F))
        a_f = a + K @ v
        P_f = P + K @ Z @ P if variant == "update sign" else P - K @ Z @ P
        Pn = P if variant == "predict from P, not P_f" else P_f
        W = 0 if variant == "no R Q R^T" else R @ Q @ R.T
        Tl = T.T if variant == "T^T in covariance predict" else T
        const = LOG2PI if variant == "constant p log 2pi wrong" else 2 * LOG2PI
        logdet = pt.linalg.det(F) if variant == "det without log" else pt.log(pt.linalg.det(F))
        ll = -0.5 * (const + logdet + v @ pt.linalg.inv(F) @ v)
        return T @ a_f, Tl @ Pn @ Tl.T + W, ll

    s = _symbols()
    P0 = s["L0"] @ s["L0"].T
    a, Ps, ll = pytensor.scan(step, sequences=[s["y"]], outputs_info=[s["a0"], P0, None],
                              non_sequences=[s["T"], s["Z"], s["R"], s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T],
                              return_updates=False)
    return ll.sum()


TB_NEAR_MISSES = ["innovation sign", "F without H", "gain without P", "gain with extra H", "update sign",
                  "predict from P, not P_f", "no R Q R^T", "T^T in covariance predict", "constant p log 2pi wrong",
                  "det without log"]


@pytest.mark.parametrize("variant", TB_NEAR_MISSES)
def test_textbook_near_misses_stay_scans(variant):
    report = iterops.explain(_tb_near(variant))
    assert not report.replaced, str(report)


def test_textbook_near_miss_builder_matches_when_unchanged():
    """The near-miss loop with no change is recognized: each near miss differs by its one change only."""
    assert iterops.explain(_tb_near("none")).replaced


def test_textbook_near_miss_explained():
    report = str(iterops.explain(_tb_near("no R Q R^T")))
    assert "kalman_textbook" in report and "kept as a Scan" in report


def test_textbook_extra_used_state_stays_scan():
    s = _symbols()

    def step(y, a, P, cnt, T, Z, R, H, Q):
        v = y - Z @ a
        F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F)
        ll = -0.5 * (2 * LOG2PI + pt.log(pt.linalg.det(F)) + v @ pt.linalg.inv(F) @ v)
        return T @ (a + K @ v), T @ (P - K @ Z @ P) @ T.T + R @ Q @ R.T, cnt + 1, ll

    _, _, cnt, ll = pytensor.scan(step, sequences=[s["y"]],
                                  outputs_info=[s["a0"], s["L0"] @ s["L0"].T, pt.zeros(()), None],
                                  non_sequences=[s["T"], s["Z"], s["R"], s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T],
                                  return_updates=False)
    assert not iterops.explain([ll.sum(), cnt[-1]]).replaced
    assert iterops.explain(ll.sum()).replaced  # the same loop with the counter unused is recognized
