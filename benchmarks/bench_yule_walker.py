"""Yule-Walker family: fused Levinson-Durbin / lattice kernels vs dense solve, Scan and statsmodels.

Rows per AR order p:

* ``yule_walker`` forward + gradient (``phi``, ``sigma2`` and d(w.phi + sigma2)/d acov):
  iterops vs (a) the plain dense spelling, ``pt.linalg.solve(g[|i - j|], g[1:p+1], assume_a="pos")``
  (the Toeplitz matrix by indexing, O(p^3)) in the default mode, the baseline of the p = 200 target,
  (b) the same solve with the matrix built by ``iterops.ts.toeplitz.toeplitz_matrix`` (``pt.where`` of
  two gathers: two scatters in its gradient) and (c) Durbin's recursion as a ``pytensor.scan``
  (autodiff through the Scan); forward vs ``statsmodels.tsa.stattools.levinson_durbin``.
* ``pacf_to_ar`` forward + gradient: iterops vs the step-up recursion as a
  ``pytensor.scan``; forward vs ``statsmodels.tsa.stattools.levinson_durbin_pacf``.
  There is no dense-solve formulation of this map, so no dense row.

All PyTensor functions use the default (Numba) linker and ``trust_input``; baselines (b) and (c) are
compiled without iterops' Scan rewrites (``mode.excluding("iterops")``), i.e. plain PyTensor (none of
iterops' rewrites matches (a)).  The dense solves call LAPACK through OpenBLAS: each is timed with its
default threads and with one thread, and the lower time is reported.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from statsmodels.tsa.arima_process import arma_acovf
from statsmodels.tsa.stattools import levinson_durbin as sm_levinson_durbin
from statsmodels.tsa.stattools import levinson_durbin_pacf as sm_levinson_durbin_pacf

from benchmarks._harness import Section, Target, best_time, best_time_any_blas_threads, ms
from iterops import reference_loops as ref
from iterops.ts import pacf_to_ar, yule_walker
from iterops.ts.toeplitz import toeplitz_matrix


def _plain_dense_yw(acov, p):
    """What a user writes: the Toeplitz matrix by indexing, a dense positive-definite solve."""
    i = pt.arange(p)
    phi = pt.linalg.solve(acov[pt.abs(i[:, None] - i[None, :])], acov[1 : p + 1], assume_a="pos")
    return phi, acov[0] - pt.dot(acov[1 : p + 1], phi)


def _where_dense_yw(acov, p):
    phi = pt.linalg.solve(toeplitz_matrix(acov[:p]), acov[1 : p + 1], assume_a="pos")
    return phi, acov[0] - pt.dot(acov[1 : p + 1], phi)


def _fn(inputs, outputs, mode=None):
    f = pytensor.function(inputs, outputs, mode=mode)
    f.trust_input = True
    return f


# Baselines are plain PyTensor: iterops' own Scan rewrites (tag "iterops") are excluded.
_PLAIN = pytensor.compile.mode.get_default_mode().excluding("iterops")


def _with_grad(x, phi, sigma2, w, mode=None):
    cost = pt.dot(w, phi) + (0.0 if sigma2 is None else sigma2)
    return _fn([x], [phi, pytensor.grad(cost, x)] + ([] if sigma2 is None else [sigma2]), mode=mode)


def run(quick: bool) -> list[Section]:
    orders = [2, 10, 50, 200]
    min_time, repeat = (0.05, 3) if quick else (0.2, 5)
    rng = np.random.default_rng(0)
    yw = Section(
        title="Yule-Walker (Levinson-Durbin): forward + gradient, and forward vs statsmodels",
        columns=[
            "p", "iterops fwd+grad (ms)", "plain dense solve (ms)", "where-built dense (ms)", "Scan (ms)",
            "x vs plain dense", "x vs where-built dense", "x vs Scan",
            "iterops fwd (ms)", "statsmodels fwd (ms)", "x vs statsmodels",
        ],
        notes="acov of a random stationary AR(p) (pacf uniform on (-0.3, 0.3), so the p=200 Toeplitz matrix is "
        "not numerically singular); gradient of w.phi + sigma2 with respect to acov.  Baselines: plain dense = "
        "`pt.linalg.solve(g[abs(i - j)], g[1:p+1], assume_a=\"pos\")` in the default mode (the target's "
        "baseline); where-built dense = the same solve with `toeplitz_matrix` (`pt.where` of two gathers, two "
        "scatters in the gradient), the only dense baseline before 2026-12-03, whose 3.12 ms at p = 200 was "
        "timed with OpenBLAS's default threads on a loaded machine (here both dense rows take the better of "
        "default and one BLAS thread).  iterops' gradient is one kernel (`LevinsonDurbinGrad`: a "
        "Gohberg-Semencul solve from the stepped-down predictor plus diagonal sums, about 3 p^2 multiply-adds "
        "in vectorizable loops), CPU time at p = 200 about 0.6x the Levinson-Durbin forward's.  What bounds the "
        "missed p <= 10 targets against the Scan: a compiled function's per-call cost; the forward alone "
        "(column 'iterops fwd') is most of the f+g call there, and the Scan's f+g divided by it is below 5.",
    )
    lat = Section(
        title="pacf_to_ar (stationary AR reparametrization): forward + gradient, and forward vs statsmodels",
        columns=["p", "iterops fwd+grad (ms)", "Scan (ms)", "x vs Scan", "iterops fwd (ms)", "statsmodels fwd (ms)", "x vs statsmodels"],
        notes="statsmodels: levinson_durbin_pacf (also returns the acf).  No dense-solve formulation exists for this map.",
    )
    for p in orders:
        pacf = rng.uniform(-0.3, 0.3, size=p)  # Toeplitz condition number <= 1e7 at p=200
        phi_true = sm_levinson_durbin_pacf(np.r_[1.0, pacf]).arcoefs
        acov = arma_acovf(np.r_[1.0, -phi_true], [1.0], nobs=p + 1, sigma2=1.0)
        w = pt.as_tensor(rng.normal(size=p))

        a = pt.vector("acov")
        f_ours = _with_grad(a, *yule_walker(a, p), w)
        f_dense = _with_grad(a, *_plain_dense_yw(a, p), w)
        f_where = _with_grad(a, *_where_dense_yw(a, p), w, mode=_PLAIN)
        f_scan = _with_grad(a, *ref.levinson_loop(a, p)[:2], w, mode=_PLAIN)
        f_fwd = _fn([a], list(yule_walker(a, p)))
        expected = f_dense(acov)
        for f in (f_ours, f_where, f_scan):  # same numbers before timing
            np.testing.assert_allclose(f(acov)[1], expected[1], rtol=1e-5, atol=1e-7 * np.abs(expected[1]).max())
        t_ours, t_scan = (best_time(f, acov, min_time=min_time, repeat=repeat) for f in (f_ours, f_scan))
        t_dense, t_where = (best_time_any_blas_threads(f, acov, min_time=min_time, repeat=repeat) for f in (f_dense, f_where))
        t_fwd = best_time(f_fwd, acov, min_time=min_time, repeat=repeat)
        t_sm = best_time(lambda g: sm_levinson_durbin(g, nlags=p, isacov=True), acov, min_time=min_time, repeat=repeat)
        yw.rows.append([p, ms(t_ours), ms(t_dense), ms(t_where), ms(t_scan), t_dense / t_ours, t_where / t_ours,
                        t_scan / t_ours, ms(t_fwd), ms(t_sm), t_sm / t_fwd])
        yw.targets.append(Target(f"yule_walker fwd+grad vs Scan, p={p}", t_scan / t_ours, 5))
        yw.targets.append(Target(f"yule_walker fwd vs statsmodels, p={p}", t_sm / t_fwd, 1))
        if p == 200:
            yw.targets.append(Target("yule_walker fwd+grad vs plain dense solve, p=200", t_dense / t_ours, 5))

        k = pt.vector("pacf")
        g_ours = _with_grad(k, pacf_to_ar(k), None, w)
        g_scan = _with_grad(k, ref.step_up_loop(k, p), None, w, mode=_PLAIN)
        g_fwd = _fn([k], pacf_to_ar(k))
        np.testing.assert_allclose(g_ours(pacf)[1], g_scan(pacf)[1], rtol=1e-6, atol=1e-9)
        t_ours, t_scan = (best_time(f, pacf, min_time=min_time, repeat=repeat) for f in (g_ours, g_scan))
        t_fwd = best_time(g_fwd, pacf, min_time=min_time, repeat=repeat)
        lag0 = np.r_[1.0, pacf]
        t_sm = best_time(sm_levinson_durbin_pacf, lag0, min_time=min_time, repeat=repeat)
        lat.rows.append([p, ms(t_ours), ms(t_scan), t_scan / t_ours, ms(t_fwd), ms(t_sm), t_sm / t_fwd])
        lat.targets.append(Target(f"pacf_to_ar fwd+grad vs Scan, p={p}", t_scan / t_ours, 5))
        lat.targets.append(Target(f"pacf_to_ar fwd vs statsmodels, p={p}", t_sm / t_fwd, 1))
    return [yw, lat]
