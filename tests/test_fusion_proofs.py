"""Proofs behind fusion (symmetric, positive semi-definite covariances) checked against the user's loop.

Each case builds the start covariance ``P0`` (or ``H``, ``Q``) of a textbook
Kalman Scan in a way a proof could get wrong, and asserts that the graph
compiled with iterops' rewrites (fused, or kept as a Scan) returns what the
loop returns.  Oracle: the same Scan with iterops' rewrites excluded
(``SCAN_ORACLE``) and PyTensor's autodiff through it.  The values are chosen
so that a wrong proof changes the result (a non-symmetric or indefinite
``P0``).
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.assumptions import assume
from pytensor.compile.mode import get_mode
from pytensor.scan.op import Scan

import iterops
from conftest import SCAN_ORACLE, as_run_by_python
from iterops import reference_loops as ref

pytestmark = [pytest.mark.python_run, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")]

N = 10
_T = np.array([[0.7, 0.2], [0.0, 0.5]])
_Z = np.array([[1.0, 0.0], [0.5, 1.0]])
_L = np.array([[1.0, 0.0], [0.3, 0.8]])


def _has_scan(f):
    return any(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes)


def _loop_outputs(P0, H=None, Q=None, T=None):
    """The textbook loop's (ll, predicted states, predicted covariances) on constant T, Z, R = I."""
    y = pt.tensor("y", shape=(N, 2))
    H = pt.eye(2) if H is None else H
    Q = pt.eye(2) if Q is None else Q
    T = pt.as_tensor(_T) if T is None else T
    ll, a, Ps = ref.kalman_textbook_loop(y, pt.zeros(2), P0, T, pt.as_tensor(_Z), pt.eye(2), H, Q)
    return y, [ll, a, Ps]


def _user_and_loop(y, outs, inputs, wrt=()):
    """(user's compile, oracle): ``outs`` and the gradient of ``sum(ll)`` w.r.t. ``wrt``.  The user's graph
    is compiled with iterops' rewrites; a kept Scan is run by Python (compiling it is not what is tested)."""
    grads = pytensor.grad(outs[0].sum(), list(wrt)) if wrt else []
    ins = [y, *inputs]
    f = pytensor.function(ins, [*outs, *grads], mode=as_run_by_python())
    g = pytensor.function(ins, [*outs, *grads], mode=SCAN_ORACLE)
    return f, g


def _assert_as_the_loop(f, g, args, rtol=1e-9):
    got, want = f(*args), g(*args)
    assert np.all(np.isfinite(want[1])), "the case is meant to run in the loop (finite states)"
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-12)


@pytest.fixture
def yv(rng):
    return rng.normal(size=(N, 2))


# inc_subtensor adds to its base; set_subtensor replaces it ---------------------------------------------------------


@pytest.mark.parametrize("B", [
    np.array([[0.0, 0.7], [-0.4, 0.0]]),   # non-symmetric: B + L L^T is not symmetric
    np.array([[0.0, 0.7], [0.7, 0.0]]),    # symmetric, indefinite: B + L L^T is indefinite
], ids=["non-symmetric base", "indefinite base"])
def test_inc_subtensor_over_the_whole_matrix_adds_the_base(yv, B):
    Bs, Ls = pt.matrix("B"), pt.matrix("L")
    y, outs = _loop_outputs(pt.inc_subtensor(Bs[:, :], Ls @ Ls.T))
    report = iterops.explain(outs[0].sum())
    assert not report.replaced and "assume(" in str(report)
    f, g = _user_and_loop(y, outs, [Bs, Ls], wrt=[Bs, Ls] if B[0, 1] != B[1, 0] else [])
    _assert_as_the_loop(f, g, (yv, B, _L))


def test_set_subtensor_over_the_whole_matrix_is_the_value(yv):
    Bs, Ls = pt.matrix("B"), pt.matrix("L")
    y, outs = _loop_outputs(pt.set_subtensor(Bs[:, :], Ls @ Ls.T))
    f, g = _user_and_loop(y, outs, [Bs, Ls], wrt=[Ls])
    assert not _has_scan(f)
    _assert_as_the_loop(f, g, (yv, np.array([[0.0, 0.7], [-0.4, 0.0]]), _L))


def test_inc_subtensor_of_a_declared_positive_definite_base_fuses(yv):
    Bs, Ls = pt.matrix("B"), pt.matrix("L")
    B = assume(Bs, symmetric=True, positive_definite=True)
    y, outs = _loop_outputs(pt.inc_subtensor(B[:, :], Ls @ Ls.T))
    f, g = _user_and_loop(y, outs, [Bs, Ls], wrt=[Ls])
    assert not _has_scan(f)
    _assert_as_the_loop(f, g, (yv, np.array([[1.0, 0.2], [0.2, 0.5]]), _L))


@pytest.mark.parametrize("write, fused", [("set", False), ("inc", True)])
def test_diagonal_writes(yv, write, fused):
    """``set`` replaces the diagonal of ``L L^T`` (indefinite for a small diagonal), ``inc`` adds to it."""
    Ls, v = pt.matrix("L"), pt.vector("v")
    S, idx = Ls @ Ls.T, np.arange(2)
    P0 = (pt.set_subtensor if write == "set" else pt.inc_subtensor)(S[idx, idx], v**2)
    y, outs = _loop_outputs(P0)
    f, g = _user_and_loop(y, outs, [Ls, v], wrt=[Ls, v] if fused else [])
    assert _has_scan(f) != fused
    L = np.array([[1.0, 0.0], [0.9, 0.4]])
    _assert_as_the_loop(f, g, (yv, L, np.array([0.1, 0.1])))


# Lyapunov solutions: symmetric for a symmetric Q, positive semi-definite only for a stable A ---------------------


@pytest.mark.parametrize("solver", ["iterops", "pytensor"])
def test_lyapunov_solution_of_an_unstable_system_is_not_positive_semi_definite(yv, solver):
    """T = diag(1.5, 1.2), Q = I: P0 = diag(-1 / 1.25, -1 / 0.44), finite and negative definite (both solvers;
    the loop runs on, its log-likelihood NaN where det(F) < 0)."""
    Ts = pt.matrix("T")
    solve = iterops.linalg.solve_discrete_lyapunov if solver == "iterops" else pt.linalg.solve_discrete_lyapunov
    P0 = solve(Ts, pt.eye(2))
    y, outs = _loop_outputs(P0, T=Ts)
    report = iterops.explain(outs[0].sum())
    assert not report.replaced and "positive semi-definite" in str(report)
    f, g = _user_and_loop(y, outs, [Ts])
    T = np.diag([1.5, 1.2])
    p0 = pytensor.function([Ts], P0, mode=SCAN_ORACLE)(T)
    np.testing.assert_allclose(p0, np.diag([-1 / 1.25, -1 / 0.44]), rtol=1e-12)
    _assert_as_the_loop(f, g, (yv, T))


# a failed factorisation: NaN where the loop has NaN (or raises) --------------------------------------------------


_NAN, _INF = np.nan, np.inf
_I = np.eye(2)


@pytest.mark.parametrize("L0, LH, T", [
    (np.zeros((2, 2)), np.zeros((2, 2)), _T),                 # F = 0 at step 0
    (np.array([[_NAN, 0.0], [0.0, 1.0]]), _I, _T),            # NaN in P0
    (_I, np.array([[_INF, 0.0], [0.0, 1.0]]), _T),            # inf in H
    (_I, _I, np.array([[_NAN, 0.2], [0.0, 0.5]])),            # NaN in T: F NaN from step 1
], ids=["F = 0", "NaN in P0", "inf in H", "NaN in T"])
def test_failed_factorisation_is_nan_like_the_loop(yv, L0, LH, T):
    L0s, LHs, Ts = pt.matrix("L0"), pt.matrix("LH"), pt.matrix("T")
    y, outs = _loop_outputs(L0s @ L0s.T, H=LHs @ LHs.T, T=Ts)
    ins = [y, L0s, LHs, Ts]
    f = pytensor.function(ins, outs, mode=as_run_by_python())
    assert not _has_scan(f)
    got = f(yv, L0, LH, T)
    assert not np.any(np.isneginf(got[0]))
    try:
        want = pytensor.function(ins, outs, mode=SCAN_ORACLE)(yv, L0, LH, T)
    except np.linalg.LinAlgError:  # the loop raises (FAST_COMPILE): NaN, as the loop compiled by Numba gives
        want = pytensor.function(ins, outs, mode=get_mode("NUMBA").excluding("iterops"))(yv, L0, LH, T)
    assert np.any(np.isnan(want[0]))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-9)


def test_constant_zero_start_and_observation_covariances_give_nan(yv):
    """P0 = 0, H = 0 as constants (provably PSD): the loop raises (FAST_COMPILE) or gives NaN (NUMBA)."""
    y, outs = _loop_outputs(pt.as_tensor(np.zeros((2, 2))), H=pt.as_tensor(np.zeros((2, 2))))
    f = pytensor.function([y], outs, mode=as_run_by_python())
    assert not _has_scan(f)
    with pytest.raises(np.linalg.LinAlgError):
        pytensor.function([y], outs, mode=SCAN_ORACLE)(yv)
    got = f(yv)
    assert np.all(np.isnan(got[0])) and np.all(np.isnan(got[1]))


# declared facts: a filter over free matrices -----------------------------------------------------------------------


def test_free_matrices_declared_positive_definite_fuse_with_plain_grad(yv, rng):
    """A textbook filter over free P0, H, Q fuses once they are declared symmetric positive definite;
    values and gradients (plain ``pytensor.grad``) equal the loop's."""
    P0s, Hs, Qs, Ts = pt.matrix("P0"), pt.matrix("H"), pt.matrix("Q"), pt.matrix("T")
    y, outs = _loop_outputs(P0s, H=Hs, Q=Qs, T=Ts)
    report = str(iterops.explain(outs[0].sum()))
    assert "assume(P0, symmetric=True, positive_definite=True)" in report
    decl = {"symmetric": True, "positive_definite": True}
    y, outs = _loop_outputs(assume(P0s, **decl), H=assume(Hs, **decl), Q=assume(Qs, **decl), T=Ts)
    assert iterops.explain(outs[0].sum()).replaced
    f, g = _user_and_loop(y, outs, [P0s, Hs, Qs, Ts], wrt=[P0s, Hs, Qs, Ts])
    assert not _has_scan(f)

    def spd():
        x = rng.normal(size=(2, 2))
        return x @ x.T + 0.5 * np.eye(2)

    args = (yv, spd(), spd(), spd(), _T)
    got, want = f(*args), g(*args)
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    # d/dP0, d/dH, d/dQ: the loop splits each off-diagonal derivative unevenly between (i, j) and (j, i)
    # (documented in iterops.fusion.patterns.kalman); the symmetric sums agree
    for a, b in zip(got[3:6], want[3:6]):
        np.testing.assert_allclose(a + a.T, b + b.T, rtol=1e-8)
    np.testing.assert_allclose(got[6], want[6], rtol=1e-8)
