"""block_diag against scipy.linalg.block_diag and finite differences."""

import pickle

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg as sla
from hypothesis import given
from hypothesis import strategies as st
from pytensor.gradient import verify_grad

from iterops import block_diag


@pytest.fixture(scope="module")
def f3():
    x = pt.tensor3("x")
    return pytensor.function([x], block_diag(x))


@given(k=st.integers(0, 5), n=st.integers(0, 4), m=st.integers(0, 4), seed=st.integers(0, 2**31))
def test_matches_scipy(f3, k, n, m, seed):
    x = np.random.default_rng(seed).normal(size=(k, n, m))
    out = f3(x)
    assert out.shape == (k * n, k * m)
    if k:
        np.testing.assert_array_equal(out, sla.block_diag(*x))


def test_every_linker_with_gradient(mode, rng):
    x = pt.tensor3("x")
    w = pt.matrix("w")
    B = block_diag(x)
    f = pytensor.function([x, w], [B, pytensor.grad((B * w).sum(), x)], mode=mode)
    xv = rng.normal(size=(3, 2, 4))
    wv = rng.normal(size=(6, 12))
    b, g = f(xv, wv)
    np.testing.assert_array_equal(b, sla.block_diag(*xv))
    np.testing.assert_array_equal(g, np.stack([wv[2 * i : 2 * i + 2, 4 * i : 4 * i + 4] for i in range(3)]))


def test_verify_grad(rng):
    verify_grad(lambda x: block_diag(x) ** 2, [rng.normal(size=(3, 2, 3))], rng=rng)


def test_second_derivative(rng):
    verify_grad(lambda x: pytensor.grad((block_diag(x) ** 3).sum(), x), [rng.normal(size=(2, 2, 2))], rng=rng)


def test_batched_equals_loop(rng):
    x = pt.tensor4("x")
    B = block_diag(x)
    assert B.type.ndim == 3
    xv = rng.normal(size=(2, 3, 2, 2))
    out = B.eval({x: xv})
    np.testing.assert_array_equal(out, np.stack([sla.block_diag(*xi) for xi in xv]))
    verify_grad(lambda x: block_diag(x), [xv], rng=rng)


def test_symbolic_k_and_static_shapes():
    assert block_diag(pt.tensor("x", shape=(3, 2, 5))).type.shape == (6, 15)
    assert block_diag(pt.tensor("x", shape=(None, 2, 5))).type.shape == (None, None)


def test_dtypes_preserved(rng):
    for dtype in ("float32", "int64", "complex128"):
        x = pt.tensor3("x", dtype=dtype)
        xv = (rng.normal(size=(2, 2, 2)) * 10).astype(dtype)
        out = block_diag(x).eval({x: xv})
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, sla.block_diag(*xv))


def test_sequence_of_matrices_dropin(rng):
    a, b, c = rng.normal(size=(2, 3)), rng.normal(size=(2, 3)), rng.normal(size=(1, 4))
    np.testing.assert_array_equal(block_diag(a, b).eval(), sla.block_diag(a, b))
    np.testing.assert_array_equal(block_diag(a, c).eval(), sla.block_diag(a, c))  # unequal shapes
    A, Bm = pt.matrix("A"), pt.matrix("B")
    np.testing.assert_array_equal(block_diag(A, Bm).eval({A: a, Bm: c}), sla.block_diag(a, c))


def test_pushforward(rng):
    x, t = pt.tensor3("x"), pt.tensor3("t")
    jvp = pytensor.gradient.pushforward(block_diag(x), x, t, use_op_pushforward=True)
    tv = rng.normal(size=(2, 2, 3))
    # block_diag is linear: the tangent map does not even depend on x
    np.testing.assert_array_equal(jvp.eval({t: tv}), sla.block_diag(*tv))


def test_pickle(rng):
    x = pt.tensor3("x")
    f = pickle.loads(pickle.dumps(pytensor.function([x], block_diag(x))))
    xv = rng.normal(size=(2, 2, 2))
    np.testing.assert_array_equal(f(xv), sla.block_diag(*xv))


def test_bad_input():
    with pytest.raises(ValueError, match=r"ndim >= 3, got x with shape \(None, None\)"):
        block_diag(pt.matrix("x"))
    with pytest.raises(ValueError, match=r"x\[1\] with shape \(None,\)"):
        block_diag(pt.matrix("a"), pt.vector("b"))
    with pytest.raises(ValueError, match="at least one"):
        block_diag()
    with pytest.raises(TypeError, match="numeric"):
        block_diag(np.array([[["a"]]]))
