"""The mit-mot -> sit-sot rewrite of gradient Scans (iterops.scan_grad).

Oracle: the same gradient graph with iterops excluded (PyTensor's own mit-mot
gradient), run on PyTensor's Python VM (``conftest.SCAN_ORACLE``: no second cold
Numba compile of a Scan per test), plus finite differences for the seed case.
The rewritten gradient Scan itself runs in every linker mode.
"""

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pytensor.scan.op import Scan
from pytensor.scan.utils import until

import iterops  # noqa: F401
from conftest import SCAN_ORACLE, as_run_by_python

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

warnings.filterwarnings("ignore", category=DeprecationWarning)


def _scan_infos(f):
    """ScanInfo of every Scan in a compiled function, inner graphs included."""
    out = []

    def visit(fgraph):
        for node in fgraph.apply_nodes:
            if isinstance(node.op, Scan):
                out.append(node.op.info)
                visit(node.op.fgraph)

    visit(f.maker.fgraph)
    return out


def _n_mit_mot(f):
    return sum(i.n_mit_mot for i in _scan_infos(f))


def _pair(inputs, outputs, mode):
    f = pytensor.function(inputs, outputs, mode=mode)
    f0 = pytensor.function(inputs, outputs, mode=SCAN_ORACLE)
    return f, f0


def _assert_same(f, f0, *args):
    for a, b in zip(f(*args), f0(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_seed_example(mode):
    x0 = pt.scalar("x0")
    xs = pytensor.scan(lambda x: x**2, outputs_info=[x0], n_steps=4, return_updates=False)
    g = pt.grad(xs[-1], x0)
    f, f0 = _pair([x0], [g], mode)
    if mode != "FAST_COMPILE":  # the rewrite is a fast_run rewrite
        assert _n_mit_mot(f) == 0
    assert _n_mit_mot(f0) == 1
    _assert_same(f, f0, 0.95)
    # d/dx0 x0**16 = 16 x0**15
    np.testing.assert_allclose(f(0.95)[0], 16 * 0.95**15)


@pytest.fixture(scope="module")
def symbolic_steps():
    x0 = pt.vector("x0")
    W = pt.matrix("W")
    n = pt.iscalar("n")
    xs = pytensor.scan(
        lambda x, W: pt.tanh(W @ x), outputs_info=[x0], non_sequences=[W], n_steps=n, return_updates=False
    )
    cost = xs[-1].sum()
    g = pt.grad(cost, [x0, W])
    return [x0, W, n], g


@pytest.mark.parametrize("steps", [1, 2, 7])
def test_symbolic_steps_nonseq(symbolic_steps, steps, rng):
    inputs, g = symbolic_steps
    f, f0 = _pair(inputs, g, "NUMBA")
    assert _n_mit_mot(f) == 0 and _n_mit_mot(f0) == 1
    x0 = rng.normal(size=3)
    W = rng.normal(size=(3, 3)) / 2
    _assert_same(f, f0, x0, W, steps)


def test_zero_steps(mode):
    # xs[-1] is undefined for 0 steps; the last state of [x0, *xs] is not.
    x0 = pt.scalar("x0")
    n = pt.iscalar("n")
    xs = pytensor.scan(lambda x: pt.sin(x) * 1.5, outputs_info=[x0], n_steps=n, return_updates=False)
    full = pt.concatenate([x0[None], xs])
    g = pt.grad(full[-1], x0)
    f, f0 = _pair([x0, n], [g], mode)
    for k in (0, 1, 5):
        _assert_same(f, f0, 0.3, k)


def test_sequences_and_matrix_state(rng):
    X0 = pt.matrix("X0")
    seq = pt.tensor3("seq")
    A = pt.matrix("A")
    xs = pytensor.scan(
        lambda s, X, A: pt.sin(A @ X) + s, sequences=[seq], outputs_info=[X0], non_sequences=[A], return_updates=False
    )
    g = pt.grad((xs[-1] ** 2).sum(), [X0, seq, A])
    f, f0 = _pair([X0, seq, A], g, "NUMBA")
    assert _n_mit_mot(f) == 0
    _assert_same(f, f0, rng.normal(size=(2, 3)), rng.normal(size=(6, 2, 3)), rng.normal(size=(2, 2)) / 2)


def test_several_states_convert_those_that_qualify(rng):
    x0, y0 = pt.vector("x0"), pt.vector("y0")

    def step(x, y):
        return pt.tanh(x + y), x * pt.cos(y)

    (xs, ys) = pytensor.scan(step, outputs_info=[x0, y0], n_steps=6, return_updates=False)
    # x uses only its last state; y uses all its states -> one mit-mot stays.
    g = pt.grad(xs[-1].sum() + ys.sum(), [x0, y0])
    f, f0 = _pair([x0, y0], g, "NUMBA")
    assert _n_mit_mot(f0) == 2 and _n_mit_mot(f) == 1
    _assert_same(f, f0, rng.normal(size=4), rng.normal(size=4))
    # both last-state only -> no mit-mot
    g2 = pt.grad(xs[-1].sum() + 2 * ys[-1].sum(), [x0, y0])
    f, f0 = _pair([x0, y0], g2, "NUMBA")
    assert _n_mit_mot(f) == 0
    _assert_same(f, f0, rng.normal(size=4), rng.normal(size=4))


@pytest.mark.parametrize(
    "cost, mode", [("sum", "NUMBA"), ("second_last", "NUMBA"), ("last_plus_first", "FAST_RUN"), ("sum", "FAST_COMPILE")]
)
def test_costs_that_must_not_convert(cost, mode, rng):
    x0 = pt.vector("x0")
    xs = pytensor.scan(lambda x: pt.sin(x) * 1.2, outputs_info=[x0], n_steps=5, return_updates=False)
    c = {"sum": xs.sum(), "second_last": xs[-2].sum(), "last_plus_first": xs[-1].sum() + xs[0].sum()}[cost]
    g = pt.grad(c, x0)
    f, f0 = _pair([x0], [g], mode)
    assert _n_mit_mot(f) == _n_mit_mot(f0) == 1
    _assert_same(f, f0, rng.normal(size=3))


def test_while_scan(mode):
    x0 = pt.scalar("x0")
    n = pt.iscalar("n")
    xs = pytensor.scan(
        lambda x: (x * 1.1 + pt.sin(x), until(x > 5.0)), outputs_info=[x0], n_steps=n, return_updates=False
    )
    g = pt.grad(xs[-1], x0)
    f, f0 = _pair([x0, n], [g], mode)
    if mode != "FAST_COMPILE":
        assert _n_mit_mot(f) == 0
    for k in (1, 3, 50):
        _assert_same(f, f0, 0.7, k)


def test_truncate_gradient_is_left_alone():
    # The tape is longer than n_steps + 1: no exact sit-sot form, no rewrite.
    x0 = pt.scalar("x0")
    xs = pytensor.scan(
        lambda x: pt.sin(x) * 1.3, outputs_info=[x0], n_steps=6, truncate_gradient=3, return_updates=False
    )
    g = pt.grad(xs[-1], x0)
    f, f0 = _pair([x0], [g], "NUMBA")
    assert _n_mit_mot(f) == 1
    _assert_same(f, f0, 0.4)


def test_nested_gradient_scan(mode):
    # The gradient Scan lives in the step of an outer Scan.
    a = pt.vector("a")

    def outer_step(ai):
        xs = pytensor.scan(lambda x: pt.sin(x) * ai, outputs_info=[ai], n_steps=4, return_updates=False)
        return pt.grad(xs[-1], ai)

    gs = pytensor.scan(outer_step, sequences=[a], return_updates=False)
    f, f0 = _pair([a], [gs], mode)
    if mode != "FAST_COMPILE":
        assert _n_mit_mot(f) == 0
    assert _n_mit_mot(f0) >= 1
    _assert_same(f, f0, np.array([0.3, 0.9, -1.2]))


def test_pymc_compile_dlogp():
    import pymc as pm  # a dev dependency: never skipped
    with pm.Model() as model:
        rho = pm.Normal("rho", 0.5, 0.1)
        x0 = pm.Normal("x0", 0, 1)
        xs = pytensor.scan(lambda x, r: pt.tanh(r * x) + 0.1, outputs_info=[x0], non_sequences=[rho],
                           n_steps=20, return_updates=False)
        pm.Normal("obs", xs[-1], 0.5, observed=0.3)
    dlogp = model.compile_dlogp()
    assert _n_mit_mot(dlogp.f) == 0
    point = {"rho": 0.4, "x0": 0.2}
    ref = pytensor.function(
        model.value_vars,
        pt.grad(model.logp(), model.value_vars),
        mode=SCAN_ORACLE,
    )
    np.testing.assert_allclose(dlogp(point), np.concatenate([np.atleast_1d(v) for v in ref(**point)]), rtol=1e-10)


# --------------------------------------------------------------------------
# Property test: random step functions from a small grammar
# --------------------------------------------------------------------------

_OPS = {
    "tanh": lambda x, p: pt.tanh(x),
    "sin": lambda x, p: pt.sin(x),
    "scale": lambda x, p: x * p["w"],
    "matmul": lambda x, p: (p["W"] @ x.T).T if x.ndim == 2 else p["W"] @ x,
    "seq": lambda x, p: x + p["s"],
    "bump": lambda x, p: pt.exp(-(x**2)),
}


@pytest.fixture(scope="module")
def grammar_functions():
    """One compiled (rewrite, reference) pair per (program, ndim); shapes stay symbolic."""
    cache = {}

    def get(program, ndim):
        key = (program, ndim)
        if key not in cache:
            x0 = pt.tensor("x0", shape=(None,) * ndim)
            seq = pt.tensor("seq", shape=(None,) * (ndim + 1))
            W = pt.matrix("W")
            w = pt.scalar("w")

            def step(s, x, W, w):
                p = {"W": W, "w": w, "s": s}
                for name in program:
                    x = _OPS[name](x, p)
                return x

            xs = pytensor.scan(step, sequences=[seq], outputs_info=[x0], non_sequences=[W, w], return_updates=False)
            cost = (xs[-1] ** 2).sum()
            g = pt.grad(cost, [x0, seq, W, w], disconnected_inputs="ignore")
            # NUMBA's rewrites (the one under test among them), run by ``perform``: a Numba compile of each
            # random program's two Scans took about 7 CPU s; linking rewritten Scans is tested above
            f, f0 = _pair([x0, seq, W, w], g, as_run_by_python("NUMBA"))
            cache[key] = (f, f0)
        return cache[key]

    return get


@settings(max_examples=10)
@given(
    program=st.lists(st.sampled_from(sorted(_OPS)), min_size=1, max_size=2).map(tuple),
    ndim=st.sampled_from([0, 1, 2]),
    n_steps=st.integers(1, 12),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_property_random_steps(grammar_functions, program, ndim, n_steps, d, seed):
    if "matmul" in program and ndim == 0:
        program = tuple(p for p in program if p != "matmul") or ("sin",)
    f, f0 = grammar_functions(program, ndim)
    assert _n_mit_mot(f) == 0
    rng = np.random.default_rng(seed)
    shape = (d,) * ndim
    args = (
        rng.normal(size=shape),
        rng.normal(size=(n_steps, *shape)) * 0.3,
        rng.normal(size=(d, d)) / (d + 1),
        rng.uniform(0.5, 1.2),
    )
    for a, b in zip(f(*args), f0(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("layers", [1, 12])
def test_large_steps_keep_their_tape(layers, rng):
    """A gradient Scan whose step has more than ``MAX_INNER_NODES`` nodes keeps its mit-mot tape (the rebuilt Scan
    would be rewritten and compiled again for little gain); a small one is converted.  Same values either way
    (NUMBA's rewrites, run by ``perform``: nothing compiled)."""
    from pytensor.graph.traversal import applys_between

    from iterops.scan_grad import MAX_INNER_NODES

    def step(x, W):
        y = x
        for _ in range(layers):
            y = pt.tanh(W @ y) + x
        return y

    x0, W = pt.vector("x0"), pt.matrix("W")
    xs = pytensor.scan(step, outputs_info=[x0], non_sequences=[W], n_steps=5, return_updates=False)
    g = [pt.grad(xs[-1].sum(), x0)]
    grad_scans = [n.op for n in applys_between([x0, W], g) if isinstance(n.op, Scan) and n.op.info.n_mit_mot]
    assert len(grad_scans) == 1
    big = len(grad_scans[0].fgraph.apply_nodes) > MAX_INNER_NODES
    assert big == (layers == 12)
    f, f0 = _pair([x0, W], g, as_run_by_python("NUMBA"))
    assert _n_mit_mot(f0) == 1
    assert _n_mit_mot(f) == (1 if big else 0)
    _assert_same(f, f0, rng.normal(size=3), 0.3 * rng.normal(size=(3, 3)))
