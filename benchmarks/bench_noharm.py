"""Do no harm: compile and run time of ordinary Scan graphs with iterops' rewrites on and off.

``import iterops`` registers rewrites that run on every graph compiled afterwards
(:mod:`iterops.rewrites`).  Each graph below is built afresh and compiled in the
default (NUMBA) mode twice per repeat, with the rewrites on and with
``mode.excluding("iterops")`` (best of ``repeat``, alternating, warm on-disk caches);
then each compiled function is timed.  Graphs iterops leaves alone should compile
within 10% and run as fast; the fused ones are listed for contrast.  Beside the
times: the rewrites applied while compiling (``FunctionGraph.replace`` calls, inner
graphs included; how many by iterops) and the compiled graph's size (outer nodes plus
the nodes of Scans' inner graphs).

Graphs: PyTensor's scan examples (``TestPushOutAddScan::test_machine_translation``'s
GRU-style recurrence and its gradient, a cumulative product with its gradient, a
random walk drawing from a shared generator), pymc-extras' convergent and univariate
Kalman filters with gradients, and two loops iterops fuses (a Lyapunov fixed point
and a textbook Kalman filter, each with its gradient).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.assumptions import assume
from pytensor.compile.mode import get_mode
from pytensor.graph.fg import FunctionGraph
from pytensor.scan.op import Scan
from pytensor.tensor.math import sigmoid, tanh

from benchmarks._harness import Section, Target, best_time, ms
from iterops import reference_loops as rl


def machine_translation(dim=5, batch=80, steps=50):
    """PyTensor's test_machine_translation (from rizar/scan-grad-speed): a GRU-style step, gradient of h[-1].sum()."""
    rng = np.random.default_rng(0)
    U = pytensor.shared(rng.normal(size=(dim, dim), scale=1e-4), name="U")
    V = pytensor.shared(U.get_value(), name="V")
    W = pytensor.shared(U.get_value(), name="W")
    x, ri, zi = (pt.tensor3(n) for n in ("x", "ri", "zi"))

    def step(x, ri, zi, h):
        r, z = sigmoid(ri + h.dot(U)), sigmoid(zi + h.dot(V))
        return z * tanh(x + (r * h).dot(W)) + (1 - z) * h

    h = pytensor.scan(step, sequences=[x, ri, zi], n_steps=steps, outputs_info=pt.zeros((batch, dim), dtype="float64"),
                      name="fpass1", return_updates=False)
    vals = [rng.normal(size=(steps, batch, dim), scale=1e-4) for _ in range(3)]
    return [x, ri, zi], pytensor.grad(h[-1].sum(), [U, V, W]), vals


def cumprod_grad(n=200):
    """A scalar recurrence x[t+1] = x[t] * a[t] and the gradient of its last value (a mit-mot gradient Scan)."""
    a, x0 = pt.vector("a"), pt.scalar("x0")
    xs = pytensor.scan(lambda at, x: x * at, sequences=[a], outputs_info=[x0], return_updates=False)
    return [a, x0], [xs[-1], *pt.grad(xs[-1], [a, x0])], [np.full(n, 1.001), np.asarray(0.5)]


def random_walk(n=200):
    """A random walk drawing from a shared generator inside the step (a non-tensor loop input)."""
    rng = pytensor.shared(np.random.default_rng(0))
    x0 = pt.scalar("x0")
    xs, _ = pytensor.scan(lambda x: x + pt.random.normal(rng=rng, size=()), outputs_info=[x0], n_steps=n)
    return [x0], [xs], [np.asarray(0.0)]


def _pmx_filter(kind, m=5, p=2, r=5, n=100):
    from pymc_extras.statespace.filters import ConvergentFilter, UnivariateFilter

    cls = {"convergent": ConvergentFilter, "univariate": UnivariateFilter}[kind]
    rng = np.random.default_rng(1)
    T = rng.standard_normal((m, m)) * 0.3
    T /= np.abs(np.linalg.eigvals(T)).max() * 1.5
    vals = dict(data=rng.standard_normal((n, p)), a0=np.zeros(m), P0=np.eye(m), c=np.zeros(m), d=np.zeros(p),
                T=T, Z=rng.standard_normal((p, m)), R=rng.standard_normal((m, r)), H=np.eye(p), Q=np.eye(r) * 0.1)
    ins = [pt.tensor(k, shape=v.shape) for k, v in vals.items()]
    ll = cls().build_graph(*ins)[-1]
    loss = ll.sum()
    return ins, [loss, *pt.grad(loss, ins[1:])], list(vals.values())


def convergent_filter():
    """pymc-extras' ConvergentFilter (m=5, p=2, n=100): loglik and its gradient in all nine matrices."""
    return _pmx_filter("convergent")


def univariate_filter():
    """pymc-extras' UnivariateFilter (m=5, p=2, n=100): loglik and its gradient in all nine matrices."""
    return _pmx_filter("univariate")


def lyapunov_fixed_point(m=4):
    """Fused: the Lyapunov fixed-point loop and the gradient of sum(X**2) (iterops.reference_loops)."""
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = rl.fixed_point_loop(A, Q)
    rng = np.random.default_rng(2)
    a = rng.standard_normal((m, m))
    return [A, Q], [X, *pt.grad((X**2).sum(), [A, Q])], [0.5 * a / np.abs(np.linalg.eigvals(a)).max(), np.eye(m)]


def kalman_textbook(m=3, p=2, n=100):
    """Fused: the textbook Kalman filter loop (iterops.reference_loops) and the gradient of its loglik."""
    y, a0, P0, T, Z, R, H, Q = (pt.tensor(k, shape=s) for k, s in (
        ("y", (n, p)), ("a0", (m,)), ("P0", (m, m)), ("T", (m, m)), ("Z", (p, m)), ("R", (m, m)), ("H", (p, p)),
        ("Q", (m, m))))
    spd = dict(symmetric=True, positive_definite=True)  # declared: the fused filter needs them (see iterops.explain)
    ll = rl.kalman_textbook_loop(y, a0, assume(P0, **spd), T, Z, R, assume(H, **spd), assume(Q, **spd))[0].sum()
    rng = np.random.default_rng(3)
    vals = [rng.standard_normal((n, p)), np.zeros(m), np.eye(m), 0.5 * np.eye(m), rng.standard_normal((p, m)),
            np.eye(m), np.eye(p), 0.1 * np.eye(m)]
    return [y, a0, P0, T, Z, R, H, Q], [ll, *pt.grad(ll, [T, Z, H, Q])], vals


UNFUSED = [machine_translation, cumprod_grad, random_walk, convergent_filter, univariate_filter]
FUSED = [lyapunov_fixed_point, kalman_textbook]


def _iterops_rewriters() -> set:
    """The rewriters :mod:`iterops.rewrites` registers (what ``FunctionGraph.replace`` gets as ``reason``)."""
    from iterops.fusion.rewrite import fuse_scan  # noqa: PLC0415
    from iterops.linalg.lyapunov_iteration import share_fixed_point_trace  # noqa: PLC0415
    from iterops.scan_grad import scan_mit_mot_to_sit_sot, scan_reversed_tail  # noqa: PLC0415
    from iterops.ts.kalman import kalman_unused_outputs  # noqa: PLC0415

    return {fuse_scan, share_fixed_point_trace, scan_mit_mot_to_sit_sot, scan_reversed_tail,
            kalman_unused_outputs, "iterops_explain"}


@contextmanager
def counting_rewrites():
    """Count ``FunctionGraph.replace`` calls (one per variable a rewrite replaces), by iterops or not."""
    counts, ours, original = Counter(), _iterops_rewriters(), FunctionGraph.replace

    def replace(self, var, new_var, reason=None, **kwargs):
        counts["iterops" if reason in ours else "other"] += 1
        return original(self, var, new_var, reason=reason, **kwargs)

    FunctionGraph.replace = replace
    try:
        yield counts
    finally:
        FunctionGraph.replace = original


def graph_size(fgraph) -> int:
    """Nodes of ``fgraph`` plus those of every Scan's inner graph (recursively)."""
    return sum(1 + (graph_size(n.op.fgraph) if isinstance(n.op, Scan) else 0) for n in fgraph.apply_nodes)


def compile_both(build, repeat):
    """Best-of-``repeat`` compile seconds with the iterops rewrites on and off, the two functions, and the
    rewrites applied in the last compile of each (``Counter`` with keys ``"iterops"`` and ``"other"``)."""
    best = {True: float("inf"), False: float("inf")}
    fns, rewrites = {}, {}
    for _ in range(repeat):
        for on in (False, True):
            ins, outs, vals = build()
            mode = get_mode("NUMBA") if on else get_mode("NUMBA").excluding("iterops")
            with counting_rewrites() as rewrites[on]:
                t0 = time.perf_counter()
                fns[on] = pytensor.function(ins, outs, mode=mode, on_unused_input="ignore")
                best[on] = min(best[on], time.perf_counter() - t0)
    return best, fns, vals, rewrites


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    repeat = 2 if quick else 3
    sec = Section(
        title="Do no harm: compile and run time with vs without iterops' rewrites (NUMBA, warm caches)",
        columns=["graph", "fused", "compile without (s)", "compile with (s)", "compile with/without",
                 "rewrites without", "rewrites with (by iterops)", "nodes without", "nodes with",
                 "run without (ms)", "run with (ms)", "run with/without"],
        notes=("Each graph built afresh and compiled in one process, alternating `mode.excluding(\"iterops\")` "
               f"and the default mode, best of {repeat}; run time best-of-5 after a warm-up.  Targets: on graphs "
               "iterops leaves alone at most 10% extra compile time and no extra run time (ratios below are "
               "without/with, met when >= the goal).  Measured with `nice -n 5` on a shared 2-core machine: "
               "differences under ~10% are within its noise."),
    )
    worst_compile, worst_run = float("inf"), float("inf")
    for build in (*UNFUSED, *FUSED):
        tc, fns, vals, rw = compile_both(build, repeat)
        tr = {on: best_time(fns[on], *vals, min_time=0.1, repeat=5) for on in (False, True)}
        fused = build in FUSED
        size = {on: graph_size(fns[on].maker.fgraph) for on in (False, True)}
        sec.rows.append([build.__name__, "yes" if fused else "no", tc[False], tc[True], tc[True] / tc[False],
                         rw[False].total(), f"{rw[True].total()} ({rw[True]['iterops']})", size[False], size[True],
                         ms(tr[False]), ms(tr[True]), tr[True] / tr[False]])
        print(sec.rows[-1], flush=True)
        if not fused:
            worst_compile = min(worst_compile, tc[False] / tc[True])
            worst_run = min(worst_run, tr[False] / tr[True])
    sec.targets += [Target("unfused graphs, worst compile time without/with", worst_compile, 1 / 1.1),
                    Target("unfused graphs, worst run time without/with", worst_run, 1 / 1.1)]
    return [sec]
