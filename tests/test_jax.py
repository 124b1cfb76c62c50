"""iterops under JAX: every Op's JAX implementation (:mod:`iterops.jax`) against the Numba Op and oracles.

* For every Op (and every gradient Op reached by PyTensor's gradient graph), a PyTensor graph compiled with
  ``mode="JAX"`` returns the Numba Op's values and ``pytensor.grad`` gradients to 1e-10 (float64).  The Numba
  Ops are themselves tested against oracles in their own test modules; some JAX results are also checked
  against oracles directly here (scipy, statsmodels, dynamax).
* ``jax.grad`` of the JAX-ified graph (what PyMC's numpyro/blackjax samplers differentiate: the
  ``jax.custom_vjp`` rules) equals the Numba gradient too.
* Batched (``Blockwise``) inputs, ``jax.jit`` and ``jax.vmap`` of the plain JAX functions.
* Failure values (NaN, ``-inf``), the fusion rewrite in JAX mode, and NUTS with numpyro / blackjax.
"""

from __future__ import annotations

import functools
import warnings
import zlib
from functools import partial

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
import pytest  # noqa: E402
import scipy.linalg  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pytensor.compile import mode as pt_mode  # noqa: E402
from pytensor.graph.fg import FunctionGraph  # noqa: E402
from pytensor.link.jax.dispatch import jax_funcify  # noqa: E402
from pytensor.scan.op import Scan  # noqa: E402

import iterops  # noqa: E402
from conftest import SCAN_ORACLE  # noqa: E402
from iterops import examples  # noqa: E402
from iterops.jax import ar as jar  # noqa: E402
from iterops.jax import kalman as jkalman  # noqa: E402
from iterops.jax import levinson as jlevinson  # noqa: E402
from iterops.jax import lyapunov as jlyap  # noqa: E402
from iterops.jax import toeplitz as jtoeplitz  # noqa: E402
from iterops.jax import riccati as jriccati  # noqa: E402
from iterops.jax.block_diag import block_diag as jblock_diag  # noqa: E402
from iterops.linalg import lyapunov_fixed_point_loop, smith_doubling_loop, solve_discrete_are  # noqa: E402
from iterops.ts.kalman import KalmanFilter  # noqa: E402
from iterops.ts.levinson_recursion import levinson_recursion  # noqa: E402

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

TOL = 1e-10


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _tensor(name, value):
    """A symbolic input with the value's static shape (PyMC's JAX samplers freeze shapes too)."""
    value = np.asarray(value)
    return pt.tensor(name, shape=value.shape, dtype=value.dtype)


def _cost(outputs, rng):
    """A random linear functional of every float output (NaN entries, e.g. missing forecast errors, skipped)."""
    total = 0
    for o in outputs:
        w = pt.constant(rng.normal(size=o.type.shape) if o.type.ndim else rng.normal())
        total = total + pt.where(pt.isnan(o), 0.0, o * w).sum()
    return total


def _jaxify(inputs, outputs):
    """The graph as one JAX function, rewritten as ``mode="JAX"`` rewrites it (PyMC's ``get_jaxified_graph``)."""
    fgraph = FunctionGraph(inputs=inputs, outputs=outputs, clone=True)
    pt_mode.JAX.optimizer.rewrite(fgraph)
    return jax_funcify(fgraph), fgraph


def _close(actual, expected, tol=TOL, what=""):
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=f"{what}: NaN pattern")
    np.testing.assert_array_equal(np.isinf(actual), np.isinf(expected), err_msg=f"{what}: inf pattern")
    ok = np.isfinite(expected)
    scale = 1.0 + np.abs(expected[ok])
    err = np.abs(actual[ok] - expected[ok]) / scale
    assert err.size == 0 or err.max() <= tol, f"{what}: max scaled error {err.max():.3e}"


def _check_against_numba(inputs, outputs, values, rng, wrt=None):
    """JAX mode == the default mode's graph (run by ``perform``: the Numba kernels) for the outputs and their gradients (PyTensor's gradient graph, whose gradient
    Ops then run in JAX), and jax.grad of the JAX-ified cost (the custom_vjp rules) == the Numba gradient."""
    wrt = inputs if wrt is None else wrt
    cost = _cost(outputs, rng)
    grads = pytensor.grad(cost, wrt)
    f_numba = pytensor.function(inputs, [*outputs, *grads])
    f_jax = pytensor.function(inputs, [*outputs, *grads], mode="JAX")
    expected = f_numba(*values)
    got = f_jax(*values)
    for i, (a, e) in enumerate(zip(got, expected)):
        _close(a, e, what=f"output {i}")
    # jax.grad of the jaxified cost, differentiating the inputs in ``wrt``
    fn, _ = _jaxify(inputs, [cost])
    idx = [inputs.index(w) for w in wrt]

    def scalar(*diff):
        args = list(values)
        for i, d in zip(idx, diff):
            args[i] = d
        return fn(*args)[0]

    jgrads = jax.grad(scalar, argnums=tuple(range(len(idx))))(*(jnp.asarray(values[i]) for i in idx))
    for k, (a, e) in enumerate(zip(jgrads, expected[len(outputs):])):
        _close(a, e, what=f"jax.grad {k}")


def _stable(rng, m, radius=0.8):
    A = rng.normal(size=(m, m))
    return A * (radius / np.max(np.abs(np.linalg.eigvals(A))))


def _spd(rng, m):
    X = rng.normal(size=(m, m))
    return X @ X.T + 0.5 * np.eye(m)


# ---------------------------------------------------------------------------
# Every Op: JAX == Numba, values and gradients
# ---------------------------------------------------------------------------


def _fused_op_classes():
    from iterops._fused import FusedOp

    todo, found = [FusedOp], set()
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if "__props__" in vars(sub) or hasattr(sub, "gufunc_signature"):
                found.add(sub)
    return sorted(found, key=lambda c: c.__name__)


def test_every_fused_op_has_a_jax_implementation():
    """A new Op without a JAX implementation fails here (PyTensor would say 'No JAX conversion')."""
    from pytensor.link.jax.dispatch.basic import jax_funcify as base

    default = base.dispatch(object)
    classes = [c for c in _fused_op_classes() if getattr(c, "gufunc_signature", None) and c.__name__[0] != "_"]
    assert len(classes) >= 18, [c.__name__ for c in classes]
    missing = [c.__name__ for c in classes if jax_funcify.dispatch(c) is default]
    assert not missing, missing


def _case_lyapunov(method):
    def build(rng):
        A, Q = _stable(rng, 3), _spd(rng, 3)
        a, q = _tensor("A", A), _tensor("Q", Q)
        return [a, q], [iterops.solve_discrete_lyapunov(a, q, method)], [A, Q], None

    return build


def _case_doubling_loop(rng):
    A, Q = _stable(rng, 3, 0.7), _spd(rng, 3)
    a, q = _tensor("A", A), _tensor("Q", Q)
    return [a, q], list(smith_doubling_loop(a, q, 1e-9, 30)), [A, Q], None


def _case_doubling_loop_symbolic_steps(rng):
    A, Q = _stable(rng, 3, 0.7), _spd(rng, 3)
    a, q, n = _tensor("A", A), _tensor("Q", Q), pt.iscalar("n")
    return [a, q, n], list(smith_doubling_loop(a, q, 0.0, n, stop="max_le")), [A, Q, np.int32(4)], [a, q]


def _case_fixed_point_loop(rng):
    A, Q, X0 = _stable(rng, 3, 0.7), _spd(rng, 3), np.eye(3)
    a, q, x0 = _tensor("A", A), _tensor("Q", Q), _tensor("X0", X0)
    return [a, q, x0], [lyapunov_fixed_point_loop(a, q, x0, 1e-8, 200, stop="fro_lt")], [A, Q, X0], None


def _case_fixed_point_loop_symbolic_steps(rng):
    A, Q, X0 = _stable(rng, 3, 0.7), _spd(rng, 3), np.eye(3)
    a, q, x0, n = _tensor("A", A), _tensor("Q", Q), _tensor("X0", X0), pt.iscalar("n")
    out = lyapunov_fixed_point_loop(a, q, x0, 1e-6, n)
    return [a, q, x0, n], [out], [A, Q, X0, np.int32(25)], [a, q, x0]


def _case_damped_fixed_point_loop(damping, symbolic_steps=False):
    def case(rng):
        A, Q, X0 = _stable(rng, 3, 0.7), _spd(rng, 3), rng.normal(size=(3, 3))
        a, q, x0, w = _tensor("A", A), _tensor("Q", Q), _tensor("X0", X0), pt.dscalar("w")
        n = pt.iscalar("n") if symbolic_steps else 300
        out = lyapunov_fixed_point_loop(a, q, x0, 1e-9, n, w=w, damping=damping)
        ins, vals = [a, q, x0, w], [A, Q, X0, np.float64(1.3 if symbolic_steps else 0.6)]
        if symbolic_steps:
            return [*ins, n], [out], [*vals, np.int32(20)], ins
        return ins, [out], vals, None

    return case


def _case_dare(rng):
    A, B = _stable(rng, 3, 1.1), rng.normal(size=(3, 2))  # an unstable A, stabilisable through B
    Q, R = _spd(rng, 3), _spd(rng, 2)
    names = "ABQR"
    ins = [_tensor(k, v) for k, v in zip(names, (A, B, Q, R))]
    return ins, [solve_discrete_are(*ins)], [A, B, Q, R], None


def _case_block_diag(rng):
    X = rng.normal(size=(3, 2, 4))
    x = _tensor("x", X)
    return [x], [iterops.block_diag(x)], [X], None


def _case_toeplitz(rng):
    C = np.r_[3.0, 0.5 * rng.normal(size=4)]
    R = np.r_[3.0, 0.5 * rng.normal(size=4)]
    B = rng.normal(size=(5, 2))
    c, r, b = _tensor("c", C), _tensor("r", R), _tensor("b", B)
    return [c, r, b], [iterops.solve_toeplitz((c, r), b)], [C, R, B], None


def _ar_acov(rng):
    phi = iterops.ts.pacf_to_ar(np.array([0.6, -0.4, 0.3])).eval()
    return iterops.ts.ar_to_acov(phi, 1.3, 5).eval()


def _case_levinson_durbin(rng):
    G = _ar_acov(rng)
    g = _tensor("acov", G)
    return [g], list(iterops.levinson_durbin(g, 3)), [G], None


def _case_levinson_recursion(rng):
    G = _ar_acov(rng)
    g = _tensor("gamma", G)
    return [g], list(levinson_recursion(g, 4)), [G], None


def _case_acovf(rng):
    X = rng.normal(size=30)
    x = _tensor("x", X)
    return [x], [iterops.acovf(x, 5), iterops.acovf(x, 3, adjusted=True)], [X], None


def _case_pacf_to_ar(rng):
    K = np.array([0.5, -0.3, 0.2, 0.7])
    k = _tensor("pacf", K)
    return [k], [iterops.pacf_to_ar(k)], [K], None


def _case_ar_to_pacf(rng):
    P = iterops.ts.pacf_to_ar(np.array([0.5, -0.3, 0.6])).eval()
    p = _tensor("phi", P)
    return [p], [iterops.ar_to_pacf(p)], [P], None


def _case_ar_to_acov(rng):
    P = iterops.ts.pacf_to_ar(np.array([0.5, -0.3, 0.6])).eval()
    p, s = _tensor("phi", P), _tensor("sigma2", np.float64(1.3))
    return [p, s], [iterops.ar_to_acov(p, s, 6)], [P, np.float64(1.3)], None


KALMAN_NAMES = ("y", "a0", "P0", "c", "d", "T", "Z", "R", "H", "Q")


def _kalman_values(rng, n=15, m=3, p=2, r=2, tv=()):
    vals = {
        "c": 0.1 * rng.normal(size=m), "d": 0.1 * rng.normal(size=p), "T": _stable(rng, m, 0.9),
        "Z": rng.normal(size=(p, m)), "R": rng.normal(size=(m, r)), "H": 0.5 * _spd(rng, p),
        "Q": 0.3 * _spd(rng, r),
    }
    for name in tv:
        vals[name] = np.stack([vals[name] * (1.0 + 0.05 * t) for t in range(n)])
    return [rng.normal(size=(n, p)), np.zeros(m), np.eye(m)] + [vals[k] for k in KALMAN_NAMES[3:]]


def _kalman(fn, y, a0, P0, *system, **kwargs):
    """``fn(y, a0, P0, c=, d=, T=, Z=, R=, H=, Q=)`` from the positional order of ``KALMAN_NAMES``
    (the iterops functions take the system matrices by keyword only)."""
    return fn(y, a0, P0, **dict(zip("cdTZRHQ", system)), **kwargs)


def _case_kalman(tv=(), missing=False, **options):
    def build(rng):
        vals = _kalman_values(rng, tv=tv)
        if missing:
            vals[0][3, 0] = np.nan
            vals[0][6, :] = np.nan
            if options.get("missing_value") is not None:
                vals[0][9, 1] = options["missing_value"]
        syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
        res = _kalman(iterops.kalman_filter, *syms, time_varying=tv, **options)
        return syms, list(res), vals, None

    return build


def _case_kalman_smoother(rng):
    vals = _kalman_values(rng)
    vals[0][4, 1] = np.nan
    syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
    res = _kalman(iterops.kalman_smoother, *syms)
    return syms, list(res), vals, []  # no gradient (not implemented for the Numba Op either)


CASES = {
    "lyapunov_auto": _case_lyapunov("auto"),
    "lyapunov_doubling": _case_lyapunov("doubling"),
    "lyapunov_schur": _case_lyapunov("schur"),
    "smith_doubling_loop": _case_doubling_loop,
    "smith_doubling_loop_symbolic_steps": _case_doubling_loop_symbolic_steps,
    "fixed_point_loop": _case_fixed_point_loop,
    "fixed_point_loop_symbolic_steps": _case_fixed_point_loop_symbolic_steps,
    "damped_fixed_point_loop": _case_damped_fixed_point_loop("convex"),
    "damped_fixed_point_loop_increment_symbolic_steps": _case_damped_fixed_point_loop("increment", True),
    "solve_discrete_are": _case_dare,
    "block_diag": _case_block_diag,
    "solve_toeplitz": _case_toeplitz,
    "levinson_durbin": _case_levinson_durbin,
    "levinson_recursion": _case_levinson_recursion,
    "acovf": _case_acovf,
    "pacf_to_ar": _case_pacf_to_ar,
    "ar_to_pacf": _case_ar_to_pacf,
    "ar_to_acov": _case_ar_to_acov,
    "kalman_filter": _case_kalman(),
    "kalman_filter_missing_jitter": _case_kalman(missing=True, cov_jitter=1e-6, missing_value=-9999.0),
    "kalman_filter_time_varying": _case_kalman(tv=("c", "T", "Z", "H", "Q")),
    "kalman_smoother": _case_kalman_smoother,
}
#: in the default run (the others, which compile larger gradient graphs twice, run with ``-m slow``)
DEFAULT_CASES = {
    "lyapunov_auto", "solve_discrete_are", "smith_doubling_loop_symbolic_steps", "fixed_point_loop", "block_diag", "solve_toeplitz",
    "damped_fixed_point_loop", "damped_fixed_point_loop_increment_symbolic_steps",
    "levinson_recursion", "pacf_to_ar", "kalman_filter_missing_jitter", "kalman_smoother",
}


@pytest.mark.parametrize(
    "case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_op_and_gradients_equal_numba(case, rng):
    inputs, outputs, values, wrt = CASES[case](rng)
    if wrt == []:  # values only
        f_numba, f_jax = pytensor.function(inputs, outputs), pytensor.function(inputs, outputs, mode="JAX")
        for i, (a, e) in enumerate(zip(f_jax(*values), f_numba(*values))):
            _close(a, e, what=f"output {i}")
        return
    _check_against_numba(inputs, outputs, values, rng, wrt)


def test_kalman_failure_is_minus_inf_and_nan_gradient(rng):
    vals = _kalman_values(rng)
    vals[8] = -50.0 * np.eye(2)  # H: F not positive definite from the first step
    syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
    res = _kalman(iterops.kalman_filter, *syms)
    fn, _ = _jaxify(syms, [res.loglik, res.filtered_state])
    ll, filtered = fn(*vals)
    assert ll == -np.inf and np.all(np.isnan(filtered))
    g = jax.grad(lambda T: fn(*vals[:5], T, *vals[6:])[0])(jnp.asarray(vals[5]))
    assert np.all(np.isnan(g))


@pytest.mark.slow
def test_kalman_failure_through_pytensor_gradient_graph(rng):
    vals = _kalman_values(rng)
    vals[8] = -50.0 * np.eye(2)
    syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
    res = _kalman(iterops.kalman_filter, *syms)
    f = pytensor.function(syms, [res.loglik, *pytensor.grad(res.loglik, syms)], mode="JAX")
    out = f(*vals)
    assert out[0] == -np.inf
    assert all(np.all(np.isnan(g)) for g in out[1:])


def test_failure_values():
    nan2 = np.full((2, 2), np.nan)
    unstable = np.diag([1.5, 0.5])
    np.testing.assert_array_equal(jlyap.solve_discrete_lyapunov(unstable, np.eye(2), "doubling"), nan2)
    np.testing.assert_array_equal(jlyap.solve_discrete_lyapunov(np.eye(2), np.eye(2), "schur"), nan2)  # singular
    np.testing.assert_array_equal(jlyap.solve_discrete_lyapunov(np.full((2, 2), np.nan), np.eye(2)), nan2)
    # unstable but solvable: auto falls back to Schur, as the Numba kernel
    X = jlyap.solve_discrete_lyapunov(unstable, np.eye(2))
    np.testing.assert_allclose(X, scipy.linalg.solve_discrete_lyapunov(unstable, np.eye(2)), rtol=1e-12)
    assert np.all(np.isnan(jtoeplitz.solve_toeplitz(jnp.zeros(3), jnp.zeros(3), jnp.ones((3, 1)))))
    assert np.all(np.isnan(jar.pacf_to_ar(jnp.array([0.5, 1.0]))))
    assert np.all(np.isnan(jar.ar_to_pacf(jnp.array([1.2, 0.0]))))
    assert np.all(np.isnan(jar.ar_to_acov(jnp.array([1.2, 0.0]), 1.0, 3)))
    phi, s2, pacf = jlevinson.levinson_durbin(jnp.array([1.0, 1.0, 1.0]), 2)  # singular Toeplitz
    assert np.all(np.isnan(phi)) and np.isnan(s2) and np.all(np.isnan(pacf))
    acov = jlevinson.acovf(jnp.arange(3.0), 4)
    assert np.all(np.isnan(acov[3:])) and np.all(np.isfinite(acov[:3]))


def _yule_walker_numpy(g, p):
    """``(phi, sigma2)``: the Yule-Walker equations solved densely (the oracle)."""
    phi = np.linalg.solve(scipy.linalg.toeplitz(g[:p]), g[1 : p + 1])
    return phi, g[0] - g[1 : p + 1] @ phi


def test_yule_walker_gradient_with_constant_cotangents_under_jax():
    """``phi.sum() + s2``: both cotangents are constants (``s2``'s a 0-d one, which PyTensor's JAX linker
    passes as a Python float), against central differences of the dense Yule-Walker solve."""
    G = np.array([2.0, 1.1, 0.4, 0.1, 0.05])
    g = _tensor("acov", G)
    phi, s2 = iterops.ts.yule_walker(g, 3)
    f = pytensor.function([g], [phi, s2, pytensor.grad(phi.sum() + s2, g)], mode="JAX")
    got_phi, got_s2, got_grad = f(G)
    e_phi, e_s2 = _yule_walker_numpy(G, 3)
    cost = lambda x: _yule_walker_numpy(x, 3)[0].sum() + _yule_walker_numpy(x, 3)[1]  # noqa: E731
    h = 1e-6
    fd = np.array([(cost(G + h * e) - cost(G - h * e)) / (2 * h) for e in np.eye(G.size)])
    np.testing.assert_allclose(got_phi, e_phi, rtol=1e-12)
    np.testing.assert_allclose(got_s2, e_s2, rtol=1e-12)
    np.testing.assert_allclose(got_grad, fd, rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------------------
# Every registered Op: constant and disconnected cotangents, integer and constant inputs
# ---------------------------------------------------------------------------
#
# PyTensor's JAX linker passes a 0-d constant as a Python scalar: a constant cotangent (an output that enters
# the cost linearly), a disconnected one's placeholder, a constant ``tol`` or ``sigma2``.  Each case calls a
# public function on some integer (and constant) inputs and differentiates two costs: every output linear
# (every cotangent a constant) and the last output alone, squared (the others disconnected); ``extra``
# outputs come from calls on integer inputs only (values).  Parametrized over PyTensor's JAX registry, so a
# new Op fails until it has a case.  Oracle: the same graph run by the Python linker (FAST_COMPILE: each
# Op's ``perform``, the Numba kernel).


def _ints(x):
    return np.asarray(x, dtype=np.int64)


def _io_lyapunov(rng):
    A, Q = _stable(rng, 3), _ints([[3, 1, 0], [1, 2, 0], [0, 0, 1]])
    a, q = _tensor("A", A), _tensor("Q", Q)
    return [a, q], [A, Q], [a], [iterops.solve_discrete_lyapunov(a, q)], []


def _io_dare(rng):
    A, B, Q = _stable(rng, 3, 1.1), rng.normal(size=(3, 2)), _ints(np.eye(3) + 1)
    a, b, q = _tensor("A", A), _tensor("B", B), _tensor("Q", Q)
    return [a, b, q], [A, B, Q], [a, b], [solve_discrete_are(a, b, q, 2 * np.eye(2, dtype=np.int64))], []


def _io_block_diag(rng):
    X, Xi = rng.normal(size=(3, 2, 2)), _ints(rng.integers(-5, 5, size=(2, 1, 3)))
    x, xi = _tensor("x", X), _tensor("xi", Xi)
    return [x, xi], [X, Xi], [x], [iterops.block_diag(x)], [iterops.block_diag(xi)]


def _io_toeplitz(rng):
    C, R, B = np.r_[4.0, 0.5 * rng.normal(size=3)], _ints([4, 1, -1, 2]), _ints([[1, 0], [2, -1], [0, 3], [1, 1]])
    c, r, b = _tensor("c", C), _tensor("r", R), _tensor("b", B)
    return [c, r, b], [C, R, B], [c], [iterops.solve_toeplitz((c, r), b)], []


def _io_single(fn, value, int_value):
    """A function of one array: the float call differentiated, the integer call's values."""

    def build(rng):
        x, xi = _tensor("x", value(rng)), _tensor("xi", _ints(int_value))
        return [x, xi], [value(rng), _ints(int_value)], [x], list(fn(x)), list(fn(xi))

    return build


def _listed(fn):
    return lambda x: [fn(x)]


def _io_ar_to_acov(rng):
    P = iterops.ts.pacf_to_ar(np.array([0.5, -0.3, 0.6])).eval()
    p, s = _tensor("phi", P), _tensor("sigma2", np.float64(1.3))
    # sigma2 a symbolic float and a constant integer (a Python int under JAX)
    outs = [iterops.ar_to_acov(p, s, 5), iterops.ar_to_acov(p, 2, 4)]
    return [p, s], [P, np.float64(1.3)], [p, s], outs, [iterops.ar_to_acov(_ints([0, 0]), 3, 3)]


def _io_doubling_loop(rng):
    A, Q = _stable(rng, 3, 0.7), _ints([[2, 1, 0], [1, 2, 0], [0, 0, 1]])
    a, q = _tensor("A", A), _tensor("Q", Q)
    return [a, q], [A, Q], [a], list(smith_doubling_loop(a, q, 1e-9, 30)), []


def _io_fixed_point_loop(rng):
    A, Q, X0 = _stable(rng, 3, 0.7), _spd(rng, 3), _ints(np.eye(3))
    a, q, x0 = _tensor("A", A), _tensor("Q", Q), _tensor("X0", X0)
    outs = [lyapunov_fixed_point_loop(a, q, x0, 1e-9, 200), lyapunov_fixed_point_loop(a, q, x0, 1e-9, 300, w=0.6)]
    return [a, q, x0], [A, Q, X0], [a, q], outs, []


def _io_kalman(fn, **kwargs):
    """``a0`` and ``P0`` integers; the filter differentiated in ``y`` and the system matrices."""

    def build(rng):
        vals = _kalman_values(rng, n=6)
        vals[1], vals[2] = _ints(vals[1]), _ints(vals[2])
        syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
        wrt = [] if fn is iterops.kalman_smoother else [syms[0], *syms[3:]]
        return syms, vals, wrt, list(_kalman(fn, *syms, **kwargs)), []

    return build


def _io_kalman_hvp(rng):
    """Second derivatives (KalmanFilterHVP): a Hessian-vector product in ``y`` and ``T`` of a cost reading two
    outputs, ``a0`` and ``P0`` integers; not differentiated again (third derivatives raise)."""
    vals = _kalman_values(rng, n=6)
    vals[1], vals[2] = _ints(vals[1]), _ints(vals[2])
    syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
    res = _kalman(iterops.kalman_filter, *syms)
    wrt = [syms[0], syms[5]]
    directions = [pt.as_tensor(rng.normal(size=vals[i].shape)) for i in (0, 5)]
    hvp = pytensor.gradient.hessian_vector_product(res.loglik + res.filtered_state.sum(), wrt, directions)
    return syms, vals, [], list(hvp), []


def _io_kalman_diffuse(rng):
    """A local linear trend (both states diffuse): integer ``a0``, ``P0``, ``T``, ``Z``, ``R``."""
    y = np.cumsum(rng.normal(size=(8, 1)), axis=0)
    vals = [y, _ints([0, 0]), _ints(np.zeros((2, 2))), np.zeros(2), np.zeros(1), _ints([[1, 1], [0, 1]]),
            _ints([[1, 0]]), _ints(np.eye(2)), np.array([[0.5]]), np.diag([0.3, 0.05])]
    syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, vals)]
    res = _kalman(iterops.kalman_filter, *syms, diffuse=[True, True])
    return syms, vals, [syms[0], syms[8], syms[9]], list(res), []


def _pacf_value(rng):
    return np.array([0.5, -0.3, 0.2, 0.7])


def _phi_value(rng):
    return iterops.ts.pacf_to_ar(np.array([0.5, -0.3, 0.6])).eval()


IO_CASES = {
    "lyapunov": _io_lyapunov,
    "dare": _io_dare,
    "block_diag": _io_block_diag,
    "toeplitz": _io_toeplitz,
    "levinson_durbin": _io_single(lambda x: iterops.levinson_durbin(x, 3), _ar_acov, [5, 2, 1, 0, 0]),
    "levinson_recursion": _io_single(lambda x: levinson_recursion(x, 3), _ar_acov, [5, 2, 1, 0, 0]),
    "acovf": _io_single(_listed(lambda x: iterops.acovf(x, 3)), lambda rng: rng.normal(size=12), [1, 3, 0, 2, 5]),
    "pacf_to_ar": _io_single(_listed(iterops.pacf_to_ar), _pacf_value, [0, 0, 0]),
    "ar_to_pacf": _io_single(_listed(iterops.ar_to_pacf), _phi_value, [0, 0]),
    "ar_to_acov": _io_ar_to_acov,
    "doubling_loop": _io_doubling_loop,
    "fixed_point_loop": _io_fixed_point_loop,
    "kalman_filter": _io_kalman(iterops.kalman_filter),
    "kalman_filter_diffuse": _io_kalman_diffuse,
    "kalman_filter_hvp": _io_kalman_hvp,
    "kalman_smoother": _io_kalman(iterops.kalman_smoother),
}
#: the case whose graph holds each registered Op (a new Op fails ``test_every_registered_op_...`` until added)
IO_CASE_OF = {
    "DiscreteLyapunov": "lyapunov", "DiscreteARE": "dare", "BlockDiag": "block_diag", "SolveToeplitz": "toeplitz",
    "LevinsonDurbin": "levinson_durbin", "LevinsonDurbinGrad": "levinson_durbin",
    "LevinsonRecursion": "levinson_recursion", "LevinsonRecursionGrad": "levinson_recursion",
    "AutoCov": "acovf", "PacfToAR": "pacf_to_ar", "ARDerivative": "pacf_to_ar", "ARToPacf": "ar_to_pacf",
    "ARToAcov": "ar_to_acov", "SmithDoublingLoop": "doubling_loop", "SmithDoublingLoopGrad": "doubling_loop",
    "LyapunovFixedPointLoop": "fixed_point_loop", "LyapunovFixedPointLoopGrad": "fixed_point_loop",
    "KalmanFilter": "kalman_filter", "KalmanFilterGrad": "kalman_filter", "KalmanFilterHVP": "kalman_filter_hvp",
    "KalmanFilterDiffuse": "kalman_filter_diffuse", "KalmanFilterDiffuseGrad": "kalman_filter_diffuse",
    "KalmanSmoother": "kalman_smoother",
}
#: with ``-m slow``: the oracle's first diffuse filter call compiles the Numba glue (~17 s CPU per process)
SLOW_IO_CASES = {"kalman_filter_diffuse"}


def _registered_op_classes():
    """The iterops Ops PyTensor's JAX dispatch knows, each marked slow if its case is in :data:`SLOW_IO_CASES`."""
    classes = sorted((c for c in jax_funcify.registry if c.__module__.startswith("iterops")), key=lambda c: c.__name__)
    return [pytest.param(c, id=c.__name__, marks=[pytest.mark.slow] if IO_CASE_OF.get(c.__name__) in SLOW_IO_CASES else [])
            for c in classes]


@functools.cache
def _io_case_results(case):
    """``(Op classes in the JAX graph, JAX results, oracle results)`` of an :data:`IO_CASES` case (compiled
    once per process: the Ops of one case share it)."""
    inputs, values, wrt, outputs, extra = IO_CASES[case](np.random.default_rng(zlib.crc32(case.encode())))
    floats = [o for o in outputs if o.type.numpy_dtype.kind == "f"]
    costs = [sum(o.sum() for o in floats), (floats[-1] ** 2).sum()]
    grads = [g for c in costs for g in pytensor.grad(c, wrt, disconnected_inputs="ignore")] if wrt else []
    wanted = [*outputs, *extra, *grads]
    f_jax = pytensor.function(inputs, wanted, mode="JAX")
    f_ref = pytensor.function(inputs, wanted, mode="FAST_COMPILE")
    ops = {type(getattr(n.op, "core_op", n.op)) for n in f_jax.maker.fgraph.apply_nodes}
    return ops, f_jax(*values), f_ref(*values)


def test_every_jax_registration_goes_through_register_op():
    """Every iterops Op PyTensor's JAX dispatch knows was registered by ``register_op`` (which converts what
    the linker passes)."""
    from iterops.jax._common import REGISTERED

    ours = {c for c in jax_funcify.registry if c.__module__.startswith("iterops")}
    assert ours == set(REGISTERED), sorted(c.__name__ for c in ours ^ set(REGISTERED))


@pytest.mark.parametrize("op_class", _registered_op_classes())
def test_every_registered_op_takes_constant_disconnected_and_integer_inputs(op_class):
    case = IO_CASE_OF.get(op_class.__name__)
    assert case is not None, f"add a case for {op_class.__name__} to IO_CASES / IO_CASE_OF"
    ops, got, expected = _io_case_results(case)
    assert op_class in ops, f"case {case!r} does not run {op_class.__name__} under JAX: {sorted(c.__name__ for c in ops)}"
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        _close(a, e, what=f"{case} output {i}")


# ---------------------------------------------------------------------------
# Batched, jit, vmap
# ---------------------------------------------------------------------------


def _check_batched(rng, with_kalman):
    A = np.stack([_stable(rng, 3, r) for r in (0.3, 0.8, 0.99)])
    Q = _spd(rng, 3)
    Kp = np.array([[0.5, -0.3], [0.9, 0.1]])
    a, q, k = _tensor("A", A), _tensor("Q", Q), _tensor("pacf", Kp)
    inputs, values, wrt = [a, q, k], [A, Q, Kp], [a, k]
    outs = [iterops.solve_discrete_lyapunov(a, q), iterops.pacf_to_ar(k)]
    if with_kalman:
        vals = _kalman_values(rng)
        ys = np.stack([vals[0], vals[0][::-1]])
        y = _tensor("y", ys)
        kal = _kalman(iterops.kalman_filter, y, *vals[1:])
        inputs, values, wrt, outs = inputs + [y], values + [ys], wrt + [y], outs + [kal.loglik, kal.filtered_cov]
    grads = pytensor.grad(_cost(outs, rng), wrt)
    f_n, f_j = pytensor.function(inputs, outs + grads), pytensor.function(inputs, outs + grads, mode="JAX")
    for i, (g, e) in enumerate(zip(f_j(*values), f_n(*values))):
        _close(g, e, what=f"batched output {i}")


def test_batched_ops_equal_numba(rng):
    """Blockwise under JAX (PyTensor vectorizes the core JAX function) == Numba, with broadcasting."""
    _check_batched(rng, with_kalman=False)


@pytest.mark.slow
def test_batched_kalman_equal_numba(rng):
    _check_batched(rng, with_kalman=True)


def test_jit_vmap_lyapunov_against_scipy(rng):
    A = np.stack([_stable(rng, 4, r) for r in (0.2, 0.9, 0.999)])
    Q = np.stack([_spd(rng, 4) for _ in range(3)])
    for method in ("auto", "doubling", "schur"):
        f = jax.jit(jax.vmap(lambda a, q, method=method: jlyap.solve_discrete_lyapunov(a, q, method)))
        X = f(A, Q)
        for i in range(3):
            expected = scipy.linalg.solve_discrete_lyapunov(A[i], Q[i])
            np.testing.assert_allclose(X[i], expected, rtol=1e-9 * (100 if i == 2 else 1), atol=1e-12)
    # jax.grad (custom_vjp, implicit function theorem) == dense-Kronecker oracle
    a, q = A[1], Q[1]
    W = rng.normal(size=(4, 4))
    gA, gQ = jax.jit(jax.grad(lambda a, q: jnp.sum(W * jlyap.solve_discrete_lyapunov(a, q)), argnums=(0, 1)))(a, q)
    K = np.eye(16) - np.kron(a, a)  # vec(X) = K^{-1} vec(Q) (row-major vec)
    lam = np.linalg.solve(K.T, W.ravel()).reshape(4, 4)
    X = scipy.linalg.solve_discrete_lyapunov(a, q)
    np.testing.assert_allclose(gQ, lam, rtol=1e-9)
    np.testing.assert_allclose(gA, lam @ a @ X.T + lam.T @ a @ X, rtol=1e-9)


def _complex_stable(rng, m, radius):
    A = rng.normal(size=(m, m)) + 1j * rng.normal(size=(m, m))
    return A * (radius / np.max(np.abs(np.linalg.eigvals(A))))


def test_lyapunov_custom_vjp_complex_against_scipy_finite_differences(rng):
    """``jax.grad`` through the Lyapunov solver's ``custom_vjp`` with complex ``A``, ``Q`` and a loss that is
    not holomorphic, under ``jit`` and ``vmap``, every method, against central differences of scipy's solver
    along the real and the imaginary parts.  JAX's convention: the gradient of a real loss in ``z = x + i y``
    is ``dL/dx - i dL/dy`` (the conjugate of the steepest-ascent direction)."""
    m, h = 3, 1e-6
    A = np.stack([_complex_stable(rng, m, r) for r in (0.5, 0.8)])
    B = rng.normal(size=(2, m, m)) + 1j * rng.normal(size=(2, m, m))
    Q = B @ np.conj(np.swapaxes(B, 1, 2)) + np.eye(m)
    W = rng.normal(size=(m, m)) + 1j * rng.normal(size=(m, m))

    def loss_scipy(A, Q):
        X = scipy.linalg.solve_discrete_lyapunov(A, Q)
        return np.sum((W * X).real) + np.sum(np.abs(X) ** 2)

    def central(f, Z):
        G = np.zeros_like(Z)
        for idx in np.ndindex(Z.shape):
            E = np.zeros_like(Z)
            E[idx] = 1.0
            G[idx] = (f(Z + h * E) - f(Z - h * E)) / (2 * h) + 1j * (f(Z + 1j * h * E) - f(Z - 1j * h * E)) / (2 * h)
        return G

    for method in ("auto", "doubling", "schur"):
        def loss(A, Q, method=method):
            X = jlyap.solve_discrete_lyapunov(A, Q, method)
            return jnp.sum((W * X).real) + jnp.sum(jnp.abs(X) ** 2)

        gA, gQ = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(A, Q)
        for i in range(2):
            eA = central(lambda Z: loss_scipy(Z, Q[i]), A[i])
            eQ = central(lambda Z: loss_scipy(A[i], Z), Q[i])
            for got, exp, name in ((gA[i], eA, "A"), (gQ[i], eQ, "Q")):
                np.testing.assert_allclose(got, np.conj(exp), rtol=1e-6, atol=1e-7 * np.abs(exp).max(),
                                           err_msg=f"{method} {name}_bar {i}")


def test_jit_vmap_dare_against_scipy(rng):
    A = np.stack([_stable(rng, 4, r) for r in (0.5, 1.3)])
    B = rng.normal(size=(2, 4, 2))
    Q = np.stack([_spd(rng, 4) for _ in range(2)])
    R = np.stack([_spd(rng, 2) for _ in range(2)])
    X = jax.jit(jax.vmap(jriccati.solve_discrete_are))(A, B, Q, R)
    for i in range(2):
        np.testing.assert_allclose(X[i], scipy.linalg.solve_discrete_are(A[i], B[i], Q[i], R[i]), rtol=1e-9)
    # no stabilising solution (an unstable mode B cannot reach): NaN, as the Numba kernel
    A_bad = np.diag([1.5, 0.5])
    X_bad = jriccati.solve_discrete_are(A_bad, np.array([[0.0], [1.0]]), np.eye(2), np.eye(1))
    assert np.all(np.isnan(X_bad))


@given(st.integers(1, 5), st.floats(0.0, 0.999), st.integers(0, 2**31 - 1))
def test_lyapunov_hypothesis_against_scipy(m, radius, seed):
    rng = np.random.default_rng(seed)
    A = _stable(rng, m, radius) if radius > 0 else np.zeros((m, m))
    Q = _spd(rng, m)
    X = np.asarray(_jit_lyap(A, Q))
    expected = scipy.linalg.solve_discrete_lyapunov(A, Q)
    np.testing.assert_allclose(X, expected, rtol=1e-8 / max(1e-3, 1 - radius), atol=1e-10)


_jit_lyap = jax.jit(jlyap.solve_discrete_lyapunov)


def test_jit_vmap_recursions_against_oracles(rng):
    from statsmodels.tsa.arima_process import arma_acovf
    from statsmodels.tsa.stattools import levinson_durbin as sm_levinson_durbin

    pacf = np.array([[0.5, -0.3, 0.2], [0.9, 0.4, -0.6], [-0.2, 0.1, 0.05]])
    phi = jax.jit(jax.vmap(jar.pacf_to_ar))(pacf)
    np.testing.assert_allclose(jax.jit(jax.vmap(jar.ar_to_pacf))(phi), pacf, rtol=1e-12)
    acov = jax.jit(jax.vmap(lambda f: jar.ar_to_acov(f, 1.0, 6)))(phi)
    durbin = jax.jit(jax.vmap(lambda g: jlevinson.levinson_durbin(g, 3)))(acov)
    for i in range(3):
        np.testing.assert_allclose(acov[i], arma_acovf(np.r_[1, -phi[i]], [1.0], nobs=7), rtol=1e-10)
        sigma_v, arcoefs, pacf_sm, _, _ = sm_levinson_durbin(np.asarray(acov[i]), nlags=3, isacov=True)
        np.testing.assert_allclose(durbin[0][i], arcoefs, rtol=1e-10)
        np.testing.assert_allclose(durbin[1][i], sigma_v, rtol=1e-10)
        np.testing.assert_allclose(durbin[2][i], pacf_sm[1:], rtol=1e-10, atol=1e-14)
    c = np.stack([np.r_[4.0, rng.normal(size=5)] for _ in range(2)])
    r = np.stack([np.r_[4.0, rng.normal(size=5)] for _ in range(2)])
    b = rng.normal(size=(2, 6, 3))
    x = jax.jit(jax.vmap(jtoeplitz.solve_toeplitz))(c, r, b)
    for i in range(2):
        np.testing.assert_allclose(x[i], scipy.linalg.solve_toeplitz((c[i], r[i]), b[i]), rtol=1e-10)
    blocks = rng.normal(size=(2, 3, 2, 2))
    B = jax.jit(jax.vmap(jblock_diag))(blocks)
    for i in range(2):
        np.testing.assert_array_equal(B[i], scipy.linalg.block_diag(*blocks[i]))


def test_jit_vmap_levinson_recursion_gradient_against_reference_scan(rng):
    """``jax.grad`` of the loop replica (its ``custom_vjp``: the hand-written reverse scan) under ``jit`` and
    ``vmap`` == PyTensor's autodiff of the reference Scan, for every cotangent and every ``v`` spelling,
    including a ``gamma`` that is not positive definite (``v_k < 0``: the loop continues)."""
    from iterops.reference_loops import levinson_loop, levinson_spelled_step
    from iterops.ts.levinson_recursion import V_UPDATES

    order = 4
    gammas = np.stack([_ar_acov(rng)[: order + 2], np.r_[2.0, 0.5 * rng.normal(size=order + 1)],
                       np.r_[1.0, 1.5, 0.2, -0.7, 0.3, 0.1]])
    w_phi, w_v, w_k = rng.normal(size=order), rng.normal(), rng.normal(size=order)
    mode = SCAN_ORACLE
    for v_form, spelling in enumerate(V_UPDATES):
        g = pt.dvector("gamma")
        phi, v, kappa = levinson_loop(g, order, step=levinson_spelled_step(spelling))
        cost = (w_phi * phi).sum() + w_v * v + (w_k * kappa).sum()
        f = pytensor.function([g], [phi, v, kappa, pytensor.grad(cost, g)], mode=mode)

        def jcost(gamma, v_form=v_form):
            phi, v, kappa = jlevinson.levinson_recursion(gamma, order, v_form)
            return jnp.sum(w_phi * phi) + w_v * v + jnp.sum(w_k * kappa), (phi, v, kappa)

        grads, (phis, vs, kappas) = jax.jit(jax.vmap(jax.grad(jcost, has_aux=True)))(gammas)
        for i, gamma in enumerate(gammas):
            e_phi, e_v, e_kappa, e_grad = f(gamma)
            _close(phis[i], e_phi, what=f"phi {spelling} {i}")
            _close(vs[i], e_v, what=f"v {spelling} {i}")
            _close(kappas[i], e_kappa, what=f"kappa {spelling} {i}")
            _close(grads[i], e_grad, what=f"gradient {spelling} {i}")


def _central_jacobian(f, x, h=1e-6):
    cols = [(np.asarray(f(x + h * e)) - np.asarray(f(x - h * e))) / (2 * h) for e in np.eye(x.shape[0])]
    return np.stack(cols, axis=-1)


def test_jit_vmap_ar_derivatives_against_finite_differences(rng):
    """The hand-written linearizations of the lattice maps (``ar_derivative``, both modes, and ``jax.grad``
    of each map's ``custom_vjp``) under ``jit`` and ``vmap`` against central differences of the maps
    (themselves checked against statsmodels above); NaN where the map fails."""
    nlags = 6
    pacf = np.stack([rng.uniform(-0.9, 0.9, size=4) for _ in range(3)])
    phi = np.asarray(jax.vmap(jar.pacf_to_ar)(pacf))
    maps = {
        "pacf_to_ar": (pacf, jar.pacf_to_ar),
        "ar_to_pacf": (phi, jar.ar_to_pacf),
        "ar_to_acov": (phi, lambda x: jar.ar_to_acov(x, 1.0, nlags)),
    }
    bad = np.array([0.5, 1.0, 0.2, 0.1])  # |pacf_2| = 1: pacf_to_ar fails; 3 bad: not stationary
    for fn, (xs, f) in maps.items():
        n_out = nlags + 1 if fn == "ar_to_acov" else 4
        xs = np.concatenate([xs, (bad if fn == "pacf_to_ar" else 3 * bad)[None]])  # row 3: the map fails
        ws, ts = rng.normal(size=(4, n_out)), rng.normal(size=(4, 4))
        vjp = jax.jit(jax.vmap(lambda x, w, fn=fn: jar.ar_derivative(fn, "vjp", x, w, nlags)))(xs, ws)
        jvp = jax.jit(jax.vmap(lambda x, t, fn=fn: jar.ar_derivative(fn, "jvp", x, t, nlags)))(xs, ts)
        grad = jax.jit(jax.vmap(jax.grad(lambda x, w, f=f: jnp.sum(w * f(x)))))(xs, ws)
        f_jit = jax.jit(f)
        for i in range(3):
            J = _central_jacobian(f_jit, xs[i])
            np.testing.assert_allclose(vjp[i], ws[i] @ J, rtol=1e-6, atol=1e-8, err_msg=f"{fn} vjp")
            np.testing.assert_allclose(grad[i], ws[i] @ J, rtol=1e-6, atol=1e-8, err_msg=f"{fn} grad")
            np.testing.assert_allclose(jvp[i], J @ ts[i], rtol=1e-6, atol=1e-8, err_msg=f"{fn} jvp")
        assert np.all(np.isnan(vjp[3])) and np.all(np.isnan(jvp[3])) and np.all(np.isnan(grad[3])), fn
    s2_grad = jax.grad(lambda s: jnp.sum(jar.ar_to_acov(jnp.asarray(phi[0]), s, nlags)))(1.3)
    np.testing.assert_allclose(s2_grad, np.sum(jar.ar_to_acov(phi[0], 1.0, nlags)), rtol=1e-12)


# ---------------------------------------------------------------------------
# Kalman filter against dynamax and statsmodels
# ---------------------------------------------------------------------------


def _dynamax_params(vals):
    from dynamax.linear_gaussian_ssm.inference import (
        ParamsLGSSM, ParamsLGSSMDynamics, ParamsLGSSMEmissions, ParamsLGSSMInitial,
    )

    _, a0, P0, c, d, T, Z, R, H, Q = (jnp.asarray(v) for v in vals)
    m, p = T.shape[-1], Z.shape[-2]
    return ParamsLGSSM(
        initial=ParamsLGSSMInitial(mean=a0, cov=P0),
        dynamics=ParamsLGSSMDynamics(weights=T[0], bias=c[0], input_weights=jnp.zeros((m, 0)),
                                     cov=R[0] @ Q[0] @ R[0].T),
        emissions=ParamsLGSSMEmissions(weights=Z[0], bias=d[0], input_weights=jnp.zeros((p, 0)), cov=H[0]),
    )


def test_kalman_against_dynamax(rng):
    from dynamax.linear_gaussian_ssm import lgssm_filter

    vals = _kalman_values(rng, n=40)
    vals = [jnp.asarray(v) for v in vals[:3]] + [jnp.asarray(v[None]) for v in vals[3:]]  # static time axis
    ours = jax.jit(jkalman.kalman_filter)(*vals)
    theirs = jax.jit(lambda vs: lgssm_filter(_dynamax_params(vs), vs[0]))(vals)
    np.testing.assert_allclose(ours[0], theirs.marginal_loglik, rtol=1e-9)  # tfp MVN arithmetic
    # dynamax's update arithmetic (its own symmetric solves) differs from statsmodels' at ~1e-9
    np.testing.assert_allclose(ours[2], theirs.filtered_means, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(ours[3], theirs.filtered_covariances, rtol=1e-7, atol=1e-8)
    # gradient of the log-likelihood in the transition matrix: our adjoint vs dynamax's autodiff
    g_ours = jax.grad(lambda T: jkalman.kalman_filter(*vals[:5], T, *vals[6:])[0])(vals[5])
    g_theirs = jax.grad(
        lambda T: lgssm_filter(_dynamax_params(vals[:5] + [T] + vals[6:]), vals[0]).marginal_loglik
    )(vals[5])
    np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-8, atol=1e-9 * np.abs(g_theirs).max())


def test_jit_vmap_kalman_adjoint_equals_numba(rng):
    """``jax.jit(jax.vmap(jax.grad))`` through the Kalman ``custom_vjp`` (the hand-written reverse scan) ==
    the Numba Op's gradient, per series, for a batch with missing data, a missing-value sentinel, jitter,
    time-varying ``c``, ``Z``, ``Q`` and static ``R``: the log-likelihood alone (every per-step cotangent a
    symbolic zero) and a random linear functional of all eight outputs; and the same through
    ``kalman_filter_vjp`` (what ``KalmanFilterGrad`` runs)."""
    tv = ("c", "Z", "Q")
    flags = tuple(name in tv for name in "cdTZRHQ")
    options = dict(cov_jitter=1e-5, missing_value=-99.0)
    vals = _kalman_values(rng, n=12, tv=tv)
    ys = np.stack([vals[0], rng.normal(size=vals[0].shape)])
    ys[0, 2, 1] = np.nan
    ys[0, 5, :] = np.nan
    ys[1, 8, 0] = -99.0
    syms = [_tensor(nm, v) for nm, v in zip(KALMAN_NAMES, [ys[0]] + vals[1:])]
    res = _kalman(iterops.kalman_filter, *syms, time_varying=tv, **options)
    weights = [rng.normal(size=o.type.shape) if o.type.ndim else rng.normal() for o in res]
    costs = {
        "loglik": res.loglik,
        "all outputs": sum(pt.where(pt.isnan(o), 0.0, o * w).sum() for o, w in zip(res, weights)),
    }
    # static matrices with their time axis of length 1 (the core Op's layout)
    core = [v if name in ("a0", "P0") or name in tv else v[None] for name, v in zip(KALMAN_NAMES[1:], vals[1:])]
    opts = jkalman.KalmanOptions(flags, options["cov_jitter"], options["missing_value"])

    def jcost(y, *rest, which):
        outs = jkalman.kalman_filter(y, *rest, options=opts)
        if which == "loglik":
            return outs[0]
        return sum(jnp.sum(jnp.where(jnp.isnan(o), 0.0, o * w)) for o, w in zip(outs, weights))

    for which, cost in costs.items():
        f = pytensor.function(syms, pytensor.grad(cost, syms), mode="FAST_COMPILE")
        grad = jax.jit(jax.vmap(jax.grad(partial(jcost, which=which), argnums=tuple(range(10))),
                                in_axes=(0,) + (None,) * 9))
        got = grad(ys, *core)
        for b in range(2):
            expected = f(ys[b], *vals[1:])
            for k, (g, e) in enumerate(zip(got, expected)):
                _close(np.reshape(g[b], np.shape(e)), e, what=f"{which}: series {b}, d/d{KALMAN_NAMES[k]}")
    # KalmanFilterGrad's path: the output cotangents given explicitly, every third one disconnected (a
    # zero-size placeholder), against the Numba gradient of the functional of the connected outputs
    cts = [jnp.asarray(w) if i % 3 else jnp.zeros((0,) * np.ndim(w)) for i, w in enumerate(weights)]
    cost = sum(pt.where(pt.isnan(o), 0.0, o * w).sum() for i, (o, w) in enumerate(zip(res, weights)) if i % 3)
    expected = pytensor.function(syms, pytensor.grad(cost, syms), mode="FAST_COMPILE")(ys[1], *vals[1:])
    got = jax.jit(lambda *a: jkalman.kalman_filter_vjp(a, cts, opts))(ys[1], *core)
    for k, (g, e) in enumerate(zip(got, expected)):
        _close(np.reshape(g, np.shape(e)), e, what=f"kalman_filter_vjp d/d{KALMAN_NAMES[k]}")


def test_kalman_missing_data_against_statsmodels(rng):
    from statsmodels.tsa.statespace.kalman_filter import KalmanFilter as SMKalmanFilter

    y, a0, P0, c, d, T, Z, R, H, Q = _kalman_values(rng, n=25)
    y[[2, 7], 0] = np.nan
    y[11] = np.nan
    kf = SMKalmanFilter(k_endog=2, k_states=3, k_posdef=2)
    kf.bind(y.copy())
    kf["design"], kf["obs_intercept"], kf["obs_cov"] = Z, d, H
    kf["transition"], kf["state_intercept"], kf["selection"], kf["state_cov"] = T, c, R, Q
    kf.initialize_known(a0, P0)
    res = kf.filter()
    ours = jax.jit(jkalman.kalman_filter)(y, a0, P0, *(v[None] for v in (c, d, T, Z, R, H, Q)))
    np.testing.assert_allclose(ours[0], res.llf, rtol=1e-10)
    np.testing.assert_allclose(ours[2], res.filtered_state.T, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------
# The fusion rewrite under JAX
# ---------------------------------------------------------------------------


def test_scan_loops_are_fused_under_jax(rng):
    """The Scan -> fused Op rewrite runs in JAX mode (it is tagged ``fast_run``, which ``mode="JAX"``
    includes): the textbook Kalman Scan and the doubling Scan become iterops Ops, with the loop's values and
    gradients."""
    from iterops import reference_loops as ref
    from iterops.linalg.lyapunov_iteration import SmithDoublingLoop

    y, a0, _, _, _, T, Z, R, _, _ = _kalman_values(rng, n=12)
    L0, LH, LQ = np.eye(3) + 0.1 * np.tril(rng.normal(size=(3, 3))), np.eye(2), np.eye(2)
    vals = [y, a0, L0, T, Z, R, LH, LQ]
    syms = [_tensor(nm, v) for nm, v in zip(("y", "a0", "L0", "T", "Z", "R", "LH", "LQ"), vals)]
    yv, a0v, l0, tv, zv, rv, lh, lq = syms
    ll, _, _ = ref.kalman_textbook_loop(yv, a0v, l0 @ l0.T, tv, zv, rv, lh @ lh.T, lq @ lq.T)
    A, Qm = _stable(rng, 3, 0.6), _spd(rng, 3)
    a, q = _tensor("A", A), _tensor("Q", Qm)
    gamma = ref.doubling_loop(a, q, tol=1e-10, n_steps=40)
    inputs, cost = [*syms, a, q], ll.sum() + (gamma ** 2).sum()
    fn, fgraph = _jaxify(inputs, [cost])
    ops = [type(getattr(node.op, "core_op", node.op)) for node in fgraph.toposort()]
    assert KalmanFilter in ops and SmithDoublingLoop in ops and Scan not in ops
    values = [*vals, A, Qm]
    unfused = pytensor.function(inputs, [cost, *pytensor.grad(cost, [tv, a])], mode=SCAN_ORACLE)
    expected = unfused(*values)
    np.testing.assert_allclose(fn(*values)[0], expected[0], rtol=1e-10)
    g = jax.grad(lambda t, a_: fn(*values[:3], t, *values[4:8], a_, values[9])[0], argnums=(0, 1))(
        jnp.asarray(T), jnp.asarray(A))
    np.testing.assert_allclose(g[0], expected[1], rtol=1e-8)
    np.testing.assert_allclose(g[1], expected[2], rtol=1e-8)
    # and through PyTensor's gradient graph compiled by the JAX linker: the gradient of a while-Scan has no
    # JAX conversion, so the loops are fused before differentiating (as PyMC's pre-gradient rewrites do)
    (fused,) = iterops.fuse_loops([cost])
    f_jax = pytensor.function(inputs, [fused, *pytensor.grad(fused, [tv, a])], mode="JAX")
    for got, e in zip(f_jax(*values), expected):
        np.testing.assert_allclose(got, e, rtol=1e-8)


# ---------------------------------------------------------------------------
# PyMC's JAX samplers
# ---------------------------------------------------------------------------


def _logp_and_grad_agree(model):
    """The model's logp and its gradient: JAX-ified (as numpyro/blackjax see it) == compiled with Numba."""
    from pymc.sampling.jax import get_jaxified_logp

    point = model.initial_point()
    x = [point[v.name] for v in model.value_vars]
    logp = get_jaxified_logp(model, negative_logp=True)  # PyMC: True returns logp itself
    val, grads = jax.value_and_grad(lambda xs: logp(xs))(x)
    f = model.compile_logp()
    df = model.compile_dlogp()
    np.testing.assert_allclose(val, f(point), rtol=1e-10)
    np.testing.assert_allclose(np.concatenate([np.ravel(g) for g in grads]), df(point), rtol=1e-8, atol=1e-10)


def _sample(model, sampler, draws=30):
    import pymc as pm

    with model, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = pm.sample(draws=draws, tune=draws, chains=1, nuts_sampler=sampler, progressbar=False,
                          random_seed=3)
    post = idata.posterior
    for name in post.data_vars:
        assert np.all(np.isfinite(post[name].values)), name
    return idata


@pytest.mark.parametrize("sampler", ["numpyro", "blackjax"])
def test_jax_samplers_sample_the_nile_demo_model(sampler):
    _, nile = examples.load_nile()
    model = examples.local_level_model(nile)
    _logp_and_grad_agree(model)
    _sample(model, sampler, draws=10)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["numpyro", "blackjax"])
@pytest.mark.parametrize("which", ["nile", "ar2", "ar2_scan", "pymc_extras"])
def test_jax_samplers_on_demo_models(which, sampler):
    _, nile = examples.load_nile()
    _, infl = examples.load_inflation()
    model = {
        "nile": lambda: examples.local_level_model(nile),
        "ar2": lambda: examples.ar2_noise_model(infl[:80]),  # solve_discrete_lyapunov + kalman_filter
        "ar2_scan": lambda: examples.ar2_noise_model(infl[:80], impl="scan"),  # the Scan version, as users write it
        "pymc_extras": lambda: examples.pymc_extras_local_linear_trend_model(nile[:, None]),
    }[which]()
    if which == "pymc_extras":  # its Kalman filter Scan is fused in the graph the JAX samplers run
        from pymc.sampling.jax import _replace_shared_variables

        _, fgraph = _jaxify(model.value_vars, _replace_shared_variables([model.logp()]))
        ops = [type(getattr(node.op, "core_op", node.op)) for node in fgraph.toposort()]
        assert KalmanFilter in ops and Scan not in ops
    _logp_and_grad_agree(model)
    _sample(model, sampler, draws=50)
