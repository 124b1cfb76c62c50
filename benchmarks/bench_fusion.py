"""Scan -> fused Op rewrites: the user's Scan graph (forward + gradient) with vs without iterops' rewrites.

Same process, same graph, default (NUMBA) mode; "without" compiles with
``mode.excluding("iterops")`` and differentiates the Scan, "with" calls
``iterops.fuse_loops`` before ``pytensor.grad`` (what PyMC's pre-gradient pass
does automatically).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import get_mode
from pytensor.scan.utils import until

import iterops
from benchmarks._harness import Section, Target, best_time, ms


def _doubling(A, B):
    def step(alpha, gamma, tol):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)

    _, gamma = pytensor.scan(step, outputs_info=[A, B], non_sequences=[pt.constant(1e-12)], n_steps=100,
                             return_updates=False)
    return gamma[-1]


def _fixed_point(A, B):
    def step(X, A, Q):
        Xn = A @ X @ A.T + Q
        return Xn, until(pt.max(pt.abs(Xn - X)) < 1e-10)

    X = pytensor.scan(step, outputs_info=[pt.zeros_like(B)], non_sequences=[A, B], n_steps=5000,
                      return_updates=False)
    return X[-1]


def _block(x):
    k, n, m = x.shape

    def step(i, out, x):
        return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], x[i])

    return pytensor.scan(step, sequences=[pt.arange(k)], outputs_info=[pt.zeros((k * n, k * m))],
                         non_sequences=[x], return_updates=False)[-1]


def _fwd_grad(build, inputs, fused: bool):
    out = build(*inputs)
    if fused:
        out = iterops.fuse_loops(out)
    cost = (out * out).sum()
    mode = get_mode("NUMBA") if fused else get_mode("NUMBA").excluding("iterops")
    return pytensor.function(inputs, [cost, *pytensor.grad(cost, inputs)], mode=mode)


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    rng = np.random.default_rng(0)
    n = 4 if quick else 10
    a = rng.normal(size=(n, n))
    a *= 0.95 / np.max(np.abs(np.linalg.eigvals(a)))
    q = np.eye(n)
    x = rng.normal(size=(8 if quick else 30, 3, 3))
    cases = [
        ("Smith doubling (seed 003)", _doubling, [pt.matrix("A"), pt.matrix("B")], (a, q)),
        ("fixed point X <- A X A' + Q", _fixed_point, [pt.matrix("A"), pt.matrix("B")], (a, q)),
        ("block-diagonal assembly", _block, [pt.tensor3("x")], (x,)),
    ]
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
        sec.targets.append(Target(f"{name}: fused vs Scan", t_scan / t_fused, 3.0))
    return [sec]
