"""Gradient Scans: mit-mot tape vs the sit-sot running adjoint (iterops.scan_grad).

The example of PyTensor issue #1687 ("Rewrite mit-mot Scans as sit-sot"): ``grad(xs[-1], x0)``
of ``x[t+1] = x[t] ** 2``, a cost that reads only the last state, compiled in
the default (NUMBA) mode with and without the ``iterops`` rewrites, for several
``n_steps``, at ``x0 = 1 - 1e-7`` (near the fixed point 1, so values stay
finite; for long loops they underflow to 0, which costs the same).

Memory: Numba allocates inside one jitted function, which ``tracemalloc`` does
not see and RSS deltas blur.  We therefore report the bytes of the *outer
buffers of the gradient Scan* in the compiled graph (its outputs after a run:
the mit-mot tape or the sit-sot / untraced adjoint), evaluated from the compiled
fgraph's shapes.  The forward trace, identical in both, is not counted.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import Mode, get_mode
from pytensor.scan.op import Scan

from benchmarks._harness import Section, Target, best_time, ms


def _grad_scan_bytes(f, *args) -> int:
    """Bytes of the outer output buffers of the gradient Scans in ``f``'s graph."""
    fg = f.maker.fgraph.clone()
    nodes = [n for n in fg.apply_nodes if isinstance(n.op, Scan) and "grad" in (n.op.name or "")]
    outs = [o for n in nodes for o in n.outputs]
    if not outs:
        return 0
    shapes = pytensor.function(
        fg.inputs,
        [o.shape for o in outs],
        mode=Mode(linker="py", optimizer=None),
        on_unused_input="ignore",
        accept_inplace=True,
    )(*args)
    return int(sum(np.prod(s) * np.dtype(o.dtype).itemsize for s, o in zip(shapes, outs, strict=True)))


def run(quick: bool) -> list[Section]:
    warnings.simplefilter("ignore")
    sizes = [10, 1000, 20000] if quick else [10, 1000, 100000]
    x0 = pt.scalar("x0")
    n = pt.iscalar("n")
    xs = pytensor.scan(lambda x: x**2, outputs_info=[x0], n_steps=n, return_updates=False)
    g = pt.grad(xs[-1], x0)
    f_with = pytensor.function([x0, n], g)
    f_without = pytensor.function([x0, n], g, mode=get_mode("NUMBA").excluding("iterops"))
    x = 1.0 - 1e-7  # x ** (2 ** n) stays representable for every n below

    sec = Section(
        title="Gradient Scan: mit-mot tape vs sit-sot adjoint (grad(xs[-1], x0) of x[t+1] = x[t]**2)",
        columns=["n_steps", "without (ms)", "with (ms)", "speed-up", "grad-Scan buffers without (bytes)",
                 "with (bytes)"],
        notes=__doc__.split("\n\n", 1)[1].strip(),
    )
    ratio_big = float("nan")
    mem_with = []
    for steps in sizes:
        a, b = f_with(x, steps), f_without(x, steps)
        np.testing.assert_allclose(a, b, rtol=1e-12)
        t_without = best_time(f_without, x, steps, min_time=0.1 if quick else 0.3)
        t_with = best_time(f_with, x, steps, min_time=0.1 if quick else 0.3)
        b_without = _grad_scan_bytes(f_without, x, steps)
        b_with = _grad_scan_bytes(f_with, x, steps)
        mem_with.append(b_with)
        sec.rows.append([steps, ms(t_without), ms(t_with), t_without / t_with, b_without, b_with])
        ratio_big = t_without / t_with
    sec.targets.append(Target(f"speed-up at {sizes[-1]} steps", ratio_big, 2.0))
    # extra memory independent of n_steps: buffer bytes at the largest n over the smallest
    growth = mem_with[-1] / max(mem_with[0], 1)
    sec.targets.append(Target("grad-Scan buffer bytes constant in n_steps (1 / growth)", 1.0 / growth, 1.0))
    return [sec]
