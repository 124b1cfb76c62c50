"""The fused-Op machinery shared by every Op (iterops._fused): entry-point memoization on every
linker, Op equality, and cache keys that cover every source a kernel depends on."""

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.mode import Mode

import iterops

from iterops.ts import kalman_filter, kalman_smoother

# the modules (``iterops.ts.kalman_smoother`` is also the name of a function)
kalman = importlib.import_module("iterops.ts.kalman")
kalman_smoother_module = importlib.import_module("iterops.ts.kalman_smoother")

LINKERS = {"python": "FAST_COMPILE", "c": Mode(linker="cvm"), "numba": "NUMBA"}


# ---------------------------------------------------------------------------
# Op identity: a NaN option is normalised (a NaN is not equal to itself)
# ---------------------------------------------------------------------------


def test_nan_missing_value_is_no_missing_value():
    """``missing_value=nan`` says what NaN entries always are (missing): the Op is the default one."""
    k1, k2 = kalman.KalmanFilter(missing_value=float("nan")), kalman.KalmanFilter(missing_value=np.float64("nan"))
    assert k1.missing_value is None
    assert k1 == k2 == kalman.KalmanFilter() and hash(k1) == hash(k2) == hash(kalman.KalmanFilter())
    assert k1 != kalman.KalmanFilter(missing_value=-9999.0)


# ---------------------------------------------------------------------------
# A compiled function does not re-JIT its entry points on every call, on any linker
# ---------------------------------------------------------------------------


def _local_level_inputs():
    y = np.array([[1.0], [np.nan], [0.5], [0.2], [-0.3]])
    return [y, [0.0], [[1.0]], [0.0], [0.0], [[0.9]], [[1.0]], [[1.0]], [[0.5]], [[0.3]]]


@pytest.mark.parametrize("linker", list(LINKERS))
def test_kalman_entry_points_built_once(linker):
    values = [np.asarray(v, dtype="float64") for v in _local_level_inputs()]
    syms = [pt.tensor(f"x{i}", shape=v.shape, dtype="float64") for i, v in enumerate(values)]
    # a cov_jitter unique to this test gives entry points no other test has built
    opts = dict(cov_jitter=1.2345e-11)
    system = dict(zip(("c", "d", "T", "Z", "R", "H", "Q"), syms[3:]))
    res = kalman_filter(*syms[:3], **system, **opts)
    T = syms[5]
    outs = [res.loglik, pytensor.grad(res.loglik + res.filtered_state.sum(), T), kalman_smoother(*syms[:3], **system, **opts)[0]]
    entries = [kalman._filter_entry, kalman._adjoint_entry, kalman_smoother_module._smoother_entry]
    before = [e.cache_info().misses for e in entries]
    f = pytensor.function(syms, outs, mode=LINKERS[linker])
    first = f(*values)
    after_first = [e.cache_info().misses for e in entries]
    for _ in range(4):
        again = f(*values)
        for u, v in zip(first, again):
            np.testing.assert_array_equal(u, v)
    after = [e.cache_info().misses for e in entries]
    assert after == after_first, f"entry points re-built on later calls: {after_first} -> {after}"
    assert all(a - b <= 1 for a, b in zip(after, before)), f"built more than once: {before} -> {after}"
    assert np.isfinite(first[0])


# ---------------------------------------------------------------------------
# Stale kernels: editing a helper module invalidates every cache of the kernels that call it
# ---------------------------------------------------------------------------

_HELPER = """
import numba


@numba.njit(cache=True)
def helper(x):
    return x + {inc}
"""

_PROBE = '''
"""A kernel module calling a helper from another module: njit kernel, opaque cfunc, entry glue."""
import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply

from iterops._fused import FusedOp, OpaqueKernel, entry_point, register_fused_op
from iterops._probe_helper import helper


@numba.njit(cache=True)
def probe_kernel(x):
    return 2.0 * helper(x)


def _probe_abi(x):
    return 3.0 * helper(x)


_ABI = OpaqueKernel(numba.types.float64(numba.types.float64), _probe_abi)


@entry_point
def _probe_entry():
    abi = _ABI.external

    @numba.njit
    def run(x):
        v = x[()]
        out = np.empty(3)
        out[0] = probe_kernel(v)
        out[1] = abi(v)
        out[2] = helper(v)
        return out

    return run


@register_fused_op
class Probe(FusedOp):
    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [pt.tensor(dtype="float64", shape=(3,))])

    def infer_shape(self, node, input_shapes):
        return [(3,)]

    def numba_fn(self, node):
        return _probe_entry()
'''

_RUN = """
import json
import pytensor, pytensor.tensor as pt
import iterops
from iterops.linalg.probe import Probe, probe_kernel

x = pt.dscalar("x")
f = pytensor.function([x], Probe()(x), mode="NUMBA")
g = pytensor.function([x], Probe()(x), mode="FAST_COMPILE")
print(json.dumps({"file": iterops.__file__, "values": [probe_kernel(1.0), *f(1.0).tolist(), *g(1.0).tolist()]}))
"""


def _run_probe(root: Path, env_extra: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), **env_extra}
    proc = subprocess.run(
        [sys.executable, "-c", _RUN], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_edited_helper_module_is_not_served_stale(tmp_path):
    root = tmp_path / "pkg"
    shutil.copytree(Path(iterops.__file__).parent, root / "iterops", ignore=shutil.ignore_patterns("__pycache__"))
    helper = root / "iterops" / "_probe_helper.py"
    helper.write_text(_HELPER.format(inc="1.0"))
    (root / "iterops" / "linalg" / "probe.py").write_text(textwrap.dedent(_PROBE))
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba_cache")}

    first = _run_probe(root, env)
    assert Path(first["file"]).parent == root / "iterops"
    assert first["values"] == [4.0, 4.0, 6.0, 2.0, 4.0, 6.0, 2.0]
    cached = {p.name.split("-")[0] for p in (tmp_path / "numba_cache").rglob("*.nbi")}
    assert {"probe.probe_kernel", "probe._probe_abi", "_probe_helper.helper"} <= cached, cached
    assert _run_probe(root, env)["values"] == first["values"]  # served from the caches

    helper.write_text(_HELPER.format(inc="2.0"))  # only the helper module changes
    assert _run_probe(root, env)["values"] == [6.0, 6.0, 9.0, 3.0, 6.0, 9.0, 3.0]


def test_kernels_cache_in_one_place_without_numba_cache_dir(tmp_path):
    """A plain ``python`` run (no NUMBA_CACHE_DIR) caches iterops' kernels under ITEROPS_CACHE_DIR
    (default: the checkout's .cache/numba, or the user cache folder), never in the package."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["ITEROPS_CACHE_DIR"] = str(tmp_path / "numba")
    # a cold PyTensor cache, so the graph is compiled (a cached graph would not need the kernel's cache)
    env["PYTENSOR_FLAGS"] = f"base_compiledir={tmp_path / 'pytensor'}"
    # the graph inlines block_diag's kernel (inline="always"); calling the kernel compiles it on its own
    code = ("import numpy as np, pytensor, pytensor.tensor as pt, iterops\n"
            "from iterops.linalg.block_diag import block_diag_kernel\n"
            "block_diag_kernel(np.ones((2, 1, 1)), np.zeros((2, 2)))\n"
            "x = pt.tensor3('x'); print(pytensor.function([x], iterops.block_diag(x))(np.ones((2, 1, 1))).sum())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("2.0")
    assert list((tmp_path / "numba").rglob("*.nbi")), "no Numba cache index written under ITEROPS_CACHE_DIR"


# ---------------------------------------------------------------------------
# as_dtype: an entry point's inputs in the working dtype, copied only when they must be
# ---------------------------------------------------------------------------


def test_as_dtype_copies_only_to_convert_or_make_contiguous():
    """Under Numba ``as_dtype(x, np.float64)`` is ``x`` itself for a C-contiguous float64 ``x`` (no copy), and
    NumPy's ``ascontiguousarray(x).astype`` otherwise: a converted copy of a float32 ``x``, a contiguous copy of
    a strided one, the same values either way."""
    import numba

    from iterops._fused import as_dtype

    @numba.njit
    def f64(x):
        return as_dtype(x, np.float64)

    @numba.njit
    def f32(x):
        return as_dtype(x, np.float32)

    x = np.arange(12.0)
    same = f64(x)
    assert np.shares_memory(same, x) and same.dtype == np.float64
    strided = f64(x[::2])
    assert not np.shares_memory(strided, x) and strided.flags.c_contiguous
    np.testing.assert_array_equal(strided, x[::2])
    for y, fn, dtype in [(x.astype(np.float32), f64, np.float64), (x, f32, np.float32)]:
        out = fn(y)
        assert out.dtype == dtype and not np.shares_memory(out, y)
        np.testing.assert_array_equal(out, y.astype(dtype))
    np.testing.assert_array_equal(as_dtype(x[::2], np.float32), x[::2].astype(np.float32))  # the Python version


def test_an_uncachable_package_function_warns_like_numba():
    """Numba warns "Cannot cache compiled function" (at the function's file and line) when a function it was asked
    to cache uses dynamic globals or lifted loops, which it reads off the cache locator; iterops' locator must
    answer like Numba's own, not raise AttributeError (NUMBA_OPT=0 compiled such a function and raised)."""
    import types  # noqa: PLC0415

    from numba.core.caching import CompileResultCacheImpl  # noqa: PLC0415
    from numba.core.errors import NumbaWarning  # noqa: PLC0415

    from iterops import _linalg_kernels  # noqa: PLC0415
    from iterops._fused import PackageCacheLocator  # noqa: PLC0415

    py_func = _linalg_kernels.converged.py_func
    impl = CompileResultCacheImpl(py_func)
    assert isinstance(impl.locator, PackageCacheLocator)
    cres = types.SimpleNamespace(lifted=(), library=types.SimpleNamespace(has_dynamic_globals=True),
                                 fndesc=types.SimpleNamespace(qualname="converged"))
    with pytest.warns(NumbaWarning, match="Cannot cache compiled function \"converged\""):
        assert not impl.check_cachable(cres)
