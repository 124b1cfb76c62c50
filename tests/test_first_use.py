"""What a user sees the first time iterops' kernels compile on a machine: one line, once per process,
and nothing once the kernels are in the on-disk cache."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import iterops

_KERNELS = '''
import numba
from iterops._fused import OpaqueKernel

def _twice(x):
    return 2.0 * x

def _thrice(x):
    return 3.0 * x

TWICE = OpaqueKernel(numba.types.float64(numba.types.float64), _twice)
THRICE = OpaqueKernel(numba.types.float64(numba.types.float64), _thrice)
'''

_RUN = '''
import numba
import iterops
from first_use_kernels import THRICE, TWICE

print("cached before:", TWICE.is_cached(), THRICE.is_cached())
twice, thrice = TWICE.external, THRICE.external

@numba.njit
def call(x):
    return twice(x) + thrice(x)

print("value:", call(1.0))
print("cached after:", TWICE.is_cached(), THRICE.is_cached())
'''


def _pythonpath(tmp_path):
    """``tmp_path`` first, then the iterops under test (a worktree's, not only the installed one)."""
    return os.pathsep.join([str(tmp_path), str(Path(iterops.__file__).resolve().parents[1])])


def _run(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": _pythonpath(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout, [line for line in out.stderr.splitlines() if line.startswith("iterops:")]


def test_first_compile_is_announced_once_and_cached_kernels_are_silent(tmp_path):
    (tmp_path / "first_use_kernels.py").write_text(textwrap.dedent(_KERNELS))
    stdout, said = _run(tmp_path)
    assert "cached before: False False" in stdout and "value: 5.0" in stdout
    assert "cached after: True True" in stdout
    assert len(said) == 1, said  # two kernels compiled, one line
    assert "compiling Numba kernels for first use" in said[0] and "python -m iterops.warmup" in said[0]
    assert str(tmp_path / "cache") in said[0]  # says where the cache is

    stdout, said = _run(tmp_path)  # a new process: the kernels load from the cache, nothing is said
    assert "cached before: True True" in stdout and "value: 5.0" in stdout
    assert said == []


_LYAPUNOV_COLD = '''
from numba.core import event
compiled = []

class Names(event.Listener):
    def on_start(self, ev):
        d = ev.data["dispatcher"]
        compiled.append(getattr(d, "py_func", d).__qualname__)

    def on_end(self, ev):
        pass

event.register("numba:compile", Names())
from iterops.linalg.lyapunov import _ABI, lyapunov_kernel
_ABI["float64"].external
print("kernel signatures:", len(lyapunov_kernel.signatures))
print("compiled:", " ".join(compiled))
'''


def test_lyapunov_kernel_compiles_once_inside_its_c_abi_function(tmp_path):
    """Cold compile structure (``benchmarks/bench_compile.py``): the kernel is inlined into its C-ABI
    function instead of being compiled on its own and then again inside it, and no slice assignment
    from an array pulls Numba's shape-mismatch message (string formatting) into the kernel."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _LYAPUNOV_COLD], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    compiled = next(line for line in out.stdout.splitlines() if line.startswith("compiled:")).split()[1:]
    assert "kernel signatures: 0" in out.stdout
    assert "_relative_residual" in compiled and "_doubling" in compiled  # it did compile cold
    assert not any("raise_with_shape_context" in name for name in compiled), compiled
    assert "_schur" not in compiled and not any("complex_schur" in name for name in compiled), compiled  # first use


_LAZY_KERNELS = '''
import numba
from iterops._fused import F64P, LazyKernel

def _scale(x, out, n, a):
    xs, o = numba.carray(x, (n,)), numba.carray(out, (n,))
    for i in range(n):
        o[i] = a * xs[i]
    return n

SCALE = LazyKernel(numba.types.int64(F64P, F64P, numba.types.int64, numba.types.float64), _scale)
'''

_LAZY_RUN = '''
import threading
import numba
import numpy as np
from iterops._fused import data_ptr, keep_alive
from lazy_kernels import SCALE

scale = SCALE.external

@numba.njit(nogil=True)
def call(x, a):
    out = np.empty_like(x)
    r = scale(data_ptr(x), data_ptr(out), x.size, a)
    keep_alive((x, out))
    return out, r

call.compile("(float64[::1], float64)")
print("compiled with the caller:", SCALE._compiled is not None, "cached:", SCALE.is_cached())
res = {}
threads = [threading.Thread(target=lambda k=k: res.__setitem__(k, call(np.arange(3.0), float(k)))) for k in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("values:", all(np.array_equal(res[k][0], k * np.arange(3.0)) and res[k][1] == 3 for k in range(3)))
print("compiled after the call:", SCALE._compiled is not None, "cached:", SCALE.is_cached())
'''


def test_lazy_kernel_compiles_on_its_first_call_from_any_thread(tmp_path):
    """:class:`iterops._fused.LazyKernel` (the Lyapunov solver's Schur fallback): compiling a caller
    does not compile it; its first call does (announced once, then cached), from threads that do not
    hold the GIL too; a new process loads it from the cache on its first call, silently."""
    (tmp_path / "lazy_kernels.py").write_text(textwrap.dedent(_LAZY_KERNELS))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": _pythonpath(tmp_path)}
    for first in (True, False):
        out = subprocess.run([sys.executable, "-c", _LAZY_RUN], env=env, capture_output=True, text=True,
                             timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert f"compiled with the caller: False cached: {not first}" in out.stdout
        assert "values: True" in out.stdout and "compiled after the call: True cached: True" in out.stdout
        said = [line for line in out.stderr.splitlines() if line.startswith("iterops:")]
        assert len(said) == (1 if first else 0), said


@pytest.mark.parametrize("jobs", [1, 2, 3, 5])
def test_warmup_parts_cover_every_kernel_and_graph_once(jobs):
    """``python -m iterops.warmup --jobs n``: the n shares are disjoint and together are the whole list, in order."""
    from iterops._fused import OPAQUE_KERNELS
    from iterops.warmup import _share

    names = [k.name for k in OPAQUE_KERNELS]
    parts = [_share(names, (i, jobs)) for i in range(jobs)]
    assert sorted(sum(parts, [])) == sorted(names)
    assert len(sum(parts, [])) == len(names)
    assert all(p == [x for x in names if x in p] for p in parts)
    if jobs <= len(names):
        assert all(parts)


_BACKGROUND = '''
import iterops
from iterops._background import RUNNING as BACKGROUND_COMPILES
from iterops.linalg.lyapunov import _ABI
from iterops.warmup import start_background

kernel = _ABI["float64"]
print("cached before:", kernel.is_cached())
proc = start_background(["iterops.linalg.lyapunov._lyapunov_abi"])
print("started:", proc is not None, "tracked:", BACKGROUND_COMPILES == [proc])
kernel.external  # needed here while the background process compiles it: waits, then loads it
print("exit:", proc.returncode, "tracked after:", BACKGROUND_COMPILES, "loaded:", kernel.from_cache)
print("cached after:", kernel.is_cached(), "started again:", start_background(["iterops.linalg.lyapunov._lyapunov_abi"]))
'''


def test_background_compile_is_waited_for_and_not_repeated(tmp_path):
    """``iterops.warmup.start_background`` (the demo's first run): a kernel needed while the background process
    compiles it waits for that process and loads its result from the cache (nothing compiled twice, so nothing
    is announced here); once cached, nothing is started."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _BACKGROUND], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "cached before: False" in out.stdout
    assert "started: True tracked: True" in out.stdout
    assert "exit: 0 tracked after: [] loaded: True" in out.stdout  # compiled there, not again here
    assert "cached after: True started again: None" in out.stdout
    assert not [line for line in out.stderr.splitlines() if line.startswith("iterops:")], out.stderr


def test_kernels_compiled_on_demand_are_lazy_and_left_out_of_the_default_warmup():
    """The Kalman filter's second-derivative kernel (51 CPU s cold, needed by few models) compiles when first called:
    a :class:`~iterops._fused.LazyKernel`, not in ``python -m iterops.warmup``'s default list, in ``--all-dtypes``'."""
    from iterops._fused import LazyKernel
    from iterops.ts._kalman_second import _HVP
    from iterops.warmup import _selected

    assert isinstance(_HVP.kernel, LazyKernel) and _HVP.kernel.on_demand
    assert _HVP.kernel not in _selected(False) and _HVP.kernel in _selected(True)
    assert all(not k.on_demand for k in _selected(False))


def test_warmup_rejects_an_unknown_kernel_name():
    out = subprocess.run([sys.executable, "-m", "iterops.warmup", "--kernels", "iterops.ts.kalman._no_such_abi"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert "unknown kernels ['iterops.ts.kalman._no_such_abi']" in out.stderr
    assert "iterops.ts.kalman._filter_abi" in out.stderr  # lists the names it knows


_COMPANIONS = '''
import iterops
from iterops._background import RUNNING as BACKGROUND_COMPILES
from iterops.linalg.lyapunov import _ABI, _SCHUR_ABI

solver, fallback = _ABI["float64"], _SCHUR_ABI["float64"]
solver.companions = ("iterops.linalg.lyapunov._schur_abi",)  # as the Kalman filter's adjoint is its filter's
print("cached before:", solver.is_cached(), fallback.is_cached())
solver.external  # not cached: compiles here, its companion in a background process
procs = list(BACKGROUND_COMPILES)
print("background:", len(procs))
fallback.compile()  # waits for that process, then loads the kernel it compiled
print("exits:", [p.returncode for p in procs], "cached after:", solver.is_cached(), fallback.is_cached())
print("loaded here from the cache:", solver.from_cache, fallback.from_cache)
'''


@pytest.mark.parametrize("background", [True, False])
def test_companion_kernels_compile_in_the_background_once(tmp_path, background):
    """A kernel's ``companions`` (the Kalman filter's adjoint) compile in a background process while the kernel
    compiles here; using one waits for that process and loads its result: one announcement, nothing compiled
    twice.  ``ITEROPS_BACKGROUND_COMPILE=0`` keeps everything in the process."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "ITEROPS_BACKGROUND_COMPILE": "1" if background else "0"}
    out = subprocess.run([sys.executable, "-c", _COMPANIONS], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "cached before: False False" in out.stdout
    assert f"background: {1 if background else 0}" in out.stdout
    assert f"exits: {[0] if background else []} cached after: True True" in out.stdout
    assert f"loaded here from the cache: False {background}" in out.stdout  # compiled once, not again here
    said = [line for line in out.stderr.splitlines() if line.startswith("iterops:")]
    assert len(said) == 1 and "_lyapunov_abi" in said[0], out.stderr


def test_a_new_graph_compiles_no_new_specialisation_of_the_shared_glue():
    """A second Kalman graph (other outputs, other gradients, a constant cotangent) reuses every compiled
    helper behind the entry points: the run-time shape checks have explicit signatures (string arguments
    would otherwise compile one specialisation per message), the cotangents reach the checked helpers
    C-contiguous and writable-typed, and the generated packers are disk-cached like any other helper."""
    import numba
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from iterops import _validate
    from iterops.ts import kalman

    names = ("y", "a0", "P0", "T", "Z", "R", "H", "Q")
    ins = [pt.tensor(k, dtype="float64", shape=(None,) * (1 if k == "a0" else 2)) for k in names]
    y, a0, P0, T, Z, R, H, Q = ins
    values = (np.array([[1.0], [0.5], [0.2]]), np.zeros(2), np.eye(2), 0.5 * np.eye(2), np.ones((1, 2)),
              np.eye(2), np.eye(1), np.eye(2))

    def compile_and_run(cost, wrt):
        f = pytensor.function(ins, [cost, *pytensor.grad(cost, wrt)], on_unused_input="ignore")
        return f(*values)

    res = iterops.kalman_filter(y, a0, P0, T=T, Z=Z, R=R, H=H, Q=Q)
    compile_and_run(res.loglik, [a0, T, Q])
    glue = [d for d in vars(kalman).values() if isinstance(d, numba.core.registry.CPUDispatcher)]
    glue += [kalman.FILTER_ABI.pack, kalman.ADJOINT_ABI.pack, _validate._check_dims]
    before = {d: len(d.overloads) for d in glue}
    res = iterops.kalman_filter(y, a0, P0, T=T, Z=Z, R=R, H=H, Q=Q)
    compile_and_run(res.loglik + (res.filtered_state ** 2).sum() + res.filtered_cov.sum(), [Z, H, P0])
    compile_and_run(res.loglik + (res.predicted_cov ** 3).sum(), [y, R])
    grown = {d.py_func.__name__: (before[d], len(d.overloads)) for d in glue if len(d.overloads) != before[d]}
    assert not grown, f"helpers compiled again for a new graph (before, after): {grown}"
