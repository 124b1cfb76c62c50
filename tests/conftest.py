"""Shared test configuration.

* Numba's object-mode fallback is an error (see ``filterwarnings`` in
  pyproject.toml): every iterops Op must run natively.
* ``mode`` parametrizes over the linkers users meet: PyTensor's default
  (NUMBA), the C backend (CVM; in PyTensor 3.3 "FAST_RUN" means Numba too)
  and the Python one (FAST_COMPILE).
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

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


@pytest.fixture(params=LINKER_MODES)
def mode(request):
    return request.param


@pytest.fixture
def rng(request):
    # A seed per test, stable across runs.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)
