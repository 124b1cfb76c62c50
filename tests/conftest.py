"""Shared test configuration.

* Numba's object-mode fallback is an error (see ``filterwarnings`` in
  pyproject.toml): every iterops Op must run natively.
* ``mode`` parametrizes over the linkers users meet: PyTensor's default
  (NUMBA), the C backend (CVM; in PyTensor 3.3 "FAST_RUN" means Numba too)
  and the Python one (FAST_COMPILE).
* ``rng`` is seeded by the CRC-32 of the test's node id: the same inputs in every run, on
  every machine.  ``ITEROPS_TEST_SEED_SALT=<text>`` salts it, to run every test on other
  random inputs (a test that fails for some salt was passing by luck).
* ``python_run`` marker: the test's default mode is ``PYTHON_RUN`` (see :func:`_python_run`).
* Oracle modes: ``SCAN_ORACLE`` runs a user's Scan (and PyTensor's autodiff of it) with iterops'
  rewrites excluded, Op by Op in Python (``perform``), the Scans' inner functions included: the
  same graph as in Numba mode, without the minutes that a cold compile of a Scan and its gradient
  Scan costs (Numba; and C, which PyTensor uses for Scan inner functions even in FAST_COMPILE).
  ``as_run_by_python(mode)`` keeps ``mode``'s rewrites (so its graph, fused or kept, is
  the one that mode compiles) and runs it the same way: for tests where the rewrite keeps the Scan.
* Shared helpers: input builders (``from conftest import stable, spd``), constant-graph
  evaluation, forward-vs-reverse Jacobian checks, random stationary AR models.
"""

import os
import zlib

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import HealthCheck, settings
from pytensor.compile.maker import FunctionMaker
from pytensor.compile.mode import Mode, get_mode
from pytensor.gradient import pushforward
from pytensor.link.vm import VMLinker
from statsmodels.tsa.arima_process import arma_acovf
from statsmodels.tsa.stattools import levinson_durbin_pacf

import iterops  # noqa: F401  (registers Ops and rewrites)

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("ITEROPS_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
settings.load_profile("ci")

LINKER_MODES = ["NUMBA", "CVM", "FAST_COMPILE"]


class _PythonThunksMaker(FunctionMaker):
    """Links every thunk as Python: ``cxx=""`` while linking reaches the Scans' inner functions too
    (``Scan.link_mode`` links them with C thunks whatever the outer linker).  ``cxx=""`` while rewriting
    too: elemwise fusion then keeps each fused node within the 32 operands ``Elemwise.perform`` (NumPy
    ufuncs) can take; Numba itself has no such limit."""

    def __init__(self, *args, **kwargs):
        with pytensor.config.change_flags(cxx=""):
            super().__init__(*args, **kwargs)

    def create(self, *args, **kwargs):
        with pytensor.config.change_flags(cxx=""):
            return super().create(*args, **kwargs)


class PythonMode(Mode):
    """A mode's rewrites, its graph (inner functions included) run by ``perform``: nothing compiled."""

    @property
    def function_maker(self):
        return _PythonThunksMaker


def as_run_by_python(mode="NUMBA"):
    """``mode``'s rewrites (iterops' among them), the rewritten graph run by ``perform``."""
    return PythonMode(linker=VMLinker(use_cloop=False, c_thunks=False), optimizer=get_mode(mode).provided_optimizer)


SCAN_ORACLE = as_run_by_python(get_mode("FAST_COMPILE").excluding("iterops"))
#: NUMBA mode's rewrites (iterops' among them), the rewritten graph run by ``perform``: the default mode of the
#: tests marked ``python_run``
PYTHON_RUN = as_run_by_python("NUMBA")
#: FAST_COMPILE's graph (iterops' rewrites included), Scans' inner functions run by ``perform`` too
FAST_PY = as_run_by_python("FAST_COMPILE")


def first_then_slow(cases):
    """``cases`` for ``parametrize``: the first runs in the default suite, the others under ``-m slow``
    (the same check on further models: the default run checks each behaviour on one representative)."""
    return [c if i == 0 else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(cases)]


@pytest.fixture(params=LINKER_MODES)
def mode(request):
    return request.param


@pytest.fixture(autouse=True)
def _python_run(request):
    """Tests marked ``python_run`` (modules that check the mathematics: values, gradients, batching against
    oracles) compile with :data:`PYTHON_RUN` wherever they give no mode (``pytensor.function``, ``verify_grad``):
    NUMBA mode's rewrites, so the same graph as the default mode, run by ``perform``, which calls the same
    jitted entry points and kernels.  What it skips is PyTensor's Numba linking of each new graph, most of a
    cold run's compile time; that linking is tested by the ``mode``-parametrized tests (every linker, per Op),
    the tests that ask for ``mode="NUMBA"``, and the PyMC, nutpie, README and notebook tests."""
    if request.node.get_closest_marker("python_run") is None:
        yield
        return
    with pytensor.config.change_flags(mode=PYTHON_RUN):
        yield


SEED_SALT = os.environ.get("ITEROPS_TEST_SEED_SALT", "")


@pytest.fixture
def rng(request):
    """A generator seeded per test, the same across runs (``hash`` is salted per process; CRC-32 is not)."""
    return np.random.default_rng(zlib.crc32((SEED_SALT + request.node.nodeid).encode()))


def stable(rng, n, rho, dtype="float64"):
    """A random (n, n) matrix with spectral radius ``rho`` (complex entries for a complex dtype)."""
    a = rng.normal(size=(n, n))
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.normal(size=(n, n))
    return (a * rho / np.max(np.abs(np.linalg.eigvals(a)))).astype(dtype)


def spd(rng, n, dtype="float64"):
    """A random symmetric positive-definite (n, n) matrix, eigenvalues at least ``n``."""
    q = rng.normal(size=(n, n))
    return (q @ q.T + n * np.eye(n)).astype(dtype)



def evaluate(*outs):
    """Evaluate constant graphs with the Python linker (whose ``perform`` runs the same Numba kernels)."""
    res = pytensor.function([], list(outs), mode=FAST_PY)()
    return res[0] if len(outs) == 1 else res


def jacobian_check(f_out, x, x_val, t_val, rtol=1e-8):
    """``pushforward(f, x, t)`` (the Ops' own and PyTensor's double-pullback one) equals the reverse-mode Jacobian times ``t``."""
    t = x.type()
    J = pytensor.gradient.jacobian(f_out, x)
    jvs = [pushforward(f_out, x, t, use_op_pushforward=use) for use in (True, False)]
    fn = pytensor.function([x, t], [pt.tensordot(J, t, axes=x.ndim), *jvs], mode=FAST_PY)  # J: a Scan
    a, *bs = fn(x_val, t_val)
    for b in bs:
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-10)


def random_pacf(rng, p, bound=0.9):
    """``p`` partial autocorrelations, uniform on ``(-bound, bound)``."""
    return rng.uniform(-bound, bound, size=p)


def random_ar(rng, p, bound=0.9):
    """Coefficients of a stationary AR(p) (from :func:`random_pacf`, by statsmodels' step-up)."""
    return levinson_durbin_pacf(np.r_[1.0, random_pacf(rng, p, bound)]).arcoefs


def sm_acov(phi, sigma2, nlags):
    """Autocovariances 0..nlags of the AR(p) ``phi`` with innovation variance ``sigma2`` (statsmodels)."""
    return arma_acovf(np.r_[1.0, -np.asarray(phi)], [1.0], nobs=nlags + 1, sigma2=sigma2)


#: The heaviest default tests (a minute of compile each on 2 cores) whose subject a lighter default test
#: also covers: run under ``-m slow`` to keep the default suite within its 25-minute budget.
HEAVY = {
    "tests/test_hessian.py::test_batched_kalman_hessian_matches_finite_differences",  # batched: test_kalman
    "tests/test_hessian.py::test_jax_hessians_match_finite_differences[kalman_filter]",  # [lyapunov] stays
    "tests/test_hessian.py::test_kalman_hessian_vector_product_is_a_few_filter_passes",
    "tests/test_kalman_diffuse.py::test_all_false_mask_is_the_ordinary_filter",
    "tests/test_kalman_diffuse.py::test_jax_custom_vjp_vmap_equals_numba_one_by_one",
    "tests/test_kalman_diffuse.py::test_jax_custom_vjp_failure_values_and_nan_gradients_equal_numba[not_ending]",
    "tests/test_levinson_recursion.py::test_matches_loop_float32",  # float64 stays
    "tests/test_lyapunov_iteration.py::test_random_stable_matches_scan",
    "tests/test_fusion_kalman.py::test_pymc_extras_time_varying_matrices[obs_intercept+design]",  # [design] stays
}


def pytest_configure(config):
    config.addinivalue_line("markers", "python_run: graphs compiled with no mode run by perform under NUMBA "
                            "mode's rewrites (see _python_run)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in HEAVY:
            item.add_marker(pytest.mark.slow)
