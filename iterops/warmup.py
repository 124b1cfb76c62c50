"""Compile every iterops kernel into Numba's on-disk cache, ahead of first use.

    python -m iterops.warmup                 # float64 kernels (what PyMC models use)
    python -m iterops.warmup --all-dtypes    # also the float32 / complex variants and the on-demand kernels
    python -m iterops.warmup --jobs 2        # split over two processes (each kernel compiled once)
    python -m iterops.warmup --kernels iterops.ts.kalman._filter_abi iterops.ts.kalman._adjoint_abi
                                             # only these C-ABI kernels (no graphs)

iterops' kernels are compiled by Numba once per machine (and again after an upgrade of iterops
or Numba) and cached on disk (see :func:`iterops._fused.kernel_cache_dir`; ``NUMBA_CACHE_DIR``
overrides it).  Without this command that one-off cost falls on the first model a user compiles;
with it, deployments (CI images, cluster nodes, ``scripts/dev setup``) pay it once, up front, and
every later process finds the kernels cached: a new graph then compiles in a second or two.

Two steps: every C-ABI kernel (:data:`iterops._fused.OPAQUE_KERNELS`: the Kalman filter, its
adjoint, second derivatives and smoother, the Lyapunov solvers and iterations, and the kernels otherwise compiled on
their first call, :class:`iterops._fused.LazyKernel`, such as the Lyapunov Schur fallback), then one small graph per public
function with its gradient, run once in PyTensor's default (Numba) mode, which compiles and caches
the directly-called kernels (Levinson, block-diagonal, Toeplitz, AR maps) and their helpers.
Running it again is cheap: everything loads from the cache.

From Python, :func:`start_background` compiles the kernels a program is going to need in another
process while this one does other work (the demo compiles iterops' kernels on the second core while
the Scan baselines compile on the first); a kernel this process needs meanwhile waits for that process
and loads what it compiled (:mod:`iterops._background`), so nothing is compiled twice.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["warm_kernels", "warm_graphs", "start_background", "main"]


def _share(items, part):
    """The items of ``part = (i, n)``: every n-th one from the i-th (all of them for ``(0, 1)``)."""
    i, n = part
    return list(items)[i::n]


def _function_name(kernel) -> str:
    """``module.function`` of a kernel (its name without the dtype tag), as ``--kernels`` takes it."""
    return f"{kernel.pyfunc.__module__}.{kernel.pyfunc.__name__}"


def _selected(all_dtypes: bool, names=None) -> list:
    """The :class:`iterops._fused.OpaqueKernel` s to warm: every float64 one but those compiled on demand (every one
    with ``all_dtypes``),
    only those whose function is in ``names`` when given (an unknown name is an error)."""
    import iterops  # noqa: F401  (defines every kernel)
    from iterops._fused import OPAQUE_KERNELS

    if names is not None:
        known = {_function_name(k) for k in OPAQUE_KERNELS}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"unknown kernels {unknown}; known: {sorted(known)}")
    return [k for k in OPAQUE_KERNELS if (all_dtypes or (k.float64_only and not k.on_demand))
            and (names is None or _function_name(k) in names)]


def warm_kernels(all_dtypes: bool = False, log=print, part=(0, 1), names=None) -> list[tuple[str, float, bool]]:
    """Compile (or load) every :class:`iterops._fused.OpaqueKernel` (of ``part``, see :func:`main`; only
    those named in ``names``, ``module.function``, when given); ``[(name, seconds, was_cached)]``."""
    done = []
    for kernel in _share(_selected(all_dtypes, names), part):
        cached = kernel.is_cached()
        t0 = time.perf_counter()
        kernel.compile()  # or loads it from the cache, and registers it (also a LazyKernel's: it compiles on first use)
        dt = time.perf_counter() - t0
        done.append((kernel.name, dt, cached))
        log(f"  {kernel.name}: {'loaded from cache' if cached else 'compiled'} in {dt:.1f} s")
    return done


def _graphs(dtype: str):
    """``[(name, inputs, outputs, values)]``: each public function and its gradient, small sizes."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import iterops
    from iterops.ts.levinson_recursion import levinson_recursion

    def grads(cost, ins):
        return pytensor.grad(cost, ins)

    out = []
    A, Q = pt.matrix("A", dtype=dtype), pt.matrix("Q", dtype=dtype)
    X = iterops.solve_discrete_lyapunov(A, Q)
    out.append(("solve_discrete_lyapunov", [A, Q], [X, *grads(X.sum(), [A, Q])],
                [np.array([[0.5, 0.1], [0.0, 0.3]]), np.eye(2)]))

    blocks = pt.tensor3("blocks", dtype=dtype)
    B = iterops.block_diag(blocks)
    out.append(("block_diag", [blocks], [B, *grads((B**2).sum(), [blocks])], [np.ones((2, 2, 2))]))

    names = ("y", "a0", "P0", "T", "Z", "R", "H", "Q")
    ins = [pt.tensor(k, dtype=dtype, shape=(None,) * (1 if k == "a0" else 2)) for k in names]
    y, a0, P0, T, Z, R, H, Qk = ins
    res = iterops.kalman_filter(y, a0, P0, c=pt.zeros(2, dtype=dtype), d=pt.zeros(1, dtype=dtype),
                                T=T, Z=Z, R=R, H=H, Q=Qk)
    sm = iterops.kalman_smoother(y, a0, P0, T=T, Z=Z, R=R, H=H, Q=Qk)
    vals = [np.array([[1.0], [np.nan], [0.5]]), np.zeros(2), np.eye(2), 0.5 * np.eye(2), np.ones((1, 2)),
            np.eye(2), np.eye(1), np.eye(2)]
    out.append(("kalman_filter, kalman_smoother", ins,
                [res.loglik, sm.smoothed_state, *grads(res.loglik + res.filtered_state.sum(), ins[1:])], vals))
    # a PyMC logp reads the log-likelihood alone: the filter variant that skips the unread covariances
    out.append(("kalman_filter (log-likelihood only)", ins, [res.loglik], vals))

    c, b = pt.vector("c", dtype=dtype), pt.vector("b", dtype=dtype)
    x = iterops.solve_toeplitz(c, b)
    out.append(("solve_toeplitz", [c, b], [x, *grads(x.sum(), [c, b])], [np.array([2.0, 0.5, 0.1]), np.ones(3)]))

    acov = pt.vector("acov", dtype=dtype)
    ld = iterops.levinson_durbin(acov, 2)
    phi, sigma2 = iterops.yule_walker(acov, 2)
    lr = levinson_recursion(acov, 2)
    cost = sum(v.sum() for v in (*ld, phi, sigma2, *lr))
    out.append(("levinson_durbin, yule_walker, levinson_recursion", [acov], [cost, *grads(cost, [acov])],
                [np.array([1.0, 0.5, 0.2])]))

    series = pt.vector("x", dtype=dtype)
    ac = iterops.acovf(series, 2)
    out.append(("acovf", [series], [ac, *grads(ac.sum(), [series])], [np.array([1.0, 2.0, 0.5, -1.0])]))

    pacf, s2 = pt.vector("pacf", dtype=dtype), pt.scalar("sigma2", dtype=dtype)
    ar = iterops.pacf_to_ar(pacf)
    back = iterops.ar_to_pacf(ar)
    acv = iterops.ar_to_acov(ar, s2, 3)
    cost = ar.sum() + back.sum() + acv.sum()
    out.append(("pacf_to_ar, ar_to_pacf, ar_to_acov", [pacf, s2], [cost, *grads(cost, [pacf, s2])],
                [np.array([0.5, -0.2]), np.array(1.0)]))
    return [(name, i, o, [np.asarray(v, dtype=dtype) for v in vs]) for name, i, o, vs in out]


def warm_graphs(dtype: str = "float64", log=print, part=(0, 1)) -> list[tuple[str, float]]:
    """Compile and run one small graph per public function (values and gradients) in the default mode
    (those of ``part``, see :func:`main`)."""
    import pytensor

    done = []
    for name, ins, outs, values in _share(_graphs(dtype), part):
        t0 = time.perf_counter()
        pytensor.function(ins, outs)(*values)
        dt = time.perf_counter() - t0
        done.append((name, dt))
        log(f"  {name} ({dtype}): {dt:.1f} s")
    return done


def start_background(names):
    """Compile the float64 kernels whose functions are named in ``names`` (``module.function``, e.g.
    ``"iterops.ts.kalman._adjoint_abi"``) into the on-disk cache in a separate process, and return it
    (``None`` when every one is cached already).  Until it ends, a kernel this process needs waits for it
    and then loads from the cache (:mod:`iterops._background`).  Its output goes to this process's stderr
    only if it fails."""
    from pathlib import Path

    import iterops
    from iterops import _background

    todo = sorted({_function_name(k) for k in _selected(False, set(names)) if not k.is_cached()})
    return _background.start(todo, str(Path(iterops.__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterops.warmup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all-dtypes", action="store_true",
                        help="also the float32 and complex kernel variants and the kernels otherwise compiled on "
                             "first use (the Kalman filter's second derivatives); default: the float64 ones")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes to split the work over (each compiles its share once; default 1)")
    parser.add_argument("--kernels", nargs="+", metavar="MODULE.FUNCTION",
                        help="only these C-ABI kernels, e.g. iterops.ts.kalman._filter_abi (no graphs)")
    parser.add_argument("--part", default="0/1", help=argparse.SUPPRESS)  # i/n: the share of one of --jobs n
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.kernels:
        try:
            _selected(args.all_dtypes, set(args.kernels))
        except ValueError as err:
            parser.error(str(err))
    if args.jobs > 1:
        return _run_parts(args.jobs, [*(["--all-dtypes"] if args.all_dtypes else []),
                                      *(["--quiet"] if args.quiet else []),
                                      *(["--kernels", *args.kernels] if args.kernels else [])])
    i, n = (int(v) for v in args.part.split("/"))
    part = (i, n)
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, flush=True))

    import logging

    from iterops import _background

    logging.getLogger("iterops").setLevel(logging.ERROR)  # this command says it itself
    _background.enabled = False  # it schedules every kernel itself (no companions on the side)
    from iterops._fused import kernel_cache_dir
    import numba

    t0, c0 = time.perf_counter(), time.process_time()
    log(f"iterops warm-up: Numba cache in {numba.core.config.CACHE_DIR or kernel_cache_dir()}")
    log("C-ABI kernels:")
    warm_kernels(args.all_dtypes, log, part, set(args.kernels) if args.kernels else None)
    if not args.kernels:
        log("graphs (each public function with its gradient):")
        for dtype in ("float64", "float32") if args.all_dtypes else ("float64",):
            warm_graphs(dtype, log, part)
    log(f"done in {time.perf_counter() - t0:.0f} s ({time.process_time() - c0:.0f} CPU s)")
    return 0


def _run_parts(jobs: int, flags: list[str]) -> int:
    """``--jobs n``: n processes, the i-th warming every n-th kernel and graph from the i-th, so that no
    kernel is compiled twice (as it is when two processes need it at the same time, e.g. two test workers).
    Returns the first non-zero exit status."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-m", "iterops.warmup", "--part", f"{i}/{jobs}", *flags])
             for i in range(jobs)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
