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
from iterops import examples
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
              "then `pytensor.grad`.\n\n"
              "Why the Lyapunov-loop and Levinson rows are short of 3x (measured 2026-12-04, load 0.5):\n"
              "- Fixed point (234 steps here): each step is two dependent 10 x 10 gemm calls forward and two in "
              "the reverse, so both passes are bound by BLAS-call latency (0.43 and 0.67 us per step). Summing the "
              "reverse's independent A_bar products by one gemm per 32 steps left the undamped reverse unchanged "
              "(and doubled it at m = 40): not kept. What did move it: the max-abs stop test returns at the first "
              "entry over the tolerance (160 ns -> a few ns per step), 1.75x -> about 3x.\n"
              "- Smith doubling (10 steps): fused 32 us, of which the forward kernel 7 and the adjoint 21 (it runs "
              "the loop again to keep its iterates; sharing the forward's trace, as the fixed point does, would "
              "save the 7 us: not done). Levinson-Durbin order 12: 6 us fused, mostly per-call cost.\n"
              "- The 2026-12-02 run (doubling 4.38x, Levinson 4.61x) was at a heavier load: the Scans then took "
              "9x and 2.6x their time here, the fused Ops 4x and 1.6x, so ratios of these short loops move with "
              "the load.",
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
    return examples.pymc_extras_local_linear_trend_model(y)


def _structural_model(n):
    """:func:`iterops.examples.pymc_extras_structural_model` (13 states) of a monthly CO2-like series with 4 missing
    values."""
    rng = np.random.default_rng(0)
    t = np.arange(n)
    y = 300 + 0.1 * t + 3 * np.sin(2 * np.pi * t / 12) + np.cumsum(rng.normal(0, 0.3, n)) + rng.normal(0, 0.2, n)
    y[[n // 12, 3 * n // 8, 5 * n // 8, 5 * n // 6]] = np.nan
    return examples.pymc_extras_structural_model(y[:, None], 12)


def _sarimax_model(n):
    """pymc-extras' ``BayesianSARIMAX(order=(2, 0, 1), seasonal_order=(1, 0, 1, 12))`` (14 states, stationary
    start from ``solve_discrete_lyapunov``) of a simulated monthly series: ``Normal(0, 0.3)`` priors on the
    ARMA coefficients, ``HalfNormal(1)`` on ``sigma_state``."""
    import pymc as pm
    import pymc_extras.statespace as pmx_ss

    rng = np.random.default_rng(0)
    e = rng.normal(size=n + 60)
    y = np.zeros(n + 60)
    for t in range(13, n + 60):  # (1 - 0.5 L)(1 - 0.4 L^12) y = (1 + 0.3 L) e
        y[t] = 0.5 * y[t - 1] + 0.4 * y[t - 12] - 0.2 * y[t - 13] + e[t] + 0.3 * e[t - 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ss = pmx_ss.BayesianSARIMAX(order=(2, 0, 1), seasonal_order=(1, 0, 1, 12), verbose=False)
        with pm.Model(coords=ss.coords) as model:
            for name in ss.param_names:
                if name == "sigma_state":
                    pm.HalfNormal(name, 1.0)
                else:
                    pm.Normal(name, 0.0, 0.3, dims=ss.param_dims[name])
            ss.build_statespace_graph(y[60:, None])
    return model


def _pymc_extras_section(quick: bool) -> Section:
    """pymc-extras structural models' logp + dlogp compiled through PyMC (default NUMBA mode)."""
    import contextlib

    from benchmarks._harness import compile_time

    sec = Section(
        title="pymc-extras state space model: logp + dlogp through PyMC, with vs without iterops' rewrite",
        columns=["model", "n_time", "variant", "compile (s)", "logp+dlogp (ms)", "speed-up"],
        notes="pymc-extras state space models, `model.compile_logp()` + `model.compile_dlogp()` in the "
              "default mode; \"without\" = iterops' rewrites off (`iterops.fusion.disabled()`: PyMC's pre-gradient "
              "pass then keeps the StandardFilter Scan and PyTensor's Lyapunov solver and differentiates them; "
              "each row checks which graphs hold the Scan). Structural "
              "local linear trend + measurement error (4 states, one missing value); level + trend + 12-month "
              "seasonal + measurement error (13 states, 4 missing values: the models pymc-extras users fit); "
              "`BayesianSARIMAX(order=(2, 0, 1), seasonal_order=(1, 0, 1, 12))` (14 states, stationary start by "
              "`solve_discrete_lyapunov`, a simulated series).\n\n"
              "Why level + trend + seasonal(12) is short of 10x (process CPU time, n = 240):\n"
              "- 2026-12-05, quiet machine: fused logp + dlogp 0.70-0.72 ms (logp 0.21, dlogp 0.49-0.51: the "
              "filter runs twice, once in each function, at about 0.79 us per step; the adjoint at about 1.1 us per "
              "step), the Scan's 3.1-3.3 ms. 10x needs 0.33 ms: the filter twice plus the adjoint at about 1.4 us "
              "per step, near their loop floors (`Kalman filter: cost model`). In the one logp + gradient function "
              "PyMC and nutpie sample with (`logp_dlogp_function`), the graph around the two Kalman Ops (block "
              "diagonals, indexing, priors: 70 nodes) costs about 20 us of 480.\n"
              "- The filter never reaches its steady state here (the largest relative change of the predicted "
              "covariance per step is still 3e-4 at t = 150 and 6e-4 at t = 200), so every step is a full one.\n"
              "- perf of the two kernels with the gradient PyMC asks for (no T or Z cotangent): before, the "
              "per-step time went to marshalling the NamedTuple arguments of the stage calls and to finiteness "
              "sums in one floating-point chain; both are gone. Then (before the change below): the adjoint's "
              "inlined body 28%, the forward's 24%, the sparse products with T 21% (three per step), "
              "symmetrizing copies 7%, the steady-state test 5%; vectorised row loops over 13 x 13 matrices, none "
              "dominant.\n"
              "- Done 2026-12-04: T's and Z's cotangents are left out when the model reads neither; a reverse "
              "step recomputes only its gain; the stages of a one-observable step are inlined; the products with "
              "T are row axpys. logp + dlogp 1.15 -> 0.78 ms. Then (same day): the products with T test "
              "finiteness only where a dense fallback needs it (the test inside each product was a third of its "
              "time; the transposed copy between the two products now tests W); the forward's second product "
              "computes the upper triangle only, and the add of R Q R^T, the mirror, the finiteness and the scale "
              "run in one pass, the steady-state test stopping at the first entry over its tolerance; the reverse "
              "sums G into the R, Q cotangent in the pass that tests it and skips sym(P_bar) where P_bar is exactly "
              "symmetric. Bitwise the same results; filter + gradient on the model's inputs 542 -> 468 us (forward "
              "0.95 -> 0.85 us per step, adjoint 1.30 -> 1.09); logp + dlogp 0.78 -> 0.72 ms. 2026-12-05: the "
              "forward's second product reads W = T P_f's columns in place, in the pass that adds R Q R^T and "
              "tests (no transposed copy): bitwise the same, forward 0.85 -> 0.79 us per step, logp 0.22 -> 0.21 "
              "ms.\n"
              "- Tried and not kept (each slower, measured): inlining the product and test helpers into the "
              "kernels (the forward 2% faster, the adjoint 6% slower); the reverse's P_f_bar on its upper "
              "triangle, mirrored (exactly symmetric, so no sym copy; the strided mirror writes cost more than "
              "the copy); S K, S u from the rows of the unsymmetrized P_f_bar with the symmetrization folded into "
              "the last pass (adjoint 1.09 -> 1.26 us per step); 2026-12-05: the reverse's second product reading "
              "G T's columns in place like the forward's (adjoint 1.12 -> 1.32 us per step: T^T's rows have two "
              "nonzeros, and the gathers lose to the copy and row axpys); P' over T's rows of one nonzero as "
              "gathers of P_f (484 against 431 ns per prediction), or as block copies over runs of shift rows "
              "(492 against 466 ns; SARIMAX's T 471 against 373); a two-slot P when nothing reads the covariances "
              "(812 against 788 ns per step: stores are not the bound). Per-pass micro-timings at m = 13 (about "
              "60-110 ns a pass over 13 x 13, the same with or without the tests in it) leave no single pass "
              "dominant: the forward makes about six, the adjoint about ten.\n"
              "- What the reverse recomputes of the forward at p = 1 is its gain and one finiteness pass over "
              "P_t, about 60 ns of its 1.1 us per step: storing them in the forward would save at most that.\n"
              "- SARIMAX: from its stationary start the predicted covariance stops changing after 13 steps, so "
              "227 of its 240 steps are frozen (a mean update and its reverse). Timed node by node (2026-12-04, "
              "n = 240, before the change below): of dlogp's 0.34 ms, PyTensor's bilinear "
              "`solve_discrete_lyapunov` (the stationary P0) and its autodiff took about 0.23 ms, the two Kalman "
              "Ops 0.26 ms of the 0.44 ms logp + dlogp; the built-in's forward alone was 77 us of logp's 102. "
              "Since 2026-12-04 iterops compiles PyTensor's solver as its own (`iterops_builtin_lyapunov`: 20 "
              "and 35 us for the forward and forward + gradient at n = 14, against 77 and 227), and a steady "
              "stretch no longer copies the frozen P_f and P into outputs nothing reads (logp reads neither, "
              "dlogp reads P, for the reverse): logp 102 -> 57 us, dlogp 339 -> 266 us, logp + dlogp 0.46 -> "
              "0.33 ms. Against a baseline that also has the fused solver (only the Scan patterns off) the "
              "ratio is the same within noise (10.3x against 10.1x, measured before the second change), as "
              "the Scan's 3.5 ms dominates it. What is left (perf, dlogp): the frozen steps' reverse (0.45 us "
              "per step; the test that a step is frozen, P_t == P_ss entry by entry, is 28% of it) and the "
              "forward's copy of P into the tape the reverse reads.",
    )
    cases = [("local linear trend", 500, _local_level_model, 3.0),
             ("level + trend + seasonal(12)", 240, _structural_model, 10.0),
             ("SARIMAX(2,0,1)(1,0,1,12)", 240, _sarimax_model, 10.0)]
    for label, n, build, goal in cases:
        model = build(n)
        point = model.initial_point()
        times = {}
        for variant in ("without", "with"):
            ctx = iterops.fusion.disabled() if variant == "without" else contextlib.nullcontext()
            with ctx:
                tc, (f, g) = compile_time(lambda: (model.compile_logp(), model.compile_dlogp()))
                f(point), g(point)
            has_scan = any(isinstance(nd.op, Scan) for fn in (f, g) for nd in fn.f.maker.fgraph.apply_nodes)
            if has_scan != (variant == "without"):
                what = "lacks" if variant == "without" else "keeps"
                raise RuntimeError(f"{label}: the {variant} variant's logp/dlogp {what} the filter Scan")

            def both(pt_, f=f, g=g):
                f(pt_)
                g(pt_)

            times[variant] = best_time(both, point, repeat=3 if quick else 5)
            sec.rows.append([label, n, variant, tc, ms(times[variant]), times["without"] / times[variant]])
        sec.targets.append(Target(f"pymc-extras {label}: logp+dlogp with vs without iterops",
                                  times["without"] / times["with"], goal))
    return sec
