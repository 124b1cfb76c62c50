"""The C-ABI boundary generated from NamedTuples (iterops._abi): arrays of declared dtypes cross it as they are,
and a kernel behind it is listed by its arrays' dtypes.  Oracles: NumPy on the same arrays; the dtypes declared."""

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numba
import numpy as np

import iterops  # noqa: F401  (defines every kernel)


class _Pair(NamedTuple):
    x: np.ndarray
    y: np.ndarray


class _Scale(NamedTuple):
    c: float
    n: int


@numba.njit(cache=True)
def _scaled_sum(inp, scale, out):
    """``out.x = c * inp.x`` in ``x``'s dtype, ``out.y = inp.y[:n] + 1``; returns ``sum(inp.y)``."""
    for i in range(inp.x.shape[0]):
        for j in range(inp.x.shape[1]):
            out.x[i, j] = inp.x.dtype.type(scale.c) * inp.x[i, j]
    for i in range(scale.n):
        out.y[i] = inp.y[i] + 1.0
    return inp.y.sum()


def test_arrays_of_declared_dtypes_cross_the_barrier(rng):
    """A float32 (2-d) and a float64 (1-d) field, and scalars, through ``Abi.pack`` -> the kernel -> ``unpack``:
    every entry as NumPy computes it, the float32 product in float32."""
    from iterops._abi import Abi, Barrier, Struct  # noqa: PLC0415  (not in the code before per-field dtypes)

    pair = Struct(_Pair, x=(2, "float32"), y=1)
    barrier = Barrier(_scaled_sum, Abi(inp=pair, scale=Struct(_Scale, c="f", n="i"), out=pair), "test")
    assert not barrier.kernel.float64_only
    call = barrier.call

    @numba.njit
    def run(x, y, c, n):
        out = _Pair(np.zeros_like(x), np.zeros_like(y))
        total = call(_Pair(x, y), _Scale(c, n), out)
        return out.x, out.y, total

    x, y = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5)
    out_x, out_y, total = run(x, y, 0.3, 4)
    assert out_x.dtype == np.float32
    np.testing.assert_array_equal(out_x, np.float32(0.3) * x)
    np.testing.assert_array_equal(out_y, np.r_[y[:4] + 1.0, 0.0])
    assert total == y.sum()


def test_default_warmup_holds_no_float32_kernel():
    """``python -m iterops.warmup`` compiles the float64 kernels by default (what PyMC models reach): a kernel
    on float32 arrays must not be among them, also when its C signature passes them as int64 addresses (the
    fixed-point loop's float32 kernel was).  Kernels name their dtypes in their tag."""
    from iterops.warmup import _selected  # noqa: PLC0415

    assert [k.name for k in _selected(False) if "32" in k.name] == []


_PROBE_FN = '''
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numba
import numpy as np


class V(NamedTuple):
    x: np.ndarray


@numba.njit
def fn(v):
    return v.x.sum() * {factor}
'''

_PROBE = '''
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import probe_fn
from iterops._abi import Abi, Barrier, Struct

barrier = Barrier(probe_fn.fn, Abi(v=Struct(probe_fn.V, x=1)), "probe")
print(barrier.call(probe_fn.V(np.ones(3))))
'''


def test_an_edited_kernel_outside_the_package_is_not_served_stale(tmp_path):
    """A Barrier's kernel is cached on disk; Numba stamps it with the file of the function it compiles (the template
    in iterops._abi) and iterops with the package's sources, neither of which sees ``fn``'s own file when it lies
    outside them.  Editing ``fn`` must recompile: the value of the edited code, not the cached one (oracle: the
    edit's arithmetic, 3 * 2 then 3 * 3)."""
    (tmp_path / "probe_fn.py").write_text(_PROBE_FN.format(factor="2.0"))
    (tmp_path / "probe.py").write_text(_PROBE)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(Path(iterops.__file__).parent.parent)}

    def run():
        out = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(tmp_path)], env=env,
                             capture_output=True, text=True, check=True)
        return float(out.stdout.split()[-1])

    assert run() == 6.0
    assert any((tmp_path / "cache").rglob("*.nbi"))  # cached: a second run would load it
    (tmp_path / "probe_fn.py").write_text(_PROBE_FN.format(factor="3.0"))
    assert run() == 9.0
