"""Run-time shape checks of every public function: a mismatched shape raises, it never returns a value.

Oracles: scipy (``solve_toeplitz`` raises on ``len(r) != len(c)``), the shape relations each function's
docstring states.  Inputs have unknown static shapes (``pt.tensor(shape=(None, ...))``), so nothing is
caught at graph-build time and the entry points' checks (``iterops._validate.check_shape``) are what
stands between a wrong shape and a kernel reading past a buffer.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
import scipy.linalg
from hypothesis import given
from hypothesis import strategies as st

import iterops
from iterops.linalg import lyapunov_fixed_point_loop, smith_doubling_loop, solve_discrete_are
from iterops.ts.levinson_recursion import levinson_recursion

FAST = "FAST_COMPILE"  # perform runs the same jitted entry point as the Numba backend
ROOT = Path(__file__).resolve().parents[1]


def _vars(shapes):
    return [pt.tensor(name=k, dtype="float64", shape=(None,) * len(s)) for k, s in shapes.items()]


# ---------------------------------------------------------------------------
# Regression tests
# ---------------------------------------------------------------------------


def test_solve_toeplitz_r_of_other_length_raises_like_scipy():
    c, r, b = np.array([1, 0.5, 0.2]), np.array([1, 0.3]), np.ones(3)
    with pytest.raises(ValueError):
        scipy.linalg.solve_toeplitz((c, r), b)
    with pytest.raises(ValueError, match="r has 2"):  # static shapes known: graph-build time
        iterops.solve_toeplitz((c, r), b)
    cv, rv, bv = pt.dvector("c"), pt.dvector("r"), pt.dvector("b")
    for mode in (FAST, "NUMBA"):
        fn = pytensor.function([cv, rv, bv], iterops.solve_toeplitz((cv, rv), bv), mode=mode)
        for r_bad in (r, np.ones(4)):
            with pytest.raises(ValueError, match=r"solve_toeplitz: r must have shape .* got r with shape \(%d,\)"
                               % len(r_bad)):
                fn(c, r_bad, b)
        with pytest.raises(ValueError, match=r"b must have shape .* got b with shape \(5, 1\)"):
            fn(c, c, np.ones(5))
        np.testing.assert_allclose(fn(c, np.array([1, 0.3, 0.1]), b),
                                   scipy.linalg.solve_toeplitz((c, [1, 0.3, 0.1]), b), rtol=1e-12)


def test_levinson_durbin_order_beyond_autocovariances_raises():
    g = np.array([1.0, 0.5, 0.2])
    with pytest.raises(ValueError, match="order must be <= len"):
        iterops.levinson_durbin(g, order=5)
    acov = pt.dvector("acov")
    fn = pytensor.function([acov], list(iterops.levinson_durbin(acov, order=5)), mode=FAST)
    with pytest.raises(ValueError, match=r"levinson_durbin: acov must have shape .* got acov with shape \(3,\)"):
        fn(g)


@pytest.mark.parametrize("name, bad", [("y", (6, 3)), ("a0", (3,)), ("P0", (2, 3)), ("Z", (2, 3)), ("H", (1, 1))])
def test_kalman_run_time_shape_error_names_the_argument(name, bad):
    """m = 2, p = 2, r = 1, n = 6 with unknown static shapes; one argument of another shape."""
    shapes = dict(y=(6, 2), a0=(2,), P0=(2, 2), c=(2,), d=(2,), T=(2, 2), Z=(2, 2), R=(2, 1), H=(2, 2), Q=(1, 1))
    ins = _vars(shapes)
    y, a0, P0, *system = ins
    res = iterops.kalman_filter(y, a0, P0, **dict(zip("c d T Z R H Q".split(), system)))
    fn = pytensor.function(ins, res.loglik, mode="NUMBA")
    vals = {k: 0.5 * np.eye(*s) if len(s) == 2 else np.zeros(s) for k, s in shapes.items()}
    assert np.isfinite(fn(*vals.values()))
    vals[name] = 0.5 * np.eye(*bad) if len(bad) == 2 else np.zeros(bad)
    # the argument is named (as the one of the wrong shape, or as the source of a size: "m = len(a0)")
    with pytest.raises(ValueError, match=rf"kalman_filter: .*\b{name}\b.* got \w+ with shape \("):
        fn(*vals.values())


# ---------------------------------------------------------------------------
# Every public function, every argument
# ---------------------------------------------------------------------------

EQ, MIN = "eq", "min"  # a constrained axis: equal to another size, or at least a size


def _kalman(func, tv=()):
    names = "c d T Z R H Q".split()

    def build(ins):
        y, a0, P0, *system = ins
        out = func(y, a0, P0, time_varying=tv, **dict(zip(names, system)))
        return out[0] if func is iterops.kalman_filter else out.smoothed_state

    n = 5  # y's n is free unless a matrix varies over time
    spec = dict(y=((n, 2), {1: EQ} | ({0: EQ} if tv else {})), a0=((3,), {0: EQ}), P0=((3, 3), {0: EQ, 1: EQ}),
                c=((3,), {0: EQ}), d=((2,), {0: EQ}), T=((n, 3, 3) if "T" in tv else (3, 3), {0: EQ, 1: EQ} | (
                    {2: EQ} if "T" in tv else {})),
                Z=((2, 3), {0: EQ, 1: EQ}), R=((3, 2), {0: EQ, 1: EQ}), H=((2, 2), {0: EQ, 1: EQ}),
                Q=((2, 2), {0: EQ, 1: EQ}))
    return build, spec


def _sq(n):
    return ((n, n), {0: EQ, 1: EQ})


#: name -> (build(inputs) -> output, {arg: (valid shape, {axis: EQ | MIN})}).  An axis not listed is free.
CASES = {
    "solve_toeplitz": (lambda i: iterops.solve_toeplitz((i[0], i[1]), i[2]),
                       dict(c=((4,), {0: EQ}), r=((4,), {0: EQ}), b=((4, 2), {0: EQ}))),
    "solve_toeplitz[c, b vector]": (lambda i: iterops.solve_toeplitz(i[0], i[1]), dict(c=((4,), {0: EQ}), b=((4,), {0: EQ}))),
    "levinson_durbin": (lambda i: iterops.levinson_durbin(i[0], 3).ar, dict(acov=((4,), {0: MIN}))),
    "yule_walker": (lambda i: iterops.yule_walker(i[0], 3)[0], dict(acov=((4,), {0: MIN}))),
    "levinson_recursion": (lambda i: levinson_recursion(i[0], 3)[0], dict(gamma=((4,), {0: MIN}))),
    "solve_discrete_lyapunov": (lambda i: iterops.solve_discrete_lyapunov(i[0], i[1]), dict(A=_sq(3), Q=_sq(3))),
    "solve_discrete_are": (lambda i: solve_discrete_are(*i),
                           dict(A=_sq(3), B=((3, 2), {0: EQ, 1: EQ}), Q=_sq(3), R=_sq(2))),
    "stationary_cov": (lambda i: iterops.stationary_cov(*i), dict(T=_sq(3), R=((3, 2), {0: EQ, 1: EQ}), Q=_sq(2))),
    "smith_doubling_loop": (lambda i: smith_doubling_loop(i[0], i[1], 1e-9, 50)[0], dict(A=_sq(3), Q=_sq(3))),
    "lyapunov_fixed_point_loop": (lambda i: lyapunov_fixed_point_loop(i[0], i[1], i[2], 1e-9, 50),
                                  dict(A=_sq(3), Q=_sq(3), X0=_sq(3))),
    "lyapunov_fixed_point_loop[w]": (lambda i: lyapunov_fixed_point_loop(i[0], i[1], i[2], 1e-9, 50, w=0.5),
                                     dict(A=_sq(3), Q=_sq(3), X0=_sq(3))),
    "kalman_filter": _kalman(iterops.kalman_filter),
    "kalman_filter[time-varying T]": _kalman(iterops.kalman_filter, ("T",)),
    "kalman_smoother": _kalman(iterops.kalman_smoother),
}

#: public functions without a run-time shape relation between or within their arguments (every size is
#: valid, the docstring says what a short input gives), and those that are not kernels at all
#: composed of other public functions and PyTensor Ops: a mismatch raises in one of those, under its names
COMPOSED = {"stationary_cov"}
FREE = {"acovf", "pacf_to_ar", "ar_to_pacf", "ar_to_acov", "block_diag"}
NOT_KERNELS = {"loop", "taps", "explain", "fuse_loops", "disabled"}


def _public_functions():
    names = set()
    for mod in (iterops, iterops.linalg, iterops.ts):
        names |= {k for k in mod.__all__ if callable(getattr(mod, k)) and not isinstance(getattr(mod, k), type)}
    return names


def test_every_public_function_is_covered():
    covered = {k.split("[")[0] for k in CASES} | FREE | NOT_KERNELS
    assert _public_functions() - covered == set()


def _values(shapes, seed=0):
    """Well-conditioned float64 values: 0.3 I + small noise for matrices, a decaying sequence for vectors."""
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        if len(s) == 1:
            out.append(0.5 ** np.arange(s[0]) + 0.01 * rng.normal(size=s))
        else:
            eye = np.broadcast_to(np.eye(s[-2], s[-1]), s)
            out.append(0.3 * eye + 0.01 * rng.normal(size=s))
    return out


_FUNCTIONS = {}


def _compiled(case):
    if case not in _FUNCTIONS:
        build, spec = CASES[case]
        ins = [pt.tensor(name=k, dtype="float64", shape=(None,) * len(s)) for k, (s, _) in spec.items()]
        _FUNCTIONS[case] = pytensor.function(ins, build(ins), mode=FAST)
    return _FUNCTIONS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_valid_shapes_give_a_value(case):
    """The reference point of the fuzz test below: with consistent shapes every case runs."""
    _, spec = CASES[case]
    out = _compiled(case)(*_values([s for s, _ in spec.values()]))
    assert np.all(np.isfinite(out))


@given(data=st.data())
@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_run_time_shape_raises(case, data):
    _, spec = CASES[case]
    constrained = [(arg, axis, kind) for arg, (_, axes) in spec.items() for axis, kind in axes.items()]
    arg, axis, kind = data.draw(st.sampled_from(constrained), label="argument, axis")
    shapes = {k: list(s) for k, (s, _) in spec.items()}
    size = shapes[arg][axis]
    bad = data.draw(st.integers(0, size - 1) if kind == MIN else
                    st.integers(0, size + 3).filter(lambda v: v != size), label="size")
    shapes[arg][axis] = bad
    with pytest.raises(ValueError) as err:
        _compiled(case)(*_values([tuple(s) for s in shapes.values()]))
    if case not in COMPOSED:  # the argument is named: as the one of the wrong shape, or as the source of a size
        assert re.search(rf"must have shape .*\b{arg}\b.* with shape \(", str(err.value)), err.value


# ---------------------------------------------------------------------------
# Kernels under Numba's bounds checking; the package's own rules
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_in_bounds(tmp_path):
    """Every case above once under ``NUMBA_BOUNDSCHECK=1`` (fresh cache: no kernel compiled without it)."""
    code = ("import sys; sys.path.insert(0, 'tests'); import numpy as np, test_shapes as t\n"
            "for case in t.CASES:\n"
            "    _, spec = t.CASES[case]\n"
            "    out = t._compiled(case)(*t._values([s for s, _ in spec.values()]))\n"
            "    assert np.all(np.isfinite(out)), case\n"
            "print('ok', len(t.CASES))\n")
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=str(ROOT), PYTENSOR_FLAGS=f"base_compiledir={tmp_path / 'pytensor'}")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


#: private functions allowed over the limit (none: arguments are grouped by role in NamedTuples); the test
#: fails when one listed here is fixed and not removed, or when any other function exceeds the limit
KNOWN = set()


def test_no_private_function_takes_more_than_12_arguments():
    too_many = []
    for path in sorted((ROOT / "iterops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and not node.name.startswith("__"):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                if n > 12:
                    too_many.append(node.name)
    assert sorted(too_many) == sorted(KNOWN)
