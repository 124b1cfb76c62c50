"""Do no harm: iterops' rewrites leave the Scans they do not fuse as PyTensor would, and cheaply.

Oracle: the same graph compiled with ``mode.excluding("iterops")`` (PyTensor alone).  Cost is
counted, not timed: how often the matcher canonicalizes a user's step or rebuilds a pullback to
identify a gradient Scan (the expensive steps), and which exceptions iterops code raises or
catches while compiling (``sys.monitoring``: the matcher says "no match" with a value, never by
raising).  Wall-clock figures are in benchmarks/bench_noharm.py.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode, get_mode
from pytensor.graph.fg import FunctionGraph
from pytensor.scan.op import Scan
from pytensor.tensor.math import sigmoid, tanh
from pytensor.tensor.random.utils import RandomStream

import iterops
from iterops.fusion import canonical, gradient
from iterops.fusion.matcher import match_scan
from iterops.fusion.registry import PATTERNS
from iterops.reference_loops import fixed_point_loop

ITEROPS_DIR = str(Path(iterops.__file__).parent)


def gru_grad():
    """PyTensor's test_machine_translation (small): a GRU-style recurrence and the gradient of h[-1].sum()."""
    rng = np.random.default_rng(0)
    U, V, W = (pytensor.shared(rng.normal(size=(3, 3), scale=0.1), name=n) for n in "UVW")
    x, ri, zi = pt.tensor3("x"), pt.tensor3("ri"), pt.tensor3("zi")

    def step(x, ri, zi, h):
        r, z = sigmoid(ri + h.dot(U)), sigmoid(zi + h.dot(V))
        return z * tanh(x + (r * h).dot(W)) + (1 - z) * h

    h = pytensor.scan(step, sequences=[x, ri, zi], outputs_info=pt.zeros((4, 3)), name="fpass1",
                      return_updates=False)
    return [x, ri, zi], pytensor.grad(h[-1].sum(), [U, V, W])


def random_walk():
    """A step drawing from a shared generator (a non-tensor loop input), as PyTensor's test_simple_shared_random."""
    rng = pytensor.shared(np.random.default_rng(0))
    x0 = pt.scalar("x0")
    xs, _ = pytensor.scan(lambda x: x + pt.random.normal(rng=rng, size=()), outputs_info=[x0], n_steps=5)
    return [x0], [xs]


def gru_forward():
    """A forward-only tanh recurrence (one 2-D state, three sequences)."""
    x, ri, zi = pt.tensor3("x"), pt.tensor3("ri"), pt.tensor3("zi")
    U = pytensor.shared(np.eye(3) * 0.1, name="U")
    h = pytensor.scan(lambda x, ri, zi, h: tanh(x + ri * zi + h.dot(U)), sequences=[x, ri, zi],
                      outputs_info=pt.zeros((4, 3)), return_updates=False)
    return [x, ri, zi], [h]


def _compile(build, on):
    ins, outs = build()
    mode = get_mode("NUMBA") if on else get_mode("NUMBA").excluding("iterops")
    return pytensor.function(ins, outs, mode=mode, on_unused_input="ignore")


def _op_counts(f):
    fg = f.maker.fgraph
    inner = Counter(type(n.op).__name__ for s in fg.apply_nodes if isinstance(s.op, Scan)
                    for n in s.op.fgraph.apply_nodes)
    return Counter(type(n.op).__name__ for n in fg.apply_nodes), inner


@pytest.mark.parametrize("build", [gru_forward, random_walk])
def test_unfused_forward_graph_is_pytensors(build):
    """A Scan no pattern matches compiles to the same graph (Op counts, outer and inner) as PyTensor alone."""
    assert _op_counts(_compile(build, True)) == _op_counts(_compile(build, False))


def test_unfused_gradient_graph_is_no_larger():
    """The GRU's gradient: no more Scans, outer nodes or inner nodes than PyTensor alone (the mit-mot tape may
    become a sit-sot), and the same values."""
    f_on, f_off = _compile(gru_grad, True), _compile(gru_grad, False)
    (outer_on, inner_on), (outer_off, inner_off) = _op_counts(f_on), _op_counts(f_off)
    assert outer_on["Scan"] == outer_off["Scan"] == 2
    assert outer_on.total() <= outer_off.total()
    assert inner_on.total() <= inner_off.total()
    vals = [np.random.default_rng(k).normal(size=(6, 4, 3)) for k in range(3)]
    for a, b in zip(f_on(*vals), f_off(*vals), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)


class _Spy:
    """Counts calls of the matcher's expensive steps and the exceptions iterops code raises or catches."""

    def __init__(self, monkeypatch):
        self.calls = Counter()
        for mod, name in ((canonical, "_canonical_user_graph"), (gradient, "_identify")):
            original = getattr(mod, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(mod, name, counted)
        self.exceptions = []

    def __enter__(self):
        mon = sys.monitoring
        self.tool = next(t for t in range(6) if mon.get_tool(t) is None)
        mon.use_tool_id(self.tool, "iterops-noharm-test")

        def seen(code, offset, exc):
            # closing a generator early (``next(iter(envs), None)``) is the generator protocol, not an error
            if code.co_filename.startswith(ITEROPS_DIR) and not isinstance(exc, GeneratorExit | StopIteration):
                self.exceptions.append(f"{type(exc).__name__}: {exc} ({code.co_name})")

        mon.register_callback(self.tool, mon.events.RAISE, seen)
        mon.register_callback(self.tool, mon.events.EXCEPTION_HANDLED, seen)
        mon.set_events(self.tool, mon.events.RAISE | mon.events.EXCEPTION_HANDLED)
        return self

    def __exit__(self, *exc):
        mon = sys.monitoring
        mon.set_events(self.tool, 0)
        mon.free_tool_id(self.tool)


def test_random_generator_scan_costs_nothing(monkeypatch):
    """A Scan whose op alone rules out every pattern (a random generator among its inputs): its step is not
    canonicalized, and no exception is raised or caught in iterops (PyTensor's test_simple_shared_random made the
    matcher catch ``ValueError: Length of constant(1,) cannot be determined``)."""
    with _Spy(monkeypatch) as spy:
        _compile(random_walk, True)
    assert spy.calls == Counter()
    assert spy.exceptions == []


def test_gru_gradient_rebuilds_no_pullback(monkeypatch):
    """The GRU's gradient Scan is a multi-tap Scan (rejected from its op) and its forward step unifies with no
    pattern (decided from its op): no pullback is rebuilt to identify the gradient Scan, no step is
    canonicalized, and no exception is raised or caught in iterops."""
    with _Spy(monkeypatch) as spy:
        f = _compile(gru_grad, True)
    assert spy.calls["_identify"] == 0
    assert spy.calls["_canonical_user_graph"] == 0  # its updates read three sequences: more than any pattern binds
    assert spy.exceptions == []
    assert sum(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes) == 2


def test_matchable_step_is_analysed_once_per_scan(monkeypatch):
    """A loop that does match is canonicalized once per Scan op however often PyTensor visits it, and the fused
    graph still replaces it (the cache does not change what is fused)."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = fixed_point_loop(A, Q)
    with _Spy(monkeypatch) as spy:
        f = pytensor.function([A, Q], [X, *pt.grad((X**2).sum(), [A, Q])])
    assert not any(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes)
    assert spy.calls["_canonical_user_graph"] <= 2  # the step, and the step with constants lifted
    assert spy.calls["_identify"] <= 1


# PyTensor's tests/scan examples whose Scans made the matcher catch ``ValueError: Length of constant(1,) cannot
# be determined`` (random draws with a size inside the step), then tensor-only steps in the same spirit: shapes
# from non-sequences and constant shape vectors, a near miss of a pattern, and a loop that matches.


def infer_shape_remove_stuff():
    """PyTensor's test_infer_shape_remove_stuff: two random draws per step, one of size [3]; gradient of o1."""
    x, trng = pt.vector("x"), RandomStream(1)
    (o1, _), _ = pytensor.scan(lambda m: [2 * m + trng.uniform(-1.1, 1.1), m + trng.uniform(size=[3])],
                               sequences=x, name="forward")
    return [x], [pytensor.grad(o1.mean(), wrt=x)]


def simple_shared_random():
    """PyTensor's test_simple_shared_random: a step with no inputs drawing two uniforms."""
    rs = RandomStream(1)
    values, _ = pytensor.scan(lambda: rs.uniform(-1, 1, size=(2,)), n_steps=5)
    return [], [values]


def inner_get_vector_length():
    """PyTensor's test_inner_get_vector_length: the draw's size is a non-sequence vector."""
    rs, s1, s2 = RandomStream(1), pt.lscalar("s1"), pt.lscalar("s2")
    res, _ = pytensor.scan(lambda size: rs.normal(0, 1, size=size), non_sequences=[pt.as_tensor([s1, s2])],
                           n_steps=10, strict=True)
    return [s1, s2], [res]


def shape_from_non_sequence():
    """A matrix state plus zeros of a shape passed as a (length-2) non-sequence, and a reshape by a constant."""
    A, X0, v, s = pt.matrix("A"), pt.matrix("X0"), pt.vector("v"), pt.lvector("s")

    def step(X, A, s, v):
        return A @ X @ A.T + pt.zeros(s) + pt.reshape(v, pt.as_tensor(np.array([2, 2])))

    xs = pytensor.scan(step, non_sequences=[A, pt.specify_shape(s, (2,)), v], outputs_info=[X0], n_steps=5,
                       return_updates=False)
    return [A, X0, s, v], [xs[-1]]


def lyapunov_near_miss():
    """The Lyapunov fixed point with ``A X A`` for ``A X A^T`` (unifies to depth 3), and its gradient."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = pytensor.scan(lambda X, A, Q: A @ X @ A + Q, non_sequences=[A, Q], outputs_info=[Q], n_steps=20,
                      return_updates=False)[-1]
    return [A, Q], [X, *pt.grad((X**2).sum(), [A, Q])]


def lyapunov_match():
    """The Lyapunov fixed-point loop (fused) and its gradient."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = fixed_point_loop(A, Q)
    return [A, Q], [X, *pt.grad((X**2).sum(), [A, Q])]


def _n_scans(ins, outs, iterops):
    """Scans left in the graph rewritten for NUMBA (not compiled: Python linker), with or without iterops."""
    opt = get_mode("NUMBA").optimizer if iterops else get_mode("NUMBA").excluding("iterops").optimizer
    f = pytensor.function(ins, outs, mode=Mode(linker="py", optimizer=opt), on_unused_input="ignore")
    return sum(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes)


@pytest.mark.parametrize("build", [infer_shape_remove_stuff, simple_shared_random, inner_get_vector_length,
                                   shape_from_non_sequence, lyapunov_near_miss, lyapunov_match])
def test_matcher_raises_nothing(monkeypatch, build):
    """Matching every Scan, ``explain`` and rewriting the graph raise and catch no exception in iterops code
    (the matcher's verdicts are values); the verdicts themselves are the expected ones."""
    ins, outs = build()
    fg = FunctionGraph(outputs=outs, clone=True)
    with _Spy(monkeypatch) as spy:
        verdicts = [match_scan(fg, n, PATTERNS.values()) for n in fg.toposort() if isinstance(n.op, Scan)]
        report = iterops.explain(outs)
        on = _n_scans(ins, outs, iterops=True)
    assert spy.exceptions == []
    fused = build is lyapunov_match
    assert bool(report.replaced) == fused
    off = _n_scans(ins, outs, iterops=False)
    assert on < off if fused else on == off
    if build is lyapunov_near_miss:
        (match, rejections), *_ = verdicts
        assert match is None
        name, why = rejections[0]
        assert name == "lyapunov_fixed_point" and why.score > 1
        assert str(why).startswith("the step differs from the reference: expected MatrixTranspose")


def _pmx_filter_grad(kind, m=2, p=1, r=1, n=8):
    """pymc-extras' ConvergentFilter / UnivariateFilter log-likelihood and its gradient in every matrix (small)."""
    from pymc_extras.statespace.filters import ConvergentFilter, UnivariateFilter

    shapes = dict(data=(n, p), a0=(m,), P0=(m, m), c=(m,), d=(p,), T=(m, m), Z=(p, m), R=(m, r), H=(p, p), Q=(r, r))
    ins = [pt.tensor(k, shape=s) for k, s in shapes.items()]
    cls = {"convergent": ConvergentFilter, "univariate": UnivariateFilter}[kind]
    loss = cls().build_graph(*ins)[-1].sum()
    return ins, [loss, *pt.grad(loss, ins[1:])]


def _rewritten(ins, outs, iterops):
    """The graph ``pytensor.function`` would compile in NUMBA mode (rewritten, not linked)."""
    from pytensor.compile.maker import FunctionMaker, construct_function_ins_and_outs

    mode = get_mode("NUMBA") if iterops else get_mode("NUMBA").excluding("iterops")
    i, o = construct_function_ins_and_outs(ins, outs)
    return FunctionMaker(i, o, mode, on_unused_input="ignore").fgraph


def _graph_ops(fgraph) -> Counter:
    """Op class names in ``fgraph`` and, recursively, in its Scans' inner graphs."""
    ops = Counter()
    for n in fgraph.apply_nodes:
        ops[type(n.op).__name__] += 1
        if isinstance(n.op, Scan):
            ops += _graph_ops(n.op.fgraph)
    return ops


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["convergent", "univariate"])
def test_pymc_extras_filter_gradients_compile_as_without_iterops(kind, monkeypatch):
    """pymc-extras' convergent and univariate filters with their gradients, graphs iterops does not fuse: with
    iterops the rewritten graph holds the same Ops (outer and every Scan's inner graph) as PyTensor's alone, and
    neither the mit-mot nor the reversed-tail rewrite fires (the gradient Scans' steps are too large)."""
    from iterops.scan_grad import scan_mit_mot_to_sit_sot, scan_reversed_tail

    fired = Counter()
    for rewriter in (scan_mit_mot_to_sit_sot, scan_reversed_tail):

        def counted(fgraph, node, _original=rewriter.fn, _name=str(rewriter)):
            out = _original(fgraph, node)
            fired[_name] += bool(out)
            return out

        monkeypatch.setattr(rewriter, "fn", counted)
    on = _rewritten(*_pmx_filter_grad(kind), iterops=True)
    off = _rewritten(*_pmx_filter_grad(kind), iterops=False)
    assert sum(fired.values()) == 0
    assert _graph_ops(on) == _graph_ops(off)


#: the Kalman-shaped steps of each filter's gradient graph that pass every cheap pre-check (they hold a
#: Cholesky factorization, as pymc-extras' filter the ``kalman_pymc_extras`` pattern matches): each is
#: canonicalized as written and with its constants lifted
_KALMAN_SHAPED_STEPS = {"convergent": 2, "univariate": 0}


@pytest.mark.parametrize("kind", ["convergent", "univariate"])
def test_pymc_extras_filter_gradients_canonicalize_each_step_once(kind, monkeypatch):
    """pymc-extras' filters with their gradients (not fused): the matcher canonicalizes only the steps that
    can match a pattern, each once per process, not again when the same graph is built and compiled anew
    (PyMC compiles a model's logp and dlogp, benchmarks compile a graph several times).  The univariate
    filter's steps are ruled out before canonicalizing: its outer step's states read a nested loop (a Scan,
    which no pattern's step holds) and its inner step has no linear-algebra operation (every Kalman pattern
    factors or inverts a covariance).  Counted, not timed."""
    with _Spy(monkeypatch) as spy:
        first = _rewritten(*_pmx_filter_grad(kind), iterops=True)
        n_first = spy.calls["_canonical_user_graph"]
        second = _rewritten(*_pmx_filter_grad(kind), iterops=True)
    assert n_first <= 2 * _KALMAN_SHAPED_STEPS[kind]
    assert spy.calls["_canonical_user_graph"] == n_first  # the same steps again: nothing canonicalized
    assert spy.calls["_identify"] == 0
    assert spy.exceptions == []
    assert _graph_ops(first) == _graph_ops(second)


def test_pre_check_families_are_held_by_every_canonical_reference_step():
    """The Op families the matcher's pre-check requires of a step before canonicalizing it (read off each
    pattern's raw reference steps) are held by every canonicalized reference variant, on every ``one_of``
    alternative, in its state updates and stop rule: a step that unifies with a reference holds them, so the
    pre-check turns away no step the full matcher would match.  Oracle: the canonical reference graphs."""
    import pymc  # noqa: F401, PLC0415  (the pm.logp variants of the textbook patterns are built when PyMC is imported)

    from iterops.fusion.matcher import _needed_families, _reference_facts
    from iterops.fusion.registry import Rejection
    from iterops.fusion.unify import _ref_graph

    required = {}
    for pattern in PATTERNS.values():
        needs = required[pattern.name] = _reference_facts(pattern).needs
        for variant in range(len(pattern.step)):
            ref = _ref_graph(pattern, variant, "float64")
            assert not isinstance(ref, Rejection), (pattern.name, variant, ref)
            held = _needed_families([*ref.updates, *([ref.cond] if ref.cond is not None else [])], ref.role_of)
            assert needs <= held, (pattern.name, variant, needs, held)
    # the pre-check filters the Kalman-shaped steps: every Kalman pattern factors or inverts a covariance
    assert all("linear algebra" in required[n] for n in PATTERNS if n.startswith("kalman"))
