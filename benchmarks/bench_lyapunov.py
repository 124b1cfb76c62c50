"""Discrete Lyapunov: iterops vs PyTensor's built-ins, the Smith doubling loop as a Scan, scipy and quantecon."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import quantecon
import scipy.linalg as sla
from pytensor.scan.utils import until

import iterops
from benchmarks._harness import Section, Target, best_time, compile_time, ms

NO_ITEROPS = pytensor.compile.get_default_mode().excluding("iterops")


def doubling_scan(A, Q, tol=1e-15, max_iter=100):
    """The Smith doubling loop PyMC users write with ``pytensor.scan`` (quantecon's
    ``solve_discrete_lyapunov`` runs the same iteration)."""

    def step(alpha, gamma):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)

    _, gammas = pytensor.scan(step, outputs_info=[A, Q], n_steps=max_iter, return_updates=False)
    return gammas[-1]


def _graph(kind, A, Q):
    if kind == "iterops":
        return iterops.solve_discrete_lyapunov(A, Q)
    if kind == "pt_bilinear":
        return pt.linalg.solve_discrete_lyapunov(A, Q, method="bilinear")
    if kind == "pt_direct":
        return pt.linalg.solve_discrete_lyapunov(A, Q, method="direct")
    if kind == "doubling_scan":
        return doubling_scan(A, Q)
    raise ValueError(kind)


def _compile(kind, grad):
    A, Q = pt.matrix("A"), pt.matrix("Q")
    X = _graph(kind, A, Q)
    outs = [X]
    if grad:
        outs = pytensor.grad((X**2).sum(), [A, Q])
    # the Scan baseline is compiled without iterops' rewrites, as users have it today
    mode = NO_ITEROPS if kind != "iterops" else None
    return pytensor.function([A, Q], outs, mode=mode)


def run(quick: bool = False):
    rng = np.random.default_rng(0)
    sizes = [4, 20] if quick else [4, 20, 50, 100]
    kinds = ["iterops", "pt_bilinear", "pt_direct", "doubling_scan"]
    fwd = Section(
        "Discrete Lyapunov: forward solve",
        ["n", "iterops (ms)", "scipy (x slower)", "quantecon (x)", "pt bilinear (x)", "pt direct (x)", "doubling Scan (x)"],
        notes="Ratios are time of the alternative / time of iterops (higher is better for iterops). "
        "Random stable A with spectral radius 0.95, SPD Q.",
    )
    grad = Section(
        "Discrete Lyapunov: forward + gradient of sum(X**2) w.r.t. A and Q",
        ["n", "iterops (ms)", "pt bilinear (x)", "pt direct (x)", "doubling Scan (x)"],
    )
    comp = Section(
        "Discrete Lyapunov: compile time of solve + gradient",
        ["n", "iterops (s)", "pt bilinear (x)", "pt direct (x)", "doubling Scan (x)"],
    )
    for n in sizes:
        a = rng.normal(size=(n, n))
        a *= 0.95 / np.max(np.abs(np.linalg.eigvals(a)))
        q = rng.normal(size=(n, n))
        q = q @ q.T + np.eye(n)
        tf, tg, tc = {}, {}, {}
        for kind in kinds:
            if kind == "pt_direct" and n > 50:
                tf[kind] = tg[kind] = tc[kind] = float("nan")  # n^2 x n^2 dense solve: too large
                continue
            tf[kind] = best_time(_compile(kind, False), a, q)
            tc[kind], fg = compile_time(lambda: _compile(kind, True), repeat=3)
            tg[kind] = best_time(fg, a, q)
        t_scipy = best_time(sla.solve_discrete_lyapunov, a, q)
        t_qe = best_time(quantecon.solve_discrete_lyapunov, a, q)
        base = tf["iterops"]
        fwd.rows.append(
            [n, ms(base), t_scipy / base, t_qe / base]
            + [tf[k] / base for k in ("pt_bilinear", "pt_direct", "doubling_scan")]
        )
        grad.rows.append([n, ms(tg["iterops"])] + [tg[k] / tg["iterops"] for k in kinds[1:]])
        comp.rows.append([n, tc["iterops"]] + [tc[k] / tc["iterops"] for k in kinds[1:]])
        fwd.targets.append(Target(f"forward faster than scipy, n={n}", t_scipy / base, 1.0))
        grad.targets.append(Target(f"fwd+grad vs doubling Scan, n={n}", tg["doubling_scan"] / tg["iterops"], 2.0))
        if n == 50:
            grad.targets.append(Target("fwd+grad vs PyTensor built-in (bilinear), n=50", tg["pt_bilinear"] / tg["iterops"], 10.0))
        comp.targets.append(Target(f"compile time: doubling Scan / iterops, n={n}", tc["doubling_scan"] / tc["iterops"], 3.0))
    return [fwd, grad, comp]
