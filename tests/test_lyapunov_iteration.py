"""smith_doubling_loop / lyapunov_fixed_point_loop against the Scans they replace.

Oracle: the user's Scan and ``pytensor.grad`` through it, compiled with iterops'
rewrites excluded, plus finite differences (``verify_grad``) and dense formulas.
"""

from functools import cache

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pytensor.gradient import DisconnectedInputError, verify_grad
from pytensor.scan.op import Scan
from pytensor.scan.utils import until

from conftest import SCAN_ORACLE, spd, stable
from iterops import reference_loops as ref
from iterops.linalg import lyapunov_fixed_point_loop, smith_doubling_loop

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

#: the user's Scans with iterops excluded, run Op by Op on PyTensor's Python VM (conftest.SCAN_ORACLE)
REF_MODE = SCAN_ORACLE
STOPS = ["max_lt", "max_le", "fro_lt", None]

# ---------------------------------------------------------------------------
# The user's loops (oracle) and the fused functions under test
# ---------------------------------------------------------------------------

STOP_RULES = {
    "max_lt": lambda new, old, tol: pt.max(pt.abs(new - old)) < tol,
    "max_le": lambda new, old, tol: pt.max(pt.abs(new - old)) <= tol,
    "fro_lt": lambda new, old, tol: pt.linalg.norm(new - old) < tol,
    None: None,
}


def scan_doubling(A, Q, tol, n_steps, stop):
    """The user's doubling Scan (:func:`iterops.reference_loops.doubling_loop`) with the stop rule ``stop``."""
    rule = STOP_RULES[stop]

    def step(alpha, gamma, tol):
        (alpha_new, gamma_new), _ = ref.doubling_step(alpha, gamma, tol)
        if rule is None:
            return alpha_new, gamma_new
        return (alpha_new, gamma_new), until(rule(gamma_new, gamma, tol))

    return ref.doubling_loop_states(A, Q, tol, n_steps, step=step)


def scan_fixed_point(A, Q, X0, tol, n_steps, stop):
    """The user's fixed-point Scan (:func:`iterops.reference_loops.fixed_point_loop`) with the stop rule ``stop``."""
    rule = STOP_RULES[stop]

    def step(X, A, Q, tol):
        X_new, _ = ref.fixed_point_step(X, A, Q, tol)
        if rule is None:
            return X_new
        return X_new, until(rule(X_new, X, tol))

    return ref.fixed_point_loop(A, Q, X0, tol, n_steps, step=step)


@cache
def doubling_fn(impl, stop, dtype_a="float64", dtype_q="float64", mode=None):
    """f(A, Q, tol, n_steps, Wa, Wg) -> alpha, gamma, dC/dA, dC/dQ with C = <Wa, alpha> + <Wg, gamma>."""
    A, Q = pt.matrix("A", dtype=dtype_a), pt.matrix("Q", dtype=dtype_q)
    tol, n = pt.dscalar("tol"), pt.lscalar("n_steps")
    loop = scan_doubling if impl == "scan" else smith_doubling_loop
    alpha, gamma = loop(A, Q, tol, n, stop)
    Wa, Wg = pt.matrix("Wa", dtype=alpha.dtype), pt.matrix("Wg", dtype=gamma.dtype)
    cost = (alpha * Wa).sum() + (gamma * Wg).sum()
    mode = REF_MODE if impl == "scan" else mode
    return pytensor.function([A, Q, tol, n, Wa, Wg], [alpha, gamma, *pytensor.grad(cost, [A, Q])], mode=mode)


@cache
def fixed_point_fn(impl, stop, dtype="float64", mode=None):
    """f(A, Q, X0, tol, n_steps, W) -> X, dC/dA, dC/dQ, dC/dX0 with C = <W, X>."""
    A, Q, X0 = (pt.matrix(name, dtype=dtype) for name in ("A", "Q", "X0"))
    tol, n = pt.dscalar("tol"), pt.lscalar("n_steps")
    loop = scan_fixed_point if impl == "scan" else lyapunov_fixed_point_loop
    X = loop(A, Q, X0, tol, n, stop)
    W = pt.matrix("W", dtype=X.dtype)
    mode = REF_MODE if impl == "scan" else mode
    return pytensor.function([A, Q, X0, tol, n, W], [X, *pytensor.grad((X * W).sum(), [A, Q, X0])], mode=mode)


def assert_close(actual, desired, rtol, name=""):
    """Equal to ``rtol`` relative to the largest finite entry (subnormals count as zero);
    NaN and inf in the same places."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.dtype == desired.dtype, (actual.dtype, desired.dtype)
    finite = desired[np.isfinite(desired)]
    scale = np.max(np.abs(finite)) if finite.size else 1.0
    atol = rtol * scale + np.finfo(desired.dtype).tiny
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, equal_nan=True, err_msg=name)


def check_doubling(a, q, tol, n_steps, stop, rtol=1e-11, rng=None, mode=None):
    rng = rng or np.random.default_rng(0)
    wa, wg = rng.normal(size=a.shape).astype(a.dtype), rng.normal(size=q.shape).astype(np.result_type(a, q))
    args = (a, q, tol, n_steps)
    fused = doubling_fn("fused", stop, a.dtype.name, q.dtype.name, mode)
    ref = doubling_fn("scan", stop, a.dtype.name, q.dtype.name)
    for name, x, y in zip(("alpha", "gamma", "dA", "dQ"), fused(*args, wa, wg), ref(*args, wa, wg)):
        assert_close(x, y, rtol, name)


def check_fixed_point(a, q, x0, tol, n_steps, stop, rtol=1e-11, rng=None, mode=None):
    rng = rng or np.random.default_rng(0)
    w = rng.normal(size=q.shape).astype(a.dtype)
    args = (a, q, x0, tol, n_steps, w)
    fused = fixed_point_fn("fused", stop, a.dtype.name, mode)
    ref = fixed_point_fn("scan", stop, a.dtype.name)
    for name, x, y in zip(("X", "dA", "dQ", "dX0"), fused(*args), ref(*args)):
        assert_close(x, y, rtol, name)


# ---------------------------------------------------------------------------
# Values and gradients against the Scan
# ---------------------------------------------------------------------------


@settings(max_examples=20)
@given(
    m=st.integers(1, 5),
    rho=st.floats(0.05, 0.98),
    seed=st.integers(0, 2**32 - 1),
    stop=st.sampled_from(STOPS),
)
def test_random_stable_matches_scan(m, rho, seed, stop):
    rng = np.random.default_rng(seed)
    a, q, x0 = stable(rng, m, rho), spd(rng, m), rng.normal(size=(m, m))
    check_doubling(a, q, 1e-10, 60, stop, rng=rng)
    check_fixed_point(a, q, x0, 1e-9, 1000, stop, rtol=1e-10, rng=rng)


_ENTRY = st.one_of(st.floats(-1e-3, 1e-3), st.sampled_from([0.0, 1e-10, -1e-10, np.nan, np.inf, -np.inf, 1e300]))


@settings(max_examples=300, deadline=None)
@given(new=st.lists(_ENTRY, min_size=6, max_size=6), old=st.lists(_ENTRY, min_size=6, max_size=6),
       tol=st.sampled_from([1e-10, 1e-4, 0.0, -1.0, np.nan, np.inf]), stop=st.sampled_from(["max_lt", "max_le"]),
       dtype=st.sampled_from(["float32", "float64"]))
def test_max_stop_rule_matches_numpy(new, old, tol, stop, dtype):
    """The kernels' max-abs stop test is the user's ``pt.max(pt.abs(new - old)) < tol`` (or ``<=``) as NumPy
    computes it (the change in the loop dtype, compared in float64; a NaN change, or an inf one, never stops)."""
    from iterops.linalg.lyapunov_iteration import _STOPS, _stopped

    new, old = np.array(new, dtype=dtype).reshape(2, 3), np.array(old, dtype=dtype).reshape(2, 3)
    with np.errstate(invalid="ignore", over="ignore"):
        change = np.float64(np.max(np.abs(new - old)))
    assert _stopped(new, old, tol, _STOPS[stop]) == bool(change < tol if stop == "max_lt" else change <= tol)


@pytest.mark.parametrize("stop", STOPS)
def test_stop_kinds_on_exact_arithmetic(stop):
    """A = I/2, Q = I, X0 = 0: every iterate and change is exact in binary, so each stop rule
    takes a known number of steps: X_K = sum_{j<K} 4^-j, change 4^-(K-1); tol = 1/64."""
    a, q, x0 = 0.5 * np.eye(2), np.eye(2), np.zeros((2, 2))
    n_steps = 12
    expected_steps = {"max_lt": 5, "max_le": 4, "fro_lt": 5, None: n_steps}[stop]
    X = fixed_point_fn("scan", stop)(a, q, x0, 1 / 64, n_steps, np.ones((2, 2)))[0]
    np.testing.assert_array_equal(X, sum(0.25**j for j in range(expected_steps)) * np.eye(2))
    check_fixed_point(a, q, x0, 1 / 64, n_steps, stop, rtol=1e-14)
    check_doubling(a, q, 1 / 2**20, n_steps, stop, rtol=1e-15)


def test_unit_root_unexcited_by_q():
    """The loop keeps X0's 1e6 on the unit root; the solution of the equation does not exist uniquely."""
    a, q, x0 = np.diag([1.0, 0.5]), np.diag([0.0, 1.0]), 1e6 * np.eye(2)
    X = fixed_point_fn("fused", "max_lt")(a, q, x0, 1e-9, 1000, np.ones((2, 2)))[0]
    np.testing.assert_allclose(X, np.diag([1e6, 4 / 3]), rtol=0, atol=1e-9)
    for stop in STOPS:
        check_fixed_point(a, q, x0, 1e-9, 1000, stop)
        check_doubling(a, q, 1e-12, 100, stop)


def test_rotation():
    c, s = np.cos(0.3), np.sin(0.3)
    a = np.array([[c, -s], [s, c]])
    x = fixed_point_fn("fused", "max_lt")(a, np.zeros((2, 2)), np.eye(2), 1e-12, 100, np.ones((2, 2)))[0]
    np.testing.assert_allclose(x, np.eye(2), atol=1e-15)
    for stop in STOPS:
        check_fixed_point(a, np.zeros((2, 2)), np.eye(2), 1e-12, 100, stop)
        # alpha_k = R^(2^k) doubles the angle, and its rounding error, at every step (the loop is
        # chaotic): after 20 steps two implementations differ by ~2^20 eps.
        check_doubling(a, np.zeros((2, 2)), 1e-12, 20, stop, rtol=1e-8)  # stops at once unless stop is None
        check_doubling(a, np.eye(2), 1e-12, 20, stop, rtol=1e-8)  # gamma_k = 2^k I: hits the guard


def test_multi_scale():
    a, q = np.diag([0.0, 0.9999]), np.diag([1.0, 1e-10])
    check_doubling(a, q, 1e-15, 100, "max_lt", rtol=1e-12)
    check_fixed_point(a, q, np.zeros((2, 2)), 1e-15, 100_000, "max_lt", rtol=1e-10)


@pytest.mark.parametrize("stop", ["max_lt", "fro_lt"])
def test_guard_hit_before_convergence(stop, rng):
    a, q, x0 = stable(rng, 4, 0.95), spd(rng, 4), np.zeros((4, 4))
    check_fixed_point(a, q, x0, 1e-12, 25, stop)
    check_doubling(a, q, 1e-300, 3, stop)


def test_zero_and_one_step(rng):
    """n_steps = 0 returns the initial values (the Scan cannot index its empty result); 1 is one step."""
    a, q, x0, w = stable(rng, 3, 0.9), spd(rng, 3), rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    for n_steps in (0, -3):
        alpha, gamma, dA, dQ = doubling_fn("fused", "max_lt")(a, q, 1e-10, n_steps, w, 2 * w)
        for x, y in ((alpha, a), (gamma, q), (dA, w), (dQ, 2 * w)):
            np.testing.assert_array_equal(x, y)
        X, dA, dQ, dX0 = fixed_point_fn("fused", "max_lt")(a, q, x0, 1e-10, n_steps, w)
        for x, y in ((X, x0), (dA, 0 * w), (dQ, 0 * w), (dX0, w)):
            np.testing.assert_array_equal(x, y)
    X, dA, dQ, dX0 = fixed_point_fn("fused", "max_lt")(a, q, x0, 1e-10, 1, w)
    np.testing.assert_allclose(X, a @ x0 @ a.T + q, rtol=1e-14)
    np.testing.assert_allclose(dA, w @ a @ x0.T + w.T @ a @ x0, rtol=1e-13)
    np.testing.assert_allclose(dX0, a.T @ w @ a, rtol=1e-13)
    np.testing.assert_array_equal(dQ, w)
    for stop in STOPS:
        check_doubling(a, q, 1e-10, 1, stop)
        check_fixed_point(a, q, x0, 1e-10, 1, stop)


@pytest.mark.parametrize("tol", [-1.0, np.nan])
def test_tol_negative_or_nan_never_stops(tol, rng):
    a, q, x0 = stable(rng, 3, 0.5), spd(rng, 3), np.zeros((3, 3))
    for stop in STOPS:
        check_doubling(a, q, tol, 40, stop)
        check_fixed_point(a, q, x0, tol, 300, stop)


def test_unstable_a_overflows_like_the_loop(rng):
    a, q, x0 = stable(rng, 3, 1.5), spd(rng, 3), np.eye(3)
    assert not np.all(np.isfinite(doubling_fn("fused", "max_lt")(a, q, 1e-10, 20, q, q)[1]))
    for stop in STOPS:
        check_doubling(a, q, 1e-10, 20, stop)
        check_fixed_point(a, q, x0, 1e-10, 1000, stop)


@pytest.mark.parametrize("stop", STOPS)
def test_float32(stop, rng):
    """Computed in float32 like the loop.  tol sits well above float32 rounding of the change, so
    both stop at the same step; alpha = A^(2^k) doubles its relative rounding error each step."""
    a, q, x0 = (x.astype("float32") for x in (stable(rng, 3, 0.8), spd(rng, 3), rng.normal(size=(3, 3))))
    check_doubling(a, q, 1e-3, 30, stop, rtol=1e-4)
    check_fixed_point(a, q, x0, 1e-3, 100, stop, rtol=1e-5)


def test_mixed_float32_a_float64_q(rng):
    """alpha stays float32 (as in the Scan), gamma is float64."""
    a, q = stable(rng, 3, 0.8).astype("float32"), spd(rng, 3)
    check_doubling(a, q, 1e-12, 30, "max_lt", rtol=1e-4)


@pytest.mark.parametrize("mode", ["NUMBA", "CVM", "FAST_COMPILE"])
def test_every_linker(mode, rng):
    a, q, x0 = stable(rng, 3, 0.9), spd(rng, 3), rng.normal(size=(3, 3))
    check_doubling(a, q, 1e-10, 60, "max_lt", rng=rng, mode=mode)
    check_fixed_point(a, q, x0, 1e-9, 1000, "max_lt", rng=rng, mode=mode)


# ---------------------------------------------------------------------------
# Gradient plumbing: one output used, tol, n_steps, finite differences
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("used", ["alpha", "gamma"])
def test_doubling_one_output_used(used, rng):
    a, q = stable(rng, 3, 0.9), spd(rng, 3)
    A, Q, tol, n = pt.dmatrix("A"), pt.dmatrix("Q"), pt.dscalar("tol"), pt.lscalar("n")
    results = []
    for loop, mode in ((scan_doubling, REF_MODE), (smith_doubling_loop, None)):
        alpha, gamma = loop(A, Q, tol, n, "max_lt")
        out = alpha if used == "alpha" else gamma
        cost = (out**2).sum()
        if used == "alpha":
            with pytest.raises(DisconnectedInputError):
                pytensor.grad(cost, Q)
            grads = pytensor.grad(cost, [A])
        else:
            grads = pytensor.grad(cost, [A, Q])
        results.append(pytensor.function([A, Q, tol, n], [out, *grads], mode=mode)(a, q, 1e-10, 50))
    for x, y in zip(*reversed(results)):
        assert_close(x, y, 1e-11)


def test_tol_gradient_is_zero_and_n_steps_disconnected(rng):
    A, Q, X0, tol, n = pt.dmatrix("A"), pt.dmatrix("Q"), pt.dmatrix("X0"), pt.dscalar("tol"), pt.lscalar("n")
    alpha, gamma = smith_doubling_loop(A, Q, tol, n)
    X = lyapunov_fixed_point_loop(A, Q, X0, tol, n)
    cost = gamma.sum() + alpha.sum() + X.sum()
    g_tol = pytensor.grad(cost, tol)
    a, q = stable(rng, 2, 0.5), spd(rng, 2)
    f = pytensor.function([A, Q, X0, tol, n], g_tol, on_unused_input="ignore")
    assert f(a, q, q, 1e-8, 100) == 0.0
    with pytest.raises(DisconnectedInputError):
        pytensor.grad(cost, n)


@pytest.mark.parametrize("stop", [None, "max_lt"])
def test_verify_grad(stop, rng):
    a, q, x0 = stable(rng, 3, 0.7), spd(rng, 3), rng.normal(size=(3, 3))
    # tol far from every step's change, so finite differences do not move the stop
    verify_grad(lambda A, Q: pt.stack(smith_doubling_loop(A, Q, 1e-3, 8, stop)), [a, q], rng=rng)
    verify_grad(lambda A, Q, X0: lyapunov_fixed_point_loop(A, Q, X0, 1e-3, 12, stop), [a, q, x0], rng=rng)


def test_verify_grad_batched_broadcast(rng):
    a = np.stack([stable(rng, 2, 0.6) for _ in range(3)])
    q = spd(rng, 2)[None]
    verify_grad(lambda A, Q: pt.stack(smith_doubling_loop(A, Q, 0.0, 4, None)), [a, q], rng=rng)
    verify_grad(lambda A, Q: lyapunov_fixed_point_loop(A, Q, Q, 0.0, 6, None), [a, q], rng=rng)


# ---------------------------------------------------------------------------
# Batching, native Numba, validation
# ---------------------------------------------------------------------------


def test_batched_equals_loop_over_batch(rng):
    b, m = 3, 3
    a = np.stack([stable(rng, m, rho) for rho in (0.3, 0.9, 0.99)])
    q, x0 = spd(rng, m), rng.normal(size=(b, m, m))
    tols, n_steps = np.array([1e-10, 1e-6, 1e-12]), 200
    wa, wg = rng.normal(size=(b, m, m)), rng.normal(size=(b, m, m))

    A, X0, Wa, Wg = pt.dtensor3("A"), pt.dtensor3("X0"), pt.dtensor3("Wa"), pt.dtensor3("Wg")
    Q, tol, n = pt.dmatrix("Q"), pt.dvector("tol"), pt.lscalar("n")
    alpha, gamma = smith_doubling_loop(A, Q, tol, n)
    X = lyapunov_fixed_point_loop(A, Q, X0, tol, n)
    cost = (alpha * Wa).sum() + (gamma * Wg).sum()
    f = pytensor.function([A, Q, X0, tol, n, Wa, Wg],
                          [alpha, gamma, *pytensor.grad(cost, [A, Q]), X, *pytensor.grad((X * Wa).sum(), [A, Q, X0])])
    got = f(a, q, x0, tols, n_steps, wa, wg)

    ref_d = [doubling_fn("scan", "max_lt")(a[i], q, tols[i], n_steps, wa[i], wg[i]) for i in range(b)]
    ref_f = [fixed_point_fn("scan", "max_lt")(a[i], q, x0[i], tols[i], n_steps, wa[i]) for i in range(b)]
    expected = [
        np.stack([r[0] for r in ref_d]), np.stack([r[1] for r in ref_d]),
        np.stack([r[2] for r in ref_d]), sum(r[3] for r in ref_d),  # Q broadcast: its gradient sums
        np.stack([r[0] for r in ref_f]), np.stack([r[1] for r in ref_f]),
        sum(r[2] for r in ref_f), np.stack([r[3] for r in ref_f]),
    ]
    for x, y in zip(got, expected):
        assert_close(x, y, 1e-10)


def test_default_mode_runs_natively(rng):
    """Compiles in the default (Numba) mode, batched and not, gradients included; object mode
    would be an error (pyproject's filterwarnings).  The graph holds the fused Ops, no Scan."""
    A, Q, tol, n = pt.tensor3("A"), pt.dmatrix("Q"), pt.dscalar("tol"), pt.lscalar("n")
    for A_ in (A, A[0]):
        alpha, gamma = smith_doubling_loop(A_, Q, tol, n, "fro_lt")
        X = lyapunov_fixed_point_loop(A_, Q, Q, tol, n, "max_le")
        cost = gamma.sum() + alpha.sum() + X.sum()
        f = pytensor.function([A, Q, tol, n], [gamma, X, *pytensor.grad(cost, [A, Q])], mode="NUMBA")
        assert not any(isinstance(node.op, Scan) for node in f.maker.fgraph.apply_nodes)
        out = f(np.stack([stable(rng, 2, 0.5)] * 2), spd(rng, 2), 1e-8, 50)
        assert all(np.all(np.isfinite(o)) for o in out)


def test_static_shapes_and_dtypes():
    alpha, gamma = smith_doubling_loop(pt.tensor("A", shape=(5, 3, 3), dtype="float32"), np.eye(3), 1e-6, 10)
    assert alpha.type.shape == (5, 3, 3) and alpha.dtype == "float32" and gamma.dtype == "float64"
    X = lyapunov_fixed_point_loop(np.eye(2, dtype="int64"), np.eye(2), np.eye(2, dtype="float32"), 0.1, 3)
    assert X.dtype == "float64" and X.type.shape == (2, 2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(A=np.zeros((2, 3))), ValueError, r"A must be square.*\(2, 3\)"),
        (dict(Q=np.eye(3)), ValueError, "A and Q must have the same m.*A has 2 but Q has 3"),
        (dict(X0=np.eye(3)), ValueError, "A and X0 must have the same m"),
        (dict(A=np.zeros(2)), ValueError, "A must have at least 2 dimensions.*ndim 1"),
        (dict(n_steps=10.0), TypeError, "n_steps must be an integer, got n_steps with dtype float"),
        (dict(tol=1j), TypeError, "tol must be real"),
        (dict(Q=np.eye(2) * 1j), TypeError, "complex Q is not supported"),
        (dict(stop="max"), ValueError, "stop must be one of"),
    ],
)
def test_validation_errors(kwargs, error, match):
    args = dict(A=np.eye(2), Q=np.eye(2), X0=np.eye(2), tol=1e-8, n_steps=10) | kwargs
    with pytest.raises(error, match=match):
        lyapunov_fixed_point_loop(**args)
    args.pop("X0")
    if "X0" not in kwargs:
        with pytest.raises(error, match=match):
            smith_doubling_loop(**args)


# ---------------------------------------------------------------------------
# The damped fixed point (``w=``): against the user's damped Scan and finite differences
# ---------------------------------------------------------------------------

DAMPED_UPDATES = {
    "convex": lambda X, A, Q, w: (1 - w) * X + w * (A @ X @ A.T + Q),
    "increment": lambda X, A, Q, w: X + w * (A @ X @ A.T + Q - X),
}




@cache
def damped_fn(impl, damping, stop, dtype="float64", mode=None):
    """f(A, Q, X0, w, tol, n_steps, W) -> X, dC/dA, dC/dQ, dC/dX0, dC/dw with C = <W, X>."""
    A, Q, X0 = (pt.matrix(name, dtype=dtype) for name in ("A", "Q", "X0"))
    w, tol, n = pt.scalar("w", dtype=dtype), pt.dscalar("tol"), pt.lscalar("n_steps")
    if impl == "scan":
        rule, update = STOP_RULES[stop], DAMPED_UPDATES[damping]

        def step(X, A, Q, w, tol):
            X_new = update(X, A, Q, w)
            return X_new if rule is None else (X_new, until(rule(X_new, X, tol)))

        X = ref.damped_fixed_point_loop(A, Q, w, X0, tol, n, step=step)
    else:
        X = lyapunov_fixed_point_loop(A, Q, X0, tol, n, stop, w=w, damping=damping)
    W = pt.matrix("W", dtype=X.dtype)
    mode = REF_MODE if impl == "scan" else mode
    return pytensor.function([A, Q, X0, w, tol, n, W], [X, *pytensor.grad((X * W).sum(), [A, Q, X0, w])],
                             mode=mode)


def check_damped(a, q, x0, w, tol, n_steps, stop, damping, rtol=1e-11, mode=None):
    wt = np.random.default_rng(0).normal(size=q.shape).astype(a.dtype)
    args = (a, q, x0, np.asarray(w, dtype=a.dtype), tol, n_steps, wt)
    fused = damped_fn("fused", damping, stop, a.dtype.name, mode)
    want = damped_fn("scan", damping, stop, a.dtype.name)
    got, expected = fused(*args), want(*args)
    for name, x, y in zip(("X", "dA", "dQ", "dX0"), got, expected):
        assert_close(x, y, rtol, name)
    # w_bar sums <W_k, Y_k - X_k> over the steps, which cancel near convergence (the Scan sums <W, Y> and
    # <W, X> apart): equal to rtol on the scale of its terms, not of the (possibly tiny) sum
    scale = np.abs(wt).sum() * max(1.0, np.abs(x0).max(), np.abs(expected[0]).max())
    np.testing.assert_allclose(got[4], expected[4], rtol=rtol, atol=10 * rtol * scale, err_msg="dw")


@settings(max_examples=15)
@given(
    m=st.integers(1, 4),
    rho=st.floats(0.05, 0.95),
    w=st.sampled_from([0.0, 1e-8, 0.3, 1.0, 1.6]),
    seed=st.integers(0, 2**32 - 1),
    stop=st.sampled_from(STOPS),
    damping=st.sampled_from(["convex", "increment"]),
)
def test_damped_matches_the_damped_scan(m, rho, w, seed, stop, damping):
    rng = np.random.default_rng(seed)
    n_steps = 40 if stop is None or w < 0.1 else 2000
    check_damped(stable(rng, m, rho), spd(rng, m), rng.normal(size=(m, m)), w, 1e-10, n_steps, stop, damping,
                 rtol=1e-9, mode="FAST_COMPILE")


@pytest.mark.parametrize("damping", ["convex", "increment"])
def test_damped_unit_root_far_start_and_nonfinite_start(damping):
    """An unexcited unit root keeps X0's part; ``w = 1`` with an inf in ``X0`` is NaN where ``0 * inf`` is
    (the damped loop, not the undamped one)."""
    a, q = np.diag([1.0, 0.5]), np.diag([0.0, 1.0])
    check_damped(a, q, 1e6 * np.eye(2), 0.5, 1e-12, 5000, "max_lt", damping, mode="FAST_COMPILE")
    x0 = np.array([[np.inf, 0.0], [0.0, 1.0]])
    X = lyapunov_fixed_point_loop(a, q, x0, 1e-12, 3, w=1.0, damping=damping).eval(mode="FAST_COMPILE")
    Xs = x0
    for _ in range(3):  # the loop in NumPy: (1 - 1) * inf is NaN
        Y = a @ Xs @ a.T + q
        Xs = (1 - 1.0) * Xs + 1.0 * Y if damping == "convex" else Xs + 1.0 * (Y - Xs)
    np.testing.assert_array_equal(np.isnan(X), np.isnan(Xs))
    assert np.isnan(X[0, 0])


def test_damped_float32_and_default_mode(rng):
    a, q, x0 = stable(rng, 3, 0.8), spd(rng, 3), rng.normal(size=(3, 3))
    check_damped(a, q, x0, 0.7, 1e-10, 3000, "max_lt", "convex", mode="NUMBA")
    a32, q32, x32 = (v.astype("float32") for v in (a, q, x0))
    check_damped(a32, q32, x32, 0.7, 1e-5, 300, "fro_lt", "increment", rtol=2e-5, mode="FAST_COMPILE")


def test_damped_verify_grad(rng):
    a, q, x0 = stable(rng, 3, 0.7), spd(rng, 3), rng.normal(size=(3, 3))
    for damping in ("convex", "increment"):
        verify_grad(lambda A, Q, X0, w: lyapunov_fixed_point_loop(A, Q, X0, 1e-3, 12, None, w=w, damping=damping),
                    [a, q, x0, np.array(0.6)], rng=rng)
    # batched w (Blockwise): one factor per system
    verify_grad(lambda A, w: lyapunov_fixed_point_loop(A, q, x0, 0.0, 6, None, w=w),
                [np.stack([a, 0.5 * a]), np.array([0.4, 1.2])], rng=rng)


def test_damped_validation_errors():
    with pytest.raises(ValueError, match="damping must be 'convex' or 'increment'"):
        lyapunov_fixed_point_loop(np.eye(2), np.eye(2), np.eye(2), 1e-8, 10, w=0.5, damping="relaxed")
    with pytest.raises(TypeError, match="w must be real, got w with dtype complex128"):
        lyapunov_fixed_point_loop(np.eye(2), np.eye(2), np.eye(2), 1e-8, 10, w=0.5j)


@pytest.mark.parametrize("damping", [None, "convex"])
def test_value_and_gradient_share_one_run_of_the_loop(damping, rng):
    """The default mode's graph, value and gradient of the fixed-point loop: one traced run of the loop read by
    the reverse pass (no second run), values and gradients those of the user's Scan: a loop stopped by its
    tolerance after more steps than the trace's first buffer holds (it grows), one hitting its guard, one
    step (the Scan's ``Xs[-1]`` of zero steps raises), float32."""
    from iterops.linalg.lyapunov_iteration import LyapunovFixedPointLoopGrad, LyapunovFixedPointTrace

    for dtype, tol, n_steps, rtol in (("float64", 1e-10, 3000, 1e-10), ("float64", 0.0, 7, 1e-12),
                                      ("float64", 1e-10, 1, 1e-14), ("float32", 1e-3, 100, 1e-5)):  # as test_float32 (a tie at tol moves the stop)
        a, q, x0 = (v.astype(dtype) for v in (stable(rng, 3, 0.9), spd(rng, 3), rng.normal(size=(3, 3))))
        if damping is None:
            f, want = fixed_point_fn("fused", "max_lt", dtype), fixed_point_fn("scan", "max_lt", dtype)
            wt = rng.normal(size=(3, 3)).astype(dtype)
            got, expected = f(a, q, x0, tol, n_steps, wt), want(a, q, x0, tol, n_steps, wt)
            for name, x, y in zip(("X", "dA", "dQ", "dX0"), got, expected):
                assert_close(x, y, rtol, name)
        else:
            f = damped_fn("fused", damping, "max_lt", dtype, None)  # the function check_damped compiles
            check_damped(a, q, x0, 0.7, tol, n_steps, "max_lt", damping, rtol=max(rtol, 1e-14))
        ops = [type(node.op) for node in f.maker.fgraph.apply_nodes]
        assert LyapunovFixedPointTrace in ops and LyapunovFixedPointLoopGrad not in ops, ops
        assert sum(op.__name__.startswith("LyapunovFixedPoint") for op in ops) == 2, ops


@pytest.mark.parametrize("bad, name", [("Ga", "alpha cotangent"), ("Gg", "gamma cotangent")])
def test_doubling_gradient_cotangent_shape_error_names_which(bad, name):
    """A wrongly shaped cotangent reaching the doubling's gradient Op at run time raises before its pointer crosses
    the C-ABI, naming which cotangent (of alpha or of gamma) it is; oracle: the shapes given."""
    from iterops.linalg.lyapunov_iteration import SmithDoublingLoopGrad

    A, Q, Ga, Gg = (pt.dmatrix(k) for k in ("A", "Q", "Ga", "Gg"))
    f = pytensor.function([A, Q, Ga, Gg], SmithDoublingLoopGrad("max_lt")(A, Q, 1e-9, 50, Ga, Gg))
    args = {"A": 0.5 * np.eye(3), "Q": np.eye(3), "Ga": np.ones((3, 3)), "Gg": np.ones((3, 3))}
    args[bad] = np.ones((3, 2))
    with pytest.raises(ValueError, match=f"{name} must have shape .* got {name} with shape \\(3, 2\\)"):
        f(**args)
