"""Tests of ``iterops.loop`` / ``iterops.taps`` against ``jax.lax.scan`` / ``jax.lax.while_loop``.

Oracles: JAX (float64) for values, finite differences (``verify_grad``) for
gradients, NumPy's ``Generator`` for random draws.  Each PyTensor function is
compiled once and called for several inputs.
"""

from __future__ import annotations

from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pytensor.scan.op import Scan
from pytensor.tensor.random.type import random_generator_type

from iterops import loop, taps

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

jax.config.update("jax_enable_x64", True)

State = namedtuple("State", ["level", "trend"])


def _tree_close(a, b, path="", rtol=1e-10, atol=1e-12):
    """Compare a NumPy pytree with a JAX pytree (same structure)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), path
        for k in a:
            _tree_close(a[k], b[k], f"{path}[{k!r}]", rtol, atol)
    elif isinstance(a, tuple | list):
        assert type(a) is type(b) and len(a) == len(b), (path, type(a), type(b))
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _tree_close(u, v, f"{path}[{i}]", rtol, atol)
    elif a is None:
        assert b is None, path
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (path, a.shape, b.shape)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=path)


def _compile_tree(inputs, tree, mode=None):
    """Compile a function returning the pytree ``tree``; the result is rebuilt as a tree."""
    from iterops.loop import _flatten, _unflatten

    leaves, _, td = _flatten(tree)
    f = pytensor.function(inputs, leaves, mode=mode)
    return lambda *args: _unflatten(td, f(*args))


# ---------------------------------------------------------------------------
# Step functions over pytrees, written once for PyTensor (lib=pt) and JAX (lib=jnp)
# ---------------------------------------------------------------------------


def step_tuple_dict(lib, c, x):
    """tuple carry, dict xs, dict y."""
    a, b = c
    new_a = lib.tanh(a * x["u"] + b)
    new_b = b + 0.5 * x["v"].sum()
    return (new_a, new_b), {"s": new_a.sum(), "ab": new_a * new_b}


def step_namedtuple_none(lib, c, x):
    """namedtuple carry with a None subtree, list xs, tuple y with a None."""
    st_, nothing = c
    u, w = x
    level = 0.9 * st_.level + 0.1 * u
    trend = st_.trend + lib.exp(-(level**2)).sum() * w
    return (State(level, trend), None), (level, None, trend)


def step_bare_carry(lib, c, x):
    """Bare new_carry (no y): a dict carry with a matrix and a nested tuple."""
    M, (v, s) = c["M"], c["pair"]
    M2 = 0.5 * (M @ M.T) / (1.0 + s) + x
    return {"M": M2, "pair": (M2 @ v, s + (v**2).sum())}


def _jax_carry(step):
    """JAX's form of the same step: always (new_carry, y)."""

    def f(c, x):
        out = step(jnp, c, x)
        if step is step_bare_carry:
            return out, None
        return out

    return f


CASES = {
    "tuple_dict": dict(
        step=step_tuple_dict,
        init=lambda r: (r.normal(size=3), np.float64(r.normal())),
        xs=lambda r, n: {"u": r.normal(size=(n, 3)), "v": r.normal(size=(n, 2))},
    ),
    "namedtuple_none": dict(
        step=step_namedtuple_none,
        init=lambda r: (State(r.normal(size=2), np.float64(0.3)), None),
        xs=lambda r, n: [r.normal(size=(n, 2)), r.normal(size=n)],
    ),
    "bare_carry": dict(
        step=step_bare_carry,
        init=lambda r: {"M": 0.3 * r.normal(size=(2, 2)), "pair": (r.normal(size=2), np.float64(0.0))},
        xs=lambda r, n: 0.1 * r.normal(size=(n, 2, 2)),
    ),
}


def _symbolic_like(tree, lead_unknown=False):
    """Symbolic tensors with the static shape/dtype of a NumPy pytree (first axis unknown if asked).

    Static trailing shapes make empty traces (n_steps = 0) carry JAX's shape.
    """
    from iterops.loop import _flatten, _unflatten

    leaves, _, td = _flatten(tree)
    sym = [
        pt.tensor(dtype=str(np.asarray(v).dtype), shape=((None,) if lead_unknown else ()) + np.shape(v)[lead_unknown:])
        for v in leaves
    ]
    return _unflatten(td, sym), sym, leaves


@pytest.fixture(scope="module", params=list(CASES))
def scan_case(request):
    case = CASES[request.param]
    r = np.random.default_rng(0)
    init_sym, init_in, _ = _symbolic_like(case["init"](r))
    xs_sym, xs_in, _ = _symbolic_like(case["xs"](r, 4), lead_unknown=True)
    step = case["step"]
    final, ys = loop(lambda c, x: step(pt, c, x), init_sym, xs_sym)
    f = _compile_tree(init_in + xs_in, (final, ys))
    return case, f


@pytest.mark.parametrize("n", [0, 1, 5])
def test_pytree_loop_matches_jax_scan(scan_case, n):
    case, f = scan_case
    r = np.random.default_rng(n)
    init, xs = case["init"](r), case["xs"](r, n)
    from iterops.loop import _flatten

    final, ys = f(*_flatten(init)[0], *_flatten(xs)[0])
    jfinal, jys = jax.lax.scan(_jax_carry(case["step"]), init, xs, length=n)
    _tree_close(final, jfinal)
    _tree_close(ys, jys)


def test_return_forms_with_tuple_carry():
    """A tuple carry returned bare is a carry, not (new_carry, y); the 2-tuple form traces y."""
    a, b = pt.dscalar("a"), pt.dscalar("b")
    (fa, fb), ys = loop(lambda c, _: (c[1], c[0] + c[1]), (a, b), n_steps=6)
    assert ys is None
    (ga, gb), ys2 = loop(lambda c, _: ((c[1], c[0] + c[1]), c[0]), (a, b), n_steps=6)
    f = pytensor.function([a, b], [fa, fb, ga, gb, ys2])
    out = f(0.0, 1.0)
    np.testing.assert_allclose(out[:4], [8.0, 13.0, 8.0, 13.0])
    np.testing.assert_allclose(out[4], [0, 1, 1, 2, 3, 5])
    # A leaf carry with a 2-tuple return is (new_carry, y).
    final, ys3 = loop(lambda c, _: (c + 1.0, c * 2.0), a, n_steps=3)
    np.testing.assert_allclose(pytensor.function([a], [final, ys3])(1.0)[1], [2.0, 4.0, 6.0])


def test_builds_one_ordinary_scan_and_rewrites_apply():
    """The loop is a plain Scan; using only ``final`` leaves an untraced state after rewriting."""
    x0, xs = pt.dvector("x0"), pt.dmatrix("xs")
    final, ys = loop(lambda c, x: (c * 0.5 + x, c.sum()), x0, xs)
    scans = [v.owner for v in pytensor.graph.traversal.ancestors([final, ys]) if v.owner and isinstance(v.owner.op, Scan)]
    assert len({n for n in scans}) == 1
    f = pytensor.function([x0, xs], final)
    (node,) = [n for n in f.maker.fgraph.apply_nodes if isinstance(n.op, Scan)]
    assert node.op.info.n_untraced_sit_sot == 1 and node.op.info.n_sit_sot == 0
    np.testing.assert_allclose(f(np.ones(2), np.ones((3, 2))), [1.875, 1.875])


# ---------------------------------------------------------------------------
# While-loops against jax.lax.while_loop
# ---------------------------------------------------------------------------


def _jax_bounded_while(step, init, xs, n, y_like):
    """``for t < n: carry, y, brk = step(carry, xs[t]); if brk: break`` with lax.while_loop.

    ``xs`` holds at least ``n`` steps; traces are written to a buffer of
    ``len(xs)`` rows and cut to the steps run.
    """
    n_buf = len(jax.tree_util.tree_leaves(xs)[0])
    ybuf = jax.tree_util.tree_map(lambda y: jnp.zeros((n_buf, *jnp.shape(y)), jnp.asarray(y).dtype), y_like)

    def cond(s):
        t, _, _, stop = s
        return (t < n) & ~stop

    def body(s):
        t, c, yb, _ = s
        x = jax.tree_util.tree_map(lambda a: a[t], xs)
        c, y, brk = step(jnp, c, x)
        yb = jax.tree_util.tree_map(lambda b, v: b.at[t].set(v), yb, y)
        return t + 1, c, yb, brk

    t, c, yb, stop = jax.lax.while_loop(cond, body, (0, init, ybuf, jnp.asarray(False)))
    return c, yb, t, stop


def step_while(lib, c, x):
    """A damped recursion that stops when the increment is small."""
    v, k = c["v"], c["k"]
    new_v = 0.5 * v + x
    return {"v": new_v, "k": k + 1}, (new_v.sum(), k), lib.abs(new_v - v).max() < 0.3


@pytest.fixture(scope="module")
def while_fn():
    v0, xs, n = pt.dvector("v0"), pt.dmatrix("xs"), pt.iscalar("n")
    final, ys, done = loop(lambda c, x: step_while(pt, c, x), {"v": v0, "k": np.int64(0)}, xs[:n], n_steps=n)
    return _compile_tree([v0, xs, n], (final, ys, done))


_jax_while_fn = jax.jit(
    lambda v0, xs, n: _jax_bounded_while(step_while, {"v": v0, "k": jnp.int64(0)}, xs, n, (0.0, jnp.int64(0)))
)


@given(n=st.integers(0, 12), scale=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_while_loop_matches_jax(while_fn, n, scale, seed):
    r = np.random.default_rng(seed)
    v0, xs = r.normal(size=3), scale * r.normal(size=(12, 3))
    final, ys, done = while_fn(v0, xs, n)
    jf, jyb, jt, jdone = _jax_while_fn(v0, xs, n)
    _tree_close(final, jf)
    _tree_close(ys, jax.tree_util.tree_map(lambda b: b[: int(jt)], jyb))
    assert bool(done) == bool(jdone)


def test_while_loop_done_semantics(while_fn):
    v0 = np.zeros(3)
    # Never small enough increments: runs all n steps, done False.
    xs = np.tile([[10.0], [-10.0]], (6, 3))
    final, ys, done = while_fn(v0, xs, 5)
    assert not done and final["k"] == 5 and ys[0].shape == (5,)
    # Breaks exactly at the last allowed step: done True although all steps ran.
    xs2 = xs.copy()
    xs2[2] = 0.5 * (0.5 * (0.5 * 0 + xs[0]) + xs[1])  # new_v == v at t=2 -> stop
    final, ys, done = while_fn(v0, xs2, 3)
    assert done and final["k"] == 3
    # n = 0: final is init, done False, empty traces.
    final, ys, done = while_fn(v0, xs, 0)
    assert not done and final["k"] == 0 and ys[0].shape == (0,)
    np.testing.assert_array_equal(final["v"], v0)


# ---------------------------------------------------------------------------
# n_steps = 0, taps
# ---------------------------------------------------------------------------


def test_n_steps_zero_keeps_init_and_trailing_shape(mode):
    x0 = pt.tensor("x0", shape=(3,))
    w = pt.dvector("w")
    n = pt.iscalar("n")

    def step(c, _):
        a, b = c["state"]
        return {"state": c["state"].push(a + b), "x": c["x"] * 2}, {"outer": pt.outer(c["x"], c["x"]), "free": w * c["x"][0]}

    init = {"state": taps(pt.as_tensor(np.array([1.0, 2.0])), taps=[-2, -1]), "x": x0}
    final, ys = loop(step, init, n_steps=n)
    f = _compile_tree([x0, w, n], (final, ys), mode=mode)
    fin, y = f(np.arange(3.0), np.ones(4), 0)
    np.testing.assert_array_equal(fin["state"], [1.0, 2.0])
    np.testing.assert_array_equal(fin["x"], np.arange(3.0))
    # The static trailing shape is known and the Numba Scan honours it;
    # PyTensor's Python and C Scan implementations (FAST_COMPILE, CVM)
    # allocate empty traces as (0, 0, ...) regardless (documented limitation).
    assert y["outer"].shape == ((0, 0, 0) if mode in ("FAST_COMPILE", "CVM") else (0, 3, 3))
    assert y["free"].shape[0] == 0  # trailing shape not known statically
    fin, y = f(np.arange(3.0), np.ones(4), 2)
    np.testing.assert_array_equal(fin["state"], [3.0, 5.0])
    assert y["outer"].shape == (2, 3, 3) and y["free"].shape == (2, 4)


def _jax_taps(coef, x0, eps):
    """y[t] = coef . (y[t-3], y[t-1]) + eps[t] with a JAX window carry (oldest first)."""

    def f(win, e):
        y = coef[0] * win[0] + coef[1] * win[2] + e
        return jnp.concatenate([win[1:], y[None]]), y

    return jax.lax.scan(f, x0, eps)


@pytest.fixture(scope="module")
def taps_fn():
    x0, eps, coef = pt.dmatrix("x0", shape=(3, 2)), pt.dmatrix("eps", shape=(None, 2)), pt.dvector("coef")

    def step(c, e):
        assert len(c) == 2
        y3, y1 = c
        y = coef[0] * y3 + coef[1] * c[1] + e
        return c.push(y), y

    final, ys = loop(step, taps(x0, taps=[-3, -1]), eps)
    return pytensor.function([coef, x0, eps], [final, ys])


@pytest.mark.parametrize("n", [0, 1, 2, 6])
def test_taps_carry_matches_jax(taps_fn, n):
    r = np.random.default_rng(n)
    coef, x0, eps = np.array([0.3, 0.5]), r.normal(size=(3, 2)), r.normal(size=(n, 2))
    final, ys = taps_fn(coef, x0, eps)
    jf, jys = _jax_taps(coef, x0, eps)
    _tree_close((final, ys), (jf, jys))


def test_taps_single_constant_step_and_default_taps():
    """n_steps=1 (PyTensor builds no Scan) and taps=None (all entries of x)."""
    x0 = pt.as_tensor(np.array([1.0, 2.0, 4.0]))
    final, ys = loop(lambda c, _: (c.push(c[0] + c[1] + c[2]), c[2]), taps(x0), n_steps=1)
    fin, y = pytensor.function([], [final, ys])()
    np.testing.assert_array_equal(fin, [2.0, 4.0, 7.0])
    np.testing.assert_array_equal(y, [4.0])


def test_taps_sequence_lookahead():
    seq, w = pt.dvector("seq"), pt.dmatrix("w")

    def step(c, x):
        s0, s2 = x["s"]
        with pytest.raises(TypeError, match="tapped sequence"):
            x["s"].push(s0)
        return c + s0 * s2 + x["w"].sum(), s2 - s0

    final, ys = loop(step, np.float64(0.0), {"s": taps(seq, taps=[0, 2]), "w": w})
    f = pytensor.function([seq, w], [final, ys])
    s, wv = np.arange(1.0, 7.0), np.ones((4, 2))
    fin, y = f(s, wv)
    np.testing.assert_allclose(y, s[2:] - s[:-2])
    np.testing.assert_allclose(fin, np.sum(s[:-2] * s[2:]) + 8.0)
    with pytest.raises(Exception, match="must agree"):
        f(s, np.ones((5, 2)))  # run-time length check: 6 - 2 != 5


# ---------------------------------------------------------------------------
# Random generators in the carry
# ---------------------------------------------------------------------------


def test_rng_in_carry_comes_back_in_final(mode):
    rng = random_generator_type("rng")

    def step(c, _):
        r, s = c
        r2, d = pt.random.normal(0, 1, rng=r, return_next_rng=True)
        return (r2, s + d), d

    (fr, fs), ys = loop(step, (rng, np.float64(0.0)), n_steps=5)
    _, nxt = pt.random.normal(0, 1, rng=fr, return_next_rng=True)
    f = pytensor.function([rng], [fs, ys, nxt], mode=mode)
    s, y, d = f(np.random.default_rng(7))
    ref = np.random.default_rng(7).normal(size=6)
    np.testing.assert_allclose(y, ref[:5])
    np.testing.assert_allclose(s, ref[:5].sum())
    np.testing.assert_allclose(d, ref[5])  # the final generator continues the stream


def test_rng_as_y_raises():
    rng = random_generator_type("rng")

    def step(r, _):
        r2, d = pt.random.normal(0, 1, rng=r, return_next_rng=True)
        return r2, r2

    with pytest.raises(TypeError, match=r"y is a random generator .* keep it in the carry"):
        loop(step, rng, n_steps=3)


# ---------------------------------------------------------------------------
# Gradients against finite differences
# ---------------------------------------------------------------------------


def test_grad_pytree_scan():
    r = np.random.default_rng(1)

    def fn(a, b, u, v):
        (fa, fb), ys = loop(lambda c, x: step_tuple_dict(pt, c, x), (a, b), {"u": u, "v": v})
        return fa.sum() + fb * 0.3 + (ys["ab"] ** 2).sum() + ys["s"].sum()

    pytensor.gradient.verify_grad(
        fn, [r.normal(size=3), np.array(0.2), r.normal(size=(4, 3)), r.normal(size=(4, 2))], rng=r
    )


def test_grad_taps_carry():
    r = np.random.default_rng(2)

    def fn(coef, x0, eps):
        def step(c, e):
            y = coef[0] * c[0] + coef[1] * c[1] + e
            return c.push(y), y

        final, ys = loop(step, taps(x0, taps=[-2, -1]), eps)
        return (final**2).sum() + (ys**2).sum()

    pytensor.gradient.verify_grad(fn, [np.array([0.3, -0.4]), r.normal(size=2), r.normal(size=5)], rng=r)


def test_grad_through_while_carry():
    """The break depends on an integer counter only, so finite differences see the same path."""
    r = np.random.default_rng(3)

    def fn(v0, A):
        def step(c, _):
            v, k = c
            return (pt.tanh(A @ v), k + 1), v.sum(), pt.ge(k + 1, 3)

        (v, k), ys, done = loop(step, (v0, np.int64(0)), n_steps=6)
        return (v**2).sum() + ys.sum()

    pytensor.gradient.verify_grad(fn, [r.normal(size=2), 0.5 * r.normal(size=(2, 2))], rng=r)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

a_vec = pt.dvector("a")
a_row = pt.tensor("row", dtype="float64", shape=(1, None))


def _tp():
    return taps(pt.dvector("t0"), taps=[-1])


ERRORS = [
    # (init, step, xs, n_steps, exception, message regex)
    ("structure", (a_vec, a_vec), lambda c, x: [c[0], c[1]], None, 2, TypeError, r"structure of init, \(\*, \*\); got .*\[\*, \*\]"),
    ("dict_keys", {"p": a_vec}, lambda c, x: {"q": c["p"]}, None, 2, TypeError, r"\{'p': \*\}"),
    ("dtype", {"p": (a_vec,)}, lambda c, x: {"p": (c["p"][0].astype("float32"),)}, None, 2, TypeError,
     r"new_carry\['p'\]\[0\] has type .*float32.* but init\['p'\]\[0\] has type .*float64"),
    ("ndim", (a_vec,), lambda c, x: (pt.outer(c[0], c[0]),), None, 2, TypeError, r"new_carry\[0\] has type .*ndim=2.*ndim=1"),
    ("broadcastable", a_row, lambda c, x: pt.concatenate([c, c], axis=0)[:1] + pt.dmatrix(), None, 2, TypeError,
     r"broadcastable"),
    ("static_shape", pt.zeros(3), lambda c, x: pt.zeros(4), None, 2, TypeError, r"static shape \(4,\).*\(3,\)"),
    ("not_pushed", (_tp(),), lambda c, x: (c[0][0],), None, 2, RuntimeError, r"init\[0\] is a tapped carry.*never called"),
    ("pushed_twice", _tp(), lambda c, x: (c.push(c[0]), c.push(c[0])), None, 2, RuntimeError, "more than once"),
    ("pushed_elsewhere", (_tp(), _tp()), lambda c, x: (c[1].push(c[0][0]), c[0].push(c[1][0])), None, 2, RuntimeError,
     r"push\(\) of init\[1\], not of init\[0\]"),
    ("taps_to_plain", (a_vec, _tp()), lambda c, x: (c[1].push(c[0]), c[1]), None, 2, TypeError, "not a tapped carry"),
    ("taps_in_y", _tp(), lambda c, x: (c.push(c[0]), c), None, 2, TypeError, r"y is a taps object"),
    ("positive_carry_taps", taps(a_vec, taps=[0]), lambda c, x: c.push(c[0]), None, 2, ValueError, "distinct negative"),
    ("taps_len", taps(pt.zeros(3), taps=[-2, -1]), lambda c, x: c.push(c[0]), None, 2, ValueError, r"needs 2 initial entries.*\(3,\)"),
    ("taps_none_len", taps(a_vec), lambda c, x: c.push(c[0]), None, 2, ValueError, "taps=None"),
    ("seq_taps_negative", a_vec, lambda c, x: c, taps(a_vec, taps=[-1, 0]), None, ValueError, "non-negative"),
    ("seq_taps_none", a_vec, lambda c, x: c, taps(a_vec), None, ValueError, "explicit non-negative taps"),
    ("no_n_steps", a_vec, lambda c, x: c, None, None, ValueError, "n_steps is required"),
    ("negative_n_steps", a_vec, lambda c, x: c, None, -1, ValueError, "non-negative"),
    ("float_n_steps", a_vec, lambda c, x: c, None, pt.dscalar(), TypeError, "integer scalar"),
    ("n_steps_vs_xs", a_vec, lambda c, x: c, pt.zeros((4, 2)), 3, ValueError, r"n_steps=3 does not match .* \(4 for xs\)"),
    ("xs_lengths", a_vec, lambda c, x: c, {"u": pt.zeros(4), "v": pt.zeros(5)}, None, ValueError,
     r"same usable length .* 4 for xs\['u'\] and 5 for xs\['v'\]"),
    ("xs_scalar", a_vec, lambda c, x: c, pt.dscalar(), 3, ValueError, "at least one dimension"),
    ("cond_not_scalar", a_vec, lambda c, x: (c, None, c > 0), None, 3, TypeError, "break_cond must be a boolean scalar"),
    ("cond_float", a_vec, lambda c, x: (c, None, c.sum()), None, 3, TypeError, "break_cond must be a boolean scalar"),
    ("y_not_tensor_like", a_vec, lambda c, x: (c, object()), None, 3, TypeError, r"y must be a tensor-like"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(case):
    _, init, step, xs, n_steps, exc, msg = case
    with pytest.raises(exc, match=msg):
        loop(step, init, xs, n_steps)


def test_step_not_callable():
    with pytest.raises(TypeError, match="callable"):
        loop(None, a_vec, n_steps=2)


def test_run_time_n_steps_mismatch():
    xs, n = pt.dvector("xs"), pt.iscalar("n")
    final, _ = loop(lambda c, x: c + x, np.float64(0.0), xs, n_steps=n)
    f = pytensor.function([xs, n], final)
    assert f(np.ones(3), 3) == 3.0
    with pytest.raises(AssertionError, match="must agree"):
        f(np.ones(3), 2)


# ---------------------------------------------------------------------------
# Scan fusion sees through loop()
# ---------------------------------------------------------------------------


def test_doubling_lyapunov_written_with_loop_is_fused():
    """Smith doubling written with ``loop`` becomes iterops' fused doubling Op."""
    import scipy.linalg

    import iterops
    from iterops.linalg.lyapunov_iteration import SmithDoublingLoop

    A, Q = pt.dmatrix("A"), pt.dmatrix("Q")

    def doubling(c, _):
        alpha, gamma = c
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), None, pt.max(pt.abs(new_gamma - gamma)) < 1e-12

    (_, X), _, _ = loop(doubling, (A, Q), n_steps=100)
    fused = iterops.fuse_loops(X)
    kinds = {type(v.owner.op) for v in pytensor.graph.traversal.ancestors([fused]) if v.owner}
    assert Scan not in kinds
    f = pytensor.function([A, Q], X)
    ops = [n.op for n in f.maker.fgraph.apply_nodes]
    assert not any(isinstance(op, Scan) for op in ops)
    assert any(isinstance(getattr(op, "core_op", op), SmithDoublingLoop) for op in ops)
    r = np.random.default_rng(4)
    a = 0.4 * r.normal(size=(3, 3))
    q = np.eye(3) + 0.1 * np.ones((3, 3))
    np.testing.assert_allclose(f(a, q), scipy.linalg.solve_discrete_lyapunov(a, q), rtol=1e-9, atol=1e-12)
