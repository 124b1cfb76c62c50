"""solve_discrete_lyapunov against scipy, finite differences and dense formulas."""

import pickle

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import quantecon
import scipy.linalg as sla
from hypothesis import given
from hypothesis import strategies as st
from pytensor.gradient import verify_grad

from conftest import SCAN_ORACLE, spd, stable
from iterops import solve_discrete_lyapunov
from iterops.reference_loops import doubling_loop
from iterops.linalg.lyapunov import DiscreteLyapunov

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

METHODS = ["auto", "doubling", "schur"]


def rel_residual(a, q, x):
    r = a @ x @ a.conj().T - x + q
    return np.linalg.norm(r) / (np.linalg.norm(a) ** 2 * np.linalg.norm(x) + np.linalg.norm(x) + np.linalg.norm(q))


@pytest.fixture(scope="module")
def solvers():
    A, Q = pt.matrix("A"), pt.matrix("Q")
    return {m: pytensor.function([A, Q], solve_discrete_lyapunov(A, Q, method=m)) for m in METHODS}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1, 4, 20, 100])
@pytest.mark.parametrize("rho", [0.5, 0.9, 0.999])
def test_matches_scipy_and_small_residual(solvers, method, n, rho, rng):
    a, q = stable(rng, n, rho), spd(rng, n)
    x = solvers[method](a, q)
    ref = sla.solve_discrete_lyapunov(a, q)
    assert rel_residual(a, q, x) <= 1e-10
    np.testing.assert_allclose(x, ref, rtol=1e-8, atol=1e-8 * np.max(np.abs(ref)))


def test_matches_quantecon(solvers, rng):
    a, q = stable(rng, 6, 0.95), spd(rng, 6)
    np.testing.assert_allclose(solvers["auto"](a, q), quantecon.solve_discrete_lyapunov(a, q), rtol=1e-9)


@pytest.mark.parametrize("method", ["auto", "schur"])
def test_unstable_but_solvable(solvers, method, rng):
    # eigenvalues 2 and 0.1: no pair with lambda_i * lambda_j = 1, unique solution exists
    a = np.array([[2.0, 1.0], [0.0, 0.1]])
    q = np.array([[1.0, 0.3], [0.2, 2.0]])
    np.testing.assert_allclose(solvers[method](a, q), sla.solve_discrete_lyapunov(a, q), rtol=1e-10)


def test_nonsymmetric_q(solvers, rng):
    a, q = stable(rng, 5, 0.8), rng.normal(size=(5, 5))
    for m in METHODS:
        np.testing.assert_allclose(solvers[m](a, q), sla.solve_discrete_lyapunov(a, q), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "a",
    [
        np.diag([1.0, 0.5]),  # lambda * lambda = 1: no unique solution
        np.array([[0.0, 1.0], [-1.0, 0.0]]),  # eigenvalues +-i: i * conj(i) = 1
        np.array([[np.nan, 0.0], [0.0, 0.5]]),
        np.array([[np.inf, 0.0], [0.0, 0.5]]),
    ],
)
def test_failure_is_nan(solvers, method, a):
    x = solvers[method](a, np.eye(2))
    assert x.shape == (2, 2) and np.all(np.isnan(x))


def test_doubling_nonconvergence_is_nan(solvers):
    # spectral radius 1.2: doubling diverges; must not return garbage
    x = solvers["doubling"](np.diag([1.2, 0.3]), np.eye(2))
    assert np.all(np.isnan(x))


def test_on_failure_raise():
    A, Q = pt.matrix("A"), pt.matrix("Q")
    f = pytensor.function([A, Q], solve_discrete_lyapunov(A, Q, on_failure="raise"))
    with pytest.raises(FloatingPointError, match="solve_discrete_lyapunov"):
        f(np.diag([1.0, 0.5]), np.eye(2))
    np.testing.assert_allclose(f(np.diag([0.5, 0.5]), np.eye(2)), np.eye(2) / 0.75)


def test_max_iter_too_small_gives_nan_for_doubling():
    A, Q = pt.matrix("A"), pt.matrix("Q")
    f = pytensor.function([A, Q], solve_discrete_lyapunov(A, Q, method="doubling", max_iter=2))
    assert np.all(np.isnan(f(np.diag([0.99, 0.5]), np.eye(2))))


def test_tolerance_is_respected():
    A, Q = pt.matrix("A"), pt.matrix("Q")
    a, q = np.diag([0.9, 0.5]), np.eye(2)
    x = pytensor.function([A, Q], solve_discrete_lyapunov(A, Q, method="doubling", tol=1e-3))(a, q)
    ref = sla.solve_discrete_lyapunov(a, q)
    assert np.max(np.abs(x - ref)) <= 1e-2 * np.max(np.abs(ref))


def test_batched_equals_loop(rng):
    A, Q = pt.tensor3("A"), pt.matrix("Q")
    X = solve_discrete_lyapunov(A, Q)
    assert X.type.ndim == 3
    f = pytensor.function([A, Q], X)
    a = np.stack([stable(rng, 4, r) for r in (0.3, 0.9, 0.99)])
    q = spd(rng, 4)
    np.testing.assert_allclose(f(a, q), np.stack([sla.solve_discrete_lyapunov(ai, q) for ai in a]), rtol=1e-9)


def test_batched_broadcast_both(rng):
    A, Q = pt.tensor4("A"), pt.tensor3("Q")
    f = pytensor.function([A, Q], solve_discrete_lyapunov(A, Q))
    a = np.stack([[stable(rng, 3, 0.7) for _ in range(2)] for _ in range(2)])  # (2, 2, 3, 3)
    q = np.stack([spd(rng, 3) for _ in range(2)])  # (2, 3, 3)
    out = f(a, q)
    for i in range(2):
        for j in range(2):
            np.testing.assert_allclose(out[i, j], sla.solve_discrete_lyapunov(a[i, j], q[j]), rtol=1e-9)


def test_static_shape_propagates():
    A = pt.tensor("A", shape=(5, 3, 3))
    Q = pt.tensor("Q", shape=(3, 3))
    assert solve_discrete_lyapunov(A, Q).type.shape == (5, 3, 3)


def test_float32_policy(rng):
    A, Q = pt.fmatrix("A"), pt.fmatrix("Q")
    X = solve_discrete_lyapunov(A, Q)
    assert X.dtype == "float32"
    a, q = stable(rng, 6, 0.95, "float32"), spd(rng, 6, "float32")
    x = pytensor.function([A, Q], X)(a, q)
    assert x.dtype == np.float32
    # solved in float64 then rounded: as accurate as float32 storage allows
    ref = sla.solve_discrete_lyapunov(a.astype("f8"), q.astype("f8"))
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5 * np.max(np.abs(ref)))


def test_integer_and_mixed_inputs_upcast():
    A, Q = pt.imatrix("A"), pt.matrix("Q")
    assert solve_discrete_lyapunov(A, Q).dtype == "float64"
    Af, Qd = pt.fmatrix("A"), pt.dmatrix("Q")
    assert solve_discrete_lyapunov(Af, Qd).dtype == "float64"


@pytest.mark.parametrize("method", METHODS)
def test_complex128(rng, method):
    A, Q = pt.zmatrix("A"), pt.zmatrix("Q")
    f = pytensor.function([A, Q], solve_discrete_lyapunov(A, Q, method=method))
    a = stable(rng, 5, 0.9, "complex128")
    q = spd(rng, 5).astype(complex) + 1j * np.triu(rng.normal(size=(5, 5)), 1)
    x = f(a, q)
    assert x.dtype == np.complex128
    np.testing.assert_allclose(x, sla.solve_discrete_lyapunov(a, q), rtol=1e-9, atol=1e-10)


def test_every_linker(mode, rng):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = solve_discrete_lyapunov(A, Q)
    gA, gQ = pytensor.grad((X**2).sum(), [A, Q])
    f = pytensor.function([A, Q], [X, gA, gQ], mode=mode)
    a, q = stable(rng, 4, 0.8), spd(rng, 4)
    x, ga, gq = f(a, q)
    np.testing.assert_allclose(x, sla.solve_discrete_lyapunov(a, q), rtol=1e-10)
    # dense-formula gradient: vec X = (I - A kron A)^{-1} vec Q
    n = 4
    M = np.eye(n * n) - np.kron(a, a)
    S = np.linalg.solve(M.T, 2 * x.ravel()).reshape(n, n)  # adjoint: (dF/dX)^T
    np.testing.assert_allclose(gq, S, rtol=1e-8)
    np.testing.assert_allclose(ga, S @ a @ x.T + S.T @ a @ x, rtol=1e-8)


@pytest.mark.parametrize("method", METHODS)
def test_verify_grad(method, rng):
    a, q = stable(rng, 4, 0.9), spd(rng, 4)
    verify_grad(lambda A, Q: solve_discrete_lyapunov(A, Q, method=method), [a, q], rng=rng)


def test_verify_grad_same_variable_in_both_positions(rng):
    # each input position gets its own cotangent; the total is their sum
    a = stable(rng, 3, 0.6)
    verify_grad(lambda A: solve_discrete_lyapunov(A, A), [a], rng=rng)


def test_verify_grad_batched_broadcast(rng):
    a = np.stack([stable(rng, 3, 0.6), stable(rng, 3, 0.9)])
    q = spd(rng, 3)
    verify_grad(lambda A, Q: solve_discrete_lyapunov(A, Q), [a, q], rng=rng)


def test_second_derivative(rng):
    a, q = stable(rng, 3, 0.7), spd(rng, 3)

    def grad_of_cost(A, Q):
        X = solve_discrete_lyapunov(A, Q)
        return pytensor.grad((X**2).sum() + X[0, 1], A)

    verify_grad(grad_of_cost, [a, q], rng=rng)


def test_hessian_vector_product_against_finite_differences(rng):
    a, q = stable(rng, 3, 0.7), spd(rng, 3)
    A, V = pt.matrix("A"), pt.matrix("V")
    cost = solve_discrete_lyapunov(A, q).sum() ** 2
    hvp = pytensor.function([A, V], pytensor.gradient.hessian_vector_product(cost, A, V))
    g = pytensor.function([A], pytensor.grad(cost, A))
    v = rng.normal(size=(3, 3))
    eps = 1e-6
    fd = (g(a + eps * v) - g(a - eps * v)) / (2 * eps)
    np.testing.assert_allclose(hvp(a, v), fd, rtol=1e-5, atol=1e-6)


def test_pushforward_matches_finite_differences(rng):
    a, q = stable(rng, 4, 0.8), spd(rng, 4)
    da, dq = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    A, Q, tA, tQ = (pt.matrix(n) for n in "A Q tA tQ".split())
    X = solve_discrete_lyapunov(A, Q)
    for use_op in (True, False):
        jvp = pytensor.gradient.pushforward(X, [A, Q], [tA, tQ], use_op_pushforward=use_op)
        got = pytensor.function([A, Q, tA, tQ], jvp)(a, q, da, dq)
        eps = 1e-6
        fd = (
            sla.solve_discrete_lyapunov(a + eps * da, q + eps * dq)
            - sla.solve_discrete_lyapunov(a - eps * da, q - eps * dq)
        ) / (2 * eps)
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-7)


def test_gradient_against_autodiff_of_reference_scan(rng):
    """The fused gradient equals PyTensor autodiff through the doubling Scan (converged)."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    ref_cost = (doubling_loop(A, Q, tol=1e-15, n_steps=60) ** 2).sum()
    cost = (solve_discrete_lyapunov(A, Q) ** 2).sum()
    f = pytensor.function([A, Q], pytensor.grad(cost, [A, Q]))
    # The reference Scan runs in the Python linker without iterops' rewrites:
    # Numba-compiling a gradient Scan costs minutes and tests nothing here.
    f_ref = pytensor.function(
        [A, Q], pytensor.grad(ref_cost, [A, Q]), mode=SCAN_ORACLE
    )
    a, q = stable(rng, 4, 0.8), spd(rng, 4)
    (ga, gq), (ra, rq) = f(a, q), f_ref(a, q)
    np.testing.assert_allclose(ga, ra, rtol=1e-8)
    np.testing.assert_allclose(gq, rq, rtol=1e-8)


def test_pickle_compiled_function(rng):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = solve_discrete_lyapunov(A, Q)
    f = pytensor.function([A, Q], [X, pytensor.grad(X.sum(), A)])
    g = pickle.loads(pickle.dumps(f))
    a, q = stable(rng, 3, 0.5), spd(rng, 3)
    np.testing.assert_allclose(g(a, q)[0], sla.solve_discrete_lyapunov(a, q), rtol=1e-10)
    op = DiscreteLyapunov(method="schur", on_failure="raise")
    assert pickle.loads(pickle.dumps(op)) == op


@given(
    n=st.integers(1, 8),
    rho=st.floats(0.0, 0.995),
    seed=st.integers(0, 2**31),
)
def test_property_random_stable(solvers, n, rho, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n))
    radius = np.max(np.abs(np.linalg.eigvals(a)))
    a = a * (rho / radius) if radius > 0 else a
    q = spd(rng, n)
    x = solvers["auto"](a, q)
    assert rel_residual(a, q, x) <= 1e-10
    np.testing.assert_allclose(x, x.T, atol=1e-9 * np.max(np.abs(x)))  # symmetric Q -> symmetric X
    assert np.all(np.linalg.eigvalsh((x + x.T) / 2) > 0)  # Q > 0 -> X > 0
    np.testing.assert_allclose(x, sla.solve_discrete_lyapunov(a, q), rtol=1e-8, atol=1e-10 * np.max(np.abs(x)))


def test_default_warmup_selects_the_float64_kernels_only():
    """``python -m iterops.warmup`` (float64: what PyMC models reach) compiles the float64 solver and its Schur
    fallback, not their complex128 twins, although every kernel on the C-ABI signature takes float64 pointers:
    the kernel's dtype is its declaration's.  ``--all-dtypes`` selects them too."""
    from iterops.linalg.lyapunov import _ABI, _SCHUR_ABI
    from iterops.warmup import _selected

    default, every = _selected(all_dtypes=False), _selected(all_dtypes=True)
    assert _ABI["float64"] in default and _SCHUR_ABI["float64"] in default
    assert _ABI["complex128"] not in default and _SCHUR_ABI["complex128"] not in default
    assert _ABI["complex128"] in every and _SCHUR_ABI["complex128"] in every


@pytest.mark.parametrize(
    "A, Q, match",
    [
        (pt.tensor("A", shape=(3, 4)), pt.matrix("Q"), r"A must be square.*\(3, 4\)"),
        (pt.matrix("A"), pt.tensor("Q", shape=(2, 3)), r"Q must be square.*\(2, 3\)"),
        (pt.tensor("A", shape=(3, 3)), pt.tensor("Q", shape=(4, 4)), r"A has 3 but Q has 4"),
        (pt.vector("A"), pt.matrix("Q"), r"A must have at least 2 dimensions.*ndim 1"),
        (pt.matrix("A"), pt.scalar("Q"), r"Q must have at least 2 dimensions"),
    ],
)
def test_bad_shapes(A, Q, match):
    with pytest.raises(ValueError, match=match):
        solve_discrete_lyapunov(A, Q)


def test_bad_dtype_and_options():
    with pytest.raises(TypeError, match="A must be a numeric.*dtype <U1"):
        solve_discrete_lyapunov(np.array([["a"]]), np.eye(1))
    with pytest.raises(ValueError, match="method"):
        solve_discrete_lyapunov(np.eye(2), np.eye(2), method="bilinear")
    with pytest.raises(ValueError, match="on_failure"):
        solve_discrete_lyapunov(np.eye(2), np.eye(2), on_failure="ignore")
    with pytest.raises(ValueError, match="max_iter"):
        solve_discrete_lyapunov(np.eye(2), np.eye(2), max_iter=0)


def test_runtime_shape_mismatch_is_an_error_not_garbage():
    A, Q = pt.matrix("A"), pt.matrix("Q")
    f = pytensor.function([A, Q], solve_discrete_lyapunov(A, Q))
    with pytest.raises(Exception):
        f(np.eye(3) * 0.5, np.eye(2))


# ---------------------------------------------------------------------------
# Every entry to its own scale: doubling stopped on the max-abs change, so entries
# many orders below the largest one were never checked.
# ---------------------------------------------------------------------------


def entrywise_error(x, ref, floor=1e-3):
    """max_ij |x - ref|_ij / (|ref_ij| + floor sqrt|ref_ii ref_jj|): the relative error of each entry
    of a covariance, an off-diagonal one measured against at least ``floor`` times its correlation
    scale (|X_ij| <= sqrt(X_ii X_jj); an entry cancelling to ~0 has no relative accuracy)."""
    d = np.sqrt(np.abs(np.diag(ref)))
    return np.max(np.abs(x - ref) / (np.abs(ref) + floor * np.outer(d, d)))


@pytest.mark.parametrize("method", METHODS)
def test_multiscale_solution_every_entry_accurate(solvers, method):
    a, q = np.diag([0.0, 0.9999]), np.diag([1.0, 1e-10])
    x = solvers[method](a, q)
    ref = sla.solve_discrete_lyapunov(a, q)
    np.testing.assert_allclose(np.diag(ref), [1.0, 1e-10 / (1 - 0.9999**2)], rtol=1e-13)  # dense formula
    np.testing.assert_allclose(np.diag(x), np.diag(ref), rtol=1e-12)
    assert entrywise_error(x, ref) <= 1e-12


def multiscale_case(rng, n, rho, triangular, lo=-8):
    """Stable A with spectral radius rho and an SPD Q whose rows/columns are scaled by 10^U(lo, 0).

    ``triangular``: A nearly lower triangular (each state driven by the ones before it) and the
    slowest states get the smallest scales -- a slow component driven by tiny noise, where a
    stop rule that looks at the largest entries only stops too early."""
    a = rng.normal(size=(n, n))
    scales = 10.0 ** rng.uniform(lo, 0, size=n)
    if triangular:
        a = np.tril(a, -1) * 0.1 + np.diag(np.diag(a))
        scales[np.argsort(-np.abs(np.diag(a)))] = np.sort(scales)
    radius = np.max(np.abs(np.linalg.eigvals(a)))
    a = a * (rho / radius) if radius > 0 else a
    D = np.diag(scales)
    return a, D @ spd(rng, n) @ D


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rho", [0.9999, 0.99999])
def test_near_unit_root_multiscale(solvers, method, rho, rng):
    # the slow state (eigenvalue rho) drives the others but is driven only by the smallest noise of Q,
    # as a nearly integrated component of a state-space model
    a = np.diag([rho, 0.5, -0.3, 0.1]) + 0.1 * np.tril(rng.normal(size=(4, 4)), -1)
    D = np.diag([1e-5, 1.0, 1e-2, 1.0])
    q = D @ spd(rng, 4) @ D
    ref = sla.solve_discrete_lyapunov(a, q)
    assert entrywise_error(solvers[method](a, q), ref) <= 1e-8


@given(
    n=st.integers(1, 6),
    rho=st.floats(0.0, 0.999),
    triangular=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_property_multiscale_every_entry_matches_scipy(solvers, n, rho, triangular, seed):
    # doubling sums positive terms entry by entry; the Schur method is accurate normwise only
    a, q = multiscale_case(np.random.default_rng(seed), n, rho, triangular)
    ref = sla.solve_discrete_lyapunov(a, q)
    for method in ("auto", "doubling"):
        assert entrywise_error(solvers[method](a, q), ref) <= 1e-10, method


def test_doubling_unit_root_and_unstable_are_nan_not_a_hang(solvers):
    for a in (np.diag([1.0, 0.5]), np.diag([1.0 + 1e-12, 0.5]), np.diag([-1.0, 0.2]), np.diag([3.0, 0.2])):
        assert np.all(np.isnan(solvers["doubling"](a, np.diag([1.0, 1e-10]))))


# ---------------------------------------------------------------------------
# Zero-size input
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_zero_size_system(mode, method):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = solve_discrete_lyapunov(A, Q, method=method)
    gA, gQ = pytensor.grad(X.sum(), [A, Q])
    x, ga, gq = pytensor.function([A, Q], [X, gA, gQ], mode=mode)(np.zeros((0, 0)), np.zeros((0, 0)))
    assert x.shape == ga.shape == gq.shape == (0, 0)
    assert sla.solve_discrete_lyapunov(np.zeros((0, 0)), np.zeros((0, 0))).shape == (0, 0)
    assert solve_discrete_lyapunov(np.zeros((3, 0, 0)), np.zeros((0, 0))).eval().shape == (3, 0, 0)


# ---------------------------------------------------------------------------
# PyTensor's own solve_discrete_lyapunov (method="bilinear") is replaced by the fused solver
# ---------------------------------------------------------------------------


def _builtin(A, Q):
    return pt.linalg.solve_discrete_lyapunov(A, Q)  # method="bilinear", PyTensor's default


def _op_names(f):
    return {type(n.op).__name__ for n in f.maker.fgraph.apply_nodes}


@pytest.mark.parametrize("case", ["stable", "near_unit_root", "unstable", "multiscale", "nonsymmetric_q"])
def test_builtin_lyapunov_is_replaced_and_matches_scipy(case, rng):
    """The default mode compiles the fused Op in place of PyTensor's; the value is scipy's solution, including
    an unstable A (a unique solution that is no covariance) and entries many orders of magnitude apart."""
    n = 6
    a, q = stable(rng, n, 0.9), spd(rng, n)
    if case == "near_unit_root":
        a = stable(rng, n, 1 - 1e-6)
    elif case == "unstable":
        a = stable(rng, n, 1.3)
    elif case == "multiscale":
        a = np.diag([0.99, 0.5, 1e-3, 0.9, -0.7, 0.2])
        q = np.diag([1e8, 1.0, 1e-8, 1e-4, 1e4, 1.0])
    elif case == "nonsymmetric_q":
        q = rng.normal(size=(n, n))
    A, Q = pt.matrix("A"), pt.matrix("Q")
    f = pytensor.function([A, Q], _builtin(A, Q))
    assert "DiscreteLyapunov" in _op_names(f) and "SolveBilinearDiscreteLyapunov" not in _op_names(f)
    ref = sla.solve_discrete_lyapunov(a, q)
    x = f(a, q)
    if case == "multiscale":  # every entry to its own precision
        np.testing.assert_allclose(x, ref, rtol=1e-10, atol=0)
    else:
        np.testing.assert_allclose(x, ref, rtol=1e-8, atol=1e-10 * np.max(np.abs(ref)))


def test_builtin_lyapunov_kept_when_iterops_is_off(rng):
    """``mode.excluding("iterops")`` and the process-wide switch keep PyTensor's Op."""
    import iterops

    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = _builtin(A, Q)
    f = pytensor.function([A, Q], X, mode=pytensor.compile.mode.get_default_mode().excluding("iterops"))
    assert "SolveBilinearDiscreteLyapunov" in _op_names(f)
    with iterops.fusion.disabled():
        g = pytensor.function([A, Q], X)
    assert "SolveBilinearDiscreteLyapunov" in _op_names(g)
    a, q = stable(rng, 4, 0.8), spd(rng, 4)
    np.testing.assert_allclose(f(a, q), sla.solve_discrete_lyapunov(a, q), rtol=1e-10)


def test_builtin_lyapunov_batched_float32_and_types(rng):
    """Batched A with a shared Q, and float32 inputs: the built-in's output type (float32 in, float64 out) is
    kept, and every batch member is scipy's solution."""
    a = np.stack([stable(rng, 3, r) for r in (0.3, 0.8, 0.99)])
    q = spd(rng, 3)
    A3, Q = pt.tensor3("A"), pt.matrix("Q")
    X3 = _builtin(A3, Q)
    f = pytensor.function([A3, Q], X3)
    assert "SolveBilinearDiscreteLyapunov" not in _op_names(f)
    assert f.maker.fgraph.outputs[0].type.dtype == X3.type.dtype and f.maker.fgraph.outputs[0].type.ndim == 3
    x = f(a, q)
    for k in range(3):
        np.testing.assert_allclose(x[k], sla.solve_discrete_lyapunov(a[k], q), rtol=1e-9)
    Af, Qf = pt.fmatrix("A"), pt.fmatrix("Q")
    Xf = _builtin(Af, Qf)
    g = pytensor.function([Af, Qf], Xf)
    assert "SolveBilinearDiscreteLyapunov" not in _op_names(g)
    a32, q32 = a[1].astype("float32"), q.astype("float32")
    out = g(a32, q32)
    assert out.dtype == Xf.type.dtype == "float64"
    np.testing.assert_allclose(out, sla.solve_discrete_lyapunov(a32.astype(float), q32.astype(float)), rtol=1e-9)


def test_builtin_lyapunov_gradient_through_pymc_pregrad_pass(rng):
    """PyMC's pre-gradient pass (``rewrite_pregrad``) swaps the Op before ``pytensor.grad``, so the gradient is
    the fused Op's implicit one: equal to autodiff of PyTensor's own solver (iterops off) and to finite
    differences."""
    from pymc.pytensorf import rewrite_pregrad
    from pytensor.graph.traversal import applys_between

    import iterops

    n = 5
    a, q, w = stable(rng, n, 0.95), spd(rng, n), rng.normal(size=(n, n))
    A, Q = pt.matrix("A"), pt.matrix("Q")
    fused = rewrite_pregrad((_builtin(A, Q) * w).sum())  # rewrites in place: a graph of its own
    assert "DiscreteLyapunov" in {type(nd.op).__name__ for nd in applys_between([A, Q], [fused])}
    f = pytensor.function([A, Q], pytensor.grad(fused, [A, Q]))
    cost = (_builtin(A, Q) * w).sum()
    with iterops.fusion.disabled():
        ref = pytensor.function([A, Q], pytensor.grad(cost, [A, Q]))
    assert "DiscreteLyapunov" not in _op_names(ref)
    for got, want in zip(f(a, q), ref(a, q)):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    verify_grad(lambda A, Q: (rewrite_pregrad((_builtin(A, Q) * w).sum())), [a, q], rng=rng)


def test_builtin_lyapunov_singular_equation_is_nan(rng):
    """An exact unit root (lambda_i lambda_j = 1) leaves no unique solution: the fused Op's documented failure
    value, all NaN, so a sampler rejects the point."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    f = pytensor.function([A, Q], _builtin(A, Q))
    a = np.array([[1.0, 0.3], [0.0, 0.5]])
    assert np.all(np.isnan(f(a, np.eye(2))))
