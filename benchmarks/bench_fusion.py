"""Scan -> fused Op rewrites: the user's Scan graph (forward + gradient) with vs without iterops' rewrites.

Same process, same graph, default (NUMBA) mode; "without" compiles with
``mode.excluding("iterops")`` and differentiates the Scan, "with" calls
``iterops.fuse_loops`` before ``pytensor.grad`` (what PyMC's pre-gradient pass
does automatically).  A second section differentiates with plain
``pytensor.grad`` (no ``fuse_loops``): the compile-time rewrite then replaces
the forward Scan and its gradient Scan together (:mod:`iterops.fusion.gradient`).

Regenerate: ``scripts/dev bench fusion``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import get_mode
from pytensor.scan.op import Scan

import iterops
from iterops import demo
from iterops import reference_loops as ref
from benchmarks._harness import Section, Target, best_time, ms


def _doubling(A, B):
    return ref.doubling_loop(A, B, tol=1e-12, n_steps=100)


def _fixed_point(A, B):
    return ref.fixed_point_loop(A, B, tol=1e-10, n_steps=5000)


def _damped_fixed_point(A, B, w):
    return ref.damped_fixed_point_loop(A, B, w, tol=1e-10, n_steps=5000)


def _kalman(y, a0, L0, T, Z, R, LH, LQ):
    """The textbook covariance-form filter a user writes, covariances built as L L^T; the total log-likelihood."""
    ll, _, _ = ref.kalman_textbook_loop(y, a0, L0 @ L0.T, T, Z, R, LH @ LH.T, LQ @ LQ.T)
    return ll.sum()


def _levinson(gamma, order=12):
    phi, sigma2, _ = ref.levinson_loop(gamma, order)
    return phi * sigma2


def _kalman_values(rng, n, m, p, r):
    T = 0.6 * np.eye(m) + 0.1 * rng.normal(size=(m, m))
    return (rng.normal(size=(n, p)), np.zeros(m), np.eye(m), T, rng.normal(size=(p, m)), rng.normal(size=(m, r)),
            np.eye(p), np.eye(r))


def _acov(rng, order=12):
    x = np.convolve(rng.normal(size=2000), [1.0, 0.5, -0.3])[:2000]
    return np.array([np.mean(x[: len(x) - h] * x[h:]) for h in range(order + 1)])


def _fwd_grad(build, inputs, fused: bool, plain_grad: bool = False):
    out = build(*inputs)
    if fused and not plain_grad:
        out = iterops.fuse_loops(out)
    cost = (out * out).sum()
    mode = get_mode("NUMBA") if fused else get_mode("NUMBA").excluding("iterops")
    f = pytensor.function(inputs, [cost, *pytensor.grad(cost, inputs)], mode=mode)
    has_scan = any(isinstance(n.op, Scan) for n in f.maker.fgraph.apply_nodes)
    if has_scan == fused:  # never time a Scan as "fused", or a fused Op as the Scan
        raise RuntimeError(f"{build.__name__}: expected {'no ' if fused else 'a '}Scan in the compiled graph")
    return f


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    n = 4 if quick else 10
    a = rng.normal(size=(n, n))
    a *= 0.95 / np.max(np.abs(np.linalg.eigvals(a)))
    q = np.eye(n)
    x = rng.normal(size=(8 if quick else 30, 3, 3))
    cases = [
        ("Smith doubling loop", _doubling, [pt.matrix("A"), pt.matrix("B")], (a, q)),
        ("fixed point X <- A X A' + Q", _fixed_point, [pt.matrix("A"), pt.matrix("B")], (a, q)),
        ("damped fixed point X <- (1-w) X + w (A X A' + Q)", _damped_fixed_point,
         [pt.matrix("A"), pt.matrix("B"), pt.scalar("w")], (a, q, np.float64(0.7))),
        ("block-diagonal assembly", ref.block_diag_loop, [pt.tensor3("x")], (x,)),
        ("Kalman filter (textbook, n=500 m=4 p=2)", _kalman,
         [pt.tensor("y", shape=(None, 2)), pt.vector("a0"), *(pt.matrix(k) for k in ("L0", "T", "Z", "R", "LH", "LQ"))],
         _kalman_values(rng, 500, 4, 2, 2)),
        ("Levinson-Durbin (order 12)", _levinson, [pt.vector("gamma")], (_acov(rng),)),
    ]
    goals = {"Kalman filter (textbook, n=500 m=4 p=2)": 20.0}
    sec = Section(
        title="Scan -> fused Op rewrite (forward + gradient, NUMBA)",
        columns=["loop", "size", "Scan (ms)", "fused (ms)", "speed-up"],
        notes="Same user graph; Scan = `excluding('iterops')` + autodiff of the Scan; fused = `iterops.fuse_loops` "
              "then `pytensor.grad`.",
    )
    for name, build, inputs, vals in cases:
        f_scan = _fwd_grad(build, inputs, fused=False)
        f_fused = _fwd_grad(build, inputs, fused=True)
        t_scan = best_time(f_scan, *vals, repeat=3 if quick else 5)
        t_fused = best_time(f_fused, *vals, repeat=3 if quick else 5)
        size = "x".join(map(str, vals[0].shape))
        sec.rows.append([name, size, ms(t_scan), ms(t_fused), t_scan / t_fused])
        sec.targets.append(Target(f"{name}: fused vs Scan", t_scan / t_fused, goals.get(name, 3.0)))
    plain = Section(
        title="Scan -> fused Op rewrite with plain pytensor.grad (forward + gradient, NUMBA)",
        columns=["loop", "size", "Scan (ms)", "fused (ms)", "speed-up"],
        notes="Same user graph, `pytensor.grad` of the user's Scan without `fuse_loops`; Scan = "
              "`excluding('iterops')`; fused = the default mode, which replaces the forward Scan and the gradient "
              "Scan `pytensor.grad` built by the fused Op and its gradient (`iterops.fusion.gradient`).",
    )
    for name, build, inputs, vals in cases:
        f_scan = _fwd_grad(build, inputs, fused=False)
        f_fused = _fwd_grad(build, inputs, fused=True, plain_grad=True)
        t_scan = best_time(f_scan, *vals, repeat=3 if quick else 5)
        t_fused = best_time(f_fused, *vals, repeat=3 if quick else 5)
        size = "x".join(map(str, vals[0].shape))
        plain.rows.append([name, size, ms(t_scan), ms(t_fused), t_scan / t_fused])
        plain.targets.append(Target(f"{name} (plain pytensor.grad): fused vs Scan", t_scan / t_fused,
                                    goals.get(name, 3.0)))
    return [sec, plain, _pymc_extras_section(quick)]


def _local_level_model(n):
    rng = np.random.default_rng(3)
    y = np.cumsum(rng.normal(size=n))[:, None]
    y[n // 3] = np.nan
    return demo.pymc_extras_local_linear_trend_model(y)


def _structural_model(n):
    """:func:`iterops.demo.pymc_extras_structural_model` (13 states) of a monthly CO2-like series with 4 missing
    values."""
    rng = np.random.default_rng(0)
    t = np.arange(n)
    y = 300 + 0.1 * t + 3 * np.sin(2 * np.pi * t / 12) + np.cumsum(rng.normal(0, 0.3, n)) + rng.normal(0, 0.2, n)
    y[[n // 12, 3 * n // 8, 5 * n // 8, 5 * n // 6]] = np.nan
    return demo.pymc_extras_structural_model(y[:, None], 12)


def _pymc_extras_section(quick: bool) -> Section:
    """pymc-extras structural models' logp + dlogp compiled through PyMC (default NUMBA mode)."""
    from unittest import mock

    from benchmarks._harness import compile_time

    sec = Section(
        title="pymc-extras state space model: logp + dlogp through PyMC, with vs without iterops' rewrite",
        columns=["model", "n_time", "variant", "compile (s)", "logp+dlogp (ms)", "speed-up"],
        notes="`pymc_extras.statespace.structural` models, `model.compile_logp()` + `model.compile_dlogp()` in the "
              "default mode; \"without\" = no pattern registered (PyMC's pre-gradient pass then keeps the "
              "StandardFilter Scan and differentiates it). Local linear trend + measurement error (4 states, one "
              "missing value); level + trend + 12-month seasonal + measurement error (13 states, 4 missing values: "
              "the models pymc-extras users fit).\n\n"
              "Why level + trend + seasonal(12) is short of 10x (measured 2026-12-04, load 3-4, process CPU time, "
              "side by side with the code before):\n"
              "- The two Kalman Ops are about 90% of the fused dlogp call (at n = 240: filter 0.32-0.43 ms, "
              "gradient 0.58-0.78 ms, of 0.88-0.95 ms).\n"
              "- Since 2026-12-04 the gradient leaves out T's and Z's cotangents when the model reads neither (T's is "
              "a dense m^3 product per reverse step) and recomputes only the gain of a step; the sparse products "
              "with T and the rank-one update run in row loops that vectorise. dlogp: 1.36-1.54 -> 0.88-0.95 ms.\n"
              "- perf of the fused dlogp since: sparse products with T 18% (three per step), the T P T^T triangle "
              "10%, the rank-one update 9%, symmetrizing copies 11%, the inlined reverse 12%: scalar loops over "
              "13 x 13 matrices of a few hundred multiply-adds each; none dominates.\n"
              "- 10x needs logp + dlogp at about 1.4 us per step, the two Ops' loop floors together "
              "(`Kalman filter: cost model`): a step written around whole-matrix SIMD, or a forward that stores "
              "what the reverse recomputes, not more trimming pass by pass.",
    )
    cases = [("local linear trend", 500, _local_level_model, 3.0),
             ("level + trend + seasonal(12)", 240, _structural_model, 10.0)]
    for label, n, build, goal in cases:
        model = build(n)
        point = model.initial_point()
        times = {}
        for variant in ("without", "with"):
            ctx = mock.patch.dict(iterops.fusion.PATTERNS, clear=True) if variant == "without" else mock.MagicMock()
            with ctx:
                tc, (f, g) = compile_time(lambda: (model.compile_logp(), model.compile_dlogp()))
                f(point), g(point)

            def both(pt_, f=f, g=g):
                f(pt_)
                g(pt_)

            times[variant] = best_time(both, point, repeat=3 if quick else 5)
            sec.rows.append([label, n, variant, tc, ms(times[variant]), times["without"] / times[variant]])
        sec.targets.append(Target(f"pymc-extras {label}: logp+dlogp with vs without iterops",
                                  times["without"] / times["with"], goal))
    return sec
