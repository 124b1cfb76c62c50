"""Regression tests of the fusion contract: each case where fusion once changed what a user computes.

The contract (``iterops.fusion``): on every input where the user's loop runs,
the rewritten graph returns the loop's values and gradients (to rounding), or
the Scan is kept; where the loop raises, the rewritten graph raises.  Oracle:
the unrewritten loop (``mode.excluding("iterops")``) and autodiff through it,
and scipy where the loop converges.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg
from pytensor.compile.mode import get_mode
from pytensor.scan.op import Scan
from pytensor.scan.utils import until

import iterops
from conftest import SCAN_ORACLE, as_run_by_python
from iterops import reference_loops as ref

pytestmark = [pytest.mark.python_run, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")]

_SCAN_MODE = SCAN_ORACLE


def _has_scan(f):
    return any(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes)


def _fused_and_loop(inputs, out, wrt):
    """(fused f, loop g): value and gradient of ``sum(out * w)`` w.r.t. ``wrt``."""
    cost = (out * pt.cos(0.3 * pt.arange(out.size)).reshape(out.shape)).sum()
    fused_out, fused_cost = iterops.fuse_loops([out, cost])
    f = pytensor.function(inputs, [fused_out, *pytensor.grad(fused_cost, wrt)])
    g = pytensor.function(inputs, [out, *pytensor.grad(cost, wrt)], mode=_SCAN_MODE)
    assert not _has_scan(f), "the loop was expected to be fused"
    return f, g


def _assert_same(got, want, rtol=1e-10, atol=0.0):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# 1. a fixed-point loop whose limit depends on its start value ---------------------------------------------


@pytest.mark.parametrize("A, Q, X0, want", [
    (np.diag([1.0, 0.5]), np.diag([0.0, 1.0]), 1e6 * np.eye(2), np.diag([1e6, 4.0 / 3.0])),
    (np.array([[np.cos(0.4), -np.sin(0.4)], [np.sin(0.4), np.cos(0.4)]]), np.zeros((2, 2)), np.eye(2), np.eye(2)),
], ids=["unit root unexcited by Q", "rotation, Q = 0"])
def test_fixed_point_limit_that_depends_on_the_start_value(A, Q, X0, want):
    As, Qs, X0s = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0")
    out = ref.fixed_point_loop(As, Qs, X0s, tol=1e-12, n_steps=5000)
    f, g = _fused_and_loop([As, Qs, X0s], out, [As, Qs, X0s])
    got, loop = f(A, Q, X0), g(A, Q, X0)
    np.testing.assert_allclose(loop[0], want, rtol=1e-9, atol=1e-12)  # the loop's own limit
    _assert_same(got, loop, rtol=1e-9, atol=1e-12)
    assert all(np.all(np.isfinite(x)) for x in got)


# 2. a doubling loop on a multi-scale solution ------------------------------------------------------------------


def test_doubling_multi_scale_solution_is_as_accurate_as_the_loop():
    A, Q = np.diag([0.0, 0.9999]), np.diag([1.0, 1e-10])
    As, Qs = pt.matrix("A"), pt.matrix("Q")
    out = ref.doubling_loop(As, Qs, tol=1e-15, n_steps=100)
    f, g = _fused_and_loop([As, Qs], out, [As, Qs])
    got, loop = f(A, Q), g(A, Q)
    np.testing.assert_allclose(loop[0], scipy.linalg.solve_discrete_lyapunov(A, Q), rtol=1e-6)
    np.testing.assert_allclose(got[0][1, 1], 5.0e-7, rtol=1e-3)
    _assert_same(got, loop, rtol=1e-9, atol=1e-20)


# 3. a narrowing cast inside the step keeps the Scan ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_narrowing_cast_in_the_step_keeps_the_scan(dtype):
    def step(alpha, gamma, tol):
        new_gamma = gamma + pt.cast(pt.cast(alpha @ gamma @ alpha.T, dtype), "float64")
        return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)

    A, Q = pt.matrix("A"), pt.matrix("Q")
    out = ref.doubling_loop(A, Q, step=step)
    report = iterops.explain(out)
    assert not report.replaced and "Cast" in str(report)
    assert _has_scan(pytensor.function([A, Q], out, mode=as_run_by_python()))


def test_widening_cast_of_an_input_still_fuses():
    A32, Q = pt.matrix("A", dtype="float32"), pt.matrix("Q")
    out = ref.fixed_point_loop(pt.cast(A32, "float64"), Q, tol=1e-12)
    assert iterops.explain(out).replaced


# 4. truncate_gradient keeps the Scan ---------------------------------------------------------------------------------


def test_truncated_gradient_keeps_the_scan():
    A, Q = pt.matrix("A"), pt.matrix("Q")
    out = ref.doubling_loop(A, Q, truncate_gradient=1)
    report = iterops.explain(out)
    assert not report.replaced and "truncate_gradient=1" in str(report)
    g = pytensor.grad(iterops.fuse_loops(out).sum(), A)
    f = pytensor.function([A, Q], g, mode=_SCAN_MODE)
    np.testing.assert_array_equal(f(np.array([[0.5, 0.1], [0.0, 0.3]]), np.eye(2)), 0.0)  # the loop's truncated zeros


# 5. last-row detection is symbolic: a huge slice bound costs nothing -----------------------------------------------


@pytest.mark.parametrize("N", [10**3, 10**8])
def test_last_row_of_a_huge_slice_compiles_in_constant_time(N):
    """``gammas[:N][-1]``: the old check evaluated the merged index at every length up to 4 N."""
    A, Q = pt.matrix("A"), pt.matrix("Q")

    def step(alpha, gamma):
        g = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, g), until(pt.max(pt.abs(g - gamma)) < 1e-12)

    _, gammas = pytensor.scan(step, outputs_info=[A, Q], n_steps=50, return_updates=False)
    out = gammas[:N][-1]
    f = pytensor.function([A, Q], out)  # must not take time (or memory) growing with N
    g = pytensor.function([A, Q], out, mode=_SCAN_MODE)
    a, q = np.array([[0.5, 0.2], [0.0, 0.4]]), np.eye(2)
    np.testing.assert_allclose(f(a, q), g(a, q), rtol=1e-12)


def test_piecewise_evaluation_of_merged_indices():
    from iterops.fusion.piecewise import evaluate

    L = pt.scalar("L", dtype="int64")
    N = 10**12
    last_of_prefix = pt.switch(pt.lt(pt.minimum(L - 1, N) - 1, 0), pt.minimum(L - 1, N) - 1 + (L - 1),
                               pt.minimum(L - 1, N) - 1)  # (buffer[1:])[:N][-1], as merged, start 1
    f = evaluate(last_of_prefix, L, 2)
    direct = lambda n: min(n - 1, N) - 1  # noqa: E731  (the expression above, for n >= 2)
    for n in [2, 3, 5, N, N + 1, N + 2, 3 * N, 2**62]:
        assert f(n) == direct(n)
    assert len(f.pieces) <= 4  # a handful of pieces, whatever N
    assert evaluate(pt.abs(L - 7) * 3, L, 0)(2) == 15
    assert evaluate(L * L, L, 0) is None  # not piecewise linear: no proof


# 6. explain never raises ---------------------------------------------------------------------------------------------------


def test_explain_reports_a_scan_carrying_a_random_generator():
    rng = pytensor.shared(np.random.default_rng(0))

    def step(r):
        r2, x = pt.random.normal(rng=r).owner.outputs
        return r2, x

    (_, xs) = pytensor.scan(step, outputs_info=[rng, None], n_steps=3, return_updates=False)
    report = iterops.explain(xs)
    assert len(report.kept) == 1 and not report.replaced
    assert "random generator" in str(report)


# 7. the fused graph keeps every input of the user's graph usable --------------------------------------------------


def test_fused_graph_uses_the_loops_tolerance_and_iteration_guard():
    A, Q, tol, max_iter = pt.matrix("A"), pt.matrix("Q"), pt.scalar("tol"), pt.iscalar("max_iter")
    out = iterops.fuse_loops(ref.doubling_loop(A, Q, tol, max_iter))
    f = pytensor.function([A, Q, tol, max_iter], out)  # no UnusedInputError
    loop = pytensor.function([A, Q, tol, max_iter], ref.doubling_loop(A, Q, tol, max_iter), mode=_SCAN_MODE)
    a, q = np.array([[0.9, 0.1], [0.0, 0.8]]), np.eye(2)
    for t, n in [(1e-12, 100), (1e-2, 100), (1e-12, 2)]:  # converged, early stop, stopped by the guard
        np.testing.assert_allclose(f(a, q, t, n), loop(a, q, t, n), rtol=1e-12)
    assert not np.allclose(f(a, q, 1e-12, 2), f(a, q, 1e-12, 100))  # the guard is honoured


# 8. Kalman and Levinson inputs the loop accepts -------------------------------------------------------------------------


def _kalman_values(rng, n=10, m=2, p=2):
    return dict(y=rng.normal(size=(n, p)), a0=np.zeros(m), T=np.array([[0.7, 0.2], [0.0, 0.5]]), Z=np.eye(p, m),
                R=np.eye(m))


def test_textbook_kalman_with_unproven_symmetric_inputs_keeps_the_scan():
    y = pt.tensor("y", shape=(10, 2))
    a0, P0, T, Z, R, H, Q = (pt.vector("a0"), *(pt.matrix(k) for k in ("P0", "T", "Z", "R", "H", "Q")))
    ll, _, _ = ref.kalman_textbook_loop(y, a0, P0, T, Z, R, H, Q)
    report = iterops.explain(ll.sum())
    assert not report.replaced and "not provably symmetric positive semi-definite" in str(report)
    # built as users build covariances, the same loop is fused
    L0, LH, LQ = pt.matrix("L0"), pt.matrix("LH"), pt.matrix("LQ")
    ll, _, _ = ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, pt.diag(pt.diag(LH) ** 2), LQ @ LQ.T)
    assert iterops.explain(ll.sum()).replaced


def test_textbook_kalman_with_an_indefinite_observation_covariance_keeps_the_scan(rng):
    """H = -5 I: det(F) > 0 with an indefinite F; the loop's log-likelihood is finite."""
    v = _kalman_values(rng)
    y, a0, L0 = pt.tensor("y", shape=(10, 2)), pt.vector("a0"), pt.matrix("L0")
    T, Z, R = pt.matrix("T"), pt.matrix("Z"), pt.matrix("R")
    ll, _, _ = ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, -5.0 * pt.eye(2), pt.eye(2))
    # the kept Scan runs on the Python VM (a Numba compile of PyTensor's Scan is not what is tested)
    f = pytensor.function([y, a0, L0, T, Z, R], iterops.fuse_loops(ll), mode=as_run_by_python())
    g = pytensor.function([y, a0, L0, T, Z, R], ll, mode=_SCAN_MODE)
    args = (v["y"], v["a0"], 0.1 * np.eye(2), v["T"], v["Z"], v["R"])
    assert _has_scan(f) and np.isfinite(g(*args)[0])
    np.testing.assert_allclose(f(*args), g(*args), rtol=1e-12)


def test_kalman_loop_with_negative_n_steps_raises_like_the_loop(rng):
    v = _kalman_values(rng)
    y, a0, L0 = pt.tensor("y", shape=(10, 2)), pt.vector("a0"), pt.matrix("L0")
    T, Z, R, n = pt.matrix("T"), pt.matrix("Z"), pt.matrix("R"), pt.iscalar("n")
    ll, _, _ = ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, pt.eye(2), pt.eye(2), n_steps=n)
    f = pytensor.function([y, a0, L0, T, Z, R, n], iterops.fuse_loops(ll.sum()))
    g = pytensor.function([y, a0, L0, T, Z, R, n], ll.sum(), mode=_SCAN_MODE)
    assert not _has_scan(f)
    args = (v["y"], v["a0"], np.eye(2), v["T"], v["Z"], v["R"])
    np.testing.assert_allclose(f(*args, 7), g(*args, 7), rtol=1e-10)
    for fn in (g, f):  # the loop fails allocating its buffers, the fused graph on its n_steps guard
        with pytest.raises((IndexError, ValueError)):
            fn(*args, -3)


def test_levinson_on_a_too_short_autocovariance_raises_like_the_loop():
    gamma = pt.vector("gamma")
    phi, sigma2, _ = ref.levinson_loop(gamma, 3)
    f = pytensor.function([gamma], iterops.fuse_loops(phi))
    g = pytensor.function([gamma], phi, mode=_SCAN_MODE)
    assert not _has_scan(f)
    for fn in (g, f):
        with pytest.raises(IndexError):
            fn(np.array([1.0, 0.5, 0.2]))


def test_levinson_on_a_non_positive_definite_autocovariance_equals_the_loop():
    gamma = pt.vector("gamma")
    phi, sigma2, pacf = ref.levinson_loop(gamma, 3)
    out = pt.concatenate([phi, sigma2[None], pacf])
    f, g = _fused_and_loop([gamma], out, [gamma])
    x = np.array([1.0, 0.0, 0.0, 1.5])
    got, loop = f(x), g(x)
    assert np.all(np.isfinite(loop[0]))
    _assert_same(got, loop, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_doubling_loop_of_few_steps_equals_the_loop(n):
    """0 steps: PyTensor reads ``gammas[-1]`` of the empty trace as the start value ``Q``; so does the replacement."""
    A, Q, ns = pt.matrix("A"), pt.matrix("Q"), pt.iscalar("n")
    out = ref.doubling_loop(A, Q, 1e-12, ns)
    f = pytensor.function([A, Q, ns], iterops.fuse_loops(out))
    g = pytensor.function([A, Q, ns], out, mode=_SCAN_MODE)
    assert not _has_scan(f)
    a, q = np.array([[0.5, 0.1], [0.2, 0.3]]), np.array([[2.0, 0.5], [0.5, 1.0]])
    np.testing.assert_allclose(f(a, q, n), g(a, q, n), rtol=1e-12)
    if n == 0:
        np.testing.assert_array_equal(f(a, q, n), q)
    for fn in (g, f):
        with pytest.raises((IndexError, ValueError)):
            fn(a, q, -1)


@pytest.mark.parametrize("read", ["[-1]", "[-1:]", "[-1:][0]", "[1:][-1]", "[:10**9][-1]"])
def test_last_reads_after_zero_steps_behave_like_the_loop(read):
    """After 0 steps PyTensor reads ``out[-1]`` as the start value, ``out[-1:]`` as empty, ``out[-1:][0]`` raises."""
    A, Q, n = pt.matrix("A"), pt.matrix("Q"), pt.iscalar("n")
    _, gammas = pytensor.scan(ref.doubling_step, outputs_info=[A, Q], non_sequences=[pt.as_tensor(1e-12)],
                              n_steps=n, return_updates=False)
    out = eval(f"gammas{read}")  # noqa: S307  (the read as a user writes it)
    f = pytensor.function([A, Q, n], out)
    g = pytensor.function([A, Q, n], out, mode=_SCAN_MODE)
    a, q = np.array([[0.5, 0.1], [0.2, 0.3]]), np.array([[2.0, 0.5], [0.5, 1.0]])
    if read != "[:10**9][-1]":
        assert not _has_scan(f)
    for k in (0, 1, 3):
        try:
            want = g(a, q, k)
        except IndexError:
            with pytest.raises(IndexError):
                f(a, q, k)
            continue
        np.testing.assert_allclose(f(a, q, k), want, rtol=1e-12)


# 9. plain pytensor.grad of a loop of 0 steps -------------------------------------------------------------------------


def _lyapunov_loop_of(kind, A, Q, X0, n):
    if kind == "doubling":
        return ref.doubling_loop(A, Q, 1e-12, n)
    if kind == "damped":
        return ref.damped_fixed_point_loop(A, Q, 0.6, X0, tol=1e-12, n_steps=n)
    return ref.fixed_point_loop(A, Q, X0, tol=1e-12, n_steps=n)


@pytest.mark.parametrize("kind", ["fixed_point", "damped", "doubling"])
def test_plain_grad_of_a_zero_step_loop_raises_like_the_loop(kind):
    """``pytensor.grad`` of ``Xs[-1]`` builds the cotangent ``inc_subtensor(zeros_like(Xs)[-1], g)``: with a
    symbolic ``n_steps`` that is 0 at run time ``Xs`` has no row and the loop's gradient graph raises
    ``IndexError`` (its value alone reads the start value); so must the fused gradient.  The loop and its
    gradient Scan are still fused, and equal the loop for every other ``n_steps``."""
    A, Q, X0, n = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0"), pt.iscalar("n")
    out = _lyapunov_loop_of(kind, A, Q, X0, n)
    wrt = [A, Q] if kind == "doubling" else [A, Q, X0]
    cost = (out * pt.cos(0.3 * pt.arange(out.size)).reshape(out.shape)).sum()
    grads = pytensor.grad(cost, wrt)
    ins = [A, Q, X0, n]
    f = pytensor.function(ins, [out, *grads], on_unused_input="ignore")
    g = pytensor.function(ins, [out, *grads], mode=_SCAN_MODE, on_unused_input="ignore")
    f_value = pytensor.function(ins, out, on_unused_input="ignore")
    f_grad = pytensor.function(ins, grads, on_unused_input="ignore")  # without the forward value's own guards
    g_value = pytensor.function(ins, out, mode=_SCAN_MODE, on_unused_input="ignore")
    assert not _has_scan(f) and not _has_scan(f_grad), "the loop and its gradient Scan were expected to be fused"
    a, q, x0 = np.array([[0.5, 0.1], [0.2, 0.3]]), np.array([[2.0, 0.5], [0.5, 1.0]]), np.eye(2)
    for k in (1, 3, 5000):
        _assert_same(f(a, q, x0, k), g(a, q, x0, k), rtol=1e-9, atol=1e-12)
    # 0 steps: the value is the start value in both graphs, the gradient raises in both
    np.testing.assert_array_equal(g_value(a, q, x0, 0), q if kind == "doubling" else x0)
    np.testing.assert_array_equal(f_value(a, q, x0, 0), g_value(a, q, x0, 0))
    for k in (0, -1):
        for fn, which in ((g, "loop"), (f, "fused"), (f_grad, "fused")):
            with pytest.raises(IndexError):
                fn(a, q, x0, k)
                pytest.fail(f"the {which} gradient does not raise at n_steps={k}")


# 10. spellings that were kept -------------------------------------------------------------------------------------


def _transposed_fixed_point_step(X, A, Q, tol):
    X_new = A.T @ X @ A + Q
    return X_new, until(pt.max(pt.abs(X_new - X)) < tol)


def test_transposed_fixed_point_is_fused_and_equals_the_loop():
    """``X <- A^T X A + Q`` is the fixed point of ``A^T X A - X + Q = 0``: the same iteration for ``A^T``, fused with
    ``A.mT``; values and gradients equal the loop's, and the limit scipy's solution for ``A^T``."""
    As, Qs, X0s = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0")
    out = ref.fixed_point_loop(As, Qs, X0s, tol=1e-12, n_steps=5000, step=_transposed_fixed_point_step)
    assert iterops.explain(out).replaced
    f, g = _fused_and_loop([As, Qs, X0s], out, [As, Qs, X0s])
    A = np.array([[0.5, 0.4, 0.0], [0.0, 0.3, 0.2], [0.1, 0.0, 0.6]])
    Q, X0 = np.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.1], [0.0, 0.1, 1.5]]), np.eye(3)
    got, loop = f(A, Q, X0), g(A, Q, X0)
    np.testing.assert_allclose(loop[0], scipy.linalg.solve_discrete_lyapunov(A.T, Q), rtol=1e-9)
    _assert_same(got, loop, rtol=1e-9, atol=1e-12)


def test_reading_the_number_of_steps_run_keeps_the_scan_and_says_why():
    """``Xs.shape[0]`` beside ``Xs[-1]``: the number of steps a loop with a stop rule ran is not an output of the
    fused Op, so the Scan is kept and ``explain`` says so."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    Xs = pytensor.scan(ref.fixed_point_step, outputs_info=[pt.zeros_like(Q)], non_sequences=[A, Q, pt.as_tensor(1e-12)],
                       n_steps=100, return_updates=False)
    report = iterops.explain([Xs[-1], Xs.shape[0]])
    assert not report.replaced and "the number of steps run" in str(report)
    assert iterops.explain(Xs[-1]).replaced  # the same loop without the count is fused


def test_textbook_kalman_with_a_diagonal_of_squares_is_fused():
    """``H = diag(hv * hv)`` is as positive semi-definite as ``diag(hv ** 2)`` (which is fused)."""
    y, a0, L0, hv = pt.tensor("y", shape=(10, 2)), pt.vector("a0"), pt.matrix("L0"), pt.vector("hv")
    T, Z, R, LQ = pt.matrix("T"), pt.matrix("Z"), pt.matrix("R"), pt.matrix("LQ")
    ll, _, _ = ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, pt.diag(hv ** 2), LQ @ LQ.T)
    assert iterops.explain(ll.sum()).replaced
    ll, _, _ = ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, pt.diag(hv * hv), LQ @ LQ.T)
    assert iterops.explain(ll.sum()).replaced, str(iterops.explain(ll.sum()))


# 11. linear algebra that fails: NaN in every linker -------------------------------------------------------------------


@pytest.fixture(scope="module")
def singular_kalman():
    """A textbook filter whose innovation covariance ``F = Z P0 Z^T + H`` is exactly 0 at step 0 (``P0 = 0``,
    ``H = 0``): ``inv(F)`` of the zero matrix.  Returns (inputs, outputs, values, the loop's outputs under Numba)."""
    y, a0, L0, LH = pt.tensor("y", shape=(6, 1)), pt.vector("a0"), pt.matrix("L0"), pt.matrix("LH")
    T, Z, R, LQ = pt.matrix("T"), pt.matrix("Z"), pt.matrix("R"), pt.matrix("LQ")
    ins = [y, a0, L0, T, Z, R, LH, LQ]
    outs = list(ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, LH @ LH.T, LQ @ LQ.T))
    vals = [np.linspace(-1.0, 1.0, 6)[:, None], np.zeros(2), np.zeros((2, 2)), 0.5 * np.eye(2), np.ones((1, 2)),
            np.eye(2), np.zeros((1, 1)), np.eye(2)]
    loop = pytensor.function(ins, outs, mode=get_mode("NUMBA").excluding("iterops"))
    assert _has_scan(loop)
    return ins, outs, vals, loop(*vals)


@pytest.mark.parametrize("mode", ["FAST_COMPILE", "NUMBA"])
def test_failed_linear_algebra_is_nan_in_every_linker(mode, singular_kalman):
    """The contract's linker-dependent failure (``iterops.fusion``, item 3): where the loop's linear algebra fails,
    the fused graph returns NaN in every linker, what the loop returns under Numba (the oracle).  Under the Python
    linker the loop itself raises ``LinAlgError`` (NumPy's ``inv`` of a singular matrix): the fused graph does not
    (a sampler treats both alike; the rewrite cannot know the linker, nor reproduce NumPy's exact-zero-pivot test)."""
    ins, outs, vals, want = singular_kalman
    assert all(np.isnan(w).any() for w in want)  # the oracle does fail: NaN, not a value
    f = pytensor.function(ins, outs, mode=mode)
    assert not _has_scan(f)
    for got, w in zip(f(*vals), want):
        np.testing.assert_allclose(got, w, rtol=1e-10, equal_nan=True)
    loop = pytensor.function(ins, outs, mode=get_mode(mode).excluding("iterops"))
    if mode == "FAST_COMPILE":
        with pytest.raises(np.linalg.LinAlgError):
            loop(*vals)
    else:
        for got, w in zip(loop(*vals), want):
            np.testing.assert_allclose(got, w, rtol=1e-10, equal_nan=True)
