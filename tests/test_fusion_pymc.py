"""The Scan-fusion rewrite inside PyMC models (iterops.fusion under ``rewrite_pregrad``).

* a model whose stationary covariance comes from the user's Smith-doubling
  Scan (the loop PyMC users write for a stationary covariance), read as ``gammas[-1]`` and through merged indices
  (``gammas[-1][0, 0]``, which ``local_subtensor_merge`` turns into
  ``gammas[-1, 0, 0]``);
* a local-level model whose likelihood is a user-written textbook Kalman
  filter Scan with constant 1x1 system matrices (``np.ones((1, 1))``, moved
  into the inner graph by ``pytensor.scan``).

``compile_dlogp()`` (default mode) holds the fused Op and no Scan; logp and
dlogp equal the model compiled with ``iterops.fusion.disabled()`` (the
unrewritten Scans, FAST_COMPILE); inside ``disabled()`` the Scans stay.
Uses of a loop's output that could read an intermediate state keep the Scan.
"""

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest
from pymc.pytensorf import rewrite_pregrad
from pytensor.compile.mode import get_default_mode
from pytensor.scan.op import Scan
from pytensor.scan.utils import until

import iterops
from conftest import FAST_PY
from iterops.fusion import disabled, is_enabled, set_enabled
from iterops.linalg.lyapunov_iteration import SmithDoublingLoop
from iterops.ts.kalman import KalmanFilterGrad

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning")


def doubling_gammas(A, Q, tol=1e-12, max_iter=100):
    """The Smith doubling loop PyMC users write: the traced gammas."""
    def step(alpha, gamma, tol):
        new_gamma = gamma + alpha @ gamma @ alpha.T
        return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)

    _, gammas = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[tol], n_steps=max_iter,
                              return_updates=False)
    return gammas


def textbook_kalman_loglik(y, a0, P0, T, Z, R, H, Q):
    def step(y_t, a, P, T, Z, R, H, Q):
        v = y_t - Z @ a
        F = Z @ P @ Z.T + H
        F_inv = pt.linalg.inv(F)
        K = P @ Z.T @ F_inv
        a_f = a + K @ v
        P_f = P - K @ Z @ P
        ll = -0.5 * (np.log(2 * np.pi) + pt.log(pt.linalg.det(F)) + v @ F_inv @ v)
        return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll

    _, _, ll = pytensor.scan(step, sequences=[y], outputs_info=[a0, P0, None], non_sequences=[T, Z, R, H, Q],
                             return_updates=False)
    return ll.sum()


def ar2_model(y):
    """AR(2): (y_1, y_2) ~ N(0, P0) with P0 the stationary covariance from the doubling Scan."""
    with pm.Model() as model:
        pacf = pm.Uniform("pacf", -0.9, 0.9, shape=2)
        sigma = pm.HalfNormal("sigma", 2.0)
        phi1, phi2 = pacf[0] * (1 - pacf[1]), pacf[1]
        T = pt.stack([pt.stack([phi1, phi2]), pt.as_tensor([1.0, 0.0])])
        RQR = pt.stack([pt.stack([sigma**2, pt.constant(0.0)]), pt.zeros(2)])
        gammas = doubling_gammas(T, RQR)
        P0 = gammas[-1]
        pm.MvNormal("y0", mu=pt.zeros(2), cov=P0, observed=y[:2])
        # the variance read from the trace again: merged into gammas[-1, 0, 0] by rewrite_pregrad
        pm.Normal("y_first", 0.0, pt.sqrt(gammas[-1][0, 0]), observed=y[0])
        pm.Normal("y_rest", mu=phi1 * y[1:-1] + phi2 * y[:-2], sigma=sigma, observed=y[2:])
    return model


def local_level_model(y):
    one = np.ones((1, 1))  # constants: pytensor.scan moves them into the step
    with pm.Model() as model:
        s_obs = pm.HalfNormal("s_obs", 2.0)
        s_lvl = pm.HalfNormal("s_lvl", 2.0)
        pm.Potential("ll", textbook_kalman_loglik(y[:, None], pt.as_tensor([y[0]]), 10.0 * pt.ones((1, 1)),
                                                  one, one, one, pt.reshape(s_obs**2, (1, 1)),
                                                  pt.reshape(s_lvl**2, (1, 1))))
    return model


def _ops(f):
    return [n.op for n in f.maker.fgraph.apply_nodes]


def _has(f, cls):
    return any(isinstance(op, cls) or isinstance(getattr(op, "core_op", None), cls) for op in _ops(f))


def _has_scan(f):
    return any(isinstance(op, Scan) for op in _ops(f))


@pytest.fixture(scope="module")
def ar_y():
    rng = np.random.default_rng(3)
    y = np.zeros(60)
    for t in range(2, 60):
        y[t] = 0.5 * y[t - 1] - 0.3 * y[t - 2] + rng.normal(scale=0.8)
    return y


@pytest.fixture(scope="module")
def level_y():
    rng = np.random.default_rng(5)
    return np.cumsum(rng.normal(scale=0.5, size=40)) + rng.normal(scale=1.0, size=40)


def _check_model(model, fused_op, point_seed, rtol):
    """Default-mode logp+dlogp holds ``fused_op`` and no Scan, and equals the unrewritten model's."""
    fused = model.compile_fn([model.logp(), model.dlogp()])  # dlogp: rewrite_pregrad, then the gradient
    assert _has(fused.f, fused_op) and not _has_scan(fused.f)
    with disabled():
        ref = model.compile_fn([model.logp(), model.dlogp()], mode=FAST_PY)
    assert _has_scan(ref.f) and not _has(ref.f, fused_op)
    ip = model.initial_point()
    rng = np.random.default_rng(point_seed)
    for _ in range(3):
        point = {k: v + 0.3 * rng.normal(size=np.shape(v)) for k, v in ip.items()}
        (lp, dlp), (ref_lp, ref_dlp) = fused(point), ref(point)
        np.testing.assert_allclose(lp, ref_lp, rtol=rtol)
        np.testing.assert_allclose(dlp, ref_dlp, rtol=rtol, atol=1e-9)


def test_doubling_scan_in_pymc_model_is_fused(ar_y):
    model = ar2_model(ar_y)
    # before compiling: PyMC's pre-gradient pass already replaces it (so dlogp uses the fused gradient)
    assert not iterops.explain(rewrite_pregrad(model.logp())).scans
    _check_model(model, SmithDoublingLoop, 0, rtol=1e-8)


def test_textbook_kalman_with_constant_matrices_in_pymc_model_is_fused(level_y):
    _check_model(local_level_model(level_y), KalmanFilterGrad, 1, rtol=1e-8)


def test_disabled_keeps_scans_in_default_mode(ar_y):
    model = ar2_model(ar_y)
    assert is_enabled()
    default_rewrites = get_default_mode().clone(linker="py")  # the default mode's rewrites, no JIT cost
    with disabled():
        assert not is_enabled()
        f = model.compile_fn(model.dlogp(), mode=default_rewrites)
        assert iterops.explain(iterops.fuse_loops(model.logp())).scans  # fuse_loops is a no-op too
        assert iterops.explain(rewrite_pregrad(model.logp())).scans  # the pre-grad pass leaves the Scan
    assert is_enabled()
    assert _has_scan(f.f) and not _has(f.f, SmithDoublingLoop)
    assert set_enabled(False) is True
    try:
        assert iterops.explain(rewrite_pregrad(model.logp())).scans
    finally:
        assert set_enabled(True) is False
    with pytest.raises(RuntimeError), disabled():
        raise RuntimeError
    assert is_enabled()


# ---------------------------------------------------------------------------
# Which reads of the last state are recognized (after rewrite_pregrad's index merges)
# ---------------------------------------------------------------------------

A_ = pt.matrix("A")
Q_ = pt.matrix("Q")
K_ = pt.lscalar("k")


def _fixed_doubling_gammas(n):
    def step(alpha, gamma):
        return alpha @ alpha, gamma + alpha @ gamma @ alpha.T

    return pytensor.scan(step, outputs_info=[A_, Q_], n_steps=n, return_updates=False)[1]


LAST_READS = {
    "[-1]": lambda g: g[-1],
    "[-1][0, 1]": lambda g: g[-1][0, 1],
    "[-1, :, 0]": lambda g: g[-1, :, 0],
    "[-1:][0]": lambda g: g[-1:][0],
    "[-1:]": lambda g: g[-1:],
    "[-2:][-1]": lambda g: g[-2:][-1],
    "[shape[0] - 1]": lambda g: g[g.shape[0] - 1],
    "mT[-1]": lambda g: g.mT[-1],
}

#: reads that may see an intermediate state (or the number of steps the loop ran)
INTERMEDIATE_READS = {
    "[-2]": lambda g: g[-2],
    "[98]": lambda g: g[98],
    "[max_iter - 1]": lambda g: g[K_ - 1],  # a while loop may stop earlier
    "[shape[0] - 2]": lambda g: g[g.shape[0] - 2],
    "[-1] * shape[0]": lambda g: g[-1] * g.shape[0],
    "[-2:]": lambda g: g[-2:],
    "[-1] and [0]": lambda g: g[-1] + g[0],
}


@pytest.mark.parametrize("name", list(LAST_READS))
def test_last_state_reads_are_fused(name):
    A = np.array([[0.5, 0.2], [-0.1, 0.3]])
    Q = np.array([[1.0, 0.2], [0.2, 0.5]])
    out = LAST_READS[name](doubling_gammas(A_, Q_, max_iter=K_))
    for graph in (out, rewrite_pregrad(out)):
        fused = iterops.fuse_loops(graph)
        assert not iterops.explain(fused).scans
        f = pytensor.function([A_, Q_, K_], fused, mode=FAST_PY, on_unused_input="ignore")
        with disabled():
            ref = pytensor.function([A_, Q_, K_], graph, mode=FAST_PY, on_unused_input="ignore")
        np.testing.assert_allclose(f(A, Q, 100), ref(A, Q, 100), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(INTERMEDIATE_READS))
def test_intermediate_state_reads_keep_the_scan(name):
    out = INTERMEDIATE_READS[name](doubling_gammas(A_, Q_, max_iter=K_))
    for graph in (out, rewrite_pregrad(out)):
        report = iterops.explain(graph)
        assert report.scans and not report.replaced, str(report)


def test_fixed_length_loop_index_of_last_step():
    """Without ``until`` the trace has n_steps rows: ``gammas[n_steps - 1]`` is the last, ``[n_steps - 2]`` not."""
    g = _fixed_doubling_gammas(64)
    assert iterops.explain(g[63]).replaced
    assert iterops.explain(rewrite_pregrad(g[63])).scans == []
    assert not iterops.explain(g[62]).replaced
    assert not iterops.explain(rewrite_pregrad(g[62])).replaced


def test_constant_matrices_must_still_match_the_reference():
    """A constant that makes the step compute something else (a scaled transpose) is not accepted."""
    B = np.array([[0.5, 0.1], [0.0, 0.4]])

    def step(gamma, A, tol):
        new = A @ gamma @ B.T + pt.eye(2)  # B^T where the fixed point needs A^T
        return new, until(pt.max(pt.abs(new - gamma)) < tol)

    g = pytensor.scan(step, outputs_info=[Q_], non_sequences=[A_, 1e-10], n_steps=K_, return_updates=False)
    report = iterops.explain(g[-1])
    assert report.scans and not report.replaced, str(report)
