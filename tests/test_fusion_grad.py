"""Gradient fusion (iterops.fusion.gradient): a user's Scan differentiated with plain ``pytensor.grad``.

For every pattern, ``pytensor.function(inputs, [cost, *pytensor.grad(cost, wrt)])``
(no ``fuse_loops``) holds an iterops Op and no Scan, and its values and
gradients equal the same graph with iterops excluded (PyTensor's own gradient
Scan: the oracle).  The oracle runs on PyTensor's Python VM (``SCAN_ORACLE``):
a cold Numba compile of a Scan and its gradient Scan costs a minute or more
each, and the Python VM runs the same graph Op by Op.  The literal comparison,
with ``mode.excluding("iterops")`` compiled by Numba, runs for the Lyapunov,
block-diagonal and Levinson loops in the default run and for every case
(the Kalman ones included) under ``-m slow``
(``test_plain_grad_equals_the_numba_compiled_scan``).  Also: every linker, gradients
w.r.t. a subset of the inputs, several costs through one loop, a loop nested
in an outer Scan, ``iterops.explain`` on the gradient Scan; and the cases that
must keep the Scans (truncated gradient, second derivative, a read of an
intermediate state).
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import get_mode
from pytensor.scan.op import Scan
from pytensor.scan.utils import until

import iterops
from conftest import SCAN_ORACLE, as_run_by_python
from iterops import reference_loops as rl
from iterops.fusion.patterns._common import CONVERGENCE_STOPS

pytestmark = [pytest.mark.python_run, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")]


def _excluded(mode):
    return get_mode(mode).excluding("iterops")


def _ops(f):
    return [n.op for n in f.maker.fgraph.apply_nodes]


def _has_scan(f):
    return any(isinstance(op, Scan) for op in _ops(f))


def _has_iterops(f):
    return any(type(getattr(op, "core_op", op)).__module__.startswith("iterops") for op in _ops(f))


def _weights(o, k):
    """A cost weight touching every entry of ``o`` differently."""
    return pt.cos(0.7 * pt.arange(o.size) + k).reshape(o.shape)


def _assert_fused_and_equal(ins, outs, vals, mode=None, rtol=1e-8, atol=1e-10, fused=True, oracle=SCAN_ORACLE):
    """``outs`` compiled in ``mode`` (default: this module's ``python_run`` mode, NUMBA's rewrites) is fused (or,
    ``fused=False``, keeps its Scans) and equals ``oracle``'s graph, the Scans with iterops excluded.  A kept
    graph is ``mode``'s rewritten graph run on the Python VM (the Scans a Numba compile would take minutes over
    are PyTensor's, not iterops')."""
    f = pytensor.function(ins, outs, mode=mode if fused else as_run_by_python(mode or "NUMBA"))
    ref = pytensor.function(ins, outs, mode=oracle)
    assert _has_scan(ref)
    if fused:
        assert _has_iterops(f) and not _has_scan(f), str(iterops.explain(outs))
    else:
        assert _has_scan(f) and not _has_iterops(f)
    for g, w in zip(f(*vals), ref(*vals)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return f


# ---------------------------------------------------------------------------
# the user loops (iterops.reference_loops), each with plain pytensor.grad
# ---------------------------------------------------------------------------


def _stable(rng, m=3, rho=0.8):
    A = rng.normal(size=(m, m))
    return rho * A / np.max(np.abs(np.linalg.eigvals(A)))


def _lyapunov_case(loop, rng, **kw):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = loop(A, Q, **kw)
    L = rng.normal(size=(3, 3))
    return [A, Q], X, [A, Q], [_stable(rng), L @ L.T + np.eye(3)]


def _fixed_point_x0_case(rng, **kw):
    A, Q, X0 = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0")
    X = rl.fixed_point_loop(A, Q, X0=X0, **kw)
    L = rng.normal(size=(3, 3))
    return [A, Q, X0], X, [A, Q, X0], [_stable(rng), L @ L.T + np.eye(3), 0.1 * np.eye(3)]


def _damped_case(rng, w=None, n_steps=3000, tol=1e-11, **kw):
    """The damped fixed point; ``w`` a symbolic scalar (``None``, also differentiated) or a constant."""
    A, Q, X0_, ws = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0"), pt.scalar("w")
    X = rl.damped_fixed_point_loop(A, Q, ws if w is None else w, X0=X0_, tol=tol, n_steps=n_steps, **kw)
    L = rng.normal(size=(3, 3))
    ins = [A, Q, X0_, *([ws] if w is None else [])]
    vals = [_stable(rng), L @ L.T + np.eye(3), rng.normal(size=(3, 3)), *([0.6] if w is None else [])]
    return ins, X, ins, vals


def _step_with_stop(update, stop):
    """A step ``X <- update(X, *args)`` with one of the accepted stop rules (``None``: ``n_steps`` iterations)."""
    if stop is None:
        return lambda X, *args: update(X, *args[:-1])

    def step(X, *args):
        X_new = update(X, *args[:-1])
        return X_new, until(stop(X_new, X, args[-1]))

    return step


def _transposed_step(stop):
    """The fixed point ``X <- A^T X A + Q`` (the same iteration for ``A^T``)."""
    return _step_with_stop(lambda X, A, Q: A.T @ X @ A + Q, stop)


def _transposed_case(rng, stop):
    n_steps = 5000 if stop is not None else 60
    return _fixed_point_x0_case(rng, step=_transposed_step(stop), tol=1e-11, n_steps=n_steps)


def _damped_stop_case(rng, stop):
    step = _step_with_stop(lambda X, A, Q, w: (1 - w) * X + w * (A @ X @ A.T + Q), stop)
    return _damped_case(rng, step=step, n_steps=3000 if stop is not None else 60, tol=1e-6)  # a short Python-VM oracle


#: every stop rule the Lyapunov patterns accept, and none
_STOPS = (*CONVERGENCE_STOPS, None)


def _block_diag_case(rng):
    x = pt.tensor3("x")
    return [x], rl.block_diag_loop(x), [x], [rng.normal(size=(4, 2, 3))]


def _block_diag_sequence_case(rng, **scan_kwargs):
    """The blocks read as a Scan *sequence*: the loop's gradient reaches ``x`` through the Scan's slice of it."""
    x = pt.tensor3("x")
    return [x], rl.block_diag_sequence_loop(x, **scan_kwargs), [x], [rng.normal(size=(4, 2, 3))]


def _levinson_case(rng, which):
    gamma = pt.vector("gamma")
    phi, sigma2, pacf = rl.levinson_loop(gamma, 3)
    out = {"phi": phi, "sigma2": sigma2, "pacf": pacf, "all": [phi, sigma2, pacf]}[which]
    # autocovariances of a stationary AR(2)
    g = np.array([2.0, 1.2, 0.5, 0.1, -0.05])
    return [gamma], out, [gamma], [g]


def _kalman_symbols(n=12, m=3, p=2):
    return dict(y=pt.tensor("y", shape=(n, p)), a0=pt.tensor("a0", shape=(m,)), L0=pt.tensor("L0", shape=(m, m)),
                T=pt.tensor("T", shape=(m, m)), Z=pt.tensor("Z", shape=(p, m)), R=pt.tensor("R", shape=(m, m)),
                LH=pt.tensor("LH", shape=(p, p)), LQ=pt.tensor("LQ", shape=(m, m)))


def _kalman_values(rng, n=12, m=3, p=2):
    return dict(y=rng.normal(size=(n, p)), a0=rng.normal(size=m), L0=np.tril(rng.normal(size=(m, m))) + 2 * np.eye(m),
                T=0.6 * np.eye(m) + 0.1 * rng.normal(size=(m, m)), Z=rng.normal(size=(p, m)),
                R=np.eye(m) + 0.1 * rng.normal(size=(m, m)), LH=np.tril(0.3 * rng.normal(size=(p, p))) + np.eye(p),
                LQ=np.tril(0.3 * rng.normal(size=(m, m))) + np.eye(m))


def _kalman_case(rng, which):
    s = _kalman_symbols()
    ll, a, Ps = rl.kalman_textbook_loop(s["y"], s["a0"], s["L0"] @ s["L0"].T, s["T"], s["Z"], s["R"],
                                        s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T)
    out = {"ll": ll, "all": [ll, a, Ps], "last": [Ps[-1], a[-1]], "wrt_y": [ll, a]}[which]
    v = _kalman_values(rng)
    names = list(s)
    wrt = [s[k] for k in names if k != "y" or which == "wrt_y"]  # the observations are a Scan sequence
    return [s[k] for k in names], out, wrt, [v[k] for k in names]


def _pymc_extras_case(rng, which):
    from pymc_extras.statespace.filters import StandardFilter

    s = _kalman_symbols()
    m, p = 3, 2
    c, d = pt.tensor("c", shape=(m,)), pt.tensor("d", shape=(p,))
    outs = StandardFilter().build_graph(s["y"], s["a0"], s["L0"] @ s["L0"].T, c, d, s["T"], s["Z"], s["R"],
                                        s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T)
    out = outs[-1] if which == "ll" else list(outs)
    v = _kalman_values(rng)
    v["y"][3, 0] = np.nan
    ins = [*(s[k] for k in s), c, d]
    vals = [*(v[k] for k in s), 0.1 * rng.normal(size=m), 0.1 * rng.normal(size=p)]
    return ins, out, [x for x in ins if x is not s["y"]], vals


CASES = {
    "doubling": lambda rng: _lyapunov_case(rl.doubling_loop, rng),
    "fixed_point": lambda rng: _lyapunov_case(rl.fixed_point_loop, rng),
    "fixed_point_x0": _fixed_point_x0_case,
    **{f"fixed_point_transposed_stop{k}": (lambda rng, s=s: _transposed_case(rng, s)) for k, s in enumerate(_STOPS)},
    "damped_fixed_point": _damped_case,
    **{f"damped_fixed_point_stop{k}": (lambda rng, s=s: _damped_stop_case(rng, s)) for k, s in enumerate(_STOPS)},
    "damped_fixed_point_constant_w": lambda rng: _damped_case(rng, w=0.5),
    "block_diag": _block_diag_case,
    "block_diag_sequence": _block_diag_sequence_case,
    "block_diag_sequence_backwards": lambda rng: _block_diag_sequence_case(rng, go_backwards=True),
    "levinson_phi": lambda rng: _levinson_case(rng, "phi"),
    "levinson_sigma2": lambda rng: _levinson_case(rng, "sigma2"),
    "levinson_pacf": lambda rng: _levinson_case(rng, "pacf"),
    "levinson_all": lambda rng: _levinson_case(rng, "all"),
    "kalman_ll": lambda rng: _kalman_case(rng, "ll"),
    "kalman_all": lambda rng: _kalman_case(rng, "all"),
    "kalman_last": lambda rng: _kalman_case(rng, "last"),
    "kalman_wrt_y": lambda rng: _kalman_case(rng, "wrt_y"),
    "pymc_extras_ll": lambda rng: _pymc_extras_case(rng, "ll"),
    "pymc_extras_all": lambda rng: _pymc_extras_case(rng, "all"),
}


def _cost(out):
    outs = out if isinstance(out, list) else [out]
    return sum((o * _weights(o, k)).sum() for k, o in enumerate(outs))


@pytest.mark.parametrize("name", list(CASES))
def test_plain_grad_is_fused_and_equal(name, rng):
    ins, out, wrt, vals = CASES[name](rng)
    cost = _cost(out)
    _assert_fused_and_equal(ins, [cost, *pytensor.grad(cost, wrt)], vals)


# the Lyapunov, block-diagonal and Levinson patterns against the Numba-compiled Scan by default, every case
# under -m slow (the Kalman Scan pair's cold Numba compile takes minutes; kalman_* run against SCAN_ORACLE)
_NUMBA_ORACLE_DEFAULT = {"fixed_point", "block_diag", "levinson_all"}


@pytest.mark.parametrize(
    "name", [n if n in _NUMBA_ORACLE_DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_plain_grad_equals_the_numba_compiled_scan(name, rng):
    """The Done-when's literal oracle: the same graph compiled with ``get_mode("NUMBA").excluding("iterops")``."""
    ins, out, wrt, vals = CASES[name](rng)
    cost = _cost(out)
    _assert_fused_and_equal(ins, [cost, *pytensor.grad(cost, wrt)], vals, mode="NUMBA", oracle=_excluded("NUMBA"))


@pytest.mark.parametrize("mode", ["CVM", "FAST_COMPILE"])
@pytest.mark.parametrize("name", ["fixed_point", "damped_fixed_point", "levinson_all", "kalman_ll"])
def test_other_linkers(name, mode, rng):
    ins, out, wrt, vals = CASES[name](rng)
    cost = _cost(out)
    _assert_fused_and_equal(ins, [cost, *pytensor.grad(cost, wrt)], vals, mode=mode)


@pytest.mark.parametrize("name", ["doubling", "kalman_all"])
def test_gradient_of_a_subset_of_the_inputs(name, rng):
    ins, out, wrt, vals = CASES[name](rng)
    cost = _cost(out)
    _assert_fused_and_equal(ins, [cost, *pytensor.grad(cost, wrt[-1:])], vals)


@pytest.mark.parametrize("name", ["fixed_point", "kalman_all", "levinson_all"])
def test_several_costs_through_one_loop(name, rng):
    ins, out, wrt, vals = CASES[name](rng)
    outs = out if isinstance(out, list) else [out]
    c1 = _cost(outs)
    c2 = sum((o**2 * _weights(o, 5 + k)).sum() for k, o in enumerate(outs))
    _assert_fused_and_equal(ins, [c1, c2, *pytensor.grad(c1, wrt), *pytensor.grad(c2, wrt[:1])], vals)


def test_gradient_only_without_the_cost(rng):
    ins, out, wrt, vals = CASES["kalman_ll"](rng)
    _assert_fused_and_equal(ins, pytensor.grad(_cost(out), wrt), vals)


def test_loop_nested_in_an_outer_scan(rng):
    """An outer Scan over a batch of A matrices, each step differentiating the user's inner fixed-point loop."""
    As, Q = pt.tensor3("As"), pt.matrix("Q")

    def outer_step(A, Q):
        X = rl.fixed_point_loop(A, Q)
        c = (X * _weights(X, 0)).sum()
        return c, *pytensor.grad(c, [A, Q])

    (cs, gAs, gQs) = pytensor.scan(outer_step, sequences=[As], non_sequences=[Q], return_updates=False)
    L = rng.normal(size=(3, 3))
    vals = [np.stack([_stable(rng) for _ in range(3)]), L @ L.T + np.eye(3)]
    f = pytensor.function([As, Q], [cs, gAs, gQs])
    ref = pytensor.function([As, Q], [cs, gAs, gQs], mode=SCAN_ORACLE)
    (outer,) = [n for n in f.maker.fgraph.apply_nodes if isinstance(n.op, Scan)]
    inner_ops = [type(n.op).__name__ for n in outer.op.fgraph.apply_nodes]
    # the fused gradient; under Numba the reverse pass reads the forward run's trace (share_fixed_point_trace)
    assert "Scan" not in inner_ops and "LyapunovFixedPointTraceGrad" in inner_ops, inner_ops
    for g, w in zip(f(*vals), ref(*vals)):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------
# kept: the contract's cases
# ---------------------------------------------------------------------------


def test_truncated_gradient_keeps_the_scans(rng):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = rl.fixed_point_loop(A, Q, truncate_gradient=3)
    cost = (X * _weights(X, 0)).sum()
    L = rng.normal(size=(3, 3))
    _assert_fused_and_equal([A, Q], [cost, *pytensor.grad(cost, [A, Q])], [_stable(rng), L @ L.T], fused=False)


def test_second_derivative_keeps_the_scans(rng):
    gamma = pt.vector("gamma")
    phi, _, _ = rl.levinson_loop(gamma, 2)
    g = pytensor.grad((phi * _weights(phi, 0)).sum(), gamma)
    h = pytensor.grad((g**2).sum(), gamma)
    _assert_fused_and_equal([gamma], [g, h], [np.array([2.0, 1.2, 0.5, 0.1])], fused=False)


def test_intermediate_state_read_keeps_the_scans(rng):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    Xs = pytensor.scan(rl.fixed_point_step, outputs_info=[pt.zeros_like(Q)], non_sequences=[A, Q, 1e-12],
                       n_steps=50, return_updates=False)
    cost = (Xs[-1] * _weights(Xs[-1], 0)).sum() + Xs[2].sum()
    L = rng.normal(size=(3, 3))
    _assert_fused_and_equal([A, Q], [cost, *pytensor.grad(cost, [A, Q])], [_stable(rng), L @ L.T], fused=False)


def test_explain_reports_the_gradient_scan(rng):
    ins, out, wrt, vals = CASES["fixed_point"](rng)
    cost = _cost(out)
    report = iterops.explain([cost, *pytensor.grad(cost, wrt)])
    text = str(report)
    assert len(report.replaced) == 2, text
    assert [r.gradient_of for r in report.replaced] == [None, report.replaced[0].scan], text
    assert "gradient of Scan" in text and "lyapunov_fixed_point" in text, text
    kept = iterops.explain(pytensor.grad((rl.fixed_point_loop(*ins[:2], truncate_gradient=2)).sum(), wrt))
    assert not kept.replaced and len(kept.kept) == 2, str(kept)
    assert "truncate_gradient=2" in str(kept.kept[1]) and kept.kept[1].gradient_of, str(kept)


def test_sequence_read_through_its_source_only_when_the_source_feeds_nothing_else():
    """``_sliced_source``: the fused gradient of a sequence's source, sliced, is the loop's gradient of the
    sequence only if the source reaches the loop through that sequence alone (shapes do not count)."""
    from iterops.fusion.gradient import _sliced_source

    def step(i, xi, out, s):
        return out + s * xi.sum()

    x = pt.tensor3("x")
    for extra, want in ((pt.cast(x.shape[0], "float64"), True), (x.sum(), False)):
        out = pytensor.scan(step, sequences=[pt.arange(x.shape[0]), x], outputs_info=[pt.zeros(())],
                            non_sequences=[extra], return_updates=False)
        F = out.owner.inputs[0].owner
        while not isinstance(F.op, Scan):
            F = F.inputs[0].owner
        seq = F.inputs[2]  # n_steps, the index sequence, the blocks sequence
        found = _sliced_source(F, seq, {x})
        assert (found is not None) == want, (extra, found)
        if want:
            assert found[0] is x and all(n.op.__class__.__name__ == "Subtensor" for n in found[1])


#: start values built from another loop input (``2 Q``: a node of constants alone, ``ExpandDims(2)``, in the
#: gradient of a while loop's start value, located in the user's graph without a variable to start from)
_STARTS = {"Q": lambda A, Q: Q, "Q.T": lambda A, Q: Q.T, "A A^T": lambda A, Q: A @ A.T, "2 Q": lambda A, Q: 2 * Q,
           "I + 0 Q": lambda A, Q: pt.eye(3) + 0 * Q}


#: the loops of the Lyapunov fixed-point patterns: (step, non-sequences after A and Q, their values)
_START_LOOPS = {
    "AXA^T": (rl.fixed_point_step, [1e-10], []),
    "A^TXA": (_transposed_step(CONVERGENCE_STOPS[0]), [1e-10], []),
    "damped": (rl.damped_fixed_point_step, [pt.scalar("w"), 1e-10], [0.6]),
}


@pytest.mark.parametrize("loop", list(_START_LOOPS))
@pytest.mark.parametrize("start", list(_STARTS))
def test_start_value_built_from_another_loop_input(start, loop, rng):
    """``X0 = Q`` (or ``Q^T``, ``A A^T``, ...) with ``Q`` (``A``) also a non-sequence.  The loop's pullback gives the
    gradient of the start value and that of the non-sequence apart (partial derivatives), summed by the user's
    graph; ``pytensor.grad`` of the fused graph with respect to ``Q`` would give both paths at once, and replacing
    both gradients with it would count the start value's path twice (a deep-fuzzer finding).  The fused partial
    derivatives come from the replacement built on stand-ins (``_partial_gradients``): fused, and equal to the
    loop's gradients (oracle: the same graph with iterops excluded)."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    step, extra, extra_vals = _START_LOOPS[loop]
    Xs = pytensor.scan(step, outputs_info=[_STARTS[start](A, Q)], non_sequences=[A, Q, *extra], n_steps=300,
                       return_updates=False)
    X = Xs[-1]
    cost = (X * _weights(X, 0)).sum()
    ins = [A, Q, *(x for x in extra if isinstance(x, pt.TensorVariable))]
    L = rng.normal(size=(3, 3))
    _assert_fused_and_equal(ins, [cost, *pytensor.grad(cost, ins)], [_stable(rng), L @ L.T, *extra_vals])
