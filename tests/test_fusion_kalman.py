"""Kalman filter Scans -> iterops.ts.kalman_filter (iterops.fusion.patterns.kalman).

Matches: the compiled graph holds the Kalman Op and no Scan; values and
gradients equal the unrewritten Scan (``excluding("iterops")``, FAST_COMPILE,
autodiff of the Scan).  pymc-extras: its ``StandardFilter`` graph (all seven
outputs, NaN and sentinel missing values), with static and with time-varying
system matrices, and a real state-space model's ``compile_logp``/``compile_dlogp``;
its square-root and univariate filters stay Scans.  Near misses stay Scans.
"""

import warnings
from unittest import mock

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import get_mode
from pytensor.scan.op import Scan

import iterops
from iterops.ts.kalman import KalmanFilter

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

_SCAN_MODE = get_mode("FAST_COMPILE").excluding("iterops")
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
    f = pytensor.function(ins, pytensor.grad(iterops.fuse_loops(ll), [P0, H]))
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


@pytest.mark.parametrize("filter_name", ["SquareRootFilter", "UnivariateFilter"])
def test_pymc_extras_other_filters_stay_scans(filter_name, pe_data):
    """pymc-extras' square-root and univariate filters run other arithmetic (Cholesky-factor updates,
    one observation at a time in a nested Scan): no fused Op reproduces it, so they stay Scans, and the
    compiled graph (rewrite registered) computes what pymc-extras computes."""
    import pymc_extras.statespace.filters as filters

    s = _symbols()
    outs = _standard_filter_outputs(s, getattr(filters, filter_name)())
    assert not iterops.explain(outs).replaced
    names = list(s)
    ins, vals = [s[k] for k in names], [pe_data[k] for k in names]
    f = pytensor.function(ins, outs[-1].sum())
    assert _has_scan(f) and not _has_kalman(f)
    ref = pytensor.function(ins, outs[-1].sum(), mode=_SCAN_MODE)
    np.testing.assert_allclose(f(*vals), ref(*vals), rtol=1e-10)


@pytest.fixture(scope="module")
def local_level_model():
    from iterops.demo import pymc_extras_local_linear_trend_model

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
    # PyMC canonicalizes the logp graph itself (pre-gradient pass), whatever the mode: the
    # reference is built with no pattern registered
    with mock.patch.dict(iterops.fusion.PATTERNS, clear=True):
        ref_logp = model.compile_logp(mode=_SCAN_MODE)
        ref_dlogp = model.compile_dlogp(mode=_SCAN_MODE)
    assert _has_scan(ref_logp.f) and _has_scan(ref_dlogp.f)
    rng = np.random.default_rng(0)
    ip = model.initial_point()
    for _ in range(3):
        point = {k: v + rng.normal(scale=0.5, size=np.shape(v)) for k, v in ip.items()}
        np.testing.assert_allclose(logp(point), ref_logp(point), rtol=1e-10)
        np.testing.assert_allclose(dlogp(point), ref_dlogp(point), rtol=1e-8, atol=1e-10)


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
