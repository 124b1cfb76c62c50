"""The loop spellings users write: each is fused and equals the unrewritten loop.

Every spelling is a reference loop of :mod:`iterops.reference_loops`; the oracle is that loop compiled
with ``mode.excluding("iterops")`` (values, and gradients by autodiff of the Scan).  Near misses of the
new spellings stay Scans.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import get_mode
from pytensor.scan.op import Scan

import iterops
from conftest import FAST_PY, SCAN_ORACLE
from iterops import reference_loops as ref
from iterops.linalg.block_diag import BlockDiag
from iterops.linalg.lyapunov_iteration import LyapunovFixedPointLoop, LyapunovFixedPointTrace
from iterops.ts.kalman import KalmanFilter
from iterops.ts.levinson_recursion import LevinsonRecursion

pytestmark = [pytest.mark.python_run, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")]

_SCAN_MODE = SCAN_ORACLE
N, M, P, R_ = 20, 3, 2, 2


def _core_ops(f):
    return [getattr(n.op, "core_op", n.op) for n in f.maker.fgraph.apply_nodes]


def _has(f, op_type):
    return any(isinstance(op, op_type) for op in _core_ops(f))


def _compare(ins, outs, wrt, vals, op_type, rtol=1e-7, atol=1e-9, mode=None):
    """The user's graph with plain ``pytensor.grad`` compiled in ``mode`` (the default mode, or this module's
    ``python_run`` one: the forward and gradient Scans fused by the compile-time rewrite, no ``fuse_loops``)
    vs the Scan: values and gradients."""
    cost = sum((o * pt.cos(0.7 * pt.arange(o.size) + k).reshape(o.shape)).sum() for k, o in enumerate(outs))
    f = pytensor.function(ins, [*outs, *pytensor.grad(cost, wrt)], mode=mode)
    g = pytensor.function(ins, [*outs, *pytensor.grad(cost, wrt)], mode=_SCAN_MODE)
    assert _has(f, op_type) and not _has(f, Scan), str(iterops.explain(outs))
    assert _has(g, Scan)
    got, want = f(*vals), g(*vals)
    for j, (a, b) in enumerate(zip(got, want)):
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=f"output/gradient {j}")
    return f


# ---------------------------------------------------------------------------
# Kalman filter
# ---------------------------------------------------------------------------

def _system(rng, kind="stable"):
    T = 0.6 * np.eye(M) + 0.15 * rng.normal(size=(M, M))
    Z = rng.normal(size=(P, M))
    LH = np.tril(0.3 * rng.normal(size=(P, P))) + np.eye(P)
    L0 = np.tril(rng.normal(size=(M, M))) + 2 * np.eye(M)
    if kind == "unit_root":  # a local linear trend (two unit roots) and a large initial covariance
        T = np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.5]])
        L0 = 1e3 * np.eye(M)
    elif kind == "multiscale":  # observations and states on very different scales
        Z = Z * np.array([1e3, 1.0, 1e-3])
        LH = LH * 1e-2
    return dict(y=rng.normal(size=(N, P)), a0=rng.normal(size=M), L0=L0, c=0.1 * rng.normal(size=M),
                d=0.1 * rng.normal(size=P), T=T, Z=Z, R=rng.normal(size=(M, R_)), LH=LH,
                LQ=np.tril(0.3 * rng.normal(size=(R_, R_))) + np.eye(R_))


def _symbols():
    return dict(y=pt.tensor("y", shape=(N, P)), a0=pt.tensor("a0", shape=(M,)), L0=pt.tensor("L0", shape=(M, M)),
                c=pt.tensor("c", shape=(M,)), d=pt.tensor("d", shape=(P,)), T=pt.tensor("T", shape=(M, M)),
                Z=pt.tensor("Z", shape=(P, M)), R=pt.tensor("R", shape=(M, R_)),
                LH=pt.tensor("LH", shape=(P, P)), LQ=pt.tensor("LQ", shape=(R_, R_)))


def _kalman(s, spelling, intercepts, predict_first):
    loop = ref.kalman_filtered_loop if predict_first else ref.kalman_textbook_loop
    step = ref.kalman_spelled_step(*spelling, intercepts=intercepts, predict_first=predict_first)
    cd = dict(c=s["c"], d=s["d"]) if intercepts else {}
    return list(loop(s["y"], s["a0"], s["L0"] @ s["L0"].T, s["T"], s["Z"], s["R"], s["LH"] @ s["LH"].T,
                     s["LQ"] @ s["LQ"].T, step=step, **cd))


#: (gain, update, loglik), intercepts, predict_first: every spelling of each part at least once, in both
#: orders and with and without intercepts
KALMAN_SPELLINGS = [
    (("inv", "minus", "det"), False, False),
    (("solve", "factor", "logdet_first"), True, False),
    (("solve_pos", "kfk", "det2pi"), False, False),
    (("inv", "joseph", "slogdet"), True, False),
    (("solve", "joseph", "distributed"), False, False),
    (("inv", "kfk", "dot"), False, False),
    (("solve", "minus", "dot"), True, False),
    (("inv", "minus", "mvn_v"), False, False),
    (("solve", "factor", "mvn_y"), True, False),
    (("inv", "minus", "det"), False, True),
    (("solve_pos", "joseph", "slogdet"), True, True),
    (("inv", "factor", "mvn_y"), True, True),
    (("solve", "kfk", "distributed"), False, True),
]


def _kalman_case(spelling, intercepts, predict_first, kind="stable", seed=5, s=None):
    s = _symbols() if s is None else s
    outs = _kalman(s, spelling, intercepts, predict_first)
    names = [k for k in s if intercepts or k not in ("c", "d")]
    vals = _system(np.random.default_rng(seed), kind)
    return [s[k] for k in names], outs, [s[k] for k in names if k != "y"], [vals[k] for k in names]


@pytest.mark.parametrize("spelling,intercepts,predict_first", KALMAN_SPELLINGS,
                         ids=lambda x: "-".join(x) if isinstance(x, tuple) else str(x))
def test_kalman_spellings_fused_and_equal(spelling, intercepts, predict_first):
    ins, outs, wrt, vals = _kalman_case(spelling, intercepts, predict_first)
    pattern = "kalman_textbook_filtered" if predict_first else "kalman_textbook"
    assert [r.pattern for r in iterops.explain(outs).replaced] == [pattern]
    _compare(ins, outs, wrt, vals, KalmanFilter)


def _values_and_grads(ins, outs, wrt, vals, fused):
    cost = sum((o * pt.cos(0.7 * pt.arange(o.size) + k).reshape(o.shape)).sum() for k, o in enumerate(outs))
    if fused:
        *outs, cost = iterops.fuse_loops([*outs, cost])
        f = pytensor.function(ins, [*outs, *pytensor.grad(cost, wrt)])
        assert _has(f, KalmanFilter) and not _has(f, Scan)
    else:
        f = pytensor.function(ins, [*outs, *pytensor.grad(cost, wrt)], mode=_SCAN_MODE)
    return f(*vals)


@pytest.mark.parametrize("kind", ["unit_root", "multiscale"])
@pytest.mark.parametrize("update", ["minus", "joseph"])
def test_kalman_update_spellings_on_hard_inputs(kind, update):
    """The Joseph form and P - K Z P on a unit-root system with a diffuse-like start (P0 = 1e6 I) and on a
    multi-scale one: the replacement equals the loop to rounding.

    "Rounding" is measured on the problem: the loop's two spellings (the same filter in exact arithmetic)
    differ by the problem's own rounding noise (1e-7 relative on the unit-root system); the replacement
    must be as close to the loop as that, for every value and gradient.
    """
    other = "joseph" if update == "minus" else "minus"
    syms = _symbols()
    ins, outs, wrt, vals = _kalman_case(("inv", update, "det"), True, False, kind, s=syms)
    got = _values_and_grads(ins, outs, wrt, vals, fused=True)
    want = _values_and_grads(ins, outs, wrt, vals, fused=False)
    _, outs2, _, _ = _kalman_case(("inv", other, "det"), True, False, kind, s=syms)
    twin = _values_and_grads(ins, outs2, wrt, vals, fused=False)
    for j, (a, b, c) in enumerate(zip(got, want, twin)):
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        noise = float(np.abs(b - c).max(initial=0.0))
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
        assert float(np.abs(a - b).max(initial=0.0)) <= 10 * noise + 1e-10 * scale, f"output/gradient {j}"


def test_kalman_spelling_default_mode_forward():
    """No fuse_loops: the default-mode compile of a new spelling replaces the Scan."""
    ins, outs, _, vals = _kalman_case(("solve", "joseph", "slogdet"), True, True)
    f = pytensor.function(ins, outs)
    assert _has(f, KalmanFilter) and not _has(f, Scan)
    g = pytensor.function(ins, outs, mode=_SCAN_MODE)
    for a, b in zip(f(*vals), g(*vals)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-9)


def _near(change):
    """A textbook loop in a new spelling with one change that makes it a different computation."""

    def step(y, a, P, T, Z, R, H, Q, log2pi_p):
        v = y - Z @ a
        F = Z @ P @ Z.T + H
        K = pt.linalg.solve(F, Z @ P).T
        I_KZ = pt.eye(a.shape[0]) - K @ Z
        if change == "joseph without K H K^T":
            P_f = I_KZ @ P @ I_KZ.T
        elif change == "joseph with K K^T":
            P_f = I_KZ @ P @ I_KZ.T + K @ K.T
        elif change == "K H K^T for K F K^T":
            P_f = P - K @ H @ K.T
        else:
            P_f = I_KZ @ P @ I_KZ.T + K @ H @ K.T
        if change == "log det(pi F)":
            ll = -0.5 * (pt.log(pt.linalg.det(np.pi * F)) + v @ pt.linalg.solve(F, v))
        elif change == "distributed with +0.5":
            ll = -0.5 * log2pi_p - 0.5 * pt.log(pt.linalg.det(F)) + 0.5 * v @ pt.linalg.solve(F, v)
        elif change == "slogdet sign":
            sign, logdet = pt.linalg.slogdet(F)
            ll = -0.5 * (log2pi_p + sign * logdet + v @ pt.linalg.solve(F, v))
        else:
            ll = -0.5 * (pt.log(pt.linalg.det(2 * np.pi * F)) + v @ pt.linalg.solve(F, v))
        return T @ (a + K @ v), T @ P_f @ T.T + R @ Q @ R.T, ll

    s = _symbols()
    ll, a, Ps = ref.kalman_textbook_loop(s["y"], s["a0"], s["L0"] @ s["L0"].T, s["T"], s["Z"], s["R"],
                                         s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T, step=step)
    return [ll, a, Ps]


KALMAN_NEAR = ["joseph without K H K^T", "joseph with K K^T", "K H K^T for K F K^T", "log det(pi F)",
               "distributed with +0.5", "slogdet sign"]


@pytest.mark.parametrize("change", KALMAN_NEAR)
def test_kalman_spelling_near_misses_stay_scans(change):
    report = iterops.explain(_near(change))
    assert not report.replaced, str(report)


def test_kalman_spelling_near_miss_builder_matches_when_unchanged():
    assert [r.pattern for r in iterops.explain(_near("none")).replaced] == ["kalman_textbook"]


# ---------------------------------------------------------------------------
# Kalman filter over free matrices: the Gaussian log density in its common algebraic forms
# ---------------------------------------------------------------------------

def _gaussian_loglik(form, v, F, p):
    """The log density of ``v ~ N(0, F)`` (``p = len(v)``) in one of the forms users write."""
    L = pt.linalg.cholesky(F)
    logdet = {"det": lambda: pt.log(pt.linalg.det(F)), "slogdet": lambda: pt.linalg.slogdet(F)[1],
              "chol": lambda: 2 * pt.sum(pt.log(pt.diag(L))),
              "chol_prod": lambda: 2 * pt.log(pt.prod(pt.diag(L)))}
    quad = {"inv": lambda: v @ pt.linalg.inv(F) @ v, "solve": lambda: v @ pt.linalg.solve(F, v),
            "solve_first": lambda: pt.linalg.solve(F, v) @ v, "inv_first": lambda: (pt.linalg.inv(F) @ v) @ v,
            "solve_pos": lambda: v @ pt.linalg.solve(F, v, assume_a="pos"),
            "cho_solve": lambda: v @ pt.linalg.cho_solve((L, True), v),
            "whitened": lambda: pt.sum(pt.linalg.solve_triangular(L, v, lower=True) ** 2),
            "whitened_dot": lambda: (w := pt.linalg.solve_triangular(L, v, lower=True)) @ w}
    const, det_form, quad_form = form
    q = quad[quad_form]()
    if const == "det2pi":
        return -0.5 * (pt.log(pt.linalg.det(2 * np.pi * F)) + q)
    ld = logdet[det_form]()
    if const == "distributed":
        return -0.5 * p * np.log(2 * np.pi) - 0.5 * ld - 0.5 * q
    return -0.5 * (p * np.log(2 * np.pi) + ld + q)


#: (constant term, log det F, quadratic form, gain): "p" = ``p log(2 pi) + log det F``, "det2pi" = ``log det(2 pi
#: F)``, "distributed" = the -0.5 multiplied out; log det by ``det``, ``slogdet``, a Cholesky factor
#: (``2 sum log diag L``, ``2 log prod diag L``); the quadratic form with ``inv`` or ``solve`` in either order,
#: ``cho_solve``, or the whitened residual ``L^{-1} v``; the gain by ``inv`` or ``solve``
GAUSSIAN_FORMS = [
    ("p", "det", "inv", "inv"),
    ("det2pi", "det", "solve", "solve"),
    ("p", "slogdet", "solve_pos", "solve"),
    ("p", "det", "solve_first", "solve"),
    ("p", "det", "inv_first", "inv"),
    ("p", "chol", "inv", "inv"),
    ("p", "chol", "cho_solve", "inv"),
    ("p", "chol", "whitened", "solve"),
    ("distributed", "chol_prod", "whitened_dot", "inv"),
    ("distributed", "chol", "solve_first", "solve"),
]


def _free_matrix_loop(form):
    """A textbook filter over plain matrix inputs declared symmetric positive definite, its log-likelihood
    written in ``form`` (see ``GAUSSIAN_FORMS``)."""
    from pytensor.assumptions import assume

    *density, gain = form

    def update(y, a, P_, Z, H):
        v = y - Z @ a
        F = Z @ P_ @ Z.T + H
        K = P_ @ Z.T @ pt.linalg.inv(F) if gain == "inv" else pt.linalg.solve(F, Z @ P_).T
        return a + K @ v, P_ - K @ Z @ P_, _gaussian_loglik(tuple(density), v, F, P)

    def step(y, a, P_, T, Z, R, H, Q, log2pi_p):
        a_f, P_f, ll = update(y, a, P_, Z, H)
        return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll

    s = _symbols()
    free = dict(P0=pt.tensor("P0", shape=(M, M)), H=pt.tensor("H", shape=(P, P)), Q=pt.tensor("Q", shape=(R_, R_)))
    P0, H, Q = (assume(free[k], symmetric=True, positive_definite=True) for k in ("P0", "H", "Q"))
    outs = list(ref.kalman_textbook_loop(s["y"], s["a0"], P0, s["T"], s["Z"], s["R"], H, Q, step=step))
    ins = [s["y"], s["a0"], free["P0"], s["T"], s["Z"], s["R"], free["H"], free["Q"]]
    sv = _system(np.random.default_rng(11))
    vals = [sv["y"], sv["a0"], sv["L0"] @ sv["L0"].T, sv["T"], sv["Z"], sv["R"], sv["LH"] @ sv["LH"].T,
            sv["LQ"] @ sv["LQ"].T]
    return ins, outs, vals


@pytest.mark.parametrize("form", GAUSSIAN_FORMS, ids="-".join)
def test_kalman_gaussian_density_forms_fused_and_equal(form):
    """Each form of the Gaussian log density is fused (no Scan left) and equals the loop: values, and
    gradients along symmetric directions of the covariances (the loop reads their raw entries, see
    :mod:`iterops.fusion.patterns.kalman`)."""
    ins, outs, vals = _free_matrix_loop(form)
    report = iterops.explain(outs)
    assert [r.pattern for r in report.replaced] == ["kalman_textbook"], str(report)
    wrt = ins[1:]
    got = _values_and_grads(ins, outs, wrt, vals, fused=True)
    want = _values_and_grads(ins, outs, wrt, vals, fused=False)
    covs = {1, 5, 6}  # P0, H, Q in wrt: compare g + g^T
    for j, (a, b) in enumerate(zip(got, want)):
        if j - len(outs) in covs:
            a, b = a + a.T, b + b.T
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9 * scale, err_msg=f"output/gradient {j}")


def _density_near(change):
    """A textbook loop over free matrices, log density by a Cholesky factor, with one change that makes it a
    different computation (``"none"``: unchanged)."""
    from pytensor.assumptions import assume

    def step(y, a, P_, T, Z, R, H, Q, log2pi_p):
        v = y - Z @ a
        F = Z @ P_ @ Z.T + H
        L = pt.linalg.cholesky(F)
        K = pt.linalg.solve(F, Z @ P_).T
        logdet = {"half log det": lambda: pt.sum(pt.log(pt.diag(L))),
                  "diag of F": lambda: 2 * pt.sum(pt.log(pt.diag(F))),
                  "Cholesky factor of H": lambda: 2 * pt.sum(pt.log(pt.diag(pt.linalg.cholesky(H))))}.get(
            change, lambda: 2 * pt.sum(pt.log(pt.diag(L))))()
        quad = {"whitened by L^T": lambda: pt.sum(pt.linalg.solve_triangular(L.T, v, lower=False) ** 2),
                "solve(F, v) @ y": lambda: pt.linalg.solve(F, v) @ y,
                "cho_solve reading L as upper": lambda: v @ pt.linalg.cho_solve((L, False), v)}.get(
            change, lambda: v @ pt.linalg.cho_solve((L, True), v))()
        ll = -0.5 * (log2pi_p + logdet + quad)
        return T @ (a + K @ v), T @ (P_ - K @ Z @ P_) @ T.T + R @ Q @ R.T, ll

    s = _symbols()
    P0, H, Q = (assume(pt.tensor(n, shape=sh), symmetric=True, positive_definite=True)
                for n, sh in (("P0", (M, M)), ("H", (P, P)), ("Q", (R_, R_))))
    return list(ref.kalman_textbook_loop(s["y"], s["a0"], P0, s["T"], s["Z"], s["R"], H, Q, step=step))


DENSITY_NEAR = ["half log det", "diag of F", "Cholesky factor of H", "whitened by L^T", "solve(F, v) @ y",
                "cho_solve reading L as upper"]


@pytest.mark.parametrize("change", DENSITY_NEAR)
def test_kalman_gaussian_density_near_misses_stay_scans(change):
    """Each stays a Scan, and ``explain`` names a difference in the log density, not in a spelling of the
    gain the user did not write (the step's gain ``solve(F, Z P).T`` is one of the reference's alternatives)."""
    report = iterops.explain(_density_near(change))
    assert not report.replaced, str(report)
    [why] = [why for name, why in report.kept[0].reasons if name == "kalman_textbook"]
    assert why.startswith("the step differs from the reference"), why
    assert "assume_a" not in why, why


def test_kalman_gaussian_density_near_miss_builder_matches_when_unchanged():
    assert [r.pattern for r in iterops.explain(_density_near("none")).replaced] == ["kalman_textbook"]


def test_kalman_filtered_start_is_predicted():
    """Predict-then-update with a NaN observation: the poisoned states and log-likelihoods match the loop."""
    ins, outs, _, vals = _kalman_case(("inv", "minus", "det"), False, True)
    vals = list(vals)
    vals[0] = vals[0].copy()
    vals[0][7, 1] = np.nan
    f = pytensor.function(ins, outs)
    g = pytensor.function(ins, outs, mode=_SCAN_MODE)
    assert _has(f, KalmanFilter)
    for a, b in zip(f(*vals), g(*vals)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a[~np.isnan(a)], b[~np.isnan(b)], rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------
# Levinson-Durbin
# ---------------------------------------------------------------------------

LEVINSON_GAMMAS = {
    "ar2": np.array([2.0, 1.2, 0.5, 0.1, -0.1, 0.05]),
    "near_unit_root": np.array([1.0, 0.999999, 0.999997, 0.999994, 0.99999, 0.999985]),
    "not_positive_definite": np.array([1.0, 0.0, 0.0, 1.5, 0.3, 0.2]),
    # kappa = 2 makes v = -3, then kappa = 1 exactly: v becomes a zero whose sign depends on the spelling
    # (v - kappa**2 * v = +0, v * (1 - kappa) * (1 + kappa) = -0), and the next kappa = num / v an infinity
    "unit_kappa_after_negative_v": np.array([1.0, 0.0, 2.0, 0.0, 1.0, 0.5]),
}


@pytest.mark.parametrize("v_update", ["minus", "factored"])
@pytest.mark.parametrize("gamma_name", list(LEVINSON_GAMMAS))
def test_levinson_variance_spellings_fused_and_equal(v_update, gamma_name):
    gamma = pt.vector("gamma")
    phi, v, kappas = ref.levinson_loop(gamma, 5, step=ref.levinson_spelled_step(v_update))
    assert [r.pattern for r in iterops.explain([phi, v, kappas]).replaced] == ["levinson_durbin"]
    ins, outs, vals = [gamma], [phi, v, kappas], [LEVINSON_GAMMAS[gamma_name]]
    f = pytensor.function(ins, outs)
    g = pytensor.function(ins, outs, mode=_SCAN_MODE)
    assert _has(f, LevinsonRecursion) and not _has(f, Scan)
    for a, b in zip(f(*vals), g(*vals)):
        # the loop's own arithmetic: NaN, infinities and zeros with their signs where the loop has them;
        # finite values equal to rounding norm-wise (the summation order of the inner product may differ,
        # amplified by 1 / (1 - kappa^2) ~ 1e6 near the unit root)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        special = np.isinf(b) | (b == 0)
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        np.testing.assert_array_equal(np.signbit(a[special]), np.signbit(b[special]))
        fin = np.isfinite(b)
        scale = max(1.0, float(np.abs(b[fin]).max(initial=0.0)))
        np.testing.assert_allclose(a[fin], b[fin], rtol=0, atol=1e-9 * scale)
    if np.all(np.isfinite(g(*vals)[1])):
        # gradients: the adjoint of the recursion vs autodiff of the loop, norm-wise to rounding (x 1e6 near
        # the unit root)
        _compare(ins, outs, ins, vals, LevinsonRecursion, rtol=0, atol=1e-8)


# ---------------------------------------------------------------------------
# Block-diagonal assembly with go_backwards=True
# ---------------------------------------------------------------------------


def _block_sequence_backwards(x):
    def step(i, xi, out):
        n, m = xi.shape[0], xi.shape[1]
        return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], xi)

    k, n, m = x.shape
    outs = pytensor.scan(step, sequences=[pt.arange(k), x], outputs_info=[pt.zeros((k * n, k * m))],
                         go_backwards=True, return_updates=False)
    return outs[-1]


@pytest.mark.parametrize("loop", ["indexed", "sequence"])
@pytest.mark.parametrize("shape", [(3, 2, 3), (1, 1, 1), (0, 2, 2)])
def test_block_diag_go_backwards_fused_and_equal(loop, shape):
    x = pt.tensor3("x")
    out = ref.block_diag_backwards_loop(x) if loop == "indexed" else _block_sequence_backwards(x)
    val = np.random.default_rng(1).normal(size=shape)
    if shape[0] == 0:  # 0 blocks: a (0, 0) matrix both ways (the loop's gradient raises: values only)
        f, g = pytensor.function([x], out), pytensor.function([x], out, mode=_SCAN_MODE)
        assert _has(f, BlockDiag) and not _has(f, Scan)
        np.testing.assert_array_equal(f(val), g(val))
        return
    f = pytensor.function([x], [out, pytensor.grad((iterops.fuse_loops(out) ** 2).sum(), x)])
    g = pytensor.function([x], [out, pytensor.grad((out ** 2).sum(), x)], mode=_SCAN_MODE)
    assert _has(f, BlockDiag) and not _has(f, Scan)
    for a, b in zip(f(val), g(val)):
        np.testing.assert_array_equal(a, b)


def _block_near(change):
    x = pt.tensor3("x")
    k, n, m = x.shape

    indexed = ref.block_diag_step

    def sequence(i, xi, out):
        bn, bm = xi.shape[0], xi.shape[1]
        return pt.set_subtensor(out[i * bn:(i + 1) * bn, i * bm:(i + 1) * bm], xi)

    zeros = pt.zeros((k * n, k * m))
    if change == "backwards over a longer arange":  # visits k+1..2, not k-1..0
        outs = pytensor.scan(indexed, sequences=[pt.arange(k + 2)], outputs_info=[zeros], non_sequences=[x],
                             n_steps=k, go_backwards=True, return_updates=False)
    elif change == "only the index reversed":  # block x[j] written at position k-1-j
        outs = pytensor.scan(sequence, sequences=[pt.arange(k)[::-1], x], outputs_info=[zeros],
                             return_updates=False)
    elif change == "only the blocks reversed":
        outs = pytensor.scan(sequence, sequences=[pt.arange(k), x[::-1]], outputs_info=[zeros],
                             return_updates=False)
    else:
        outs = pytensor.scan(sequence, sequences=[pt.arange(k), x], outputs_info=[zeros], go_backwards=True,
                             return_updates=False)
    return outs[-1]


@pytest.mark.parametrize("change", ["backwards over a longer arange", "only the index reversed",
                                    "only the blocks reversed"])
def test_block_diag_backwards_near_misses_stay_scans(change):
    assert not iterops.explain(_block_near(change)).replaced


def test_block_diag_backwards_near_miss_builder_matches_when_unchanged():
    assert iterops.explain(_block_near("none")).replaced


# ---------------------------------------------------------------------------
# The damped fixed point X <- (1 - w) X + w (A X A^T + Q): the same damped iteration fused
# ---------------------------------------------------------------------------


def _damped_loop(update, w, stop=lambda new, old, tol: pt.max(pt.abs(new - old)) < tol, n_steps=3000,
                 X0=None, **scan_kwargs):
    """``ref.damped_fixed_point_loop`` with the update (and stop) spelled otherwise."""
    from pytensor.scan.utils import until

    def step(X, A, Q, w, tol):
        X_new = update(X, A, Q, w)
        return X_new if stop is None else (X_new, until(stop(X_new, X, tol)))

    return ref.damped_fixed_point_loop(_DA, _DQ, w, X0=_DX0 if X0 is None else X0, tol=_DTOL, n_steps=n_steps,
                                       step=step, **scan_kwargs)


_DA, _DQ, _DX0, _DW, _DTOL = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0"), pt.scalar("w"), pt.scalar("tol")

#: the damped spellings accepted (each is the iteration of ``ref.damped_fixed_point_step`` as written)
DAMPED_SPELLINGS = {
    "reference": ref.damped_fixed_point_step,
    "(1 - w) X + w (A X A^T + Q)": lambda X, A, Q, w: (1 - w) * X + w * (A @ X @ A.T + Q),
    "1.0 - w": lambda X, A, Q, w: (1.0 - w) * X + w * (A @ X @ A.T + Q),
    "terms swapped": lambda X, A, Q, w: w * (A @ X @ A.T + Q) + (1 - w) * X,
    "factors swapped": lambda X, A, Q, w: X * (1 - w) + (Q + A @ X @ A.T) * w,
    "X + w (A X A^T + Q - X)": lambda X, A, Q, w: X + w * (A @ X @ A.T + Q - X),
    "increment, operands swapped": lambda X, A, Q, w: (A @ X @ A.T + Q - X) * w + X,
    "increment, -X first": lambda X, A, Q, w: X + w * (-X + A @ X @ A.T + Q),
}


def _damped_values(rng, kind="stable"):
    L = rng.normal(size=(3, 3))
    if kind == "unit_root":  # an unexcited unit root: the limit keeps X0's part
        return [np.diag([1.0, 0.5, 0.2]), np.diag([0.0, 1.0, 1.0]), 10.0 * np.eye(3), 1e-10]
    A = rng.normal(size=(3, 3))
    return [0.8 * A / np.abs(np.linalg.eigvals(A)).max(), L @ L.T + np.eye(3), rng.normal(size=(3, 3)), 1e-10]


def _compare_damped(ins, outs, wrt, vals, rtol=1e-7, atol=1e-9):
    """:func:`_compare` for many small graphs: values and plain-``pytensor.grad`` gradients through the Python
    linker (``FAST_COMPILE``: the fused Op's ``perform`` runs the same kernel), and the graph the default mode
    links (rewritten, not linked: linking is slow) holds the fused Op and no Scan."""
    from pytensor.graph.fg import FunctionGraph

    cost = sum((o * pt.cos(0.7 * pt.arange(o.size) + k).reshape(o.shape)).sum() for k, o in enumerate(outs))
    grads = pytensor.grad(cost, wrt)
    f = pytensor.function(ins, [*outs, *grads], mode=FAST_PY)
    g = pytensor.function(ins, [*outs, *grads], mode=_SCAN_MODE)
    assert _has(f, LyapunovFixedPointLoop) and not _has(f, Scan), str(iterops.explain(outs))
    fg = FunctionGraph(outputs=[*outs, *grads], clone=True)
    get_mode("NUMBA").optimizer.rewrite(fg)
    ops = [getattr(n.op, "core_op", n.op) for n in fg.apply_nodes]
    # (the Numba backend's share_fixed_point_trace turns the loop and its gradient into one traced run)
    assert any(isinstance(op, LyapunovFixedPointLoop | LyapunovFixedPointTrace) for op in ops)
    assert not any(isinstance(op, Scan) for op in ops)
    for v in vals:
        for j, (a, b) in enumerate(zip(f(*v), g(*v))):
            scale = max(1.0, float(np.abs(b).max(initial=0.0)))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=f"output/gradient {j}")


@pytest.mark.parametrize("name", list(DAMPED_SPELLINGS))
def test_damped_fixed_point_spellings_fused_and_equal(name, rng):
    step = DAMPED_SPELLINGS[name]
    if name == "reference":
        out = ref.damped_fixed_point_loop(_DA, _DQ, _DW, X0=_DX0, tol=_DTOL, n_steps=3000)
    else:
        out = _damped_loop(step, _DW)
    ins = [_DA, _DQ, _DX0, _DTOL, _DW]
    vals = [[*_damped_values(rng, kind), w] for kind, w in (("stable", 0.6), ("stable", 1.3), ("unit_root", 0.45))]
    _compare_damped(ins, [out], [_DA, _DQ, _DX0, _DW], vals)  # w > 1 over-relaxes


@pytest.mark.parametrize("w", [0.5, 0.25, 1.5])
def test_damped_fixed_point_with_a_constant_w(w, rng):
    """``w`` written as a number (``(1 - 0.5)`` folds to a constant in the step)."""
    ins = [_DA, _DQ, _DX0, _DTOL]
    for name in ("reference", "X + w (A X A^T + Q - X)"):
        step = DAMPED_SPELLINGS[name] if name != "reference" else DAMPED_SPELLINGS["(1 - w) X + w (A X A^T + Q)"]
        _compare_damped(ins, [_damped_loop(step, w)], [_DA, _DQ, _DX0], [_damped_values(rng)])


@pytest.mark.parametrize("case", ["w = 0", "w near 0", "guard", "no stop", "frobenius stop", "float32"])
def test_damped_fixed_point_edge_cases(case, rng):
    """Loops the damped Op must run as written: ``w = 0`` stops after one step at ``X0`` (its gradient for
    ``w`` is the first step's ``Y - X0``), a tiny ``w`` stopped by the tolerance far from the solution, the
    ``n_steps`` guard, no stop, the Frobenius stop, float32."""
    upd = DAMPED_SPELLINGS["(1 - w) X + w (A X A^T + Q)"]
    vals, w = _damped_values(rng), {"w = 0": 0.0, "w near 0": 1e-9}.get(case, 0.7)
    ins, wrt = [_DA, _DQ, _DX0, _DTOL, _DW], [_DA, _DQ, _DX0, _DW]
    kw = dict(rtol=1e-7, atol=1e-9)
    if case == "guard":
        out = _damped_loop(upd, _DW, n_steps=7)
    elif case == "no stop":
        out = _damped_loop(upd, _DW, stop=None, n_steps=40)
    elif case == "frobenius stop":
        out = _damped_loop(upd, _DW, stop=lambda new, old, tol: pt.linalg.norm(old - new) < tol)
    elif case == "float32":
        A, Q, X0 = (pt.matrix(n, dtype="float32") for n in ("A", "Q", "X0"))
        w32, tol = pt.scalar("w", dtype="float32"), pt.scalar("tol", dtype="float32")
        out = ref.damped_fixed_point_loop(A, Q, w32, X0=X0, tol=tol, n_steps=500)
        ins, wrt = [A, Q, X0, tol, w32], [A, Q, X0, w32]
        vals = [v.astype("float32") for v in vals[:3]] + [np.float32(1e-5)]
        kw = dict(rtol=1e-4, atol=1e-4)
    else:
        out = _damped_loop(upd, _DW)
    _compare_damped(ins, [out], wrt, [[*vals, np.asarray(w, dtype=ins[-1].type.dtype)]], **kw)


def _damped_near(change):
    from pytensor.scan.utils import until

    upd = DAMPED_SPELLINGS["(1 - w) X + w (A X A^T + Q)"]
    if change == "(2 - w) X":
        return _damped_loop(lambda X, A, Q, w: (2 - w) * X + w * (A @ X @ A.T + Q), _DW)
    if change == "0.4 X + 0.5 Y":
        return _damped_loop(lambda X, A, Q, w: 0.4 * X + 0.5 * (A @ X @ A.T + Q), 0.5)
    if change == "two different factors":
        w2 = pt.scalar("w2")
        return _damped_loop(lambda X, A, Q, w: (1 - w2) * X + w * (A @ X @ A.T + Q), _DW)
    if change == "w read as a sequence":
        ws = pt.vector("ws")

        def step(w, X, A, Q, tol):
            X_new = upd(X, A, Q, w)
            return X_new, until(pt.max(pt.abs(X_new - X)) < tol)

        return pytensor.scan(step, sequences=[ws], outputs_info=[_DX0], non_sequences=[_DA, _DQ, _DTOL],
                             return_updates=False)[-1]
    if change == "narrowing cast":
        return _damped_loop(lambda X, A, Q, w: upd(X, A, Q, w.astype("float32").astype("float64")), _DW)
    if change == "w on the other side":
        return _damped_loop(lambda X, A, Q, w: w * X + (1 - w) * (A @ X @ A.T + Q), _DW)
    if change == "X - w (X - Y)":  # the same in exact arithmetic, not a spelling the pattern lists
        return _damped_loop(lambda X, A, Q, w: X - w * (X - (A @ X @ A.T + Q)), _DW)
    if change == "w distributed":
        return _damped_loop(lambda X, A, Q, w: (1 - w) * X + w * (A @ X @ A.T) + w * Q, _DW)
    if change == "intermediate iterates used":
        Xs = pytensor.scan(lambda X, A, Q, w: upd(X, A, Q, w), outputs_info=[_DX0], non_sequences=[_DA, _DQ, _DW],
                           n_steps=20, return_updates=False)
        return Xs[-2]
    raise ValueError(change)


DAMPED_NEAR_MISSES = ["(2 - w) X", "0.4 X + 0.5 Y", "two different factors", "w read as a sequence",
                      "narrowing cast", "w on the other side", "X - w (X - Y)", "w distributed",
                      "intermediate iterates used"]


@pytest.mark.parametrize("change", DAMPED_NEAR_MISSES)
def test_damped_fixed_point_near_misses_stay_scans(change):
    report = iterops.explain(_damped_near(change))
    assert report.scans and not report.replaced, str(report)
    assert all(s.reasons for s in report.kept)


def test_damped_fixed_point_truncated_gradient_keeps_the_scans():
    out = ref.damped_fixed_point_loop(_DA, _DQ, _DW, X0=_DX0, tol=_DTOL, n_steps=100, truncate_gradient=3)
    f = pytensor.function([_DA, _DQ, _DX0, _DW, _DTOL], pytensor.grad(out.sum(), _DW), mode=FAST_PY)
    assert _has(f, Scan) and not _has(f, LyapunovFixedPointLoop)


def test_damped_fixed_point_default_mode_compiled(rng):
    """One damped loop compiled and run in the default (Numba) mode with plain ``pytensor.grad`` (value and
    gradient: one traced run of the loop, ``share_fixed_point_trace``)."""
    out = ref.damped_fixed_point_loop(_DA, _DQ, _DW, X0=_DX0, tol=_DTOL, n_steps=3000)
    _compare([_DA, _DQ, _DX0, _DTOL, _DW], [out], [_DA, _DQ, _DX0, _DW], [*_damped_values(rng), 0.6],
             LyapunovFixedPointTrace, mode="NUMBA")


@pytest.mark.parametrize("loop", ["fixed point", "damped fixed point"])
def test_constant_negative_n_steps_raises_as_the_loop(loop):
    """Deep-fuzzer finding (the damped harness, mutation ``n_steps=-1``): Scan raises on a negative
    ``n_steps`` when it runs; the fused graph ran 0 steps and returned ``X0`` when ``n_steps`` was a constant."""
    out = (ref.fixed_point_loop(_DA, _DQ, _DX0, tol=_DTOL, n_steps=-1) if loop == "fixed point"
           else ref.damped_fixed_point_loop(_DA, _DQ, _DW, X0=_DX0, tol=_DTOL, n_steps=-1))
    f = pytensor.function([_DA, _DQ, _DX0, _DTOL, _DW], out, mode=FAST_PY, on_unused_input="ignore")
    g = pytensor.function([_DA, _DQ, _DX0, _DTOL, _DW], out, mode=_SCAN_MODE, on_unused_input="ignore")
    assert not _has(f, Scan)
    vals = [0.5 * np.eye(2), np.eye(2), np.eye(2), 1e-8, 0.5]
    with pytest.raises(IndexError):
        g(*vals)
    with pytest.raises(IndexError, match="negative number of steps"):
        f(*vals)
