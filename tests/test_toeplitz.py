"""solve_toeplitz (iterops.ts.toeplitz) against scipy.linalg.solve_toeplitz, dense solves and finite differences."""


import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg as sl
from pytensor.gradient import pushforward, verify_grad

from conftest import evaluate, jacobian_check
import iterops
from iterops.ts import solve_toeplitz

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

ATOL = 1e-10
# Gradient and batching checks compile many small graphs: use the Python linker (whose perform
# runs the same Numba kernels); every linker is covered by the ``mode``-parametrized tests.
FAST = "FAST_COMPILE"


# ---------------------------------------------------------------------------
# solve_toeplitz
# ---------------------------------------------------------------------------


def _toeplitz_case(rng, n, k=None, symmetric=False):
    c = rng.normal(size=n)
    c[0] += 2.0 * n  # diagonally dominant: every leading block non-singular
    r = c.copy() if symmetric else rng.normal(size=n)
    b = rng.normal(size=n if k is None else (n, k))
    return c, r, b


def test_solve_toeplitz_matches_scipy_every_linker(mode, rng):
    c, r, B = _toeplitz_case(rng, 7, 3)
    cv, rv, Bv, bv = pt.vector("c"), pt.vector("r"), pt.matrix("B"), pt.vector("b")
    fn = pytensor.function(
        [cv, rv, Bv, bv],
        [solve_toeplitz((cv, rv), Bv), solve_toeplitz(cv, bv), solve_toeplitz((cv, rv), bv)],
        mode=mode,
    )
    X, x_sym, x_gen = fn(c, r, B, B[:, 0])
    np.testing.assert_allclose(X, sl.solve_toeplitz((c, r), B), atol=ATOL)
    np.testing.assert_allclose(x_sym, sl.solve_toeplitz(c, B[:, 0]), atol=ATOL)
    np.testing.assert_allclose(x_gen, sl.solve_toeplitz((c, r), B[:, 0]), atol=ATOL)
    assert x_sym.shape == (7,) and X.shape == (7, 3)


def test_solve_toeplitz_scipy_docstring_example():
    x = evaluate(solve_toeplitz(([1.0, 3, 6, 10], [1.0, -1, -2, -3]), [1.0, 2, 2, 5]))
    np.testing.assert_allclose(x, sl.solve_toeplitz(([1, 3, 6, 10], [1, -1, -2, -3]), [1, 2, 2, 5]), atol=1e-12)


def test_solve_toeplitz_indefinite_but_strongly_regular(rng):
    """Not positive definite, but all leading blocks regular: Levinson solves it like scipy."""
    c = np.array([1.0, 2.0, 0.5, -0.3])
    b = rng.normal(size=4)
    assert np.min(np.linalg.eigvalsh(sl.toeplitz(c))) < 0
    np.testing.assert_allclose(evaluate(solve_toeplitz(c, b)), sl.solve_toeplitz(c, b), atol=1e-10)


def test_solve_toeplitz_batched_vs_looped(rng):
    cs = np.stack([_toeplitz_case(rng, 5)[0] for _ in range(3)])
    rs = rng.normal(size=(3, 5))
    B = rng.normal(size=(3, 5, 2))
    b = rng.normal(size=(2, 3, 5))  # (batch, batch, n) vectors broadcast against c (3, n)
    X, xb = evaluate(solve_toeplitz((cs, rs), B), solve_toeplitz(cs, b, b_ndim=1))
    for i in range(3):
        np.testing.assert_allclose(X[i], sl.solve_toeplitz((cs[i], rs[i]), B[i]), atol=ATOL)
        for j in range(2):
            np.testing.assert_allclose(xb[j, i], sl.solve_toeplitz(cs[i], b[j, i]), atol=ATOL)


def test_solve_toeplitz_grad(rng):
    c, r, B = _toeplitz_case(rng, 5, 2)
    verify_grad(lambda c, r, B: solve_toeplitz((c, r), B), [c, r, B], rng=rng, mode=FAST)
    verify_grad(lambda c, b: solve_toeplitz(c, b), [c, B[:, 0]], rng=rng, mode=FAST)
    # batched gradient (Blockwise of the pullback)
    cs = np.stack([c, _toeplitz_case(rng, 5)[0]])
    verify_grad(lambda c, b: solve_toeplitz(c, b, b_ndim=1), [cs, rng.normal(size=(2, 5))], rng=rng, mode=FAST)


def test_solve_toeplitz_grad_against_dense_solve(rng):
    """Reverse-mode gradient equals autodiff of a dense solve of the same Toeplitz matrix."""
    c, r, b = _toeplitz_case(rng, 6)
    cv, rv, bv = pt.vector("c"), pt.vector("r"), pt.vector("b")
    w = rng.normal(size=6)
    ours = pt.dot(w, solve_toeplitz((cv, rv), bv))
    dense = pt.dot(w, pt.linalg.solve(iterops.ts.toeplitz.toeplitz_matrix(cv, rv), bv))
    f = pytensor.function([cv, rv, bv], pytensor.grad(ours, [cv, rv, bv]) + pytensor.grad(dense, [cv, rv, bv]), mode=FAST)
    out = f(c, r, b)
    for a, d in zip(out[:3], out[3:]):
        np.testing.assert_allclose(a, d, atol=1e-10)
    assert out[1][0] == 0.0  # r[0] is ignored


def test_solve_toeplitz_second_derivatives(rng):
    """The pullback is written with solve_toeplitz itself, so Hessians compose (vs dense solve)."""
    c, _, b = _toeplitz_case(rng, 4)
    cv = pt.vector("c")
    cost = pt.sum(solve_toeplitz(cv, pt.as_tensor(b)) ** 2)
    dense = pt.sum(pt.linalg.solve(iterops.ts.toeplitz.toeplitz_matrix(cv), pt.as_tensor(b)) ** 2)
    f = pytensor.function([cv], [pytensor.gradient.hessian(cost, cv), pytensor.gradient.hessian(dense, cv)], mode=FAST)
    H, H_dense = f(c)
    np.testing.assert_allclose(H, H_dense, rtol=1e-8, atol=1e-12)


def test_solve_toeplitz_pushforward(rng):
    c, r, B = _toeplitz_case(rng, 5, 2)
    cv = pt.vector("c")
    jacobian_check(solve_toeplitz((cv, pt.as_tensor(r)), pt.as_tensor(B)), cv, c, rng.normal(size=5))
    Bv = pt.matrix("B")
    jacobian_check(solve_toeplitz(pt.as_tensor(c), Bv), Bv, B, rng.normal(size=B.shape))
    jacobian_check(solve_toeplitz(cv, pt.as_tensor(B)), cv, c, rng.normal(size=5))  # c is also r


def test_solve_toeplitz_failure_is_nan():
    cv, bv = pt.vector("c"), pt.vector("b")
    f = pytensor.function([cv, bv], solve_toeplitz(cv, bv), mode=FAST)
    assert np.all(np.isnan(f([0.0, 1.0, 0.2], [1.0, 2.0, 3.0])))  # singular leading 1x1 block
    assert np.all(np.isnan(f([1.0, 1.0, 0.2], [1.0, 2.0, 3.0])))  # singular leading 2x2 block
    assert np.all(np.isnan(f([1.0, np.nan, 0.2], [1.0, 2.0, 3.0])))
    assert np.all(np.isnan(f([1.0, 0.1, 0.2], [1.0, np.inf, 3.0])))


def test_solve_toeplitz_bad_input():
    with pytest.raises(ValueError, match="c and r must have the same length"):
        solve_toeplitz((np.ones(3), np.ones(4)), np.ones(3))
    with pytest.raises(ValueError, match="b must have n rows"):
        solve_toeplitz(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="b_ndim"):
        solve_toeplitz(np.ones(3), np.ones(3), b_ndim=3)
    with pytest.raises(ValueError, match="c must have at least 1 dimensions"):
        solve_toeplitz(pt.scalar("c"), np.ones(3))
    with pytest.raises(TypeError, match="complex"):
        solve_toeplitz(np.ones(3) + 1j, np.ones(3))


def test_solve_toeplitz_double_pullback_pushforward(rng):
    """PyTensor's double-pullback pushforward (batched forward mode uses it) in all of (c, r, b) at once,
    against central differences of scipy's solver."""
    c, r, b = _toeplitz_case(rng, 4, 2)
    C, R, B = pt.vector("c"), pt.vector("r"), pt.matrix("b")
    tangents = [C.type("tc"), R.type("tr"), B.type("tb")]
    jvp = pushforward(solve_toeplitz((C, R), B), [C, R, B], tangents, use_op_pushforward=False)
    t = [rng.normal(size=c.shape), rng.normal(size=r.shape), rng.normal(size=b.shape)]
    got = pytensor.function([C, R, B, *tangents], jvp, mode=FAST)(c, r, b, *t)
    eps = 1e-6
    fd = (
        sl.solve_toeplitz((c + eps * t[0], r + eps * t[1]), b + eps * t[2])
        - sl.solve_toeplitz((c - eps * t[0], r - eps * t[1]), b - eps * t[2])
    ) / (2 * eps)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)
