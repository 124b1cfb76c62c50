"""Test oracle: the Kalman filter as a ``pytensor.scan`` of its recursion, and its second derivatives by
PyTensor's reverse mode twice through that Scan.

Until the fused second-derivative kernel (:mod:`iterops.ts._kalman_hvp`), this was the package's own route for
the pullback of :class:`~iterops.ts.kalman.KalmanFilterGrad`; here it is an independent reference: PyTensor's
autodiff of a reference Scan, checked itself against central differences of the fused gradient.

The recursion (module docstring of :mod:`iterops.ts.kalman`): ``sym(P)``, missing components dropped,
``cov_jitter``, time-varying matrices.  ``F[o, o]^{-1}`` and ``log det F[o, o]`` by inverse and determinant (a
Cholesky only tests positive definiteness), or for one observable by scalar division and log.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.gradient import disconnected_grad

from iterops._constants import LOG_2PI
from iterops._second_order import reverse_twice
from iterops.ts._kalman_steps import SYSTEM_NAMES

__all__ = ["filter_graph", "scan_pullback"]


def _sym(X):
    return 0.5 * (X + X.T)


def _step(y, o, a, P, c, d, T, Z, R, H, Q, jitter):
    """One step of the filter on core arrays; ``o`` (p,) is 1 on observed components, 0 on missing ones
    (whose ``y`` is 0).  Returns the next prediction, ``ll``, the filtered moments, ``v`` and ``F``."""
    m, p = a.shape[0], y.shape[0]
    S = _sym(P)
    v = y - d - Z @ a
    F = Z @ S @ Z.T + _sym(H) + jitter * pt.eye(p)
    # F[o, o] with ones on the missing diagonal: the inverse and log-determinant of F_oo
    F_oo = pt.switch(pt.outer(o, o) > 0, F, 0.0) + pt.diag(1.0 - o)
    v_o = pt.switch(o > 0, v, 0.0)
    M = S @ (Z * o[:, None]).T  # (m, p), zero columns where missing
    # failure is a value: NaN where F_oo is not positive definite, as the filter's
    if y.type.shape[0] == 1:
        # one observable (structural, SARIMAX): scalar divisions, not three LAPACK calls per step in each of the
        # pullback's Scans.  Divisions, not a reciprocal: PyTensor's Python implementation of the scalar
        # reciprocal returns float32 precision for a float64 Python scalar (np.float32(1.0) / x)
        F_pd = pt.switch(F_oo > 0, F_oo, np.nan)  # (1, 1)
        Kt = M.T / F_pd
        ll = -0.5 * (pt.sum(o) * LOG_2PI + pt.log(F_pd[0, 0]) + v_o[0] * v_o[0] / F_pd[0, 0])
    else:
        # F_oo^{-1} and log det F_oo by inverse and determinant, not by Cholesky: PyTensor's Cholesky pullback
        # (tril through arange masks, diag(diagonal)) drops static shapes, and where p = 1 its rewrites then
        # scalarize an ``X + X^T`` whose declared type is (?, ?): an Elemwise with no array input, which the
        # Numba backend cannot compile.  Inverse and determinant pullbacks are products: static shapes kept.
        # The Cholesky only tests positive definiteness.
        pd = pt.all(pt.isfinite(pt.diag(pt.linalg.cholesky(disconnected_grad(F_oo)))))
        F_inv = pt.linalg.inv(F_oo) * pt.switch(pd, 1.0, np.nan)
        Kt = F_inv @ M.T  # K^T = F_oo^{-1} M^T
        ll = -0.5 * (pt.sum(o) * LOG_2PI + pt.log(pt.linalg.det(F_oo)) + v_o @ F_inv @ v_o)
    a_f = a + Kt.T @ v_o
    P_f = S - Kt.T @ M.T - jitter * (Kt.T @ Kt) + jitter * pt.eye(m)
    a_next = T @ a_f + c
    P_next = T @ P_f @ T.T + R @ _sym(Q) @ R.T
    return a_next, P_next, ll, a_f, P_f, pt.switch(o > 0, v, np.nan), F


def filter_graph(y, a0, P0, c, d, T, Z, R, H, Q, time_varying, cov_jitter, missing_value, needed=(True,) * 8):
    """The eight outputs of :class:`~iterops.ts.kalman.KalmanFilter` (core shapes, system matrices
    with their time axis) as a ``pytensor.scan``: ``(loglik, loglik_obs, filtered_state,
    filtered_cov, predicted_state, predicted_cov, forecast_error, forecast_error_cov)``.  ``needed``: one flag
    per output; the Scan computes the per-step outputs ``filtered_*`` and ``forecast_*`` only where set
    (None in their place otherwise: a second derivative of PyMC's logp, which reads only ``loglik``, then
    runs and reverses a loop of fewer operations)."""
    missing = pt.isnan(y)
    if missing_value is not None:
        missing = missing | pt.eq(y, missing_value)
    observed = 1.0 - pt.cast(missing, "float64")
    y = pt.switch(missing, 0.0, y)
    mats = dict(zip(SYSTEM_NAMES, (c, d, T, Z, R, H, Q)))
    seq_names = [k for k, tv in zip(SYSTEM_NAMES, time_varying) if tv]
    fixed = {k: mats[k][0] for k, tv in zip(SYSTEM_NAMES, time_varying) if not tv}
    jitter = pt.constant(float(cov_jitter), dtype="float64")

    def step(y_t, o_t, *rest):
        seqs = dict(zip(seq_names, rest[: len(seq_names)]))
        a, P = rest[len(seq_names) : len(seq_names) + 2]
        args = {**fixed, **seqs}
        a_next, P_next, ll, *per_step = _step(y_t, o_t, a, P, *(args[k] for k in SYSTEM_NAMES), jitter)
        return [a_next, P_next, ll, *(o for o, keep in zip(per_step, kept) if keep)]

    # the per-step outputs (a_f, P_f, v, F) are outputs 2, 3, 6, 7
    kept = [needed[i] for i in (2, 3, 6, 7)]
    a_next, P_next, llo, *per_step = pytensor.scan(
        step,
        sequences=[y, observed, *(mats[k] for k in seq_names)],
        outputs_info=[a0, P0, None, *(None for keep in kept if keep)],
        return_updates=False,
    )
    it = iter(per_step)
    af, Pf, v, F = (next(it) if keep else None for keep in kept)
    ap = pt.concatenate([a0[None], a_next], axis=0)
    Pp = pt.concatenate([P0[None], P_next], axis=0)
    return [pt.sum(llo), llo, af, Pf, ap, Pp, v, F]


def scan_pullback(x, g, w, time_varying, cov_jitter=0.0, missing_value=None):
    """``(x_bar, g_bar)`` of the adjoint's pullback by reverse mode twice through :func:`filter_graph`: ``x`` the
    10 filter inputs, ``g`` the 8 output cotangents (None where disconnected), ``w`` the 10 directions.

    ``loglik`` is ``sum(loglik_obs)`` in the Scan graph, and PyTensor's ``known_grads`` takes a cotangent given for
    ``loglik_obs`` as its whole cotangent (the one of ``loglik`` would not reach it): with both connected, the
    ``loglik`` cotangent is added to every ``loglik_obs`` one, and ``g_bar`` of ``loglik`` is the sum of theirs."""
    g = list(g)
    both = g[0] is not None and g[1] is not None
    if both:
        g[1], g[0] = g[1] + g[0], None

    def graph(*x_):
        needed = tuple(gi is not None for gi in g)
        return filter_graph(*x_, time_varying, cov_jitter, missing_value, needed)

    x_bar, g_bar = reverse_twice(graph, list(x), g, list(w))
    if both:
        g_bar[0] = pt.sum(g_bar[1])
    return x_bar, g_bar
