"""Levinson-Durbin Scans -> iterops.ts.levinson_durbin (iterops.fusion.patterns.levinson).

Matches: no Scan and the LevinsonRecursion Op (the same recursion, fused) in the compiled graph; values equal
statsmodels' ``levinson_durbin`` and the unrewritten Scan; gradients equal
autodiff of the Scan.  Near misses (more than matches) stay Scans.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.scan.op import Scan
from statsmodels.tsa.stattools import levinson_durbin as sm_levinson_durbin

import iterops
from conftest import SCAN_ORACLE
from iterops.ts.levinson_recursion import LevinsonRecursion

_SCAN_MODE = SCAN_ORACLE
ORDER = 4


def _ops(f):
    return [getattr(n.op, "core_op", n.op) for n in f.maker.fgraph.apply_nodes]


def _acov(seed, n_lags=ORDER + 2):
    x = np.random.default_rng(seed).normal(size=300)
    x = np.convolve(x, [1.0, 0.6, -0.3, 0.2])[:300]
    x = x - x.mean()
    return np.array([np.mean(x[: len(x) - h] * x[h:]) for h in range(n_lags)])


def levinson_sum(gamma, p=ORDER):
    """Brockwell & Davis' recursion, coefficients carried in p zeros; returns (phi, sigma2, pacf)."""

    def step(k, phi, v, gamma):
        kappa = (gamma[k + 1] - pt.sum(phi[:k] * gamma[1:k + 1][::-1])) / v
        new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
        new_phi = pt.set_subtensor(new_phi[k], kappa)
        return new_phi, v * (1 - kappa**2), kappa

    phis, vs, kappas = pytensor.scan(step, sequences=[pt.arange(p)], outputs_info=[pt.zeros(p), gamma[0], None],
                                     non_sequences=[gamma], return_updates=False)
    return phis[-1], vs[-1], kappas


def levinson_dot(gamma, p=ORDER):
    """`@` and a reversed slice, outputs in another order, no kappa output, other argument order."""

    def step(k, v, phi, gamma):
        kappa = (gamma[k + 1] - phi[:k] @ gamma[k:0:-1]) / v
        upd = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
        return v * (1 - kappa**2), pt.set_subtensor(upd[k], kappa)

    vs, phis = pytensor.scan(step, sequences=[pt.arange(p)], outputs_info=[gamma[0], pt.zeros(p)],
                             non_sequences=[gamma], return_updates=False)
    return phis[-1], vs[-1]


@pytest.mark.parametrize("build", [levinson_sum, levinson_dot])
def test_levinson_matches_statsmodels_and_scan_gradients(build):
    gamma = pt.vector("gamma")
    outs = list(build(gamma))
    report = iterops.explain(outs)
    assert [r.pattern for r in report.replaced] == ["levinson_durbin"], str(report)
    cost = outs[0] @ np.arange(1.0, ORDER + 1) + 3 * outs[1] + (outs[2].sum() if len(outs) > 2 else 0)
    fused = iterops.fuse_loops([*outs, cost])
    f = pytensor.function([gamma], [*fused[:-1], pytensor.grad(fused[-1], gamma)])
    ref = pytensor.function([gamma], [*outs, pytensor.grad(cost, gamma)], mode=_SCAN_MODE)
    ops = _ops(f)
    assert any(isinstance(op, LevinsonRecursion) for op in ops) and not any(isinstance(op, Scan) for op in ops)
    for seed in range(3):
        g = _acov(seed)
        got, want = f(g), ref(g)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
        sigma2, phi, pacf = sm_levinson_durbin(g, nlags=ORDER, isacov=True)[:3]
        np.testing.assert_allclose(got[0], phi, rtol=1e-10)
        np.testing.assert_allclose(got[1], sigma2, rtol=1e-10)
        if len(outs) > 2:
            np.testing.assert_allclose(got[2], pacf[1:], rtol=1e-10, atol=1e-12)


def _near(variant, p=ORDER):
    gamma = pt.vector("gamma")

    def step(k, phi, v, gamma):
        lag = gamma[k] if variant == "kappa reads gamma[k]" else gamma[k + 1]
        rev = gamma[1:k + 1] if variant == "lags not reversed" else gamma[1:k + 1][::-1]
        kappa = (lag - pt.sum(phi[:k] * rev)) / v
        mirror = phi[:k] if variant == "phi not mirrored" else phi[:k][::-1]
        if variant == "reflection update with + sign":
            new_phi = pt.set_subtensor(phi[:k], phi[:k] + kappa * mirror)
        else:
            new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * mirror)
        new_phi = pt.set_subtensor(new_phi[k], -kappa if variant == "stores -kappa" else kappa)
        new_v = v * (1 + kappa**2) if variant == "v * (1 + kappa^2)" else v * (1 - kappa**2)
        return new_phi, new_v

    seq = pt.arange(1, p + 1) if variant == "counter from 1" else pt.arange(p)
    phi0 = pt.ones(p) if variant == "phi starts at ones" else pt.zeros(p)
    v0 = gamma[1] if variant == "v starts at gamma[1]" else gamma[0]
    n_steps = pt.iscalar("n") if variant == "symbolic n_steps" else None
    phis, vs = pytensor.scan(step, sequences=[seq], outputs_info=[phi0, v0], non_sequences=[gamma],
                             n_steps=n_steps, return_updates=False)
    if variant == "intermediate phi used":
        return phis[-2]
    return phis[-1] + vs[-1]


NEAR_MISSES = ["kappa reads gamma[k]", "lags not reversed", "reflection update with + sign", "phi not mirrored",
               "stores -kappa", "v * (1 + kappa^2)", "counter from 1", "phi starts at ones",
               "v starts at gamma[1]", "symbolic n_steps", "intermediate phi used"]


@pytest.mark.parametrize("variant", NEAR_MISSES)
def test_levinson_near_misses_stay_scans(variant):
    report = iterops.explain(_near(variant))
    assert not report.replaced, str(report)
    assert report.kept


def test_near_miss_builder_matches_when_unchanged():
    """The near-miss loop with no change is recognized: each near miss differs by its one change only."""
    assert iterops.explain(_near("none")).replaced


def test_levinson_near_miss_explains_reason():
    report = str(iterops.explain(_near("v starts at gamma[1]")))
    assert "levinson_durbin" in report and "gamma[0]" in report
