"""Scan -> fused Op rewrites (iterops.fusion).

Matches: the compiled graph holds the fused Op and no Scan; values equal the
independent oracle (scipy / numpy) and the unrewritten Scan graph
(``mode.excluding("iterops")``); gradients of the fused graph equal autodiff of
the Scan.  Near misses (more of them than matches): the Scan stays and
``explain`` says why.
"""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg
from pytensor.compile.mode import get_mode
from pytensor.graph.fg import FunctionGraph
from pytensor.scan.op import Scan
from pytensor.scan.utils import until

import iterops
from conftest import SCAN_ORACLE
from iterops.linalg.block_diag import BlockDiag
from iterops.linalg.lyapunov_iteration import LyapunovFixedPointLoop, SmithDoublingLoop

#: what the Lyapunov loops are replaced by: the same iterations, fused
LOOP_OPS = (SmithDoublingLoop, LyapunovFixedPointLoop)

pytestmark = [pytest.mark.python_run, pytest.mark.filterwarnings("ignore:matrix_dot is deprecated:FutureWarning")]


#: the unrewritten reference: Python linker (cheap to compile), iterops rewrites off
_SCAN_MODE = SCAN_ORACLE


def _ops(f):
    return [n.op for n in f.maker.fgraph.apply_nodes]


def _has(f, cls):
    return any(isinstance(op, cls) or isinstance(getattr(op, "core_op", None), cls) for op in _ops(f))


def _inner_ops(f):
    """Ops inside the (baked) inner graphs of the compiled function's Scans."""
    out = []
    for op in _ops(f):
        if isinstance(op, Scan):
            out += [n.op for n in op.fgraph.apply_nodes]
    return out


def _stable(rng, n, dtype="float64", rho=0.9):
    A = rng.normal(size=(n, n))
    A *= rho / np.max(np.abs(np.linalg.eigvals(A)))
    Q = rng.normal(size=(n, n))
    return A.astype(dtype), (Q @ Q.T + n * np.eye(n)).astype(dtype)


# ---------------------------------------------------------------------------
# loops as users write them
# ---------------------------------------------------------------------------


def user_doubling(A, B, tol, max_iter):
    """The Smith doubling loop as PyMC users wrote it (translated from aesara): matrix_dot, .conj().T."""

    def doubling_step(alpha, gamma, tol):
        new_alpha = alpha.dot(alpha)
        new_gamma = gamma + pt.linalg.matrix_dot(alpha, gamma, alpha.conj().T)
        diff = pt.max(pt.abs(new_gamma - gamma))
        return (new_alpha, new_gamma), until(diff < tol)

    alpha, gamma = pytensor.scan(doubling_step, outputs_info=[A, B], non_sequences=[tol], n_steps=max_iter,
                                 name="doubling_algo", return_updates=False)
    return gamma[-1]


def doubling_variant(A, B):
    """`@`, `.mT`, a constant tolerance, outputs in the other order, a Frobenius stop."""

    def step(gamma, alpha):
        g = alpha @ gamma @ alpha.mT + gamma
        return (g, alpha @ alpha), until(pt.linalg.norm(gamma - g) < 1e-12)

    gamma, _ = pytensor.scan(step, outputs_info=[B, A], n_steps=100, return_updates=False)
    return gamma[-1]


def fixed_point(A, Q, tol, n_steps=pt.constant(2000)):
    def step(X, Q, A, tol):
        X_new = Q + pt.dot(A, pt.dot(X, pt.transpose(A)))
        return X_new, until(pt.all(pt.abs(X_new - X) < tol))

    X = pytensor.scan(step, outputs_info=[pt.zeros_like(Q)], non_sequences=[Q, A, tol], n_steps=n_steps,
                      return_updates=False)
    return X[-1]


def block_loop(x):
    k, n, m = x.shape

    def step(i, out, x):
        return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], x[i])

    outs = pytensor.scan(step, sequences=[pt.arange(k)], outputs_info=[pt.zeros((k * n, k * m), dtype=x.dtype)],
                         non_sequences=[x], return_updates=False)
    return outs[-1]


def block_loop_sequence(x):
    """Blocks as a sequence, inc_subtensor, block size from static shape."""
    k, n, m = x.type.shape

    def step(xi, i, out):
        return pt.inc_subtensor(out[n * i:n * i + n, m * i:m * i + m], xi)

    outs = pytensor.scan(step, sequences=[x, pt.arange(k)], outputs_info=[pt.zeros((k * n, k * m))],
                         return_updates=False)
    return outs[-1]


# ---------------------------------------------------------------------------
# matches
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doubling_graph():
    A, B, tol = pt.matrix("A"), pt.matrix("B"), pt.scalar("tol")
    max_iter = pt.lscalar("max_iter")
    return [A, B, tol, max_iter], user_doubling(A, B, tol, max_iter)


def test_user_doubling_every_linker(doubling_graph, mode, rng):
    inputs, X = doubling_graph
    f = pytensor.function(inputs, X, mode=mode)
    assert not any(isinstance(op, Scan) for op in _ops(f))
    assert _has(f, SmithDoublingLoop)
    a, q = _stable(rng, 3)
    expected = scipy.linalg.solve_discrete_lyapunov(a, q)
    np.testing.assert_allclose(f(a, q, 1e-12, 100), expected, rtol=1e-9, atol=1e-12)
    f_scan = pytensor.function(inputs, X, mode=_SCAN_MODE)
    assert any(isinstance(op, Scan) for op in _ops(f_scan))
    np.testing.assert_allclose(f(a, q, 1e-12, 100), f_scan(a, q, 1e-12, 100), rtol=1e-9, atol=1e-12)


def test_user_doubling_gradient_equals_scan_autodiff(doubling_graph, rng):
    (A, B, tol, max_iter), X = doubling_graph
    W = pt.matrix("W")
    cost = lambda X: (X * W).sum()  # noqa: E731
    g_scan = pytensor.function([A, B, tol, max_iter, W], pytensor.grad(cost(X), [A, B]),
                               mode=_SCAN_MODE)
    Xf = iterops.fuse_loops(X)
    assert Xf.owner is not None and not isinstance(Xf.owner.op, Scan)
    g_fused = pytensor.function([A, B, tol, max_iter, W], pytensor.grad(cost(Xf), [A, B]),
                                on_unused_input="ignore")
    assert not any(isinstance(op, Scan) for op in _ops(g_fused))
    a, q = _stable(rng, 3, rho=0.7)
    w = rng.normal(size=(3, 3))
    for gs, gf in zip(g_scan(a, q, 1e-14, 100, w), g_fused(a, q, 1e-14, 100, w)):
        np.testing.assert_allclose(gf, gs, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_doubling_spelling_variants(dtype, rng):
    A, B = pt.matrix("A", dtype=dtype), pt.matrix("B", dtype=dtype)
    X = doubling_variant(A, B)
    f = pytensor.function([A, B], X)
    assert _has(f, LOOP_OPS) and not any(isinstance(op, Scan) for op in _ops(f))
    a, q = _stable(rng, 4, dtype)
    out = f(a, q)
    assert out.dtype == dtype
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(out, scipy.linalg.solve_discrete_lyapunov(a.astype(float), q.astype(float)),
                               rtol=tol, atol=tol)


def test_fixed_point_matches_and_gradient(rng):
    A, Q, tol = pt.matrix("A"), pt.matrix("Q"), pt.scalar("tol")
    X = fixed_point(A, Q, tol, n_steps=pt.constant(500))
    f = pytensor.function([A, Q, tol], X)  # the fused iteration honours the tolerance
    assert _has(f, LOOP_OPS) and not any(isinstance(op, Scan) for op in _ops(f))
    a, q = _stable(rng, 3, rho=0.6)
    f_scan = pytensor.function([A, Q, tol], X, mode=_SCAN_MODE)
    # the loop stops when its change is below tol: it is within tol / (1 - rho^2) of the solution
    np.testing.assert_allclose(f(a, q, 1e-12), scipy.linalg.solve_discrete_lyapunov(a, q), rtol=1e-10)
    for t in (1e-12, 1e-3):  # the fused iteration stops where the loop stops
        np.testing.assert_allclose(f(a, q, t), f_scan(a, q, t), rtol=1e-12)
    g_scan = pytensor.function([A, Q, tol], pytensor.grad(X.sum(), A), mode=_SCAN_MODE)
    g = pytensor.function([A, Q, tol], pytensor.grad(iterops.fuse_loops(X).sum(), A))
    np.testing.assert_allclose(g(a, q, 1e-14), g_scan(a, q, 1e-14), rtol=1e-8, atol=1e-10)


def test_block_diag_loops(mode, rng):
    x = pt.tensor3("x")
    B = block_loop(x)
    f = pytensor.function([x], B, mode=mode)
    assert _has(f, BlockDiag) and not any(isinstance(op, Scan) for op in _ops(f))
    xv = rng.normal(size=(3, 2, 4))
    np.testing.assert_array_equal(f(xv), scipy.linalg.block_diag(*xv))
    # gradient: fused (fuse_loops before grad) == autodiff of the Scan
    W = pt.matrix("W")
    g_scan = pytensor.function([x, W], pytensor.grad((B * W).sum(), x), mode=_SCAN_MODE)
    g = pytensor.function([x, W], pytensor.grad((iterops.fuse_loops(B) * W).sum(), x), mode=mode)
    w = rng.normal(size=(6, 12))
    np.testing.assert_array_equal(g(xv, w), g_scan(xv, w))


def test_block_diag_sequence_variant(rng):
    x = pt.tensor3("x", shape=(3, 2, 2))
    f = pytensor.function([x], block_loop_sequence(x))
    assert _has(f, BlockDiag) and not any(isinstance(op, Scan) for op in _ops(f))
    xv = rng.normal(size=(3, 2, 2))
    np.testing.assert_array_equal(f(xv), scipy.linalg.block_diag(*xv))


@pytest.mark.parametrize("mode", ["NUMBA", "FAST_COMPILE"])
def test_nested_loop_inner_graph_is_rewritten(mode, rng):
    """A matched loop inside another Scan's step is replaced in the inner graph."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    scales = pt.vector("scales")

    def outer_step(s, A, Q):
        return user_doubling(s * A, Q, pt.constant(1e-12), pt.constant(100)).sum()

    out = pytensor.scan(outer_step, sequences=[scales], non_sequences=[A, Q], return_updates=False)
    f = pytensor.function([scales, A, Q], out, mode=mode)
    inner = _inner_ops(f)
    assert inner and not any(isinstance(op, Scan) for op in inner)
    assert any(isinstance(getattr(op, "core_op", op), SmithDoublingLoop) for op in inner)
    a, q = _stable(rng, 2, rho=0.8)
    sv = np.array([0.5, 1.0])
    expected = [scipy.linalg.solve_discrete_lyapunov(s * a, q).sum() for s in sv]
    np.testing.assert_allclose(f(sv, a, q), expected, rtol=1e-9)


def test_excluding_iterops_keeps_scan(doubling_graph):
    inputs, X = doubling_graph
    f = pytensor.function(inputs, X, mode=SCAN_ORACLE)
    assert any(isinstance(op, Scan) for op in _ops(f)) and not _has(f, LOOP_OPS)


def test_pymc_pregrad_rewrites_scan():
    from pymc.pytensorf import rewrite_pregrad

    A, B = pt.matrix("A"), pt.matrix("B")
    X = user_doubling(A, B, pt.constant(1e-12), pt.constant(100))
    cost = rewrite_pregrad(X.sum())
    from pytensor.graph.traversal import ancestors

    owners = [v.owner.op for v in ancestors([cost]) if v.owner is not None]
    assert not any(isinstance(op, Scan) for op in owners)
    assert any(isinstance(getattr(op, "core_op", op), SmithDoublingLoop) for op in owners)


def test_fuse_loops_list_in_list_out_and_explain(doubling_graph):
    inputs, X = doubling_graph
    out = iterops.fuse_loops([X, X.sum()])
    assert isinstance(out, list) and len(out) == 2
    report = iterops.explain(X)
    assert len(report.replaced) == 1 and "smith_doubling_loop" in str(report)
    assert "no Scan" in str(iterops.explain(inputs[0] + 1))


# ---------------------------------------------------------------------------
# near misses: the Scan stays
# ---------------------------------------------------------------------------

_A, _B, _TOL = pt.matrix("A"), pt.matrix("B"), pt.scalar("tol")


def _doubling_with(update, stop=None, n_steps=100, used="last"):
    def step(alpha, gamma, tol):
        new_gamma = update(alpha, gamma)
        cond = (stop or (lambda n, o, t: pt.max(pt.abs(n - o)) < t))(new_gamma, gamma, tol)
        return (alpha @ alpha, new_gamma), until(cond)

    alpha, gamma = pytensor.scan(step, outputs_info=[_A, _B], non_sequences=[_TOL], n_steps=n_steps,
                                 return_updates=False)
    return {"last": gamma[-1], "trace": gamma, "alpha": gamma[-1] + alpha[-1]}[used]


def _no_stop_doubling(n_steps):
    def step(alpha, gamma):
        return alpha @ alpha, gamma + alpha @ gamma @ alpha.T

    _, gamma = pytensor.scan(step, outputs_info=[_A, _B], n_steps=n_steps, return_updates=False)
    return gamma[-1]


def _fixed_point_with(update, n_steps=2000, stop=True):
    def step(X, A, Q, tol):
        Xn = update(X, A, Q)
        return (Xn, until(pt.max(pt.abs(Xn - X)) < tol)) if stop else Xn

    X = pytensor.scan(step, outputs_info=[pt.zeros_like(_B)], non_sequences=[_A, _B, _TOL], n_steps=n_steps,
                      return_updates=False)
    return X[-1]


def _block_with(write=None, init=None, n_steps=None, stride=0):
    x = pt.tensor3("x")
    k, n, m = x.shape

    def step(i, out, x):
        w = write or (lambda out, i, x: pt.set_subtensor(out[i * n:(i + 1) * n, i * m + stride:(i + 1) * m + stride],
                                                         x[i]))
        return w(out, i, x)

    init = pt.zeros((k * n, k * m)) if init is None else init(k, n, m)
    seq = pt.arange(k if n_steps is None else n_steps(k))
    outs = pytensor.scan(step, sequences=[seq], outputs_info=[init], non_sequences=[x], return_updates=False)
    return outs[-1]


NEAR_MISSES = {
    "transpose on the other side": lambda: _doubling_with(lambda a, g: g + a.T @ g @ a),
    "missing term": lambda: _doubling_with(lambda a, g: a @ g @ a.T),
    "extra term": lambda: _doubling_with(lambda a, g: g + a @ g @ a.T + 1e-3),
    "scaled term": lambda: _doubling_with(lambda a, g: g + 0.5 * (a @ g @ a.T)),
    "stop when diverging": lambda: _doubling_with(lambda a, g: g + a @ g @ a.T,
                                                  stop=lambda n, o, t: pt.max(pt.abs(n - o)) > t),
    "stop on the value, not the change": lambda: _doubling_with(lambda a, g: g + a @ g @ a.T,
                                                                stop=lambda n, o, t: pt.max(pt.abs(n)) < t),
    "intermediate gammas used": lambda: _doubling_with(lambda a, g: g + a @ g @ a.T, used="trace"),
    "fixed point, two different matrices": lambda: _fixed_point_with(lambda X, A, Q: A @ X @ Q.T + Q),
    "block diag, initial matrix not zero": lambda: _block_with(init=lambda k, n, m: pt.ones((k * n, k * m))),
    "block diag, one block short": lambda: _block_with(n_steps=lambda k: k - 1),
    "block diag, shifted columns": lambda: _block_with(stride=1),
    "block diag, transposed blocks": lambda: _block_with(
        write=lambda out, i, x: pt.set_subtensor(out[i * 2:(i + 1) * 2, i * 2:(i + 1) * 2], x[i].T)),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_stays_scan(name):
    out = NEAR_MISSES[name]()
    report = iterops.explain(out)
    assert report.scans and not report.replaced, str(report)
    assert all(s.reasons for s in report.kept)
    # the graph the default (NUMBA) mode links, after all its rewrites (linking skipped: it is slow)
    fg = FunctionGraph(outputs=[out], clone=True)
    get_mode("NUMBA").optimizer.rewrite(fg)
    ops = [n.op for n in fg.apply_nodes]
    assert any(isinstance(op, Scan) for op in ops)
    assert not any(isinstance(getattr(op, "core_op", op), LOOP_OPS + (BlockDiag,)) for op in ops)


#: loops once kept because a solver could not reproduce them; the fused iterations are exact on them
EXACT_NOW = {
    "max-iteration guard smaller than convergence": lambda: _doubling_with(lambda a, g: g + a @ g @ a.T, n_steps=5),
    "no stop, a few doublings": lambda: _no_stop_doubling(8),
    "alpha used": lambda: _doubling_with(lambda a, g: g + a @ g @ a.T, used="alpha"),
    "fixed point, no stop": lambda: _fixed_point_with(lambda X, A, Q: A @ X @ A.T + Q, stop=False),
    "fixed point, few steps": lambda: _fixed_point_with(lambda X, A, Q: A @ X @ A.T + Q, n_steps=50),
    "fixed point, other transpose": lambda: _fixed_point_with(lambda X, A, Q: A.T @ X @ A + Q),  # the loop for A^T
}


@pytest.mark.parametrize("name", list(EXACT_NOW))
def test_truncated_lyapunov_loops_are_fused_and_equal_the_loop(name, rng):
    out = EXACT_NOW[name]()
    cost = (out * pt.cos(pt.arange(out.size)).reshape(out.shape)).sum()
    fused = iterops.fuse_loops(cost)
    f = pytensor.function([_A, _B, _TOL], [fused, *pytensor.grad(fused, [_A, _B])], on_unused_input="ignore")
    g = pytensor.function([_A, _B, _TOL], [cost, *pytensor.grad(cost, [_A, _B])], mode=_SCAN_MODE,
                          on_unused_input="ignore")
    assert not any(isinstance(op, Scan) for op in _ops(f))
    a, q = _stable(rng, 3, rho=0.95)
    for got, want in zip(f(a, q, 1e-12), g(a, q, 1e-12)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_explain_reports_reason():
    report = str(iterops.explain(NEAR_MISSES["stop when diverging"]()))
    assert "kept as a Scan" in report and "differs from the reference" in report
    report = str(iterops.explain(NEAR_MISSES["transpose on the other side"]()))
    assert "kept as a Scan" in report and "differs from the reference" in report


def test_optimizer_verbose_logs(capsys, doubling_graph):
    inputs, X = doubling_graph
    with pytensor.config.change_flags(optimizer_verbose=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pytensor.function(inputs, X, mode="FAST_COMPILE")
    assert "iterops: replaced Scan{doubling_algo}" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_explain_shows_a_real_difference(name):
    """Near misses never read "expected X, found X": operands are printed until the two sides differ."""
    import re

    report = str(iterops.explain(NEAR_MISSES[name]()))
    for line in report.splitlines():
        m = re.search(r"expected (.*?), found (.*?)(?: \(as an operand of|$)", line)
        if m:
            assert m.group(1) != m.group(2), line
