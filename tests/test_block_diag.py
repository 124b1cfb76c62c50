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

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run


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


# ---------------------------------------------------------------------------
# Drop-in for pytensor.tensor.linalg.block_diag with any shapes
# ---------------------------------------------------------------------------


def _blocks_of(w, shapes):
    """The diagonal blocks of ``w`` for blocks of ``shapes``: the gradient of sum(B * w) (dense formula)."""
    out, i, j = [], 0, 0
    for r, c in shapes:
        out.append(w[i : i + r, j : j + c])
        i, j = i + r, j + c
    return out


@pytest.mark.parametrize("as_list", [True, False])
def test_matrices_of_unknown_static_shape(mode, as_list, rng):
    a, b, w = pt.matrix("a"), pt.matrix("b"), pt.matrix("w")
    B = block_diag([a, b]) if as_list else block_diag(a, b)
    ga, gb = pytensor.grad((B * w).sum(), [a, b])
    f = pytensor.function([a, b, w], [B, ga, gb], mode=mode)
    for shapes in ([(2, 3), (1, 1)], [(2, 2), (2, 2)], [(0, 3), (2, 0)], [(1, 4), (3, 2)]):
        av, bv = (rng.normal(size=s) for s in shapes)
        ref = sla.block_diag(av, bv)
        wv = rng.normal(size=ref.shape)
        out, ga_v, gb_v = f(av, bv, wv)
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(ga_v, _blocks_of(wv, shapes)[0])
        np.testing.assert_array_equal(gb_v, _blocks_of(wv, shapes)[1])


def test_fused_kernel_only_for_statically_equal_shapes(rng):
    from iterops.linalg.block_diag import BlockDiag

    def uses_kernel(out):
        return any(isinstance(getattr(v.owner, "op", None), BlockDiag) for v in pytensor.graph.ancestors([out]))

    same = [pt.tensor(f"m{i}", shape=(2, 3)) for i in range(3)]
    assert uses_kernel(block_diag(same))
    assert not uses_kernel(block_diag(pt.matrix("a"), pt.matrix("b")))  # equal only maybe, at run time
    assert not uses_kernel(block_diag(pt.tensor("a", shape=(2, 3)), pt.tensor("b", shape=(2, None))))
    vals = [rng.normal(size=(2, 3)) for _ in same]
    np.testing.assert_array_equal(block_diag(same).eval(dict(zip(same, vals))), sla.block_diag(*vals))


def test_mixed_shapes_tuple_of_three_with_empty_blocks_and_gradient(rng):
    shapes = [(0, 3), (2, 2), (1, 0), (3, 1)]
    vals = [rng.normal(size=s) for s in shapes]
    mats = [pt.matrix(f"m{i}") for i in range(len(shapes))]
    B = block_diag(tuple(mats))
    np.testing.assert_array_equal(B.eval(dict(zip(mats, vals))), sla.block_diag(*vals))
    verify_grad(lambda *m: block_diag(list(m)) ** 2, [v for v in vals if v.size], rng=rng)


def test_batched_matrices_of_different_shapes(rng):
    a, b = pt.tensor3("a"), pt.tensor3("b")
    av, bv = rng.normal(size=(2, 1, 3)), rng.normal(size=(2, 2, 2))
    out = block_diag([a, b]).eval({a: av, b: bv})
    np.testing.assert_array_equal(out, np.stack([sla.block_diag(x, y) for x, y in zip(av, bv)]))


def test_single_matrix_and_empty_sequence(rng):
    av = rng.normal(size=(2, 3))
    np.testing.assert_array_equal(block_diag([pt.as_tensor(av)]).eval(), sla.block_diag(av))
    with pytest.raises(ValueError, match="empty sequence"):
        block_diag([])


# ---------------------------------------------------------------------------
# Zero-size stacks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 2, 3), (3, 0, 2), (3, 2, 0), (0, 0, 0)])
def test_zero_size_stack_value_and_gradient(mode, shape, rng):
    x, w = pt.tensor3("x"), pt.matrix("w")
    B = block_diag(x)
    f = pytensor.function([x, w], [B, pytensor.grad((B * w).sum(), x)], mode=mode)
    k, n, m = shape
    xv, wv = rng.normal(size=shape), rng.normal(size=(k * n, k * m))
    b, g = f(xv, wv)
    ref = sla.block_diag(*xv) if k else np.zeros((0, 0))  # scipy: block_diag() is (1, 0)
    np.testing.assert_array_equal(b, ref.reshape(k * n, k * m))
    assert g.shape == shape
