"""solve_discrete_are against scipy, finite differences and the Kalman steady state."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg as sla
from hypothesis import given
from hypothesis import strategies as st
from pytensor.gradient import verify_grad

from iterops.linalg import solve_discrete_are

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

# Gradient checks compile several graphs: the Python linker (whose perform runs the same Numba
# kernel); every linker is covered by test_dtype.
FAST = "FAST_COMPILE"


def system(rng, n, m, scale=1.0):
    """A random system (stabilisable almost surely: B is dense), SPD Q and R."""
    a = scale * rng.normal(size=(n, n))
    b = rng.normal(size=(n, m))
    q = rng.normal(size=(n, n))
    r = rng.normal(size=(m, m))
    return a, b, q @ q.T + np.eye(n), r @ r.T + np.eye(m)


def relative_error(x, ref):
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


@pytest.fixture(scope="module")
def solver():
    A, B, Q, R = pt.dmatrix("A"), pt.dmatrix("B"), pt.dmatrix("Q"), pt.dmatrix("R")
    return pytensor.function([A, B, Q, R], solve_discrete_are(A, B, Q, R))


@pytest.mark.parametrize("n, m", [(1, 1), (3, 1), (4, 2), (8, 3), (15, 15)])
@pytest.mark.parametrize("scale", [0.5, 1.0])
def test_matches_scipy(solver, rng, n, m, scale):
    """Unstable A too (scale 1: spectral radius about sqrt(n)): the stabilising solution."""
    a, b, q, r = system(rng, n, m, scale)
    x = solver(a, b, q, r)
    ref = sla.solve_discrete_are(a, b, q, r)
    assert relative_error(x, ref) < 1e-9
    np.testing.assert_array_equal(x, x.T)
    k = np.linalg.solve(r + b.T @ x @ b, b.T @ x @ a)
    assert np.max(np.abs(np.linalg.eigvals(a - b @ k))) < 1.0


@given(
    n=st.integers(1, 6),
    m=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_scipy_random_systems(solver, n, m, seed):
    a, b, q, r = system(np.random.default_rng(seed), n, m)
    ref = sla.solve_discrete_are(a, b, q, r)
    assert relative_error(solver(a, b, q, r), ref) < 1e-8


def test_is_the_kalman_filter_steady_state(rng):
    """X is the limit of the Kalman filter's predicted-covariance recursion (A = T^T, B = Z^T)."""
    n, p = 3, 2
    T = 0.9 * rng.normal(size=(n, n)) / np.sqrt(n)
    Z = rng.normal(size=(p, n))
    W, V = np.eye(n), 0.5 * np.eye(p)
    P = np.eye(n)
    for _ in range(2000):
        F = Z @ P @ Z.T + V
        P = T @ (P - P @ Z.T @ np.linalg.solve(F, Z @ P)) @ T.T + W
    x = solve_discrete_are(T.T, Z.T, W, V).eval()
    np.testing.assert_allclose(x, P, rtol=1e-10, atol=1e-12)


def test_no_control_is_the_lyapunov_equation(rng):
    """B with zero columns: X = A^T X A + Q (scipy's Lyapunov solver with A^T)."""
    a = rng.normal(size=(4, 4))
    a *= 0.9 / np.max(np.abs(np.linalg.eigvals(a)))
    q = np.eye(4)
    x = solve_discrete_are(a, np.zeros((4, 0)), q, np.zeros((0, 0))).eval()
    np.testing.assert_allclose(x, sla.solve_discrete_lyapunov(a.T, q), rtol=1e-10)


@pytest.mark.parametrize(
    "case",
    ["unstabilisable", "singular_R", "nan_input"],
)
def test_failure_is_nan(solver, case):
    a, b, q, r = np.diag([1.5, 0.5]), np.array([[0.0], [1.0]]), np.eye(2), np.eye(1)
    if case == "singular_R":
        b, r = np.ones((2, 2)), np.zeros((2, 2))
    if case == "nan_input":
        q = np.array([[1.0, np.nan], [np.nan, 1.0]])
    assert np.all(np.isnan(solver(a, b, q, r)))


def test_symmetric_parts_of_q_and_r(solver, rng):
    a, b, q, r = system(rng, 3, 2)
    skew_q, skew_r = rng.normal(size=(3, 3)), rng.normal(size=(2, 2))
    x = solver(a, b, q + skew_q - skew_q.T, r + skew_r - skew_r.T)
    assert relative_error(x, sla.solve_discrete_are(a, b, q, r)) < 1e-9


def test_batched_broadcasts_like_a_loop(rng):
    systems = [system(rng, 3, 2) for _ in range(4)]
    a, b, q, r = (np.stack(x) for x in zip(*systems))
    x = solve_discrete_are(a, b, q[0], r).eval()  # Q broadcast over the batch
    for i in range(4):
        assert relative_error(x[i], sla.solve_discrete_are(a[i], b[i], q[0], r[i])) < 1e-9


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dtype(mode, rng, dtype):
    a, b, q, r = (x.astype(dtype) for x in system(rng, 3, 2))
    A, B, Q, R = (pt.matrix(name, dtype=dtype) for name in "ABQR")
    X = solve_discrete_are(A, B, Q, R)
    assert X.type.dtype == dtype
    x = pytensor.function([A, B, Q, R], X, mode=mode)(a, b, q, r)
    ref = sla.solve_discrete_are(*(v.astype("float64") for v in (a, b, q, r)))
    assert relative_error(x, ref) < (1e-6 if dtype == "float32" else 1e-9)


def test_gradient_verify_grad(rng):
    """Finite differences of the solver itself (Q, R kept symmetric positive definite)."""
    a, b, q, r = system(rng, 3, 2, scale=0.7)

    def f(A, B, Q, R):
        return solve_discrete_are(A, B, Q @ Q.T + pt.eye(3), R @ R.T + pt.eye(2))

    args = [a, b, np.linalg.cholesky(q - np.eye(3) + 0.1 * np.eye(3)), np.eye(2)]
    verify_grad(f, args, rng=rng, eps=1e-7, mode=FAST)


def test_gradient_matches_scipy_finite_differences(rng):
    """Directional derivative of a weighted sum of X against central differences of scipy's solver."""
    a, b, q, r = system(rng, 4, 2)
    w = rng.normal(size=(4, 4))
    A, B, Q, R = (pt.dmatrix(name) for name in "ABQR")
    cost = (pt.as_tensor(w) * solve_discrete_are(A, B, Q, R)).sum()
    grads = pytensor.function([A, B, Q, R], pytensor.grad(cost, [A, B, Q, R]), mode=FAST)(a, b, q, r)
    dirs = [rng.normal(size=v.shape) for v in (a, b, q, r)]
    dirs[2], dirs[3] = dirs[2] + dirs[2].T, dirs[3] + dirs[3].T  # symmetric directions for Q, R
    eps = 1e-6
    plus = sla.solve_discrete_are(*(v + eps * d for v, d in zip((a, b, q, r), dirs)))
    minus = sla.solve_discrete_are(*(v - eps * d for v, d in zip((a, b, q, r), dirs)))
    fd = np.sum(w * (plus - minus)) / (2 * eps)
    got = sum(np.sum(g * d) for g, d in zip(grads, dirs))
    np.testing.assert_allclose(got, fd, rtol=1e-6)


def test_forward_mode_matches_reverse(rng):
    a, b, q, r = system(rng, 3, 2, scale=0.7)
    A, B, Q, R = (pt.dmatrix(name) for name in "ABQR")
    X = solve_discrete_are(A, B, Q, R)
    dA = pt.dmatrix("dA")
    jvp = pytensor.gradient.pushforward(X, A, dA)
    w = rng.normal(size=(3, 3))
    g = pytensor.grad((pt.as_tensor(w) * X).sum(), A)
    f = pytensor.function([A, B, Q, R, dA], [(pt.as_tensor(w) * jvp).sum(), (g * dA).sum()], mode=FAST)
    fwd, rev = f(a, b, q, r, rng.normal(size=(3, 3)))
    np.testing.assert_allclose(fwd, rev, rtol=1e-9)


def test_graph_time_validation():
    with pytest.raises(ValueError, match="solve_discrete_are: A must be square"):
        solve_discrete_are(np.zeros((2, 3)), np.zeros((2, 1)), np.eye(2), np.eye(1))
    with pytest.raises(ValueError, match="R must be .m, m. for B of shape"):
        solve_discrete_are(np.eye(2), np.zeros((2, 1)), np.eye(2), np.eye(2))
    with pytest.raises(ValueError, match="same n"):
        solve_discrete_are(np.eye(2), np.zeros((3, 1)), np.eye(2), np.eye(1))
    with pytest.raises(TypeError, match="complex Q"):
        solve_discrete_are(np.eye(2), np.zeros((2, 1)), np.eye(2) * 1j, np.eye(1))


def test_zero_size():
    x = solve_discrete_are(np.zeros((0, 0)), np.zeros((0, 2)), np.zeros((0, 0)), np.eye(2)).eval()
    assert x.shape == (0, 0)


def assert_entries_close(x, ref, rtol):
    """Every entry within ``rtol`` of its own scale ``sqrt(|ref_ii ref_jj|)`` (scale-free)."""
    d = np.sqrt(np.abs(np.diag(ref)))
    err = np.abs(x - ref) / np.outer(d, d)
    assert np.max(err) <= rtol, f"{np.max(err):.3g} relative to the entry's scale"


def test_multiscale_solution_is_converged_in_every_entry(solver):
    """X ~ diag(1e8, 1e-8): the small entry converges slowly (closed loop 0.999), the large one at once.  A
    stop test relative to the largest entry stopped when the large entry had converged, returning the small
    one unconverged; every entry against scipy on its own scale."""
    a, b, q, r = np.diag([0.5, 0.999]), np.eye(2), np.diag([1e8, 1e-8]), np.eye(2)
    assert_entries_close(solver(a, b, q, r), sla.solve_discrete_are(a, b, q, r), 1e-9)


@given(seed=st.integers(0, 2**32 - 1), log_d=st.lists(st.floats(-6.0, 6.0), min_size=4, max_size=4))
def test_rescaled_states_give_the_rescaled_solution(solver, seed, log_d):
    """States rescaled by D (``A -> D A D^-1``, ``B -> D B``, ``Q -> D^-1 Q D^-1``): the solution is
    ``D^-1 X D^-1`` with X scipy's on the unscaled system, entry by entry on its own scale."""
    a, b, q, r = system(np.random.default_rng(seed), 4, 2, 0.5)
    D = 10.0 ** np.array(log_d)
    Di = 1.0 / D
    x = solver(D[:, None] * a * Di, D[:, None] * b, Di[:, None] * q * Di, r)
    assert_entries_close(x, Di[:, None] * sla.solve_discrete_are(a, b, q, r) * Di, 1e-8)


def test_indefinite_q_converges_like_scipy(solver):
    """An indefinite Q (a negative variance on the iterate's diagonal) converges: the per-entry stop test
    takes the magnitudes of both variances (the square root of a negative one would never pass)."""
    a = np.array([[0.5, 0.2], [0.0, 0.3]])
    b = np.eye(2)
    q = np.diag([1.0, -0.05])
    r = np.eye(2)
    ref = sla.solve_discrete_are(a, b, q, r)
    assert ref[1, 1] < 0  # the iterate's second variance is negative
    np.testing.assert_allclose(solver(a, b, q, r), ref, rtol=1e-10, atol=1e-12)
