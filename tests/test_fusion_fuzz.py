"""Mutation fuzzer of the Scan-fusion rewrite: every mutant keeps its Scan or computes what its loop computes.

For each registered pattern a *harness* builds the loop as users write it
(:mod:`iterops.reference_loops`, or the pattern's own reference step for
pymc-extras' filter) and evaluates it on random and adversarial inputs (unit
roots unexcited by Q, multi-scale solutions, start values far from the
solution, near-singular covariances, non-positive-definite autocovariances,
too-short sequences, zero-step loops).  Hypothesis (seeded through the
``ci`` profile) draws one mutation per example:

graph mutations of the step (one node, chosen by index):
    ``swap`` operands of a non-commutative operation (``-``, ``/``, ``**``,
    comparisons, matrix products); insert a ``transpose`` of a matrix; drop a
    transpose; change a ``constant``; ``add`` a small constant; a ``narrow``
    cast (float64 -> float32/float16 -> float64); ``flip`` a comparison
    (``<`` / ``<=`` / ``>``); replace an operand by another step ``input`` of
    the same type (an intermediate or previous state in the update or the
    stop rule);
loop mutations:
    ``truncate_gradient=1``, ``go_backwards=True``, another ``n_steps``
    (0, 1, 2, 3, negative), another initial state.

The contract (``iterops.fusion``): the graph after :func:`iterops.fuse_loops`
either still holds a Scan, or its values and gradients equal the unrewritten
loop's (``mode.excluding("iterops")``), with NaN/inf at the same places, and
it raises where the loop raises.  "Equal" is rtol 1e-6, widened elementwise by
a few times the loop's own rounding spread (its outputs' change when the
inputs move by a few ulps, :func:`_rounding_spread`): rounding-sized on
well-conditioned inputs, O(1) where the loop itself cancels catastrophically.  Each example also draws how the gradient is
taken: after ``fuse_loops``, or with plain ``pytensor.grad`` of the user's
loop (the compile-time rewrite then replaces the loop together with the
gradient Scan ``pytensor.grad`` built, :mod:`iterops.fusion.gradient`).

Budget: ``ITEROPS_FUZZ_EXAMPLES`` examples per pattern (default 12; a third
of that for the ``COSTLY`` harnesses), a few minutes in CI; the ``slow`` test
runs ``ITEROPS_FUZZ_DEEP`` (default 150) per pattern.  A run prints its
fused / kept counts per pattern and mutation kind (``pytest -s``).
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import numpy as np
import pytensor
import pytensor.scalar as ps
import pytensor.tensor as pt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytensor.graph.basic import Constant, Variable
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import io_toposort
from pytensor.scan.op import Scan
from pytensor.scan.utils import until
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.math import Dot

import iterops
from conftest import SCAN_ORACLE, as_run_by_python
from iterops import reference_loops as ref
from iterops.fusion.patterns.kalman import _pymc_extras_step

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")

# both sides run by ``perform`` (conftest.PythonMode): the fused side with FAST_COMPILE's rewrites, iterops' included
_SCAN_MODE = SCAN_ORACLE
_FUSED_MODE = as_run_by_python("FAST_COMPILE")
EXAMPLES = int(os.environ.get("ITEROPS_FUZZ_EXAMPLES", "12"))
DEEP = int(os.environ.get("ITEROPS_FUZZ_DEEP", "150"))
STATS: collections.Counter = collections.Counter()


class NotApplicable(Exception):
    """The drawn mutation does not apply to this step (or builds an invalid graph)."""


#: the exceptions that make a mutant invalid (a graph PyTensor refuses to build), by type and message; any other
#: exception while building a mutant fails the test (a bug of the fuzzer, of PyTensor or of iterops' graph code)
INVALID_MUTANT = (
    (ValueError, "Incompatible shared dimension"),  # operands of a matrix product swapped, static shapes disagree
    (ValueError, "length should not be negative"),  # a constant negative ``n_steps`` over a sequence
)


def _is_invalid(err) -> bool:
    return any(isinstance(err, t) and m in str(err) for t, m in INVALID_MUTANT)


# ---------------------------------------------------------------------------
# Mutations of a step's graph
# ---------------------------------------------------------------------------

_NONCOMMUTATIVE = (ps.Sub, ps.TrueDiv, ps.Pow, ps.LT, ps.LE, ps.GT, ps.GE)
_FLIPS = {ps.LT: (ps.le, ps.gt), ps.LE: (ps.lt, ps.ge), ps.GT: (ps.ge, ps.lt), ps.GE: (ps.gt, ps.le)}


def _scalar_op(node):
    return node.op.scalar_op if isinstance(node.op, Elemwise) else None


def _is_matmul(node):
    op = node.op.core_op if isinstance(node.op, Blockwise) else node.op
    return isinstance(op, Dot) or type(op).__name__ in ("Matmul", "MatMul")


def _rebuild(node, inputs):
    return node.op.make_node(*inputs).outputs[0]


def _swap(node, args, k):
    if len(node.inputs) == 2 and (isinstance(_scalar_op(node), _NONCOMMUTATIVE) or _is_matmul(node)):
        return _rebuild(node, node.inputs[::-1])
    return None


def _fresh(node):
    """A copy of ``node``'s output on the same inputs (so a mutation may wrap it without a cycle)."""
    return node.clone().outputs[0]


def _transpose(node, args, k):
    out = node.outputs[0]
    if out.type.ndim == 2 and not isinstance(node.op, DimShuffle):
        return _fresh(node).T
    return None


def _drop_transpose(node, args, k):
    if isinstance(node.op, DimShuffle) and tuple(node.op.new_order) == (1, 0):
        return node.inputs[0]
    return None


def _change_constant(node, args, k):
    for j, x in enumerate(node.inputs):
        if isinstance(x, Constant) and str(x.type.dtype).startswith("float"):
            new = pt.constant(np.asarray(x.data) * 1.5 + 0.25, dtype=x.type.dtype)
            if x.type.broadcastable != new.type.broadcastable:
                new = pt.specify_broadcastable(new, *[d for d, b in enumerate(x.type.broadcastable) if b])
            return _rebuild(node, [*node.inputs[:j], new, *node.inputs[j + 1:]])
    return None


def _add_constant(node, args, k):
    out = node.outputs[0]
    if str(out.type.dtype).startswith("float"):
        return _fresh(node) + np.asarray(1e-3, dtype=out.type.dtype)
    return None


def _narrow(node, args, k):
    out = node.outputs[0]
    if out.type.dtype == "float64":
        return pt.cast(pt.cast(_fresh(node), ("float32", "float16")[k % 2]), "float64")
    return None


def _flip(node, args, k):
    s = _scalar_op(node)
    if type(s) in _FLIPS:
        return _FLIPS[type(s)][k % 2](*node.inputs)
    return None


def _other_input(node, args, k):
    for j, x in enumerate(node.inputs):
        if x in args:
            others = [a for a in args if a is not x and a.type == x.type]
            if others:
                return _rebuild(node, [*node.inputs[:j], others[k % len(others)], *node.inputs[j + 1:]])
    return None


GRAPH_MUTATIONS = {
    "swap": _swap, "transpose": _transpose, "drop_transpose": _drop_transpose, "constant": _change_constant,
    "add": _add_constant, "narrow": _narrow, "flip": _flip, "input": _other_input,
}
LOOP_MUTATIONS = ("truncate_gradient", "go_backwards", "n_steps", "init")


def _split(ret):
    """``(outputs, until condition or None)`` of a step's return value."""
    if isinstance(ret, until):
        return [], ret.condition
    if isinstance(ret, tuple | list) and ret and isinstance(ret[-1], until):
        outs = ret[0] if len(ret) == 2 and isinstance(ret[0], tuple | list) else ret[:-1]
        return list(outs), ret[-1].condition
    return ([ret] if isinstance(ret, Variable) else list(ret)), None


def mutated(step, kind, index):
    """``step`` with the ``index``-th applicable node (mod their number) changed by mutation ``kind``."""
    mutate = GRAPH_MUTATIONS[kind]

    def new_step(*args):
        outs, cond = _split(step(*args))
        roots = [*outs, *([cond] if cond is not None else [])]
        args = [a for a in args if isinstance(a, Variable)]
        cands = []
        for node in io_toposort(args, roots):
            try:
                new = mutate(node, args, index)
            except Exception as err:  # noqa: BLE001  (an invalid mutant graph: not applicable here)
                if not _is_invalid(err):
                    raise
                new = None
            if new is not None:
                cands.append((node.outputs[0], new))
        if not cands:
            raise NotApplicable(kind)
        old, new = cands[index % len(cands)]
        try:
            new = pt.cast(new, old.type.dtype) if new.type.dtype != old.type.dtype else new
            roots = graph_replace(roots, {old: new}, strict=False)
        except Exception as err:  # noqa: BLE001
            if not _is_invalid(err):
                raise
            raise NotApplicable(f"{kind}: {err}") from err
        outs = roots[:len(outs)]
        return (outs, until(roots[-1])) if cond is not None else outs

    return new_step


# ---------------------------------------------------------------------------
# Harnesses: the loop as users write it, and inputs that stress the contract
# ---------------------------------------------------------------------------


@dataclass
class Harness:
    step: object
    build: object  # (step, loop mutation or None, k) -> (symbolic inputs, outputs)
    values: object  # () -> list of input value tuples
    dtype_inputs: list = field(default_factory=list)


def _loop_kwargs(loop, k, n_steps_choices):
    """``pytensor.scan`` keyword arguments of a loop mutation (``n_steps`` from ``n_steps_choices``)."""
    if loop == "truncate_gradient":
        return {"truncate_gradient": 1}
    if loop == "go_backwards":
        return {"go_backwards": True}
    if loop == "n_steps":
        return {"n_steps": n_steps_choices[k % len(n_steps_choices)]}
    return {}


def _doubling_build(step, loop, k):
    A, Q, tol, n = pt.matrix("A"), pt.matrix("Q"), pt.scalar("tol"), pt.iscalar("n")
    kw = {"n_steps": n, **_loop_kwargs(loop, k, (0, 1, 2, 3, -1))}
    alpha0, gamma0 = ((A.T, Q), (A, Q + 1.0), (0.5 * A, 2 * Q))[k % 3] if loop == "init" else (A, Q)
    _, gammas = pytensor.scan(step, outputs_info=[alpha0, gamma0], non_sequences=[tol], return_updates=False,
                              **kw)
    return [A, Q, tol, n], [gammas[-1]]


def _lyapunov_values():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(3, 3))
    A *= 0.8 / np.abs(np.linalg.eigvals(A)).max()
    L = rng.normal(size=(3, 3))
    c, s = np.cos(0.3), np.sin(0.3)
    return [
        (A, L @ L.T + np.eye(3), 1e-12, 100),
        (np.diag([1.0, 0.5]), np.diag([0.0, 1.0]), 1e-12, 100),  # unit root unexcited by Q
        (np.diag([0.0, 0.9999]), np.diag([1.0, 1e-10]), 1e-15, 100),  # multi-scale
        (np.array([[c, -s], [s, c]]), np.eye(2), 1e-12, 12),  # rotation: never converges, stops at the guard
        (np.diag([0.99999, 0.2]), np.eye(2), 1e-8, 7),  # hits its n_steps guard
    ]


def _fixed_point_build(step, loop, k):
    A, Q, X0, tol, n = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0"), pt.scalar("tol"), pt.iscalar("n")
    kw = {"n_steps": n, **_loop_kwargs(loop, k, (0, 1, 2, 3, -1))}
    x0 = (pt.zeros_like(Q), Q, X0.T)[k % 3] if loop == "init" else X0
    Xs = pytensor.scan(step, outputs_info=[x0], non_sequences=[A, Q, tol], return_updates=False, **kw)
    return [A, Q, X0, tol, n], [Xs[-1]]


def _fixed_point_values():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(3, 3))
    A *= 0.7 / np.abs(np.linalg.eigvals(A)).max()
    L = rng.normal(size=(3, 3))
    c, s = np.cos(0.3), np.sin(0.3)
    return [
        (A, L @ L.T, rng.normal(size=(3, 3)), 1e-12, 3000),
        (np.diag([1.0, 0.5]), np.diag([0.0, 1.0]), 1e6 * np.eye(2), 1e-12, 5000),  # limit depends on X0
        (np.array([[c, -s], [s, c]]), np.zeros((2, 2)), np.eye(2), 1e-12, 5000),  # rotation, Q = 0
        (np.diag([0.0, 0.9999]), np.diag([1.0, 1e-10]), np.zeros((2, 2)), 1e-15, 300),  # guard, multi-scale
    ]


def _damped_build(step, loop, k):
    A, Q, X0, w = pt.matrix("A"), pt.matrix("Q"), pt.matrix("X0"), pt.scalar("w")
    tol, n = pt.scalar("tol"), pt.iscalar("n")
    kw = {"n_steps": n, **_loop_kwargs(loop, k, (0, 1, 2, 3, -1))}
    x0 = (pt.zeros_like(Q), Q, X0.T)[k % 3] if loop == "init" else X0
    Xs = pytensor.scan(step, outputs_info=[x0], non_sequences=[A, Q, w, tol], return_updates=False, **kw)
    return [A, Q, X0, w, tol, n], [Xs[-1]]


def _damped_values():
    rng = np.random.default_rng(5)
    A = rng.normal(size=(3, 3))
    A *= 0.7 / np.abs(np.linalg.eigvals(A)).max()
    L = rng.normal(size=(3, 3))
    c, s = np.cos(0.3), np.sin(0.3)
    return [
        (A, L @ L.T, rng.normal(size=(3, 3)), 0.6, 1e-12, 3000),
        (A, L @ L.T, rng.normal(size=(3, 3)), 1.4, 1e-12, 3000),  # over-relaxed
        (np.diag([1.0, 0.5]), np.diag([0.0, 1.0]), 1e6 * np.eye(2), 0.5, 1e-12, 5000),  # limit depends on X0
        (np.array([[c, -s], [s, c]]), np.zeros((2, 2)), np.eye(2), 0.8, 1e-12, 400),  # rotation, Q = 0
        (A, L @ L.T, 1e8 * rng.normal(size=(3, 3)), 1e-7, 1e-9, 300),  # w near 0, start far off: the guard
        (A, L @ L.T, rng.normal(size=(3, 3)), 0.0, 1e-12, 50),  # w = 0: one step, X0 kept
    ]


def _block_build(step, loop, k, sequence=False):
    x = pt.tensor3("x")
    kw = _loop_kwargs(loop, k, (x.shape[0] - 1, 1, x.shape[0] + 0))
    kk, n, m = x.shape
    init = pt.zeros((kk * n, kk * m), dtype=x.dtype)
    if loop == "init":
        init = (pt.ones((kk * n, kk * m)), pt.zeros((kk * n + 1, kk * m)))[k % 2]
    if sequence:
        outs = pytensor.scan(step, sequences=[pt.arange(kk), x], outputs_info=[init], return_updates=False, **kw)
    else:
        outs = pytensor.scan(step, sequences=[pt.arange(kk)], outputs_info=[init], non_sequences=[x],
                             return_updates=False, **kw)
    return [x], [outs[-1]]


def _block_sequence_step(i, xi, out):
    n, m = xi.shape[0], xi.shape[1]
    return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], xi)


def _block_values():
    rng = np.random.default_rng(2)
    return [(rng.normal(size=(3, 2, 3)),), (rng.normal(size=(1, 1, 1)),), (np.zeros((0, 2, 2)),),
            (rng.normal(size=(2, 0, 3)),)]


KN, KM, KP = 12, 3, 2


def _kalman_symbols():
    return dict(y=pt.tensor("y", shape=(KN, KP)), a0=pt.vector("a0"), L0=pt.matrix("L0"), T=pt.matrix("T"),
                Z=pt.matrix("Z"), R=pt.matrix("R"), LH=pt.matrix("LH"), LQ=pt.matrix("LQ"))


def _kalman_build(step, loop, k, loop_fn=ref.kalman_textbook_loop):
    s = _kalman_symbols()
    kw = _loop_kwargs(loop, k, (KN - 3, 1, -3))
    P0, H, Q = s["L0"] @ s["L0"].T, s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T
    if loop == "init":
        P0 = (s["L0"], s["L0"] + s["L0"].T, s["L0"] @ s["L0"].T + 1.0)[k % 3]
    ll, a, Ps = loop_fn(s["y"], s["a0"], P0, s["T"], s["Z"], s["R"], H, Q, step=step, **kw)
    return list(s.values()), [ll, a, Ps]


def _kalman_values():
    rng = np.random.default_rng(3)
    T = 0.6 * np.eye(KM) + 0.15 * rng.normal(size=(KM, KM))
    base = dict(y=rng.normal(size=(KN, KP)), a0=rng.normal(size=KM), L0=np.tril(rng.normal(size=(KM, KM))) + 2 * np.eye(KM),
                T=T, Z=rng.normal(size=(KP, KM)), R=rng.normal(size=(KM, 2)),
                LH=np.tril(0.3 * rng.normal(size=(KP, KP))) + np.eye(KP), LQ=np.tril(0.3 * rng.normal(size=(2, 2))) + np.eye(2))
    near_singular = {**base, "LH": 1e-7 * np.eye(KP), "L0": 1e-6 * np.eye(KM)}
    missing = {**base, "y": base["y"].copy()}
    missing["y"][5, 1] = np.nan
    return [tuple(d.values()) for d in (base, near_singular, missing)]


def _pymc_extras_build(step, loop, k):
    s = _kalman_symbols()
    c, d = pt.vector("c"), pt.vector("d")
    P0, H, Q = s["L0"] @ s["L0"].T, s["LH"] @ s["LH"].T, s["LQ"] @ s["LQ"].T
    kw = _loop_kwargs(loop, k, (KN - 3, 1, -3))
    if loop == "init":
        P0 = (s["L0"], s["L0"] + s["L0"].T)[k % 2]
    jitter, fill = pt.constant(1e-8), pt.constant(-9999.0)
    outs = pytensor.scan(step, sequences=[s["y"]], outputs_info=[s["a0"], P0, None, None, None, None, None],
                         non_sequences=[c, d, s["T"], s["Z"], s["R"], H, Q, jitter, fill], return_updates=False,
                         **kw)
    return [*s.values(), c, d], [outs[-1], outs[2], outs[1]]


def _pymc_extras_values():
    rng = np.random.default_rng(4)
    cd = (0.1 * rng.normal(size=KM), 0.1 * rng.normal(size=KP))
    vals = _kalman_values()
    fill = list(vals[0])
    fill[0] = fill[0].copy()
    fill[0][3, 0] = -9999.0  # the sentinel
    return [(*v, *cd) for v in (*vals, tuple(fill))]


def _levinson_build(step, loop, k):
    gamma = pt.vector("gamma")
    order, kw = 3, _loop_kwargs(loop, k, (2, 1))
    if loop == "init":
        phis, vs, kappas = pytensor.scan(step, sequences=[pt.arange(order)],
                                         outputs_info=[pt.zeros(order), (gamma[1], gamma[0] + 1.0)[k % 2], None],
                                         non_sequences=[gamma], return_updates=False)
        return [gamma], [phis[-1], vs[-1], kappas]
    return [gamma], list(ref.levinson_loop(gamma, order, step=step, **kw))


def _levinson_values():
    return [(np.array([2.0, 1.2, 0.5, 0.1, -0.1]),), (np.array([1.0, 0.0, 0.0, 1.5]),),  # not positive definite
            (np.array([1.0, 0.5, 0.2]),),  # too short: the loop raises
            (np.array([0.0, 0.5, 0.2, 0.1]),)]  # gamma_0 = 0


HARNESSES = {
    "lyapunov_doubling": Harness(ref.doubling_step, _doubling_build, _lyapunov_values),
    "lyapunov_fixed_point": Harness(ref.fixed_point_step, _fixed_point_build, _fixed_point_values),
    "lyapunov_damped_fixed_point": Harness(ref.damped_fixed_point_step, _damped_build, _damped_values),
    "block_diag_indexed": Harness(ref.block_diag_step, _block_build, _block_values),
    "block_diag_sequence": Harness(_block_sequence_step, lambda s, lp, k: _block_build(s, lp, k, sequence=True),
                                   _block_values),
    "kalman_textbook": Harness(ref.kalman_textbook_step, _kalman_build, _kalman_values),
    "kalman_textbook_filtered": Harness(ref.kalman_filtered_step,
                                        lambda s, lp, k: _kalman_build(s, lp, k, loop_fn=ref.kalman_filtered_loop),
                                        _kalman_values),
    "kalman_pymc_extras": Harness(_pymc_extras_step, _pymc_extras_build, _pymc_extras_values),
    "levinson_durbin": Harness(ref.levinson_step, _levinson_build, _levinson_values),
}


# ---------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------


def _run(f, vals):
    try:
        return f(*vals), None
    except Exception as err:  # noqa: BLE001
        return None, err


def _close(got, want, what, spread=None):
    """``got`` equals the loop's ``want`` to rounding: rtol 1e-6, plus the loop's own sensitivity to rounding
    (``spread``, elementwise, from :func:`_rounding_spread`), NaN and infinities at the same places."""
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    spread = np.zeros_like(want) if spread is None else np.broadcast_to(np.asarray(spread, dtype=float), want.shape)
    # where the loop's own result is decided by rounding (infinite spread) nothing is compared, NaN included
    determined = np.isfinite(spread)
    fin = np.isfinite(want) & determined
    np.testing.assert_array_equal(np.isnan(got[determined]), np.isnan(want[determined]),
                                  err_msg=f"{what}: NaN positions")
    inf = np.isinf(want) & determined
    np.testing.assert_array_equal(got[inf], want[inf], err_msg=f"{what}: infinities")
    scale = max(1.0, float(np.abs(want[fin]).max(initial=0.0)))
    tol = 1e-6 * np.abs(want[fin]) + 1e-9 * scale + _SPREAD_FACTOR * spread[fin]
    err = np.abs(got[fin] - want[fin])
    bad = ~(err <= tol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.size} entries differ beyond rounding; worst "
                           f"|got - want| = {err[bad].max():.3g} where the tolerance is {tol[bad][np.argmax(err[bad])]:.3g}"
                           f" (loop's own rounding spread {spread[fin][bad].max():.3g})\ngot  {got}\nwant {want}")


#: how many times the loop's own rounding spread a replacement may differ by (the loop and the fused Op round
#: differently, in a different order, so on an ill-conditioned input both are off the exact value by a few
#: spreads)
_SPREAD_FACTOR = 8.0


def _rounding_spread(f, vals, inputs, want, n=3):
    """The loop's own sensitivity to rounding at ``vals``: the largest change of its outputs ``want`` (from
    ``f(*vals)``) when every floating-point input is perturbed by a few units in the last place (relative
    ``8 eps``, random signs, ``n`` draws).  On a well-conditioned input this is rounding-sized and the contract's
    rtol 1e-6 decides; where the loop itself cancels catastrophically (a near-singular innovation covariance,
    cond ~ 1e14) its results move by O(1) under such perturbations, and so would the loop's results compiled
    with other rewrites: "equal to rounding" then means within that spread.  An output that turns NaN or
    infinite under perturbation where ``want`` is finite, or finite where ``want`` is NaN or infinite, has an
    infinite spread there: its value, NaN or not, is decided by rounding (a Kalman loop whose innovation
    covariance is exactly singular, so that ``log det F`` takes the sign of rounding noise)."""
    rng = np.random.default_rng(0)
    spread = [np.zeros(np.shape(w)) for w in want]
    for _ in range(n):
        moved = [v * (1 + 8 * np.finfo(v.dtype).eps * rng.choice([-1.0, 1.0], size=v.shape))
                 if x.type.dtype.startswith("float") else v for v, x in zip(vals, inputs)]
        out, err = _run(f, moved)
        for j, w in enumerate(want):
            w = np.asarray(w, dtype=float)
            if err is not None or np.shape(out[j]) != w.shape:  # raised: every finite entry is undetermined
                spread[j] = np.where(np.isfinite(w), np.inf, spread[j])
                continue
            o = np.asarray(out[j], dtype=float)
            same_nonfinite = (np.isnan(w) & np.isnan(o)) | (np.isinf(w) & (o == w))
            both_finite = np.isfinite(w) & np.isfinite(o)
            d = np.where(both_finite, np.abs(np.where(both_finite, o - w, 0.0)), np.where(same_nonfinite, 0.0, np.inf))
            spread[j] = np.fmax(spread[j], d)
    return spread


def _after_failure(spread, n_out):
    """``spread`` with every later step of the loop's outputs, and every gradient, marked undetermined (infinite)
    from the first step at which the loop's result is decided by rounding (an entry of infinite spread: a few ulps
    of input turn it NaN, or finite where it is NaN).  From there on the loop has failed without saying so (a
    Kalman loop whose innovation covariance is exactly singular: ``log det F`` takes the sign of rounding noise
    and the carried state is noise after it), the fused graph's failure value NaN is the exact-arithmetic answer,
    and the carried state propagates it to later steps and to every gradient.  Only for loops whose outputs are
    sequences of one length (their leading axis is the step)."""
    seq = spread[:n_out]
    lengths = {np.shape(s)[0] if np.ndim(s) else None for s in seq}
    if len(lengths) != 1 or None in lengths:
        return spread
    failed = [t for t in range(lengths.pop()) if any(np.isinf(np.asarray(s)[t]).any() for s in seq)]
    if not failed:
        return spread
    out = [np.array(s, dtype=float) for s in spread]
    for s in out[:n_out]:
        s[failed[0]:] = np.inf
    for s in out[n_out:]:
        s[...] = np.inf
    return out


def _has_iterops_op(f):
    return any(type(getattr(n.op, "core_op", n.op)).__module__.startswith("iterops") for n in f.maker.fgraph.apply_nodes)


def check_contract(inputs, outputs, values, plain_grad=False):
    """Fuse; unless the graph is left as it was, values and gradients equal the loop's on every input set.

    Returns ``"kept"`` (Scans only, nothing replaced), ``"fused"`` (no Scan left) or ``"partial"`` (a fused Op
    beside a Scan: compared like a fused graph), with `` (values only)`` when the loop has no gradient graph.

    ``plain_grad``: differentiate the user's loop with ``pytensor.grad`` (no ``fuse_loops``) and let the
    compile-time rewrite replace the loop and its gradient Scan; where the loop's gradient graph raises (and its
    values do not), the fused graph with its gradients must raise too, and its values alone equal the loop's.
    """
    float_ins = [x for x in inputs if x.type.dtype.startswith("float")]
    weights = [pt.cos(0.37 * pt.arange(o.size) + j).reshape(o.shape) for j, o in enumerate(outputs)]
    cost = sum((pt.switch(pt.isfinite(o), o, 0.0) * w).sum() for o, w in zip(outputs, weights))
    try:
        grads = pytensor.grad(cost, float_ins, disconnected_inputs="ignore")
    except Exception:  # noqa: BLE001  (the loop has no gradient: compare values only)
        grads = None
    if plain_grad:
        fused_outputs = [*outputs, *(grads or [])]
    else:
        fused = iterops.fuse_loops([*outputs, cost])
        try:
            fused_grads = pytensor.grad(fused[-1], float_ins, disconnected_inputs="ignore")
        except Exception as err:  # noqa: BLE001  (allowed only where the loop has no gradient either)
            assert grads is None, f"the loop has a gradient, the fused graph has none: {err!r}"
            fused_grads = []
        fused_outputs = [*fused[:-1], *(fused_grads if grads is not None else [])]
    f = pytensor.function(inputs, fused_outputs, mode=_FUSED_MODE, on_unused_input="ignore")
    has_scan = any(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes)
    if has_scan and not _has_iterops_op(f):
        return "kept"
    outcome = "partial" if has_scan else "fused"
    g = pytensor.function(inputs, [*outputs, *(grads or [])], mode=_SCAN_MODE, on_unused_input="ignore")
    g_values = pytensor.function(inputs, outputs, mode=_SCAN_MODE, on_unused_input="ignore")
    n_out = len(outputs)
    f_values = None
    for vals in values:
        vals = [np.asarray(v, dtype=x.type.dtype) for v, x in zip(vals, inputs)]
        got, err_f = _run(f, vals)
        want, err_g = _run(g, vals)
        if err_g is not None:
            want, err_g = _run(g_values, vals)
            if err_g is not None:  # the loop itself raises: so must the fused graph
                if err_f is None and isinstance(err_g, np.linalg.LinAlgError):
                    # a linker-dependent failure (inv / det of a singular F raises under the Python linker,
                    # gives NaN under Numba): the contract's value is NaN, in every output of the loop
                    assert all(np.isnan(np.asarray(x, dtype=float)).any() for x in got[:n_out]), (
                        f"the loop raises {err_g!r}, the fused graph returns a value without NaN: {got}")
                    continue
                assert err_f is not None, f"the loop raises {err_g!r}, the fused graph returns {got}"
                continue
            # only the loop's gradient graph raises (PyTensor's Scan gradient of a 0-step loop)
            if plain_grad:  # the user's own gradient graph raises: so must the fused one
                assert err_f is not None, f"the loop's gradient raises, the fused graph returns {got}"
                if f_values is None:
                    f_values = pytensor.function(inputs, outputs, mode=_FUSED_MODE, on_unused_input="ignore")
                got, err_f = _run(f_values, vals)
            assert err_f is None, f"the fused graph raises {err_f!r} where the loop returns {want}"
            spread = _after_failure(_rounding_spread(g_values, vals, inputs, want), n_out)
            for j, (a, b) in enumerate(zip(got[:n_out], want)):
                _close(a, b, f"output {j}", spread[j])
            continue
        assert err_f is None, f"the fused graph raises {err_f!r} where the loop returns {want}"
        spread = _after_failure(_rounding_spread(g, vals, inputs, want), n_out)
        for j, (a, b) in enumerate(zip(got[:n_out], want[:n_out])):
            _close(a, b, f"output {j}", spread[j])
        for j, (a, b) in enumerate(zip(got[n_out:], want[n_out:])):
            # the contract covers gradients where the loop's are finite: compared entry by entry there
            b, fin = np.asarray(b, dtype=float), np.isfinite(np.asarray(b, dtype=float))
            a = np.asarray(a, dtype=float)
            assert a.shape == b.shape, f"gradient w.r.t. {float_ins[j]}: shape {a.shape} != {b.shape}"
            _close(a[fin], b[fin], f"gradient w.r.t. {float_ins[j]}", np.asarray(spread[n_out + j])[fin])
    return outcome + ("" if grads is not None else " (values only)")


def _fuzz_one(name, data):
    h = HARNESSES[name]
    kind = data.draw(st.sampled_from(["none", *GRAPH_MUTATIONS, *LOOP_MUTATIONS]), label="mutation")
    k = data.draw(st.integers(0, 50), label="index")
    plain_grad = data.draw(st.booleans(), label="plain pytensor.grad")
    step = mutated(h.step, kind, k) if kind in GRAPH_MUTATIONS else h.step
    try:
        inputs, outputs = h.build(step, kind if kind in LOOP_MUTATIONS else None, k)
    except NotApplicable:
        STATS[(name, kind, "not applicable")] += 1
        return "not applicable"
    except Exception as err:  # noqa: BLE001  (only the named invalid graphs count: anything else fails)
        if not _is_invalid(err):
            raise
        STATS[(name, kind, "invalid")] += 1
        return "invalid"
    outcome = check_contract(inputs, outputs, h.values(), plain_grad=plain_grad)
    STATS[(name, kind, outcome + (" (plain grad)" if plain_grad else ""))] += 1
    return outcome


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if STATS:
        print("\nfusion fuzzer: (pattern, mutation, outcome) -> count")  # noqa: T201
        for key, n in sorted(STATS.items()):
            print(f"  {key}: {n}")  # noqa: T201


_FUZZ_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


#: harnesses whose mutants cost several times the others' to rewrite and compile (pymc-extras' filter and its
#: gradient): a third of the examples in the default run, the full ``DEEP`` budget under ``-m slow``
COSTLY = {"kalman_pymc_extras"}


#: at least this share of a pattern's drawn mutants must build a loop (a harness or mutation that stops
#: building, e.g. a renamed argument, would make the fuzzer test nothing)
MIN_VALID_SHARE = 0.5


def fuzz(name, examples):
    """Run ``examples`` drawn mutants of ``name``'s loop through the contract; returns the outcomes.

    Fails if fewer than :data:`MIN_VALID_SHARE` of them built a loop (not "invalid", not "not applicable")."""
    outcomes = []

    @settings(max_examples=examples, **_FUZZ_SETTINGS)
    @given(data=st.data())
    def run(data):
        outcomes.append(_fuzz_one(name, data))

    run()
    valid = [o for o in outcomes if o not in ("invalid", "not applicable")]
    assert len(valid) >= MIN_VALID_SHARE * len(outcomes), (
        f"{name}: only {len(valid)} of {len(outcomes)} mutants built a loop: {collections.Counter(outcomes)}")
    return outcomes


@pytest.mark.parametrize("name", sorted(set(HARNESSES) - COSTLY))
def test_mutants_keep_the_scan_or_compute_the_loop(name):
    fuzz(name, EXAMPLES)


@pytest.mark.parametrize("name", sorted(COSTLY))
def test_costly_mutants_keep_the_scan_or_compute_the_loop(name):
    fuzz(name, max(1, EXAMPLES // 3))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_mutants_deep(name):
    fuzz(name, DEEP)


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_unmutated_loops_are_fused_and_exact(name):
    """The harness loops themselves are recognized: the fuzzer's mutants start from fused loops."""
    h = HARNESSES[name]
    inputs, outputs = h.build(h.step, None, 0)
    assert check_contract(inputs, outputs, h.values()) == "fused"


#: harness loops whose plain-``pytensor.grad`` graph keeps its Scans today (sound, not yet fused), and why
PLAIN_GRAD_KEPT: dict[str, str] = {}


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_unmutated_loops_with_plain_grad_are_exact(name):
    """With plain ``pytensor.grad`` (no ``fuse_loops``) the harness loops and their gradient Scans are fused
    (except the documented ``PLAIN_GRAD_KEPT``), and equal the loop's values and gradients."""
    h = HARNESSES[name]
    inputs, outputs = h.build(h.step, None, 0)
    want = "kept" if name in PLAIN_GRAD_KEPT else "fused"
    assert check_contract(inputs, outputs, h.values(), plain_grad=True) == want


def test_registry_is_covered():
    assert set(HARNESSES) == set(iterops.fusion.PATTERNS)


def test_mutant_without_a_gradient_is_compared_on_its_values():
    """Fuzzer finding (an unseeded run, ``kalman_textbook`` mutated by a ``transpose`` of node 0): PyTensor cannot
    differentiate the mutant loop (its Scan gradient raises "Incompatible shared dimension for dot product"), so
    ``pytensor.grad`` after ``fuse_loops`` raises too.  The contract then covers values only, as for a plain
    ``pytensor.grad`` that raises; a fused graph without a gradient where the loop has one is still a failure."""
    h = HARNESSES["kalman_textbook"]
    inputs, outputs = h.build(mutated(h.step, "transpose", 0), None, 0)
    float_ins = [x for x in inputs if x.type.dtype.startswith("float")]
    with pytest.raises(ValueError, match="Incompatible shared dimension"):
        pytensor.grad(sum(o.sum() for o in outputs), float_ins, disconnected_inputs="ignore")
    # since the matcher's op-level pre-checks this mutant is no longer matched (kept: the step differs from the
    # reference); either way the harness must not crash and must not report a gradient it cannot compare
    assert check_contract(inputs, outputs, h.values()) in ("fused (values only)", "kept")


def test_ill_conditioned_start_value_is_fused_and_within_the_loops_rounding():
    """Deep-fuzzer finding (``kalman_textbook``, start value ``P0 = L0 L0^T + 1`` on the near-singular inputs
    ``L0 = 1e-6 I``, ``H = 1e-14 I``): the innovation covariance has cond ~ 1e14, the first update cancels
    catastrophically, and the loop's own results differ by O(1) between its compilations (the Scan compiled with
    its gradient gave -0.33 where the Scan alone and an 80-bit reference give -28.1).  The fused graph must stay
    within the loop's own rounding spread there, and equal it to rtol 1e-6 on the well-conditioned inputs."""
    h = HARNESSES["kalman_textbook"]
    inputs, outputs = h.build(h.step, "init", 26)
    for plain_grad in (False, True):
        assert check_contract(inputs, outputs, h.values(), plain_grad=plain_grad) == "fused"


def test_rounding_spread_is_rounding_sized_on_well_conditioned_inputs():
    """The fuzzer's tolerance only widens where the loop itself is ill-conditioned: on the well-conditioned Kalman
    inputs the loop's outputs move by less than 1e-11 relative under ulp perturbations, so the rtol 1e-6 check
    decides and a replacement off by 1e-5 is caught; on the ill-conditioned inputs they move by far more."""
    h = HARNESSES["kalman_textbook"]
    inputs, outputs = h.build(h.step, "init", 26)
    f = pytensor.function(inputs, outputs, mode=_SCAN_MODE)
    base, near_singular = h.values()[:2]
    for vals, tiny in ((base, True), (near_singular, False)):
        vals = [np.asarray(v, dtype=x.type.dtype) for v, x in zip(vals, inputs)]
        want = f(*vals)
        spread = _rounding_spread(f, vals, inputs, want)
        rel = max(float((s / np.maximum(1.0, np.abs(w))).max()) for s, w in zip(spread, want))
        assert (rel < 1e-11) if tiny else (rel > 1e-3), rel
        if tiny:
            with pytest.raises(AssertionError, match="differ beyond rounding"):
                _close(want[0] * (1 + 1e-5), want[0], "loglik", spread[0])


# ---------------------------------------------------------------------------
# How P0, H and Q are built: proofs of symmetry / positive semi-definiteness
# ---------------------------------------------------------------------------
#
# A textbook Kalman loop (:func:`iterops.reference_loops.kalman_textbook_loop`) is fused only when P0, H and Q are
# proved symmetric positive semi-definite from how they are built (``iterops.fusion.proofs``).  Each construction
# below builds one of them from free inputs; the contract is checked on inputs that make the wrong proofs wrong
# (a non-symmetric or indefinite base under ``inc_subtensor``, an unstable A under a Lyapunov solver, an indefinite
# S in ``X S X^T``, diagonals of any sign, constants that make F singular): either the Scan is kept or the fused
# values and gradients equal the loop's.


def _lyap_iterops(A, W):
    return iterops.solve_discrete_lyapunov(A, W)


def _lyap_pytensor(A, W):
    return pt.linalg.solve_discrete_lyapunov(A, W)


def _diag_index(n):
    return pt.arange(n), pt.arange(n)


#: name -> (inputs it reads, builder (n, inputs) -> (n, n) matrix)
CONSTRUCTIONS = {
    "L L^T": ("L", lambda n, s: s["L"] @ s["L"].T),
    "set_subtensor(B[:, :], L L^T)": ("LB", lambda n, s: pt.set_subtensor(s["B"][:, :], s["L"] @ s["L"].T)),
    "inc_subtensor(B[:, :], L L^T)": ("LB", lambda n, s: pt.inc_subtensor(s["B"][:, :], s["L"] @ s["L"].T)),
    "set_subtensor(zeros[i, i], v**2)": ("v", lambda n, s: pt.set_subtensor(pt.zeros((n, n))[_diag_index(n)],
                                                                            s["v"] ** 2)),
    "inc_subtensor(B[i, i], v**2)": ("Bv", lambda n, s: pt.inc_subtensor(s["B"][_diag_index(n)], s["v"] ** 2)),
    "iterops.solve_discrete_lyapunov(A, L L^T)": ("AL", lambda n, s: _lyap_iterops(s["A"], s["L"] @ s["L"].T)),
    "linalg.solve_discrete_lyapunov(A, L L^T)": ("AL", lambda n, s: _lyap_pytensor(s["A"], s["L"] @ s["L"].T)),
    "X diag(s) X^T": ("Xs", lambda n, s: s["X"] @ pt.diag(s["s"]) @ s["X"].T),
    "diag(-v**2)": ("v", lambda n, s: pt.diag(-s["v"] ** 2)),
    "diag(v)": ("v", lambda n, s: pt.diag(s["v"])),
    "diag(v * v)": ("v", lambda n, s: pt.diag(s["v"] * s["v"])),
    "zeros": ("", lambda n, s: pt.zeros((n, n))),
}

_CONSTRUCTION_INPUT = {"L": pt.matrix, "B": pt.matrix, "A": pt.matrix, "X": pt.matrix, "v": pt.vector, "s": pt.vector}


def _construction_value(key, n, which, rng):
    """Input ``key`` of an (n, n) construction: ``which`` 0 benign, 1 adversarial (the proofs' traps)."""
    if key == "L":
        return np.tril(0.3 * rng.normal(size=(n, n))) + np.eye(n)
    if key == "B":  # non-symmetric (benign: small), symmetric indefinite (adversarial)
        return 0.1 * rng.normal(size=(n, n)) if which == 0 else np.diag(np.r_[-2.0, 1.0, -0.5][:n]) + 0.3 * (
            np.eye(n, k=1) + np.eye(n, k=-1))
    if key == "A":  # stable, unstable (the Schur method's finite, indefinite solution)
        return 0.5 * np.eye(n) + 0.1 * rng.normal(size=(n, n)) if which == 0 else np.diag(np.r_[2.0, 3.0, 4.0][:n])
    if key == "X":
        return rng.normal(size=(n, n))
    if key == "v":  # positive, mixed signs
        return np.abs(rng.normal(size=n)) + 0.5 if which == 0 else np.r_[1.0, -0.7, 0.4][:n]
    if key == "s":  # positive, mixed signs (an indefinite S)
        return np.abs(rng.normal(size=n)) + 0.5 if which == 0 else np.r_[1.0, -2.0, 0.5][:n]
    raise KeyError(key)


def construction_case(kinds):
    """(inputs, outputs, values) of the textbook Kalman loop with P0, H, Q built as ``kinds`` (three names)."""
    s = _kalman_symbols()
    base = dict(zip(s, _kalman_values()[0]))
    inputs = [s[k] for k in ("y", "a0", "T", "Z", "R")]
    rng = np.random.default_rng(7)
    value_sets = [[base[k] for k in ("y", "a0", "T", "Z", "R")] for _ in range(2)]
    mats = []
    for slot, n, kind in zip(("P0", "H", "Q"), (KM, KP, 2), kinds):
        keys, build = CONSTRUCTIONS[kind]
        if slot == "P0" and "A" in keys:  # the stationary start: P0 solves the Lyapunov equation of the filter's T
            keys = keys.replace("A", "")
            value_sets[1][2] = _construction_value("A", KM, 1, rng)  # an unstable T
        sym = {k: _CONSTRUCTION_INPUT[k](f"{slot}_{k}") for k in keys}
        mats.append(build(n, {"A": s["T"], **sym}))
        inputs += list(sym.values())
        for which, vals in enumerate(value_sets):
            vals += [_construction_value(k, n, which, rng) for k in keys]
    P0, H, Q = mats
    ll, a, Ps = ref.kalman_textbook_loop(s["y"], s["a0"], P0, s["T"], s["Z"], s["R"], H, Q)
    return inputs, [ll, a, Ps], [tuple(v) for v in value_sets]


def _slot_cases(slot):
    return [tuple(kind if j == slot else "L L^T" for j in range(3)) for kind in CONSTRUCTIONS if kind != "L L^T"]


#: the cases the default run checks (each construction in every slot, and their combinations, under ``-m slow``)
CONSTRUCTION_CASES = [
    ("inc_subtensor(B[:, :], L L^T)", "L L^T", "L L^T"),
    ("iterops.solve_discrete_lyapunov(A, L L^T)", "L L^T", "L L^T"),
    ("linalg.solve_discrete_lyapunov(A, L L^T)", "L L^T", "L L^T"),
    ("zeros", "zeros", "L L^T"),  # F = 0 at step 0: the loop raises or gives NaN, and so must the fused graph
    # H = Q = 0 (deep-fuzzer finding): F is exactly singular from step 1 (rank P drops by p = 2 of m = 3 at each
    # update), the loop's results from there are rounding noise (NaN or 1e15..1e69 by the sign of det F's
    # rounding), the fused graph's are NaN: accepted from the first step the loop's result is decided by rounding
    ("L L^T", "zeros", "zeros"),
    ("L L^T", "inc_subtensor(B[i, i], v**2)", "diag(-v**2)"),
]
_DEFAULT_CASES = {p.values[0] if hasattr(p, "values") else p for p in CONSTRUCTION_CASES}
SLOW_CONSTRUCTION_CASES = sorted({c for slot in range(3) for c in _slot_cases(slot)} - _DEFAULT_CASES)


def _construction_id(case):
    return " | ".join(case)


@pytest.mark.parametrize("case", CONSTRUCTION_CASES, ids=_construction_id)
def test_constructions_keep_the_scan_or_compute_the_loop(case):
    inputs, outputs, values = construction_case(case)
    check_contract(inputs, outputs, values)


def test_after_failure_exempts_only_what_rounding_decides():
    """The contract's exemption (:func:`_after_failure`) starts at the loop's first step decided by rounding and
    nothing before it: a NaN before that step, or anywhere in a loop without such a step, still fails."""
    want = [np.array([1.0, 2.0, 3.0]), np.ones((3, 2)), np.array(0.5)]  # two loop outputs, one gradient
    spread = [np.array([0.0, np.inf, 0.0]), np.zeros((3, 2)), np.array(0.0)]
    marked = _after_failure(spread, n_out=2)
    np.testing.assert_array_equal(np.isinf(marked[0]), [False, True, True])
    np.testing.assert_array_equal(np.isinf(marked[1]), [[False] * 2, [True] * 2, [True] * 2])
    assert np.isinf(marked[2])
    _close(np.array([1.0, np.nan, np.nan]), want[0], "exempt", marked[0])
    with pytest.raises(AssertionError, match="NaN positions"):
        _close(np.array([np.nan, np.nan, np.nan]), want[0], "step 0", marked[0])
    clean = _after_failure([np.zeros(3), np.zeros((3, 2)), np.array(0.0)], n_out=2)
    with pytest.raises(AssertionError, match="NaN positions"):
        _close(np.array([1.0, 2.0, np.nan]), want[0], "no failure", clean[0])
    ragged = _after_failure([spread[0], np.zeros(2)], n_out=2)  # outputs of different lengths: no exemption
    np.testing.assert_array_equal(np.isinf(ragged[0]), [False, True, False])
    with pytest.raises(AssertionError, match="NaN positions"):
        _close(np.array([1.0, 2.0, np.nan]), want[0], "not a sequence", ragged[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CONSTRUCTION_CASES, ids=_construction_id)
def test_constructions_deep(case):
    inputs, outputs, values = construction_case(case)
    check_contract(inputs, outputs, values)


@pytest.mark.slow
@settings(max_examples=DEEP, **_FUZZ_SETTINGS)
@given(data=st.data())
def test_construction_combinations_deep(data):
    kinds = tuple(data.draw(st.sampled_from(sorted(CONSTRUCTIONS)), label=slot) for slot in ("P0", "H", "Q"))
    plain_grad = data.draw(st.booleans(), label="plain pytensor.grad")
    inputs, outputs, values = construction_case(kinds)
    STATS[("constructions", kinds, check_contract(inputs, outputs, values, plain_grad=plain_grad))] += 1
